"""The vLLM double's sleep mode and pause (tests/fakevllm/sleep.py), through real HTTP and real processes.

What vLLM does, and so what these hold the double to: the dev endpoints exist only with
VLLM_SERVER_DEV_MODE=1; /sleep takes its level from the query string only and aborts running
requests unless told mode=wait or keep; a sleeping engine holds new requests until it wakes and
keeps answering /health; /is_sleeping stays true until every tag is awake; a level-2 wake leaves
the weights garbage until they are reloaded. The faults are the double's: a wake that changes the
weights, a wake that fails, a sleep that never answers, a residual that grows per sleep.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import httpx
import pytest

from tests.fakevllm.harness import FakeVllm, http, sse_events
from tests.waiting import wait_until

pytestmark = pytest.mark.component

DEV = {"VLLM_SERVER_DEV_MODE": "1"}
SLEEP_ROUTES = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/pause"), ("POST", "/resume"),
                ("GET", "/is_paused"), ("POST", "/collective_rpc")]  # fmt: skip
BOUND = 20.0  # a start or a held request on a loaded 2-core machine
AWAKE_MIB = 15349


def launch(fake_vllm, *args: str, env: dict | None = None) -> FakeVllm:
    double = fake_vllm("--fake-token-delay", "0.002", *args, env={**DEV, **(env or {})})
    double.wait_healthy(BOUND)
    return double


def post(double: FakeVllm, path: str, timeout: float = BOUND, **kw) -> httpx.Response:
    return http().post(double.url + path, timeout=timeout, **kw)


def greedy(double: FakeVllm, prompt: str = "the canary sings", timeout: float = BOUND) -> str:
    body = {
        "model": double.served_model_name,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = http().post(double.url + "/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def is_sleeping(double: FakeVllm) -> bool:
    r = http().get(double.url + "/is_sleeping")
    assert r.status_code == 200
    return r.json()["is_sleeping"]


def in_background(call) -> tuple[threading.Thread, dict]:
    """Runs call() in a thread; result["value"] or result["error"] once it ends."""
    result: dict = {}

    def run():
        try:
            result["value"] = call()
        except Exception as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def stream(double: FakeVllm, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streamed completion in the background: result["chunks"] (choices), result["first"] (an Event)."""
    result: dict = {"chunks": [], "first": threading.Event()}

    def run():
        body = {
            "model": double.served_model_name,
            "prompt": "a long story",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        with http().stream("POST", double.url + "/v1/completions", json=body, timeout=BOUND) as r:
            for _, payload in sse_events(r):
                if payload != "[DONE]":
                    result["chunks"].append(payload["choices"][0])
                    result["first"].set()
        result["first"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def finish_reason(result: dict) -> str | None:
    return result["chunks"][-1]["finish_reason"] if result["chunks"] else None


# ----------------------------------------------------------------- the routes


def test_without_dev_mode_every_sleep_route_is_unknown(fake_vllm):
    double = fake_vllm("--enable-sleep-mode")
    double.wait_healthy(BOUND)
    for method, path in SLEEP_ROUTES:
        r = http().request(method, double.url + path)
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"}), path
    assert double.state()["sleep"]["dev_mode"] is False


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "answer"),
    [
        ("GET", "/is_sleeping", None, 200, {"is_sleeping": False}),
        ("GET", "/is_paused", None, 200, {"is_paused": False}),
        ("POST", "/resume", None, 200, {"status": "resumed"}),
        ("POST", "/wake_up", None, 200, None),  # awake already: vLLM's executor warns and does nothing
        ("GET", "/sleep", None, 405, {"detail": "Method Not Allowed"}),
        ("POST", "/collective_rpc", {}, 400, {"detail": "Missing 'method' in request body"}),
        ("POST", "/collective_rpc", {"method": "reload_weights"}, 200, {"results": [None]}),
        ("POST", "/collective_rpc", {"method": "no_such_method"}, 500, "InternalServerError"),
        ("POST", "/sleep?level=deep", None, 500, "InternalServerError"),  # vLLM: int(level) raises
        ("POST", "/pause?mode=later", None, 422, "enum"),  # FastAPI's validation of the PauseMode query
        ("POST", "/sleep?mode=later", None, 422, "enum"),
    ],
)
def test_each_route_answers_as_vllm_does(fake_vllm, method, path, body, status, answer):
    double = launch(fake_vllm, "--enable-sleep-mode")
    r = http().request(method, double.url + path, json=body)
    assert r.status_code == status, r.text
    if answer is None:
        assert r.content == b""
    elif isinstance(answer, dict):
        assert r.json() == answer
    else:
        assert answer in r.text
    assert is_sleeping(double) is False  # none of these puts it to sleep


