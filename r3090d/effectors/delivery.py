"""What an alert channel is: the protocol the dispatcher (r3090d.effectors.alerts) drives,
and the error of one failed attempt. Syslog and SMTP (r3090d.effectors.channels) and
Alertmanager (r3090d.effectors.alertmanager) implement it, neither importing the other's module."""

from __future__ import annotations

from typing import Any, Protocol


class DeliveryError(Exception):
    """One delivery attempt failed; the text is safe to log (no secrets)."""


class Channel(Protocol):
    name: str
    target: str  # where it delivers, for humans: "/dev/log", "smtp.example.org:587 (starttls) ..."
    max_attempts: int

    def prepare(self, item: Any) -> Any: ...  # a RaisedAlert, or what the channel's own feed queues

    def deliver(self, payload: Any) -> str: ...  # a note for the operator, "" if none; raises DeliveryError

    def redact(self, text: str) -> str: ...

    def close(self) -> None: ...
