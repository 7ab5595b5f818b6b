"""Alert text: what every channel says about an alert, and where it comes from.

Pure: the subject and body of a mail, the syslog line and its priority, all
from a `RaisedAlert` (the policy's SendAlert, its `AlertContext` and the time
it was raised). The channels (r3090d.effectors.channels, .alertmanager) send
what this module writes.

Syslog priorities (RFC 5424 severities), chosen so a filter on "warning and
worse" sees every open problem and a filter on "notice and worse" also sees
each all-clear:

    critical, firing or reminder  -> crit (2)
    warning,  firing or reminder  -> warning (4)
    any severity, resolved        -> notice (5)
    info,     firing or reminder  -> info (6)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import re
import socket
from dataclasses import dataclass

from r3090d.config import Config
from r3090d.core.actions import SendAlert
from r3090d.core.vocabulary import AlertState, Severity

MAX_SYSLOG_TEXT = 2000  # characters; well under any datagram limit
MAX_SUBJECT_SUMMARY = 100


_SYSLOG_PRIORITY = {Severity.CRITICAL: "crit", Severity.WARNING: "warning", Severity.INFO: "info"}
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]+")


# ------------------------------------------------------------------ the alert


@dataclass(frozen=True)
class AlertContext:
    """Where the alert comes from: printed in every subject, body and syslog line.

    The configured GPU index is known at start; the name and UUID only once NVML
    has answered (AlertDispatcher.set_gpu), so alerts raised before then carry
    the index alone.
    """

    hostname: str
    gpu_index: int | None = None  # None: gpu.required = false, no GPU is watched
    gpu_name: str | None = None  # from NVML once known; None before the first sample
    instance: int | None = None  # N of r3090d@N; None for the plain unit
    gpu_uuid: str | None = None  # from NVML once known, e.g. "GPU-5f2e1c7a-..."

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        gpu_name: str | None = None,
        gpu_uuid: str | None = None,
        hostname: str | None = None,
    ) -> AlertContext:
        return cls(
            hostname=hostname or socket.gethostname(),
            gpu_index=cfg.gpu.index if cfg.gpu.required else None,
            gpu_name=gpu_name,
            instance=cfg.instance,
            gpu_uuid=gpu_uuid,
        )

    def with_gpu(self, name: str | None, index: int | None, uuid: str | None) -> AlertContext:
        """This context for the GPU NVML reported; what a sample lacks (a failed read) stays as known."""
        return dataclasses.replace(
            self,
            gpu_index=self.gpu_index if index is None else index,
            gpu_name=one_line(name) if name else self.gpu_name,
            gpu_uuid=one_line(uuid) if uuid else self.gpu_uuid,
        )

    @property
    def gpu_label(self) -> str:
        return f"gpu{self.gpu_index}" if self.gpu_index is not None else "nogpu"

    @property
    def watched_gpu_uuid(self) -> str | None:
        """The UUID of the GPU the daemon watches, once NVML has given it; None with gpu.required = false."""
        return self.gpu_uuid if self.gpu_index is not None else None

    @property
    def gpu_identity(self) -> str:
        """'[name, uuid]' (either part when only one is known), or '' when neither is or no GPU is watched."""
        if self.gpu_index is None:
            return ""
        known = [one_line(part) for part in (self.gpu_name, self.gpu_uuid) if part]
        return f"[{', '.join(known)}]" if known else ""

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        """The origin as name/value pairs, only those known: for channels that carry labels."""
        pairs = [
            ("host", self.hostname),
            ("instance", None if self.instance is None else str(self.instance)),
            ("gpu_index", None if self.gpu_index is None else str(self.gpu_index)),
            ("gpu_name", self.gpu_name),
            ("gpu_uuid", self.gpu_uuid),
        ]
        return tuple((name, value) for name, value in pairs if value)


@dataclass(frozen=True)
class RaisedAlert:
    """An alert as submitted: the action, its origin, and when it was raised (wall clock)."""

    alert: SendAlert
    context: AlertContext
    raised_at: float

    @property
    def label(self) -> str:
        return alert_label(self)

    @property
    def coalesce_key(self) -> str | None:
        return None  # every message counts: a mail is never replaced by a later one

    def delivered(self, channel: str) -> None:
        pass


# ----------------------------------------------------------- pure formatting


def one_line(text: str) -> str:
    return CONTROL_CHARS.sub(" ", text).strip()


def log_level(alert: SendAlert) -> int:
    """The daemon's own log line for an alert. A resolve is good news: INFO, so `journalctl -p warning` lists only problems."""
    if alert.state == AlertState.RESOLVED:
        return logging.INFO
    return logging.ERROR if alert.severity == Severity.CRITICAL else logging.WARNING