# ----------------------------------------------------------------- sleep and wake


def test_level_1_sleep_holds_requests_until_wake_and_answers_stay_the_same(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode")
    before = greedy(double)
    # A JSON body's level is ignored: vLLM reads the query string only.
    r = post(double, "/sleep", json={"level": 2})
    assert (r.status_code, r.content) == (200, b"")
    assert is_sleeping(double)
    assert double.state()["sleep"]["level"] == 1
    assert http().get(double.url + "/health").status_code == 200  # a sleeping engine is healthy
    held, result = in_background(lambda: greedy(double))
    wait_until(
        lambda: double.state()["sleep"]["held_requests"] == 1, BOUND, what="the completion to arrive and wait"
    )
    assert held.is_alive()
    # As vLLM's scheduler does, the held request counts as waiting.
    assert (
        'vllm:num_requests_waiting{engine="0",model_name="fake"} 1.0'
        in http().get(double.url + "/metrics").text
    )
    assert post(double, "/wake_up").status_code == 200
    held.join(BOUND)
    assert result == {"value": before}
    assert is_sleeping(double) is False
    assert greedy(double) == before
    # vLLM's own lines, for a daemon's log to read as with vLLM
    wait_until(lambda: "seconds to fall asleep." in double.output() and "seconds to wake up tags" in double.output(), BOUND,
               what="the sleep's log lines", details=double.output)  # fmt: skip


def test_wake_by_tags_is_sleeping_until_every_tag_is_awake(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode")
    assert post(double, "/sleep?level=1").status_code == 200
    assert post(double, "/wake_up?tags=weights").status_code == 200
    assert is_sleeping(double)
    assert double.state()["sleep"]["asleep_tags"] == ["kv_cache"]
    assert post(double, "/wake_up?tags=kv_cache").status_code == 200
    assert is_sleeping(double) is False


def test_level_2_wake_answers_garbage_until_the_weights_are_reloaded(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode")
    before = greedy(double)
    assert post(double, "/sleep?level=2").status_code == 200
    assert post(double, "/wake_up?tags=weights").status_code == 200
    assert post(double, "/collective_rpc", json={"method": "reload_weights"}).json() == {"results": [None]}
    assert post(double, "/wake_up?tags=kv_cache").status_code == 200
    assert greedy(double) == before
    # The same sleep and wake without the reload: the weights are what the allocator left.
    assert post(double, "/sleep?level=2").status_code == 200
    assert post(double, "/wake_up").status_code == 200
    assert greedy(double) != before
    assert post(double, "/collective_rpc", json={"method": "reload_weights"}).status_code == 200
    assert greedy(double) == before


def test_sleep_aborts_running_requests_by_default(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode", "--fake-token-delay", "0.05")
    thread, result = stream(double, 200)
    assert result["first"].wait(BOUND)
    assert post(double, "/sleep?level=1").status_code == 200
    thread.join(BOUND)
    assert finish_reason(result) == "abort"
    assert sum(1 for c in result["chunks"] if c["text"]) < 200


def test_sleep_mode_wait_answers_once_running_requests_have_finished(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode", "--fake-token-delay", "0.02")
    thread, result = stream(double, 30)
    assert result["first"].wait(BOUND)
    assert post(double, "/sleep?level=1&mode=wait").status_code == 200
    thread.join(BOUND)
    assert finish_reason(result) == "length"
    assert "".join(c["text"] for c in result["chunks"]).count(" ") == 30
    assert is_sleeping(double)


def test_pause_keep_freezes_running_requests_until_resume(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode", "--fake-token-delay", "0.01")
    thread, result = stream(double, 20)  # 0.2 s unpaused
    assert result["first"].wait(BOUND)
    assert post(double, "/pause?mode=keep").json() == {"status": "paused"}
    assert http().get(double.url + "/is_paused").json() == {"is_paused": True}
    assert is_sleeping(double)  # vLLM: a paused scheduler counts as sleeping
    # A deliberate pause, five times the whole stream: a frozen request does not finish in it.
    thread.join(1.0)
    assert thread.is_alive() and finish_reason(result) is None
    assert post(double, "/resume").json() == {"status": "resumed"}
    thread.join(BOUND)
    assert finish_reason(result) == "length"


def test_pause_abort_ends_running_requests_and_holds_new_ones(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode", "--fake-token-delay", "0.05")
    thread, result = stream(double, 200)
    assert result["first"].wait(BOUND)
    assert post(double, "/pause").json() == {"status": "paused"}
    thread.join(BOUND)
    assert finish_reason(result) == "abort"
    held, answer = in_background(lambda: greedy(double))
    wait_until(lambda: double.state()["sleep"]["held_requests"] == 1, BOUND, what="a new completion to wait")
    assert post(double, "/resume").status_code == 200
    held.join(BOUND)
    assert "value" in answer


def test_without_sleep_mode_a_sleep_frees_nothing(fake_vllm, tmp_path):
    card = tmp_path / "card.json"
    double = launch(fake_vllm, env={"R3090D_FAKE_NVML": str(card)})
    core = double.state()["engine_core_pid"]
    card.write_text(
        json.dumps(
            {"memory_total_mib": 24576, "memory_used_mib": AWAKE_MIB, "processes": [[core, AWAKE_MIB]]}
        )
    )
    before = greedy(double)
    assert post(double, "/sleep?level=2").status_code == 200
    assert is_sleeping(double)
    assert json.loads(card.read_text())["processes"] == [[core, AWAKE_MIB]]
    assert post(double, "/wake_up").status_code == 200
    assert greedy(double) == before  # nothing was dropped


# ----------------------------------------------------------------- the card


def test_sleep_leaves_the_residual_on_the_card_and_it_grows_per_cycle(fake_vllm, tmp_path):
    card = tmp_path / "card.json"
    double = launch(fake_vllm, "--enable-sleep-mode", "--fake-sleep-residual-mib", "1200", "--fake-sleep-residual-growth-mib", "300",
                    env={"R3090D_FAKE_NVML": str(card)})  # fmt: skip
    core = double.state()["engine_core_pid"]
    other = [os.getpid(), 500]  # someone else on the card: untouched
    card.write_text(
        json.dumps(
            {
                "memory_total_mib": 24576,
                "memory_used_mib": AWAKE_MIB + 500,
                "processes": [[core, AWAKE_MIB], other],
            }
        )
    )
    for cycle, residual in enumerate((1200, 1500, 1800)):
        assert post(double, "/sleep?level=1").status_code == 200
        seen = json.loads(card.read_text())
        assert seen["processes"] == [[core, residual], other], cycle
        assert seen["memory_used_mib"] == residual + 500
        assert double.state()["sleep"]["residual_mib"] == residual
        assert post(double, "/wake_up").status_code == 200
        assert json.loads(card.read_text())["processes"] == [[core, AWAKE_MIB], other]


# ----------------------------------------------------------------- faults


def test_fault_wake_corrupts_changes_greedy_answers(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode", "--fake-wake-corrupts")
    before = greedy(double)
    assert post(double, "/sleep?level=1").status_code == 200
    assert post(double, "/wake_up").status_code == 200
    after = greedy(double)
    assert after != before
    assert post(double, "/sleep?level=1").status_code == 200
    assert post(double, "/wake_up").status_code == 200
    assert greedy(double) not in (before, after)  # each faulty wake changes them again


def test_fault_wake_500_leaves_the_engine_asleep(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode", "--fake-wake-500")
    assert post(double, "/sleep?level=1").status_code == 200
    r = post(double, "/wake_up")
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    assert is_sleeping(double)


def test_fault_sleep_hangs_never_answers_and_holds_new_requests(fake_vllm):
    double = launch(fake_vllm, "--enable-sleep-mode", "--fake-sleep-hangs")
    with pytest.raises(httpx.ReadTimeout):
        post(double, "/sleep?level=1", timeout=1.0)
    assert is_sleeping(double)  # the scheduler was paused before the sleep stuck
    assert any(e["path"] == "/sleep" and e["status"] is None for e in double.request_log())
    with pytest.raises(httpx.ReadTimeout):
        greedy(double, timeout=1.0)
    assert http().get(double.url + "/health").status_code == 200


def test_the_sleep_flags_are_in_the_readme():
    readme = (Path(__file__).resolve().parents[1] / "fakevllm" / "README.md").read_text()
    for flag in ("--enable-sleep-mode", "--fake-sleep-residual-mib", "--fake-sleep-residual-growth-mib", "--fake-wake-corrupts",
                 "--fake-wake-500", "--fake-sleep-hangs", "VLLM_SERVER_DEV_MODE"):  # fmt: skip
        assert flag in readme, flag
