"""One suspend, resume or state command against the driver, and the helper process that runs one:
`python -m r3090d.effectors.suspender_worker`.

The daemon never calls the CUDA driver itself: cuInit, and a driver call stuck
in D state, stay in another process. For the daemon's engine that is its
launcher (r3090d.effectors.launcher, an ancestor of every engine process, as
ptrace's rules want), which runs `handle()` for each command line it is sent;
for an engine preflight finds running, it is this short-lived process, which
reads one JSON command on stdin and writes JSON lines on stdout:

    in:   {"op": "suspend" | "resume" | "state", "pid": 1234, "lock_timeout_ms": 5000}
    out:  {"step": "lock", "elapsed_s": 0.21, "ok": null, "error": "", "state": null}       a step begins
          {"step": "lock", "elapsed_s": 0.22, "ok": true, "took_s": 0.003, "error": "", ...} it ended
          ...
          {"step": "done", "elapsed_s": 7.1, "ok": true, "outcome": "suspended", "state": "CHECKPOINTED", ...}

Suspend is lock (with the timeout) then checkpoint; resume is restore then
unlock. On any error the process's state is read: RUNNING means nothing is left
to undo, LOCKED is unlocked (once); either way the engine kept running. Any other
state, or an error reading it, is a failure: the driver does not try to keep a
process usable after an error in checkpoint or restore, so the daemon restarts
the engine cold.

It needs no GPU to run: without a usable driver it reports outcome
"unavailable" with a one-line reason and exits 0.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from r3090d.core.suspend_types import Op, Outcome, ProcessState, Step
from r3090d.effectors.checkpoint import CheckpointDriver, CheckpointError, load_driver

DONE = "done"  # the step name of the last line
EXIT_REJECTED = 64  # EX_USAGE: the command line on stdin was not a valid command


@dataclass(frozen=True)
class Command:
    op: Op
    pid: int
    lock_timeout_ms: int = 5000

    def to_json(self) -> str:
        return json.dumps({"op": str(self.op), "pid": self.pid, "lock_timeout_ms": self.lock_timeout_ms})

    @classmethod
    def parse(cls, text: str) -> Command:
        """Raises ValueError with a one-line message naming the bad key."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"the command is not JSON ({exc}): send one line such as {{\"op\": \"state\", \"pid\": 1234}}") from None
        if not isinstance(raw, dict):
            raise ValueError("the command must be a JSON object with keys op, pid and optionally lock_timeout_ms")
        try:
            op = Op(raw.get("op"))
        except ValueError:
            raise ValueError(f"op: {raw.get('op')!r} is not one of {', '.join(o.value for o in Op)}") from None
        pid = raw.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"pid: {pid!r} is not a process id (a positive integer)")
        timeout = raw.get("lock_timeout_ms", cls.lock_timeout_ms)
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
            raise ValueError(f"lock_timeout_ms: {timeout!r} is not a non-negative integer (0 waits for ever)")
        return cls(op, pid, timeout)


@dataclass(frozen=True)
class Line:
    """One progress line. `ok` None: the step has begun; `outcome` only on the last line (step "done")."""

    step: str  # a Step value, or DONE
    elapsed_s: float
    ok: bool | None = None
    error: str = ""
    state: ProcessState | None = None
    took_s: float | None = None
    outcome: Outcome | None = None

    def to_json(self) -> str:
        out = {"step": self.step, "elapsed_s": round(self.elapsed_s, 6), "ok": self.ok, "error": self.error,
               "state": self.state.name if self.state is not None else None}  # fmt: skip
        if self.took_s is not None:
            out["took_s"] = round(self.took_s, 6)
        if self.outcome is not None:
            out["outcome"] = str(self.outcome)
        return json.dumps(out)

    @classmethod
    def parse(cls, text: str) -> Line:
        """Raises ValueError on a line this module did not write."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or not isinstance(raw.get("step"), str):
            raise ValueError(f"not a progress line: {text[:80]!r}")
        step = raw["step"]
        if step != DONE:
            Step(step)
        state = raw.get("state")
        outcome = raw.get("outcome")
        took = raw.get("took_s")
        return cls(
            step=step,
            elapsed_s=float(raw.get("elapsed_s", 0.0)),
            ok=raw.get("ok"),
            error=str(raw.get("error") or ""),
            state=ProcessState[state] if state is not None else None,
            took_s=float(took) if took is not None else None,
            outcome=Outcome(outcome) if outcome is not None else None,
        )


Emit = Callable[[Line], None]


class _Run:
    """One operation's steps, each announced and timed."""

    def __init__(self, driver: CheckpointDriver, pid: int, emit: Emit, clock=time.monotonic, t0: float | None = None):
        self.driver = driver
        self.pid = pid
        self.emit = emit
        self.clock = clock
        self.t0 = clock() if t0 is None else t0
        self.state: ProcessState | None = None
        self.error = ""

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def step(self, step: Step, call: Callable[[], object]) -> bool:
        self.emit(Line(str(step), self.elapsed(), state=self.state))
        began = self.clock()
        try:
            result = call()
        except CheckpointError as exc:
            self.error = str(exc)
            self.emit(Line(str(step), self.elapsed(), ok=False, error=self.error, state=self.state, took_s=self.clock() - began))
            return False
        if isinstance(result, ProcessState):
            self.state = result
        self.emit(Line(str(step), self.elapsed(), ok=True, state=self.state, took_s=self.clock() - began))
        return True

    def read_state(self) -> ProcessState | None:
        if self.step(Step.STATE, lambda: self.driver.state(self.pid)):
            return self.state
        self.state = None
        return None

    def recover(self) -> Outcome:
        """After a failed step: leave the engine running if the driver says it can, else report failure."""
        first_error = self.error
        state = self.read_state()
        if state is ProcessState.LOCKED and self.step(Step.UNLOCK, lambda: self.driver.unlock(self.pid)):
            self.state = ProcessState.RUNNING
            state = ProcessState.RUNNING
        errors = [e for e in (first_error, self.error) if e]
        self.error = first_error if state is ProcessState.RUNNING else "; ".join(dict.fromkeys(errors))  # each error once
        return Outcome.KEPT_RUNNING if state is ProcessState.RUNNING else Outcome.FAILED


