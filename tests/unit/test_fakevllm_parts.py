"""Pure parts of the vLLM double: its Prometheus number format and its KV-block scheduler."""

from __future__ import annotations

import pytest
from prometheus_client.utils import floatToGoString

from tests.fakevllm.engine_core import Request, Scheduler
from tests.fakevllm.metrics import go_float
from tests.fakevllm.server import check_control


@pytest.mark.parametrize("value", [0, 1, 2.5, 0.92, 1638, 999999.0, 1e6, 1795995557.7113917, 1.23e-7, float("inf"), 12345678.5])
def test_numbers_are_written_as_prometheus_client_writes_them(value):
    assert go_float(value) == floatToGoString(value)


def test_scheduler_preempts_the_newest_request_when_blocks_run_out():
    sched = Scheduler(num_blocks=5, block_size=4, max_num_seqs=8)  # 4 usable blocks
    for name in ("a", "b"):
        sched.add(Request(name, prompt_tokens=3, max_tokens=20, eos_after=None))
    sched.step()  # both admitted: 1 block each for 3 + 1 tokens
    assert (len(sched.running), sched.used_blocks) == (2, 2)
    for _ in range(4):
        sched.step()  # each grows to 2 blocks (8 tokens): the pool is full
    assert (sched.used_blocks, sched.preemptions) == (4, 0)
    sched.step()  # a needs a third block for its 9th token: b gives way
    assert sched.preemptions == 1
    assert [r.id for r in sched.running] == ["a"] and [r.id for r in sched.waiting] == ["b"]
    assert sched.stats()["kv_cache_usage_perc"] == sched.used_blocks / 4


def test_scheduler_finishes_every_request_with_exact_token_counts():
    sched = Scheduler(num_blocks=5, block_size=4, max_num_seqs=2)
    for name, max_tokens in (("a", 6), ("b", 9), ("c", 3)):
        sched.add(Request(name, prompt_tokens=2, max_tokens=max_tokens, eos_after=None))
    finished = {}
    for _ in range(200):
        for req_id, generated, finish in sched.step():
            if finish:
                finished[req_id] = (generated, finish)
        if not sched.has_work():
            break
    assert finished == {"a": (6, "length"), "b": (9, "length"), "c": (3, "length")}
    assert sched.generation_tokens >= 18 and sched.used_blocks == 0


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ([], "expected a JSON object"),
        ({"metrics": "sideways"}, "metrics must be one of"),
        ({"freeze": "yes"}, "freeze must be true or false"),
        ({"exit": 300}, "exit must be an integer"),
        ({"metrics_values": {"bogus": 1}}, "metrics_values must be an object"),
        ({"nope": 1}, "unknown keys"),
    ],
)
def test_control_requests_are_checked(body, problem):
    assert problem in check_control(body)
    assert check_control({"metrics": "leak", "kv_usage": 0.9, "freeze": False, "metrics_values": {"waiting": 3}}) is None
