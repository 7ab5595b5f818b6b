"""What decide() asks the effectors to do: frozen data, no handles."""

from __future__ import annotations

from dataclasses import dataclass

from r3090d.core.snapshot import CanaryAnswer
from r3090d.core.vocabulary import AlertState, CanaryPurpose, Severity


@dataclass(frozen=True)
class StartEngine:
    reason: str


@dataclass(frozen=True)
class StopEngine:
    drain: bool
    reason: str


@dataclass(frozen=True)
class SendAlert:
    key: str
    severity: Severity
    state: AlertState
    summary: str  # one line: the syslog message and the email subject's tail
    detail: str = ""  # optional longer text for the email body (evidence, numbers, hints)


@dataclass(frozen=True)
class RecordRestart:
    """Write a restart forensics record."""

    reason: str
    detail: str
    root_cause: str | None = None


@dataclass(frozen=True)
class SendInferenceProbe:
    pass


@dataclass(frozen=True)
class SendCanary:
    """Send the known-answer canary, off the loop; its answer arrives in Snapshot.canary."""

    purpose: CanaryPurpose


@dataclass(frozen=True)
class SaveBaseline:
    """Persist this engine's canary baseline in state_dir, with what it depends on."""

    answer: CanaryAnswer
    start_mismatch: bool = False  # it differed from the earlier engine's: kept beside that one, never over it


@dataclass(frozen=True)
class Exit:
    code: int
    reason: str


# ------------------------------------------------------------ suspend/resume
# Each driver operation runs in the suspender's worker process, off the loop;
# decide() reads its result in a later snapshot (Snapshot.suspender).


@dataclass(frozen=True)
class SuspendEngine:
    """Lock then checkpoint `pid` (the engine's one GPU process)."""

    pid: int
    lock_timeout_ms: int
    frozen_requests: int = 0  # still running or waiting at the drain deadline: they finish after resume


@dataclass(frozen=True)
class ResumeEngine:
    """Restore then unlock `pid`."""

    pid: int


@dataclass(frozen=True)
class QueryEngineState:
    """Ask the driver for `pid`'s checkpoint state (after a worker that ended without a result)."""

    pid: int


@dataclass(frozen=True)
class SleepEngine:
    """Park by vLLM's sleep mode: pause (waiting for what runs), sleep at level 1, confirm /is_sleeping."""

    timeout_s: float


@dataclass(frozen=True)
class WakeEngine:
    """Unpark a sleeping engine: /wake_up then /resume."""

    timeout_s: float


@dataclass(frozen=True)
class UnpauseEngine:
    """A failed sleep: /resume, so that what the paused engine holds runs to its end before the drained stop."""

    timeout_s: float


@dataclass(frozen=True)
class SuspendRecord:
    """The suspension as state_dir/suspended.json keeps it across daemon restarts."""

    pid: int  # the checkpointed process
    engine_pid: int | None  # the engine's main pid (its process group)
    bytes: int  # GPU memory the checkpointed process held: what resuming needs free again
    since: float  # wall-clock time it was suspended
    baseline: CanaryAnswer | None = None  # the canary's answer before the lock: a resume must give it back
    baseline_for: tuple = ()  # the canary's request_key it answered: a resume with another question drops it
    parked: bool = False  # swap mode's park, not the operator's suspension


@dataclass(frozen=True)
class SaveSuspension:
    """Persist the suspension (record), or forget it (None)."""

    record: SuspendRecord | None


@dataclass(frozen=True)
class RequestGpuSample:
    """A fresh NVML reading now, not at the next period: resuming judges the room on it."""


@dataclass(frozen=True)
class ResetProbes:
    """Forget the inference probe's past: the engine was frozen, its old failures say nothing now."""


Action = (
    StartEngine | StopEngine | SendAlert | RecordRestart | SendInferenceProbe | Exit
    | SuspendEngine | ResumeEngine | QueryEngineState | SaveSuspension | RequestGpuSample | ResetProbes
    | SendCanary | SaveBaseline
)  # fmt: skip
