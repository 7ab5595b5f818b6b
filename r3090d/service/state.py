"""The daemon's persisted state: what `r3090ctl status` and the exporter read.

Written atomically (write a temporary file, rename) every tick into the
state directory, which systemd keeps across restarts, so the last word of a
daemon that gave up is still there for `status` to show, and the next daemon
goes on from its alert book and restart history (`carried_over`; in swap mode each
model's engine leaves its own in HANDED_ON_FILE, in its state directory). Times in the
file are wall-clock seconds; the policy's monotonic times are converted on the
way out and back.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import time
from pathlib import Path

from r3090d.core.alerting import AlertBook, AlertEntry
from r3090d.core.policy import RestartHistory
from r3090d.core.vocabulary import Severity
from r3090d.service.statedoc import RestartsInfo, UnreadableFormat, check_format, parse_section

log = logging.getLogger("r3090d")

STATE_FILE = "state.json"
# Swap mode: what one model's engine hands on (report.hand_on), in its own state directory (<state_dir>/models/<name>);
# the card's alert book is in STATE_FILE, as the one engine's is in single mode.
HANDED_ON_FILE = "handed-on.json"
FORMAT_VERSION = 1


def wall_offset() -> float:
    """Add to a monotonic time to get wall-clock time."""
    return time.time() - time.monotonic()


def plain(obj):
    """Dataclasses, enums and tuples as JSON-ready data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    return obj


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


BOOK_TIME_FIELDS = ("since", "last_sent_at", "clear_since")  # monotonic in AlertEntry, wall in the file


def book_from_json(data: dict | None, offset: float) -> AlertBook:
    """Rebuild the alert book persisted by a previous daemon; garbage gives an empty book."""
    if not isinstance(data, dict):
        return AlertBook()

    def mono(t):
        return None if t is None else float(t) - offset

    entries = []
    try:
        for key, raw in (data.get("entries") or {}).items():
            fields = {f.name for f in dataclasses.fields(AlertEntry)}
            if "fired_sent" not in raw:
                # Written before fired_sent existed: then a firing entry with a send time had sent its FIRING.
                raw = {**raw, "fired_sent": bool(raw.get("firing")) and raw.get("last_sent_at") is not None}
            raw = {k: v for k, v in raw.items() if k in fields}
            for name in BOOK_TIME_FIELDS:
                raw[name] = mono(raw.get(name))
            if "severity" in raw:
                raw["severity"] = Severity(raw["severity"])
            entries.append((key, AlertEntry(**raw)))
        silenced = tuple(sorted((k, float(u) - offset) for k, u in (data.get("silenced") or {}).items()))
    except (TypeError, ValueError, AttributeError):
        return AlertBook()
    return AlertBook(entries=tuple(sorted(entries)), silenced=silenced)


def carried_over(path: Path, offset: float) -> tuple[AlertBook, RestartHistory]:
    """The alert book and restart history an earlier daemon left in its state file at `path`, in this
    process's monotonic times (`offset` as wall_offset() gives it). Nothing when there is no file; a
    damaged one, or one in a format this version cannot read, is logged and goes for nothing."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return AlertBook(), RestartHistory()
    except OSError as exc:
        log.warning("cannot read %s (%s): starting without the earlier daemon's alert book and restart history", path, exc)
        return AlertBook(), RestartHistory()
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise UnreadableFormat(f"a JSON {type(doc).__name__}, not an object")
        check_format(doc)
    except ValueError as exc:  # bad JSON, or UnreadableFormat
        log.warning("%s is damaged (%s): starting without the earlier daemon's alert book and restart history", path, str(exc)[:200])
        return AlertBook(), RestartHistory()
    return book_from_json(doc.get("alert_book"), offset), history_from_json(doc.get("restarts"), offset)


def history_from_json(data, offset: float) -> RestartHistory:
    """The restart history in a state document's `restarts` section; what does not fit is left out."""
    restarts = parse_section(RestartsInfo, data) or RestartsInfo()
    return RestartHistory(
        restart_times=tuple(t - offset for t in restarts.recent_at),
        start_failures=restarts.start_failures,
        same_cause_run=restarts.same_cause_run,
        last_root_cause=restarts.last_root_cause,
        restarts_total=max(0, restarts.total),
        restarts_by_reason=tuple(sorted((reason, n) for reason, n in restarts.by_reason.items() if n > 0)),
        last_restart_reason=restarts.last_reason,
        last_restart_at=None if restarts.last_at is None else restarts.last_at - offset,
    )