def suspend(driver: CheckpointDriver, pid: int, lock_timeout_ms: int, run: _Run) -> Outcome:
    if not run.step(Step.LOCK, lambda: driver.lock(pid, lock_timeout_ms)):
        return run.recover()
    run.state = ProcessState.LOCKED
    if not run.step(Step.CHECKPOINT, lambda: driver.checkpoint(pid)):
        return run.recover()
    run.state = ProcessState.CHECKPOINTED
    return Outcome.SUSPENDED


def resume(driver: CheckpointDriver, pid: int, run: _Run) -> Outcome:
    if not run.step(Step.RESTORE, lambda: driver.restore(pid)):
        return run.recover()
    run.state = ProcessState.LOCKED  # restore leaves the process locked
    if not run.step(Step.UNLOCK, lambda: driver.unlock(pid)):
        return run.recover()
    run.state = ProcessState.RUNNING
    return Outcome.RESUMED


def execute(command: Command, emit: Emit, load=load_driver, clock=time.monotonic) -> Outcome:
    """Run one command against the driver `load()` gives, writing progress through `emit`."""
    t0 = clock()
    emit(Line(str(Step.INIT), 0.0))
    driver, reason = load()
    if driver is None:
        emit(Line(str(Step.INIT), clock() - t0, ok=False, error=reason, took_s=clock() - t0))
        emit(Line(DONE, clock() - t0, ok=False, error=reason, outcome=Outcome.UNAVAILABLE))
        return Outcome.UNAVAILABLE
    emit(Line(str(Step.INIT), clock() - t0, ok=True, error="", took_s=clock() - t0))
    run = _Run(driver, command.pid, emit, clock, t0)
    if command.op is Op.SUSPEND:
        outcome = suspend(driver, command.pid, command.lock_timeout_ms, run)
    elif command.op is Op.RESUME:
        outcome = resume(driver, command.pid, run)
    else:
        outcome = Outcome.REPORTED if run.read_state() is not None else Outcome.FAILED
    ok = outcome in (Outcome.SUSPENDED, Outcome.RESUMED, Outcome.REPORTED)
    emit(Line(DONE, run.elapsed(), ok=ok, error="" if ok else run.error, state=run.state, outcome=outcome))
    return outcome


def handle(text: str, emit: Emit, load=load_driver) -> Outcome:
    """Parse one command line and run it; a bad line is answered "rejected", its reason also on stderr."""
    try:
        command = Command.parse(text)
    except ValueError as exc:
        print(f"r3090d suspender: {exc}", file=sys.stderr, flush=True)
        emit(Line(DONE, 0.0, ok=False, error=str(exc), outcome=Outcome.REJECTED))
        return Outcome.REJECTED
    return execute(command, emit, load)


def _emit(line: Line) -> None:
    # The daemon may be gone: the sequence still runs to its end, so an engine is
    # never left locked because nobody was listening.
    try:
        sys.stdout.write(line.to_json() + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


def main() -> int:
    return EXIT_REJECTED if handle(sys.stdin.readline(), _emit) is Outcome.REJECTED else 0


if __name__ == "__main__":
    sys.exit(main())
