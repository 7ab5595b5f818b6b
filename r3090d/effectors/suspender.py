"""Lend the GPU and take it back: suspend the engine through the driver's process checkpoint.

The daemon's side. The driver applies ptrace's access rules (under Yama's
ptrace_scope = 1 only an ancestor of the engine may act on it), so the daemon's
operations run in the engine's launcher (r3090d.effectors.launcher), the
ancestor of every engine process, sent over its command pipe. Elsewhere (preflight
asking about an engine it did not start) each operation runs in a fresh helper
process (r3090d.effectors.suspender_worker). Either way a thread sends the
command and reads the progress lines, so neither cuInit nor a driver call stuck
in D state ever touches the daemon's loop. The loop reads a frozen
`SuspendSample` each tick, as it reads the inference probe.

A suspended engine keeps its process and its host memory (its GPU bytes move
into it: RSS grows by the VRAM it held); only its GPU memory is given back.
The sample's types, and the pure checks the policy makes before acting (which
engine process to checkpoint, whether the GPU has room to take it back), are
the core's: r3090d.core.suspend_types and r3090d.core.suspension.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from r3090d.core.suspend_types import Op, Outcome, Step, StepResult, SuspendSample
from r3090d.effectors.launcher import LauncherChannel
from r3090d.effectors.suspender_worker import DONE, Command, Line

WORKER_MODULE = "r3090d.effectors.suspender_worker"
# A checkpoint moves GPU memory to host at 2-3 GB/s (15.3 GB in 6.3-6.9 s on an H200):
# a 24 GB card takes about 10 s. Past this an operation is reported overdue, not abandoned:
# its late result still counts, since a late checkpoint still leaves the engine suspended.
DEFAULT_DEADLINE_S = 120.0
_MAX_ERROR = 300


class Suspender:
    """Runs one suspend/resume/state operation at a time; the loop reads `sample()`.

    With `launcher` (a callable giving the running engine's LauncherChannel, or
    None when no engine runs) each operation goes to the engine's launcher;
    without, each runs in a worker process of its own.
    """

    def __init__(self, *, python: str = sys.executable, env: Mapping[str, str] | None = None,
                 deadline_s: float = DEFAULT_DEADLINE_S, wake: threading.Event | None = None,
                 launcher: Callable[[], LauncherChannel | None] | None = None):  # fmt: skip
        self._launcher = launcher
        self._argv = [python, "-m", WORKER_MODULE]
        self._env = dict(os.environ if env is None else env)
        self._deadline_s = deadline_s
        self._wake = wake  # set on every progress line, so the loop acts at once
        self._cond = threading.Condition()
        self._sample = SuspendSample()
        self._generation = 0

    # ------------------------------------------------------------ loop's side

    def suspend(self, pid: int, lock_timeout_ms: int) -> bool:
        return self.start(Command(Op.SUSPEND, pid, lock_timeout_ms))

    def resume(self, pid: int) -> bool:
        return self.start(Command(Op.RESUME, pid))

    def query(self, pid: int) -> bool:
        return self.start(Command(Op.STATE, pid))

    def start(self, command: Command) -> bool:
        """Begin `command` off the caller's thread. False (and nothing started) if one is in flight."""
        now = time.monotonic()
        with self._cond:
            if self._sample.in_flight:
                return False
            self._generation += 1
            generation = self._generation
            self._sample = SuspendSample(op=command.op, pid=command.pid, in_flight=True, started_at=now)
        try:
            threading.Thread(target=self._run, args=(generation, command), name="suspender", daemon=True).start()
        except Exception as exc:  # noqa: BLE001 - no thread to be had: nothing was done to the engine
            self._finish(generation, Outcome.UNAVAILABLE, f"worker not started: {type(exc).__name__}: {exc}")
        return True

    def sample(self) -> SuspendSample:
        """The latest state of the operation; never blocks on the worker."""
        with self._cond:
            sample = self._sample
        if sample.in_flight and sample.started_at is not None and time.monotonic() - sample.started_at > self._deadline_s:
            sample = replace(sample, overdue=True)
        return sample

    def wait(self, timeout: float) -> SuspendSample:
        """Block until no operation is in flight, or `timeout` passes (scripts and tests; never the loop)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._sample.in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return self.sample()

    # ---------------------------------------------------------- thread's side

    def _run(self, generation: int, command: Command) -> None:
        outcome, error = Outcome.UNKNOWN, "the worker ended without a result"
        try:
            outcome, error = self._drive(generation, command)
        except Exception as exc:  # noqa: BLE001 - whatever broke, the sample must not stay in flight
            outcome, error = Outcome.UNKNOWN, f"{type(exc).__name__}: {exc}"
        finally:
            self._finish(generation, outcome, error)

    def _drive(self, generation: int, command: Command) -> tuple[Outcome, str]:
        if self._launcher is None:
            return self._drive_worker(generation, command)
        channel = self._launcher()
        if channel is None:
            return Outcome.FAILED, f"no engine is running: no process {command.pid} to {command.op}"
        done = self._follow(generation, channel.exchange(command))
        if done is not None and done.outcome is not None:
            return done.outcome, done.error
        return Outcome.UNKNOWN, "the engine's launcher exited without a result"

    def _follow(self, generation: int, lines: Iterable[str]) -> Line | None:
        """Apply each progress line to the sample; the last line (step "done"), or None if none came."""
        done: Line | None = None
        for text in lines:
            try:
                line = Line.parse(text)
            except (ValueError, KeyError):
                self._note(generation, f"unreadable worker line: {text.strip()[:120]}")
                continue
            self._apply(generation, line)
            if line.step == DONE:
                done = line
        return done

    def _drive_worker(self, generation: int, command: Command) -> tuple[Outcome, str]:
        with tempfile.TemporaryFile() as errors:
            try:
                proc = subprocess.Popen(
                    self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                    env=self._env, text=True, start_new_session=True,  # a terminal's Ctrl-C must not cut a checkpoint short
                )  # fmt: skip
            except OSError as exc:
                return Outcome.UNAVAILABLE, f"worker not started: {exc}"
            with proc:
                try:
                    proc.stdin.write(command.to_json() + "\n")
                    proc.stdin.close()
                except OSError:
                    pass  # it exited at once; its stderr says why
                done = self._follow(generation, proc.stdout)
                rc = proc.wait()
            if done is not None and done.outcome is not None:
                return done.outcome, done.error
            errors.seek(0)
            tail = [t for t in errors.read().decode(errors="replace").splitlines() if t.strip()]
            why = f": {tail[-1].strip()}" if tail else ""
            return Outcome.UNKNOWN, f"the worker exited with status {rc} without a result{why}"

    def _apply(self, generation: int, line: Line) -> None:
        now = time.monotonic()
        with self._cond:
            if generation != self._generation:
                return
            s = self._sample
            changes: dict = {"state": line.state}  # the worker's current belief, None when it cannot know
            if line.error:
                changes["error"] = _short(line.error)
            if line.step != DONE:
                step = Step(line.step)
                changes["step"] = step
                if line.ok is None:
                    changes["step_started_at"] = now
                else:
                    changes["steps"] = s.steps + (StepResult(step, bool(line.ok), line.took_s or 0.0, _short(line.error)),)
            self._sample = replace(s, **changes)
        if self._wake is not None:
            self._wake.set()

    def _note(self, generation: int, error: str) -> None:
        with self._cond:
            if generation == self._generation:
                self._sample = replace(self._sample, error=_short(error))

    def _finish(self, generation: int, outcome: Outcome, error: str) -> None:
        with self._cond:
            if generation != self._generation:
                return
            if error:
                last_error = _short(error)
            else:  # a clean outcome clears the step errors a recovery left behind
                last_error = "" if outcome in _CLEAN else self._sample.error
            self._sample = replace(self._sample, in_flight=False, finished_at=time.monotonic(), outcome=outcome, error=last_error)
            self._cond.notify_all()
        if self._wake is not None:
            self._wake.set()


_CLEAN = (Outcome.SUSPENDED, Outcome.RESUMED, Outcome.REPORTED)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."
