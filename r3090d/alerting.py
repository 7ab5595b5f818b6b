"""Alert lifecycle, pure: conditions in, SendAlert actions and a new AlertBook out.

Per key: OK -> FIRING after `hysteresis_polls` consecutive active polls, a
reminder every `reminder_interval` while firing, RESOLVED after as many
inactive polls. Events (engine restarted, gave up) are sent as they happen.
A per-key minimum interval limits how often any one key can send; silences
suppress sending but not tracking. The book is plain data so the daemon can
persist it and a restart neither re-sends nor forgets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from r3090d.config import Config
from r3090d.model import SendAlert
from r3090d.rules import Condition


@dataclass(frozen=True)
class AlertEntry:
    firing: bool = False
    active_polls: int = 0
    inactive_polls: int = 0
    severity: str = "warning"
    summary: str = ""
    since: float | None = None  # when it started firing
    last_sent_at: float | None = None


@dataclass(frozen=True)
class AlertBook:
    entries: tuple[tuple[str, AlertEntry], ...] = ()
    silenced: tuple[tuple[str, float], ...] = ()  # key -> until (monotonic)

    def get(self, key: str) -> AlertEntry:
        return dict(self.entries).get(key, AlertEntry())

    def firing(self) -> dict[str, AlertEntry]:
        return {k: e for k, e in self.entries if e.firing}

    def silenced_until(self, key: str, now: float) -> float | None:
        until = dict(self.silenced).get(key)
        return until if until is not None and until > now else None


def silence(book: AlertBook, key: str, until: float) -> AlertBook:
    items = dict(book.silenced)
    items[key] = until
    return replace(book, silenced=tuple(sorted(items.items())))


def evaluate(conditions: list[Condition], book: AlertBook, cfg: Config, now: float) -> tuple[list[SendAlert], AlertBook]:
    ac = cfg.alerts
    entries = dict(book.entries)
    out: list[SendAlert] = []
    silenced = tuple((k, u) for k, u in book.silenced if u > now)
    muted = dict(silenced)

    def send(key: str, entry: AlertEntry, state: str, severity: str, summary: str) -> AlertEntry:
        if key in muted:
            return entry
        out.append(SendAlert(key=key, severity=severity, state=state, summary=summary))
        return replace(entry, last_sent_at=now)

    for c in conditions:
        e = entries.get(c.key, AlertEntry())
        if c.event:
            if c.active and (e.last_sent_at is None or now - e.last_sent_at >= ac.min_interval or c.severity == "critical"):
                e = send(c.key, replace(e, summary=c.summary, severity=c.severity), "firing", c.severity, c.summary)
            entries[c.key] = e
            continue
        if c.active:
            e = replace(e, active_polls=e.active_polls + 1, inactive_polls=0, severity=c.severity, summary=c.summary)
            if not e.firing and e.active_polls >= ac.hysteresis_polls:
                e = replace(e, firing=True, since=now)
                if e.last_sent_at is None or now - e.last_sent_at >= ac.min_interval:
                    e = send(c.key, e, "firing", c.severity, c.summary)
            elif e.firing and ac.reminder_interval > 0 and e.last_sent_at is not None and now - e.last_sent_at >= max(ac.reminder_interval, ac.min_interval):
                e = send(c.key, e, "reminder", c.severity, c.summary)
            elif e.firing and e.last_sent_at is None and c.key not in muted:
                e = send(c.key, e, "firing", c.severity, c.summary)  # a rate-limited fire goes out late
        else:
            e = replace(e, inactive_polls=e.inactive_polls + 1, active_polls=0)
            if e.firing and e.inactive_polls >= ac.hysteresis_polls:
                was_sent = e.last_sent_at is not None
                e = replace(e, firing=False, since=None)
                if was_sent:
                    e = send(c.key, replace(e, summary=c.summary), "resolved", "info", f"resolved: {c.summary}")
        entries[c.key] = e
    return out, AlertBook(entries=tuple(sorted(entries.items())), silenced=silenced)
