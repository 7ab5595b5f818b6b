"""What the suspend policy and the suspender share: the driver's process states,
the worker's operations, steps and outcomes, and the sample the loop reads.

Pure data, so the policy (r3090d.core.suspension) can read a `SuspendSample`
without loading what produces it: ctypes (r3090d.effectors.checkpoint), the
helper process (r3090d.effectors.suspender_worker) and the thread that reads it
(r3090d.effectors.suspender).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ProcessState(enum.IntEnum):
    """CUprocessState. Values past FAILED come from newer headers; anything unknown reads as UNKNOWN."""

    UNKNOWN = -1
    RUNNING = 0
    LOCKED = 1  # CUDA calls of the process block
    CHECKPOINTED = 2  # its GPU memory is in its host memory, its device handles released
    FAILED = 3  # an uncorrectable error during checkpoint or restore
    CHECKPOINTING = 4
    RESTORING = 5

    @classmethod
    def from_code(cls, code: int) -> ProcessState:
        try:
            return cls(code)
        except ValueError:
            return cls.UNKNOWN


class Step(enum.StrEnum):
    """One driver call, as progress lines and errors name it."""

    INIT = "init"  # load libcuda, check the driver, cuInit
    LOCK = "lock"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    UNLOCK = "unlock"
    STATE = "state"


class Op(enum.StrEnum):
    SUSPEND = "suspend"
    RESUME = "resume"
    STATE = "state"


class Outcome(enum.StrEnum):
    SUSPENDED = "suspended"  # checkpointed: the GPU memory is free, the process waits, locked
    RESUMED = "resumed"  # restored and unlocked: serving again
    KEPT_RUNNING = "kept_running"  # the operation did not happen and the engine runs as before
    FAILED = "failed"  # the engine is in no state to serve: restart it cold
    UNAVAILABLE = "unavailable"  # no usable driver here (or the worker could not start): nothing was done
    REJECTED = "rejected"  # the command was not valid: nothing was done
    REPORTED = "reported"  # op "state": the state was read
    UNKNOWN = "unknown"  # the worker ended without a result: read the state before acting


@dataclass(frozen=True)
class StepResult:
    step: Step
    ok: bool
    took_s: float
    error: str = ""


@dataclass(frozen=True)
class SuspendSample:
    """The latest (or current) suspend/resume operation, as the loop sees it."""

    op: Op | None = None  # None: nothing was ever asked
    pid: int | None = None
    in_flight: bool = False
    started_at: float | None = None  # monotonic, when the operation was asked for
    finished_at: float | None = None
    step: Step | None = None  # the step under way, or the last one that ran
    step_started_at: float | None = None  # monotonic, as this process saw the step begin
    steps: tuple[StepResult, ...] = ()  # the steps that ended, in order, with the worker's timings
    outcome: Outcome | None = None  # None while in flight
    state: ProcessState | None = None  # the driver's last word on the pid's state
    error: str = ""  # the last error, one line
    overdue: bool = False  # in flight past the deadline: a driver call may be stuck

    def took(self, step: Step) -> float | None:
        """Seconds the last run of `step` took in the worker, or None if it did not end."""
        for result in reversed(self.steps):
            if result.step is step:
                return result.took_s
        return None

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


class SleepOp(enum.StrEnum):
    """One of vLLM's sleep-mode exchanges (its dev endpoints), as the sleep worker runs it."""

    SLEEP = "sleep"  # POST /pause?mode=wait, POST /sleep?level=1, GET /is_sleeping
    WAKE = "wake"  # POST /wake_up, POST /resume
    UNPAUSE = "unpause"  # POST /resume: a failed sleep gives the engine its scheduler back


@dataclass(frozen=True)
class SleepSample:
    """The sleep worker's latest exchange with the engine, as the loop sees it."""

    op: SleepOp | None = None  # None: nothing was ever asked
    in_flight: bool = False
    started_at: float | None = None  # monotonic, when the exchange was asked for
    finished_at: float | None = None
    ok: bool = False  # every call answered 2xx (and, for a sleep, /is_sleeping said true)
    error: str = ""  # the failed call and why, one line
