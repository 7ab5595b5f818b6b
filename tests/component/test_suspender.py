"""Suspend and resume an "engine" through the real worker process, the driver faked at its calls.

The engine is a real sleeping child process; the CUDA driver is tests/fakecuda
(lock SIGSTOPs, checkpoint takes the pid off the fake NVML card, restore puts it
back, unlock SIGCONTs), selected through $R3090D_FAKE_CUDA_CHECKPOINT. The
Suspender starts `python -m r3090d.effectors.suspender_worker` exactly as the
daemon would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from r3090d import procstat
from r3090d.core.suspend_types import Outcome, ProcessState, Step
from r3090d.effectors.checkpoint import FAKE_ENV
from r3090d.effectors.suspender import WORKER_MODULE, Suspender
from r3090d.effectors.suspender_worker import EXIT_REJECTED
from tests.waiting import wait_until

FAKE_CUDA = Path(__file__).resolve().parents[1] / "fakecuda"
ENGINE_MIB = 15349
OTHER = [4242, 300]  # another process on the card, never touched
BOUND_S = 60.0  # generous: each operation starts a Python process on a busy 2-core machine


def proc_state(pid: int) -> str:
    """The one-letter state in /proc/<pid>/stat (T: stopped)."""
    st = procstat.read(pid)
    assert st is not None, f"pid {pid} is gone"
    return st.state


class Rig:
    def __init__(self, tmp_path: Path):
        self.engine = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
        self.pid = self.engine.pid
        self.card = tmp_path / "card.json"
        self.card.write_text(json.dumps({"memory_used_mib": ENGINE_MIB + OTHER[1], "processes": [[self.pid, ENGINE_MIB], OTHER]}))
        self.control = tmp_path / "cuda.json"
        self.log = tmp_path / "calls.jsonl"
        self.control_set()
        pythonpath = os.pathsep.join(p for p in (str(FAKE_CUDA), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PYTHONPATH": pythonpath, FAKE_ENV: str(self.control), "R3090D_FAKE_NVML": str(self.card)}
        self.suspender = Suspender(env=self.env)

    def control_set(self, **conf) -> None:
        self.control.write_text(json.dumps({"log": str(self.log), **conf}))

    def card_json(self) -> dict:
        return json.loads(self.card.read_text())

    def calls(self) -> list[str]:
        if not self.log.exists():
            return []
        lines = [json.loads(t) for t in self.log.read_text().splitlines()]
        return [c["step"] for c in lines if c["pid"] == self.pid]

    def run(self, op: str):
        assert getattr(self.suspender, op)(self.pid, **({"lock_timeout_ms": 2000} if op == "suspend" else {}))
        sample = self.suspender.wait(BOUND_S)
        assert not sample.in_flight, f"{op} still in flight after {BOUND_S} s: {sample}"
        return sample

    def on_card(self) -> bool:
        return any(p == self.pid for p, _ in self.card_json()["processes"])

    def close(self) -> None:
        self.engine.kill()
        self.engine.wait()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def test_suspend_stops_the_engine_and_frees_its_memory_resume_brings_it_back(rig):
    sample = rig.run("suspend")
    assert sample.outcome is Outcome.SUSPENDED, sample
    assert sample.state is ProcessState.CHECKPOINTED
    assert [s.step for s in sample.steps] == [Step.INIT, Step.LOCK, Step.CHECKPOINT]
    assert all(s.ok for s in sample.steps) and sample.error == ""
    # A SIGSTOP lands when the engine next runs: on a busy machine, some time after the worker sent it.
    wait_until(lambda: proc_state(rig.pid) == "T", 10.0, what="the engine stopped")
    card = rig.card_json()
    assert card["processes"] == [OTHER] and card["memory_used_mib"] == OTHER[1]

    sample = rig.run("resume")
    assert sample.outcome is Outcome.RESUMED, sample
    assert sample.state is ProcessState.RUNNING
    assert [s.step for s in sample.steps] == [Step.INIT, Step.RESTORE, Step.UNLOCK]
    wait_until(lambda: proc_state(rig.pid) != "T", 10.0, what="the engine to run again")
    card = rig.card_json()
    assert sorted(card["processes"]) == sorted([OTHER, [rig.pid, ENGINE_MIB]])
    assert card["memory_used_mib"] == ENGINE_MIB + OTHER[1]
    assert rig.calls() == ["lock", "checkpoint", "restore", "unlock"]


def test_state_query_reports_the_drivers_state(rig):
    sample = rig.run("query")
    assert (sample.outcome, sample.state) == (Outcome.REPORTED, ProcessState.RUNNING)
    assert rig.calls() == ["state"]


@pytest.mark.parametrize(
    ("conf", "outcome", "state", "calls", "stopped"),
    [
        # A lock that times out leaves the process RUNNING (documented): nothing to undo.
        ({"fail": {"lock": 600}}, Outcome.KEPT_RUNNING, ProcessState.RUNNING, ["lock", "state"], False),
        # Checkpoint failed, the process still LOCKED: unlock, and it serves on.
        ({"fail": {"checkpoint": 999}}, Outcome.KEPT_RUNNING, ProcessState.RUNNING, ["lock", "checkpoint", "state", "unlock"], False),
        # Checkpoint failed and took the process with it: a cold restart is the way out.
        ({"fail": {"checkpoint": 999}, "leave": {"checkpoint": "FAILED"}}, Outcome.FAILED, ProcessState.FAILED,
         ["lock", "checkpoint", "state"], True),  # fmt: skip
        # The state cannot be read after a failure: nothing can be trusted.
        ({"fail": {"checkpoint": 999, "state": 999}}, Outcome.FAILED, None, ["lock", "checkpoint", "state"], True),
    ],
    ids=["lock-timeout", "checkpoint-locked", "checkpoint-failed", "state-unreadable"],
)
def test_suspend_failures(rig, conf, outcome, state, calls, stopped):
    rig.control_set(**conf)
    sample = rig.run("suspend")
    assert sample.outcome is outcome, sample
    assert sample.state is state
    assert rig.calls() == calls
    failed_step = next(iter(conf["fail"]))
    assert f"{failed_step}: " in sample.error and "\n" not in sample.error
    assert rig.on_card()  # the memory never left
    if stopped:
        wait_until(lambda: proc_state(rig.pid) == "T", 10.0, what="the engine stopped")
    else:
        wait_until(lambda: proc_state(rig.pid) != "T", 10.0, what="the engine to keep running")


@pytest.mark.parametrize(
    ("conf", "outcome", "state", "calls", "on_card"),
    [
        # Restore failed, still CHECKPOINTED: no way back but a cold restart.
        ({"fail": {"restore": 2}}, Outcome.FAILED, ProcessState.CHECKPOINTED, ["restore", "state"], False),
        # Restore reported an error but left the process LOCKED: unlock it and it runs.
        ({"fail": {"restore": 999}, "leave": {"restore": "LOCKED"}}, Outcome.KEPT_RUNNING, ProcessState.RUNNING,
         ["restore", "state", "unlock"], False),  # fmt: skip
        # Unlock keeps failing: the process stays locked, which serves nobody.
        ({"fail": {"unlock": 999}}, Outcome.FAILED, ProcessState.LOCKED, ["restore", "unlock", "state", "unlock"], True),
    ],
    ids=["restore-checkpointed", "restore-locked", "unlock-fails"],
)
def test_resume_failures(rig, conf, outcome, state, calls, on_card):
    assert rig.run("suspend").outcome is Outcome.SUSPENDED
    rig.control_set(**conf)
    sample = rig.run("resume")
    assert sample.outcome is outcome, sample
    assert sample.state is state
    assert rig.calls() == ["lock", "checkpoint", *calls]
    assert rig.on_card() is on_card


def test_a_slow_checkpoint_leaves_the_callers_thread_free(rig):
    rig.control_set(delay_s={"checkpoint": 5})
    t0 = time.monotonic()
    assert rig.suspender.suspend(rig.pid, 2000)
    assert time.monotonic() - t0 < 0.5  # the worker is started by the suspender's thread
    assert not rig.suspender.suspend(rig.pid, 2000)  # one operation at a time
    slowest, seen_in_checkpoint = 0.0, False

    def finished():
        """The sample once the suspension is over; on the way, how long each sample() took, and CHECKPOINT seen."""
        nonlocal slowest, seen_in_checkpoint
        began = time.monotonic()
        sample = rig.suspender.sample()
        slowest = max(slowest, time.monotonic() - began)
        seen_in_checkpoint |= (
            sample.in_flight and sample.step is Step.CHECKPOINT and sample.step_started_at is not None
        )
        return None if sample.in_flight else sample

    sample = wait_until(finished, BOUND_S, what="the suspension to finish", interval=0.01)
    assert sample.outcome is Outcome.SUSPENDED
    assert sample.duration_s >= 5.0
    assert seen_in_checkpoint
    assert sample.took(Step.CHECKPOINT) >= 5.0
    assert slowest < 0.05, f"sample() took {slowest:.3f} s while the checkpoint ran"


def test_unavailable_driver_is_reported_and_nothing_is_called(rig):
    rig.control_set(unavailable="no NVIDIA GPU in this test")
    sample = rig.run("suspend")
    assert sample.outcome is Outcome.UNAVAILABLE
    assert sample.error == "no NVIDIA GPU in this test"
    assert rig.calls() == [] and proc_state(rig.pid) != "T"


def test_the_real_driver_on_this_gpu_less_machine_is_unavailable(rig):
    env = {k: v for k, v in rig.env.items() if k != FAKE_ENV}
    suspender = Suspender(env=env)
    assert suspender.suspend(rig.pid, 1000)
    sample = suspender.wait(BOUND_S)
    if sample.outcome is not Outcome.UNAVAILABLE and "libcuda" not in sample.error:
        pytest.skip("this machine has a CUDA driver")
    assert sample.outcome is Outcome.UNAVAILABLE
    assert "libcuda.so.1" in sample.error and "\n" not in sample.error
    assert proc_state(rig.pid) != "T"


def test_a_worker_that_dies_without_a_result_is_unknown(rig):
    suspender = Suspender(python="/bin/false", env=rig.env)
    assert suspender.suspend(rig.pid, 1000)
    sample = suspender.wait(BOUND_S)
    assert sample.outcome is Outcome.UNKNOWN
    assert "exited with status 1 without a result" in sample.error


def test_the_worker_rejects_a_bad_command_in_one_line(rig):
    done = subprocess.run([sys.executable, "-m", WORKER_MODULE], input='{"op": "suspend", "pid": "x"}\n',
                          capture_output=True, text=True, env=rig.env, timeout=BOUND_S)  # fmt: skip
    assert done.returncode == EXIT_REJECTED
    assert done.stderr.strip().count("\n") == 0 and "pid: 'x'" in done.stderr
    assert json.loads(done.stdout)["outcome"] == "rejected"
    assert rig.calls() == []
