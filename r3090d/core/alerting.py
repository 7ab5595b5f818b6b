"""Alert lifecycle, pure: conditions in, SendAlert actions and a new AlertBook out.

Per key: OK -> FIRING after `hysteresis_polls` consecutive active polls (one
for an `immediate` condition, a state rather than a noisy reading), a
reminder every `reminder_interval` while firing, RESOLVED once the condition
has been inactive for as many polls *and* for the key's resolve
hold (`alerts.resolve_hold`, or `alerts.kv_pressure_resolve_hold` for
kv_pressure, which flaps with load) -- as Prometheus' keep_firing_for. A
condition that comes back inside the hold continues the same episode: no
second FIRING, no RESOLVED in between.

Every FIRING is answered by exactly one RESOLVED, and a RESOLVED is sent only
for a FIRING that was sent (`AlertEntry.fired_sent`). A per-key minimum
interval limits how often a key sends FIRING and reminders; a FIRING it holds
back goes out late, at the first poll it is allowed, if the condition still
fires then. Silences suppress sending but not tracking; a FIRING held back by
a silence goes out when the silence ends. A RESOLVED for a FIRING that was
sent goes out even while the key is silenced or inside its minimum interval,
so nobody is left holding a stale FIRING. The RESOLVED text is the inactive
condition's summary: it says what the state is now, not what it was.

Events (engine restarted, gave up) are sent as they happen, rate-limited
unless critical, and never resolve. The book is plain data so the daemon can
persist it and a restart neither re-sends nor forgets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from r3090d.config.schema import AlertsConfig, Config
from r3090d.core.actions import SendAlert
from r3090d.core.rules import Condition
from r3090d.core.vocabulary import AlertState, Severity

KV_PRESSURE = "kv_pressure"  # the key with its own resolve hold


@dataclass(frozen=True)
class AlertEntry:
    firing: bool = False  # the condition fires, whether or not a FIRING could be sent
    active_polls: int = 0
    inactive_polls: int = 0
    severity: Severity = Severity.WARNING
    summary: str = ""
    since: float | None = None  # when it started firing
    last_sent_at: float | None = None  # any state, for the per-key minimum interval
    fired_sent: bool = False  # a FIRING went out for this episode: one RESOLVED is owed
    clear_since: float | None = None  # the first inactive poll of the current clear stretch


@dataclass(frozen=True)
class AlertBook:
    entries: tuple[tuple[str, AlertEntry], ...] = ()
    silenced: tuple[tuple[str, float], ...] = ()  # key -> until (monotonic)

    def get(self, key: str) -> AlertEntry:
        return dict(self.entries).get(key, AlertEntry())

    def firing(self) -> dict[str, AlertEntry]:
        return {k: e for k, e in self.entries if e.firing}



def silence(book: AlertBook, key: str, until: float) -> AlertBook:
    items = dict(book.silenced)
    items[key] = until
    return replace(book, silenced=tuple(sorted(items.items())))


def resolve_hold(ac: AlertsConfig, key: str) -> float:
    """Seconds a condition must stay clear before its RESOLVED goes out."""
    return ac.kv_pressure_resolve_hold if key == KV_PRESSURE else ac.resolve_hold


def evaluate(
    conditions: list[Condition], book: AlertBook, cfg: Config, now: float
) -> tuple[list[SendAlert], AlertBook]:
    ac = cfg.alerts
    entries = dict(book.entries)
    out: list[SendAlert] = []
    silenced = tuple((k, u) for k, u in book.silenced if u > now)
    muted = dict(silenced)
    for c in conditions:
        e = entries.get(c.key, AlertEntry())
        if c.event:
            e, alert = _on_event(c, e, ac, now, c.key in muted)
        elif c.active:
            e, alert = _on_active(c, e, ac, now, c.key in muted)
        else:
            e, alert = _on_inactive(c, e, ac, now)
        entries[c.key] = e
        if alert is not None:
            out.append(alert)
    return out, AlertBook(entries=tuple(sorted(entries.items())), silenced=silenced)


def _polls_needed(c: Condition, ac: AlertsConfig) -> int:
    """Consecutive polls that turn a condition on or off: a state (immediate) needs one."""
    return 1 if c.immediate else ac.hysteresis_polls


def _rate_ok(e: AlertEntry, ac: AlertsConfig, now: float) -> bool:
    return e.last_sent_at is None or now - e.last_sent_at >= ac.min_interval


def _on_event(
    c: Condition, e: AlertEntry, ac: AlertsConfig, now: float, muted: bool
) -> tuple[AlertEntry, SendAlert | None]:
    if not c.active or not (_rate_ok(e, ac, now) or c.severity == Severity.CRITICAL):
        return e, None
    e = replace(e, summary=c.summary, severity=c.severity)
    if muted:
        return e, None
    return replace(e, last_sent_at=now), SendAlert(c.key, c.severity, AlertState.FIRING, c.summary)


def _on_active(
    c: Condition, e: AlertEntry, ac: AlertsConfig, now: float, muted: bool
) -> tuple[AlertEntry, SendAlert | None]:
    e = replace(
        e,
        active_polls=e.active_polls + 1,
        inactive_polls=0,
        clear_since=None,
        severity=c.severity,
        summary=c.summary,
    )
    if not e.firing and e.active_polls >= _polls_needed(c, ac):
        e = replace(e, firing=True, since=now)
    if not e.firing or muted:
        return e, None
    if not e.fired_sent:
        # The episode's FIRING, first try or held back by min_interval or a silence:
        # it goes out at the first poll it may, as long as the condition still fires.
        if not _rate_ok(e, ac, now):
            return e, None
        return replace(e, fired_sent=True, last_sent_at=now), SendAlert(
            c.key, c.severity, AlertState.FIRING, c.summary
        )
    due = max(ac.reminder_interval, ac.min_interval)
    if ac.reminder_interval > 0 and (e.last_sent_at is None or now - e.last_sent_at >= due):
        return replace(e, last_sent_at=now), SendAlert(c.key, c.severity, AlertState.REMINDER, c.summary)
    return e, None


def _on_inactive(
    c: Condition, e: AlertEntry, ac: AlertsConfig, now: float
) -> tuple[AlertEntry, SendAlert | None]:
    clear_since = e.clear_since if e.clear_since is not None else now
    e = replace(e, inactive_polls=e.inactive_polls + 1, active_polls=0, clear_since=clear_since)
    if not e.firing or e.inactive_polls < _polls_needed(c, ac) or now - clear_since < resolve_hold(ac, c.key):
        return e, None  # not firing, or not clear long enough: a return continues this episode
    owed = e.fired_sent
    e = replace(e, firing=False, since=None, fired_sent=False, summary=c.summary)
    if not owed:
        return e, None  # nobody was told it fired, so nobody is told it cleared
    # Not held by a silence or min_interval: whoever got the FIRING must get its end.
    return replace(e, last_sent_at=now), SendAlert(c.key, e.severity, AlertState.RESOLVED, c.summary)
