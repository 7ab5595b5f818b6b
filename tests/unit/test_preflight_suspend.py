"""Preflight's note on `r3090ctl suspend`: can the driver checkpoint, and can the host hold what the engine holds?"""

from __future__ import annotations

import dataclasses

import pytest

from r3090d import config
from r3090d.core.snapshot import GpuProcess, GpuSample, GpuStatus, HostFacts
from r3090d.preflight import gather
from r3090d.preflight.checks import (
    GPU_CHECKS,
    PreflightFacts,
    Status,
    check_ptrace_scope,
    check_suspend,
    exit_code,
    run_checks,
)
from r3090d.units import GIB

CARD = GpuSample(GpuStatus.OK, driver_version="580.95.05", cuda_driver_version=13000, memory_total=24 * GIB, memory_free=23 * GIB,
                 memory_used=0, processes=())  # fmt: skip


def cfg(**engine) -> config.Config:
    return config.from_dict({"profile": "none", "engine": {"model": "m", **engine}}, check_files=False)


def facts(gpu=CARD, available=64 * GIB, swap=0, own=(), state=None) -> PreflightFacts:
    host = HostFacts(swap_total_bytes=swap, mem_available_bytes=available)
    return PreflightFacts(gpu=gpu, host=host, own_pids=frozenset(own), checkpoint_state=state)


@pytest.mark.parametrize(
    ("gpu", "f", "c", "status", "text"),
    [
        (CARD, {}, cfg(), Status.OK, "driver 580.95.05 can checkpoint; 64.00 GiB of host memory available for the engine's 21.60 GiB + 1.00 GiB"),
        (dataclasses.replace(CARD, driver_version="535.183.01", cuda_driver_version=12020), {}, cfg(), Status.SKIP,
         "suspend unavailable: driver 535.183.01 (CUDA 12.2) predates process checkpointing"),
        (dataclasses.replace(CARD, driver_version=None, cuda_driver_version=12080), {}, cfg(), Status.OK, "can checkpoint"),
        (CARD, {}, cfg(extra_args=["--tensor-parallel-size", "2"]), Status.SKIP, "suspend unavailable: the engine runs on 2 GPUs"),
        (CARD, {"available": 16 * GIB, "swap": 8 * GIB}, cfg(), Status.WARN, "swap would take the checkpoint: 16.00 GiB of host memory"),
        (CARD, {"available": 16 * GIB}, cfg(), Status.SKIP, "suspend unavailable: only 16.00 GiB of host memory available"),
        (CARD, {"available": None}, cfg(), Status.OK, "host memory not measured"),
        (CARD, {"state": "unavailable: libcuda.so.1 lacks cuCheckpointProcessLock"}, cfg(), Status.SKIP,
         "suspend unavailable: libcuda.so.1 lacks cuCheckpointProcessLock"),
        # A running engine: its own share of the card counts, and the driver's answer about it is shown.
        (dataclasses.replace(CARD, processes=(GpuProcess(7, 15 * GIB),)), {"own": (6, 7), "state": "pid 7: RUNNING", "available": 17 * GIB}, cfg(),
         Status.OK, "17.00 GiB of host memory available for the engine's 15.00 GiB + 1.00 GiB; the driver answers for pid 7: RUNNING"),
    ],
    ids=["ok", "old-driver", "cuda-version-only", "tp2", "swap", "short", "unmeasured", "worker-unavailable", "running-engine"],
)  # fmt: skip
def test_suspend_check(gpu, f, c, status, text):
    r = check_suspend(gpu, facts(gpu, **f), c)
    assert r.name == "suspend" and r.status is status and text in r.measured, r
    assert "\n" not in r.measured


def test_suspend_unavailable_is_a_note_not_a_failure():
    old = dataclasses.replace(CARD, driver_version="535.183.01", cuda_driver_version=12020)
    results = [r for r in run_checks(facts(old), cfg()) if r.name in GPU_CHECKS]
    assert [r.name for r in results][-1] == "suspend"
    assert exit_code([r for r in results if r.name == "suspend"]) == 0


def test_mem_available_is_read_from_meminfo(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:       65536000 kB\nMemFree:  1000 kB\nMemAvailable:   50000000 kB\n")
    assert gather.read_mem_available(tmp_path) == 50000000 * 1024
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 1 kB\n")
    assert gather.read_mem_available(tmp_path) is None
    assert gather.read_mem_available(tmp_path / "nowhere") is None


def test_no_engine_of_ours_on_the_gpu_asks_the_driver_nothing():
    assert gather.checkpoint_state(dataclasses.replace(CARD, processes=(GpuProcess(9, GIB),)), frozenset({5})) is None
    assert gather.checkpoint_state(CARD, frozenset()) is None


@pytest.mark.parametrize(
    ("scope", "c", "status", "text"),
    [
        (0, cfg(), Status.OK, "kernel.yama.ptrace_scope = 0"),
        # The launcher, which makes the calls, is an ancestor of every engine process: what scope 1 allows.
        (1, cfg(), Status.OK, "kernel.yama.ptrace_scope = 1"),
        (2, cfg(), Status.WARN, "kernel.yama.ptrace_scope = 2: even an ancestor is refused without CAP_SYS_PTRACE: r3090ctl suspend will fail"),
        (3, cfg(), Status.WARN, "kernel.yama.ptrace_scope = 3: every process is refused"),
        (None, cfg(), Status.SKIP, "no Yama in this kernel"),
        (3, cfg(extra_args=["--tensor-parallel-size", "2"]), Status.SKIP, "suspend unavailable: the engine runs on 2 GPUs"),
    ],
    ids=["0", "1", "2", "3", "no-yama", "suspend-unavailable"],
)  # fmt: skip
def test_ptrace_scope_check(scope, c, status, text):
    r = check_ptrace_scope(dataclasses.replace(facts(), ptrace_scope=scope), c)
    assert r.name == "ptrace_scope" and r.status is status and text in r.measured, r
    assert "\n" not in r.measured
    assert (r.hint != "") is (status is Status.WARN)


def test_ptrace_scope_is_read_from_proc(tmp_path):
    yama = tmp_path / "proc" / "sys" / "kernel" / "yama"
    yama.mkdir(parents=True)
    (yama / "ptrace_scope").write_text("1\n")
    assert gather.read_ptrace_scope(tmp_path) == 1
    (yama / "ptrace_scope").write_text("2\n")
    assert gather.read_ptrace_scope(tmp_path) == 2
    assert gather.read_ptrace_scope(tmp_path / "nowhere") is None  # no Yama
