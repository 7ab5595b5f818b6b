"""The pure parts of suspending the engine: which pid, whether the GPU can take it back, the worker's protocol."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3090d.core.snapshot import GpuProcess
from r3090d.core.suspend_types import Op, Outcome, ProcessState, Step
from r3090d.core.suspension import can_resume, pick_target
from r3090d.effectors.checkpoint import CheckpointError
from r3090d.effectors.suspender_worker import DONE, Command, Line, execute
from r3090d.units import GIB


def test_can_resume_with_room():
    ok, reason = can_resume(20 * GIB, 15 * GIB, GIB // 2)
    assert ok and reason == "20.0 GiB free, 15.0 GiB + 0.5 GiB margin needed"


def test_can_resume_refusal_names_the_holders_largest_first():
    holders = [GpuProcess(pid=111, used_bytes=GIB), GpuProcess(pid=222, used_bytes=12 * GIB), GpuProcess(pid=333, used_bytes=None)]
    ok, reason = can_resume(4 * GIB, 15 * GIB, GIB // 2, holders)
    assert not ok
    assert reason == "4.0 GiB free, 15.0 GiB + 0.5 GiB margin needed; held by pid 222 (12.0 GiB), pid 111 (1.0 GiB), pid 333 (?)"


def test_can_resume_refuses_when_free_memory_is_unknown():
    ok, reason = can_resume(None, 15 * GIB, 0)
    assert not ok and "unknown" in reason


@settings(deadline=None, derandomize=True, max_examples=200)
@given(free=st.integers(0, 200 * GIB), needed=st.integers(0, 150 * GIB), margin=st.integers(0, 4 * GIB))
def test_can_resume_exactly_when_free_covers_needed_plus_margin(free, needed, margin):
    assert can_resume(free, needed, margin)[0] is (free >= needed + margin)


@dataclass(frozen=True)
class Proc:
    pid: int
    used_bytes: int | None


def test_pick_target_the_engines_only_gpu_process():
    assert pick_target([Proc(10, GIB), Proc(99, GIB)], engine_pids=[5, 10, 11]) == (10, "")


def test_pick_target_refuses_several_engine_processes():
    pid, reason = pick_target([Proc(10, GIB), Proc(11, GIB)], engine_pids=[5, 10, 11])
    assert pid is None and "2 engine processes" in reason and "10, 11" in reason


def test_pick_target_refuses_an_engine_without_gpu_memory():
    assert pick_target([Proc(99, GIB)], engine_pids=[5]) == (None, "no process of the engine holds GPU memory")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not JSON"),
        ("[1]", "JSON object"),
        ('{"op": "pause", "pid": 3}', "op: 'pause' is not one of suspend, resume, state"),
        ('{"op": "suspend", "pid": 0}', "pid: 0 is not a process id"),
        ('{"op": "suspend", "pid": true}', "pid: True is not a process id"),
        ('{"op": "suspend", "pid": 3, "lock_timeout_ms": -1}', "lock_timeout_ms: -1"),
    ],
)
def test_bad_commands_are_one_line_errors_naming_the_key(text, message):
    with pytest.raises(ValueError) as info:
        Command.parse(text)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_command_round_trip():
    command = Command(Op.SUSPEND, 1234, 250)
    assert Command.parse(command.to_json()) == command


def test_line_round_trip():
    line = Line(DONE, 7.25, ok=True, state=ProcessState.CHECKPOINTED, outcome=Outcome.SUSPENDED)
    assert Line.parse(line.to_json()) == line


class ScriptedDriver:
    """In-memory driver: failures by step, a state to report; records the calls."""

    def __init__(self, fail: dict[Step, int] | None = None, state_after_fail: ProcessState = ProcessState.RUNNING):
        self.fail = fail or {}
        self.state_after_fail = state_after_fail
        self.calls: list[Step] = []

    def _do(self, step: Step) -> None:
        self.calls.append(step)
        if step in self.fail:
            raise CheckpointError(step, self.fail[step])

    def lock(self, pid, timeout_ms):
        self._do(Step.LOCK)

    def checkpoint(self, pid):
        self._do(Step.CHECKPOINT)

    def restore(self, pid):
        self._do(Step.RESTORE)

    def unlock(self, pid):
        self._do(Step.UNLOCK)

    def state(self, pid):
        self._do(Step.STATE)
        return self.state_after_fail


def run(op: Op, driver) -> tuple[Outcome, list[Line]]:
    lines: list[Line] = []
    outcome = execute(Command(op, 42, 100), lines.append, load=lambda: (driver, "scripted"))
    return outcome, lines


def test_every_step_is_announced_then_reported_and_the_last_line_carries_the_outcome():
    outcome, lines = run(Op.SUSPEND, ScriptedDriver())
    assert outcome is Outcome.SUSPENDED
    assert [(ln.step, ln.ok) for ln in lines] == [
        ("init", None), ("init", True), ("lock", None), ("lock", True), ("checkpoint", None), ("checkpoint", True), (DONE, True),
    ]  # fmt: skip
    assert lines[-1].outcome is Outcome.SUSPENDED and lines[-1].state is ProcessState.CHECKPOINTED
    assert all(ln.took_s is not None for ln in lines if ln.ok is not None and ln.step != DONE)


def test_no_driver_is_unavailable_with_the_reason():
    lines: list[Line] = []
    assert execute(Command(Op.RESUME, 42), lines.append, load=lambda: (None, "no libcuda")) is Outcome.UNAVAILABLE
    assert lines[-1].outcome is Outcome.UNAVAILABLE and lines[-1].error == "no libcuda"


@pytest.mark.parametrize(
    ("op", "fail", "state", "outcome", "calls"),
    [
        (Op.SUSPEND, {Step.LOCK: 600}, ProcessState.RUNNING, Outcome.KEPT_RUNNING, ["lock", "state"]),
        (Op.SUSPEND, {Step.CHECKPOINT: 999}, ProcessState.LOCKED, Outcome.KEPT_RUNNING, ["lock", "checkpoint", "state", "unlock"]),
        (Op.SUSPEND, {Step.CHECKPOINT: 999}, ProcessState.FAILED, Outcome.FAILED, ["lock", "checkpoint", "state"]),
        (Op.SUSPEND, {Step.CHECKPOINT: 999}, ProcessState.CHECKPOINTED, Outcome.FAILED, ["lock", "checkpoint", "state"]),
        (Op.RESUME, {Step.RESTORE: 2}, ProcessState.CHECKPOINTED, Outcome.FAILED, ["restore", "state"]),
        (Op.RESUME, {Step.UNLOCK: 999}, ProcessState.LOCKED, Outcome.FAILED, ["restore", "unlock", "state", "unlock"]),
        (Op.RESUME, {Step.UNLOCK: 999}, ProcessState.RUNNING, Outcome.KEPT_RUNNING, ["restore", "unlock", "state"]),
        (Op.STATE, {Step.STATE: 3}, ProcessState.RUNNING, Outcome.FAILED, ["state"]),
    ],
)
def test_recovery_follows_the_state_the_driver_reports(op, fail, state, outcome, calls):
    driver = ScriptedDriver(fail, state)
    got, lines = run(op, driver)
    assert got is outcome
    assert [str(c) for c in driver.calls] == calls
    first = next(iter(fail))
    assert lines[-1].error.startswith(f"{first}: ")
