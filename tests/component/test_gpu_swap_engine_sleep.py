"""The swap bench's engine (bench/gpu_swap_engine.py) in sleep mode, on its CPU worker: the double's /sleep and
/wake_up move the worker's own weights (bench/gpu_sleep_worker.py), and greedy answers follow what it holds.

The torch path does the same with cudaMemcpyAsync into pinned memory; it needs a GPU, so here the dry run's
worker stands in for it, through the same request file, the same status and the same double.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.fakevllm.harness import FakeVllm, http

pytestmark = pytest.mark.component

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "bench" / "gpu_swap_engine.py"
BOUND = 60.0  # an engine, its worker and its coupler starting on a loaded 2-core machine
CPU_WEIGHT_BYTES = 4 << 20  # bench/gpu_engine_standin.py's CPU worker


@pytest.fixture
def engine(tmp_path):
    launched: list[FakeVllm] = []

    def launch(*args: str) -> FakeVllm:
        status = tmp_path / f"status-{len(launched)}"
        status.mkdir()
        env = {"VLLM_SERVER_DEV_MODE": "1", "GPU_IDLE_STATUS_DIR": str(status), "GPU_IDLE_WORKER": "cpu", "GPU_IDLE_SEED": "3090",
               "PYTHONPATH": str(ROOT)}  # fmt: skip
        double = FakeVllm(sys.executable, "--enable-sleep-mode", "--fake-token-delay", "0.002", *args, env=env,
                          log_path=tmp_path / f"engine-{len(launched)}.log")  # fmt: skip
        double.argv[1:1] = [str(ENGINE)]  # the bench's engine python runs this file with vLLM's argv
        launched.append(double)
        double.start()
        double.wait_healthy(BOUND)
        double.status_dir = status
        return double

    yield launch
    for double in launched:
        double.kill_all()


def greedy(double: FakeVllm) -> str:
    body = {
        "model": "fake",
        "prompt": "the canary sings",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = http().post(double.url + "/v1/completions", json=body, timeout=BOUND)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def post(double: FakeVllm, path: str, **kw) -> int:
    return http().post(double.url + path, timeout=BOUND, **kw).status_code


def worker_report(double: FakeVllm) -> dict:
    return double.state()["sleep"]["worker"]


def test_level_1_moves_the_weights_to_a_host_buffer_allocated_once(engine):
    double = engine()
    before = greedy(double)
    assert post(double, "/sleep?level=1") == 200
    first = worker_report(double)
    assert (first["state"], first["level"], first["pinned_bytes"]) == ("asleep", 1, CPU_WEIGHT_BYTES)
    # The first sleep allocates the pinned buffer, and that time is reported apart.
    assert first["pinned_alloc_s"] == first["first_pinned_alloc_s"] >= 0
    assert {"copy_out_s", "free_s"} <= first.keys()
    assert post(double, "/wake_up") == 200
    woke = worker_report(double)
    assert woke["state"] == "awake" and {"alloc_s", "copy_in_s"} <= woke.keys()
    assert greedy(double) == before
    assert post(double, "/sleep?level=1") == 200
    second = worker_report(double)
    assert "pinned_alloc_s" not in second  # kept from the first sleep
    assert second["first_pinned_alloc_s"] == first["first_pinned_alloc_s"]
    assert second["sleeps"] == 2
    assert post(double, "/wake_up") == 200
    assert greedy(double) == before


def test_level_2_drops_the_weights_and_the_reload_reads_them_from_the_file(engine):
    double = engine()
    before = greedy(double)
    assert post(double, "/sleep?level=2") == 200
    report = worker_report(double)
    assert report["pinned_bytes"] == 0  # nothing kept in host memory
    assert report["weights_file_write_s"] >= 0
    assert (double.status_dir / "weights-3090.bin").stat().st_size == CPU_WEIGHT_BYTES
    assert post(double, "/wake_up") == 200
    assert greedy(double) != before  # woken weights are not the model's until the reload
    assert post(double, "/collective_rpc", json={"method": "reload_weights"}) == 200
    assert worker_report(double)["reload_s"] >= 0
    assert greedy(double) == before


def test_faults_reach_the_worker_a_corrupting_wake_and_a_growing_residual(engine):
    double = engine("--fake-wake-corrupts", "--fake-sleep-residual-growth-mib", "1")
    answers = [greedy(double)]
    for cycle in (1, 2):
        assert post(double, "/sleep?level=1") == 200
        assert worker_report(double)["leaked_mib"] == cycle
        assert post(double, "/wake_up") == 200
        assert worker_report(double)["corrupted"] == 8
        answers.append(greedy(double))
    assert len(set(answers)) == 3  # the canary's signal: each faulty wake changed the weights again
