"""What decide() asks the effectors to do: frozen data, no handles."""

from __future__ import annotations

from dataclasses import dataclass


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
    severity: str  # "info" | "warning" | "critical"
    state: str  # "firing" | "reminder" | "resolved"
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
class Exit:
    code: int
    reason: str


Action = StartEngine | StopEngine | SendAlert | RecordRestart | SendInferenceProbe | Exit