def syslog_priority_name(alert: SendAlert) -> str:
    if alert.state == AlertState.RESOLVED:
        return "notice"
    return _SYSLOG_PRIORITY.get(alert.severity, "warning")


def syslog_message(raised: RaisedAlert) -> str:
    """The text after `ident[pid]: `: one line, GPU, key, state, severity, summary, GPU name and UUID.

    The name and UUID come last, so a filter on the leading words keeps working,
    and survive a summary cut at the length limit.
    """
    a, c = raised.alert, raised.context
    head = one_line(f"{c.gpu_label} {a.key} {a.state.upper()} ({a.severity}):")
    tail = f" {c.gpu_identity}" if c.gpu_identity else ""
    room = MAX_SYSLOG_TEXT - len(head) - len(tail) - 1
    summary = one_line(a.summary)
    if len(summary) > room:
        summary = summary[: max(0, room - 1)] + "…"
    return (f"{head} {summary}".rstrip() + tail)[:MAX_SYSLOG_TEXT]


def email_subject(raised: RaisedAlert) -> str:
    a, c = raised.alert, raised.context
    summary = one_line(a.summary)
    if len(summary) > MAX_SUBJECT_SUMMARY:
        summary = summary[: MAX_SUBJECT_SUMMARY - 1] + "…"
    subject = (
        f"[r3090d] {one_line(c.hostname)} {c.gpu_label} {one_line(a.key)} {a.state.upper()} ({a.severity})"
    )
    if summary:
        subject = f"{subject}: {summary}"
    # The GPU's name and UUID last: what and how bad stay at the front of a mail list.
    return f"{subject} {c.gpu_identity}" if c.gpu_identity else subject


def _format_time(wall: float) -> str:
    local = dt.datetime.fromtimestamp(wall).astimezone()
    utc = dt.datetime.fromtimestamp(wall, dt.UTC)
    return f"{local.isoformat(timespec='seconds')} ({utc.strftime('%Y-%m-%d %H:%M:%S')} UTC)"


def email_body(raised: RaisedAlert) -> str:
    a, c = raised.alert, raised.context
    gpu = "none configured" if c.gpu_index is None else str(c.gpu_index)
    if c.gpu_index is not None and c.gpu_name:
        gpu += f" ({c.gpu_name})"
    lines = [f"{a.key} is {a.state.upper()} ({a.severity})", "", a.summary, ""]
    if a.detail:
        lines += [a.detail.rstrip(), ""]
    lines += [
        f"Host:     {c.hostname}",
        f"GPU:      {gpu}",
    ]
    if c.watched_gpu_uuid:
        lines.append(f"GPU UUID: {c.watched_gpu_uuid}")
    if c.instance is not None:
        lines.append(f"Unit:     r3090d@{c.instance}")
    lines += [
        f"Alert:    {a.key}",
        f"Severity: {a.severity}",
        f"State:    {a.state}",
        f"Raised:   {_format_time(raised.raised_at)}",
        "",
        "-- ",
        f"Sent by r3090d on {c.hostname}. `r3090ctl status` shows the current state.",
    ]
    return "\n".join(lines) + "\n"


def alert_label(raised: RaisedAlert) -> str:
    a = raised.alert
    return f"{one_line(a.key)} {a.state.upper()} ({a.severity})"
