"""The stand-in worker's sleep state (bench/gpu_sleep_worker.py) on its CPU weights: what each request does to them.

The torch weights make the same calls on cuda:0 (bench/gpu_sleep_cycle.py runs them on a GPU).
"""

from __future__ import annotations

import json
import random

import pytest

from bench import gpu_sleep_worker as gsw

SIZE = 1 << 16
SEED = 7


def original() -> bytes:
    return random.Random(SEED).randbytes(SIZE)


@pytest.fixture
def sleeper(tmp_path):
    return gsw.Sleeper(gsw.CpuWeights(bytearray(original())), str(tmp_path), SEED)


def run(sleeper: gsw.Sleeper, *requests: dict) -> dict:
    for seq, request in enumerate(requests, 1):
        sleeper.handle({"seq": seq, **request})
    return sleeper.report


# (requests, state after them, the weights then: "intact", "zeros", "changed" or None for freed)
CASES = [
    ([{"op": "sleep", "level": 1}], "asleep", None),
    ([{"op": "sleep", "level": 1}, {"op": "wake"}], "awake", "intact"),
    (
        [{"op": "sleep", "level": 1}, {"op": "sleep", "level": 2}, {"op": "wake"}],
        "awake",
        "intact",
    ),  # a second sleep: nothing
    ([{"op": "wake"}], "awake", "intact"),  # awake already: nothing
    ([{"op": "sleep", "level": 2}, {"op": "wake"}], "awake", "zeros"),
    ([{"op": "sleep", "level": 2}, {"op": "wake"}, {"op": "reload"}], "awake", "intact"),
    ([{"op": "sleep", "level": 1}, {"op": "wake", "corrupt": 8}], "awake", "changed"),
    (
        [{"op": "sleep", "level": 1}, {"op": "wake", "corrupt": 8}] * 2,
        "awake",
        "changed",
    ),  # flips never undo each other
]


@pytest.mark.parametrize(("requests", "state", "weights"), CASES)
def test_requests_move_the_weights(sleeper, requests, state, weights):
    report = run(sleeper, *requests)
    assert report["state"] == state
    assert "error" not in report
    data = sleeper.weights.data
    expected = {None: None, "intact": original(), "zeros": bytes(SIZE)}
    if weights == "changed":
        assert data is not None and bytes(data) != original()
        assert sum(a != b for a, b in zip(data, original(), strict=True)) == 8 * (len(requests) // 2)
    else:
        assert (None if data is None else bytes(data)) == expected[weights]


def test_the_pinned_buffer_is_allocated_once_and_its_time_reported_apart(sleeper):
    first = run(sleeper, {"op": "sleep", "level": 1})
    buffer = sleeper.weights.host
    assert first["pinned_alloc_s"] == first["first_pinned_alloc_s"] and first["pinned_bytes"] == SIZE
    sleeper.handle({"seq": 2, "op": "wake"})
    sleeper.handle({"seq": 3, "op": "sleep", "level": 1})
    again = sleeper.report
    assert sleeper.weights.host is buffer
    assert "pinned_alloc_s" not in again and again["first_pinned_alloc_s"] == first["first_pinned_alloc_s"]
    assert again["sleeps"] == 2


def test_level_2_writes_the_file_once_and_keeps_nothing_in_host_memory(sleeper, tmp_path):
    report = run(sleeper, {"op": "sleep", "level": 2})
    assert report["pinned_bytes"] == 0 and report["weights_file_write_s"] >= 0
    path = tmp_path / f"weights-{SEED}.bin"
    assert path.read_bytes() == original()
    path.write_bytes(b"x" * SIZE)  # marked: a second write would put the weights back
    sleeper.handle({"seq": 2, "op": "wake"})
    sleeper.handle({"seq": 3, "op": "sleep", "level": 2})
    assert path.read_bytes() == b"x" * SIZE


def test_the_residual_grows_by_the_asked_mib_per_sleep(sleeper):
    for cycle in (1, 2, 3):
        sleeper.handle({"seq": 2 * cycle, "op": "sleep", "level": 1, "growth_mib": 1})
        assert sleeper.report["leaked_mib"] == cycle
        sleeper.handle({"seq": 2 * cycle + 1, "op": "wake"})
    assert sum(len(b) for b in sleeper.weights.leaked) == 3 * gsw.MIB


@pytest.mark.parametrize("request_", [{"op": "fly"}, {"op": "reload"}])
def test_a_request_that_cannot_be_done_reports_an_error(sleeper, request_):
    if request_["op"] == "reload":
        sleeper.handle({"seq": 1, "op": "sleep", "level": 1})  # asleep: nothing to reload into
    sleeper.handle({"seq": 9, **request_})
    assert sleeper.report["seq"] == 9 and sleeper.report["error"]


def test_poll_takes_the_request_file_and_waits_asleep_until_the_wake(sleeper, tmp_path):
    (tmp_path / gsw.REQUEST).write_text(json.dumps({"seq": 1, "op": "sleep", "level": 1}))
    seen = []

    def idle():  # the worker's pause between polls: here, the double's next request arrives
        status = json.loads(next(tmp_path.glob("worker-*.json")).read_text())
        seen.append(status["sleep"]["state"])
        (tmp_path / gsw.REQUEST).write_text(json.dumps({"seq": 2, "op": "wake"}))

    assert sleeper.poll(idle) is True
    assert seen == ["asleep"]  # the sleep was reported while the worker waited
    assert sleeper.report["seq"] == 2 and sleeper.report["state"] == "awake"
    assert not (tmp_path / gsw.REQUEST).exists()
    assert sleeper.poll(idle) is False  # no request: nothing done
