"""The alert lifecycle, pure: conditions and a simulated clock in, SendAlert actions out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3090d.config import AlertsConfig, Config
from r3090d.core import alerting
from r3090d.core.actions import SendAlert
from r3090d.core.alerting import AlertBook
from r3090d.core.rules import Condition
from r3090d.core.vocabulary import AlertState, Severity
from r3090d.service.report import book_info
from r3090d.service.state import book_from_json

POLL = 2.0  # seconds between polls, as the daemon's default
FIRING_TEXT = "KV cache full under load: 0 free blocks, 12 running, 30 waiting"
CLEAR_TEXT = "KV cache has room again: 900 free blocks, 3 running, 0 waiting"


def config(**alerts) -> Config:
    return Config(alerts=AlertsConfig(**alerts))


def cond(
    active: bool, key: str = "kv_pressure", severity: Severity = Severity.WARNING, immediate: bool = False
) -> Condition:
    return Condition(key, active, severity, FIRING_TEXT if active else CLEAR_TEXT, immediate=immediate)


def drive(
    active_at: Callable[[int], bool],
    polls: int,
    cfg: Config,
    key: str = "kv_pressure",
    book: AlertBook | None = None,
    severity: Severity = Severity.WARNING,
    start: float = 1000.0,
    muted_until: float | None = None,
    immediate: bool = False,
) -> tuple[list[tuple[float, SendAlert]], AlertBook]:
    """Poll `polls` times, POLL seconds apart; active_at(i) says whether poll i sees the condition."""
    book = book or AlertBook()
    if muted_until is not None:
        book = alerting.silence(book, key, muted_until)
    sent: list[tuple[float, SendAlert]] = []
    for i in range(polls):
        now = start + i * POLL
        actions, book = alerting.evaluate([cond(active_at(i), key, severity, immediate)], book, cfg, now)
        sent += [(now, a) for a in actions]
    return sent, book


def states(sent: list[tuple[float, SendAlert]]) -> list[str]:
    return [a.state for _, a in sent]


def sawtooth(on: int, off: int, polls: int) -> Callable[[int], bool]:
    """Active for `on` polls, clear for `off`, repeated for `polls` polls; clear afterwards."""
    return lambda i: i < polls and i % (on + off) < on


# ------------------------------------------------------------ flapping


def test_sawtooth_load_fires_once_and_resolves_once_after_the_hold():
    # 10 polls on, 4 off (8 s: past the 3-poll hysteresis, inside the 180 s hold) for 5 minutes.
    cfg = config()
    assert (cfg.alerts.hysteresis_polls, cfg.alerts.kv_pressure_resolve_hold) == (3, 180.0)
    pattern_polls = int(300 / POLL)
    sent, book = drive(sawtooth(10, 4, pattern_polls), pattern_polls + 200, cfg)
    assert states(sent) == ["firing", "resolved"]
    last_active = 1000.0 + max(i for i in range(pattern_polls) if sawtooth(10, 4, pattern_polls)(i)) * POLL
    resolved_at = sent[1][0]
    # Resolved at the first poll at least the hold after the first clear poll, not before.
    assert resolved_at == last_active + POLL + 180.0
    assert not book.get("kv_pressure").firing


def test_the_general_hold_applies_to_other_keys():
    cfg = config(resolve_hold=30.0, min_interval=0.0)
    # 10 on, 6 off (12 s < 30 s) for 100 polls: one episode.
    sent, _ = drive(sawtooth(10, 6, 100), 200, cfg, key="gpu_temperature")
    assert states(sent) == ["firing", "resolved"]
    # 10 on, 20 off (40 s > 30 s): each episode fires and resolves.
    sent, _ = drive(sawtooth(10, 20, 90), 200, cfg, key="gpu_temperature")
    assert states(sent) == ["firing", "resolved"] * 3


def test_without_a_hold_hysteresis_alone_decides():
    cfg = config(min_interval=0.0)  # resolve_hold defaults to 0
    sent, _ = drive(lambda i: i < 5, 20, cfg, key="gpu_memory")
    assert [(t - 1000.0, a.state) for t, a in sent] == [(4.0, "firing"), (14.0, "resolved")]


def test_an_immediate_condition_needs_one_poll_each_way():
    cfg = config(min_interval=0.0, hysteresis_polls=3)
    sent, _ = drive(lambda i: 2 <= i < 4, 10, cfg, key="gave_up", immediate=True)
    assert [(t - 1000.0, a.state) for t, a in sent] == [(4.0, "firing"), (8.0, "resolved")]


@settings(deadline=None, derandomize=True, max_examples=200)
@given(
    runs=st.lists(st.tuples(st.booleans(), st.integers(1, 60)), min_size=1, max_size=30),
    hysteresis=st.integers(1, 5),
    min_interval=st.sampled_from([0.0, 10.0, 60.0]),
    hold=st.sampled_from([0.0, 10.0, 180.0]),
    reminder=st.sampled_from([0.0, 30.0]),
)
def test_resolved_and_firing_alternate_whatever_the_pattern(runs, hysteresis, min_interval, hold, reminder):
    pattern = [active for active, n in runs for _ in range(n)]
    cfg = config(
        hysteresis_polls=hysteresis, min_interval=min_interval, resolve_hold=hold, reminder_interval=reminder
    )
    sent, _ = drive(lambda i: i < len(pattern) and pattern[i], len(pattern) + 200, cfg, key="gpu_power")
    opening = [s for s in states(sent) if s != "reminder"]
    # FIRING, RESOLVED, FIRING, ... : never two of a kind in a row, never a RESOLVED first,
    # and the pattern ends clear for 400 s, so the last word is RESOLVED.
    assert opening == ["firing", "resolved"] * (len(opening) // 2)
    firing_times = [t for t, a in sent if a.state != "resolved"]
    assert all(b - a >= min_interval for a, b in zip(firing_times, firing_times[1:], strict=False))


# ---------------------------------------------------- no RESOLVED unsent


@pytest.mark.parametrize(
    "case,active_polls,alerts,muted_until",
    [
        # FIRING, RESOLVED at once, then a re-fire inside min_interval that clears before it may go out.
        ("rate-limited re-fire", [1] * 3 + [0] * 3 + [1] * 3 + [0] * 20, dict(min_interval=60.0), None),
        ("fired while silenced", [1] * 3 + [0] * 20, dict(min_interval=0.0), 2000.0),
        ("silence ends after the clear", [1] * 3 + [0] * 20, dict(min_interval=0.0), 1000.0 + 15 * POLL),
    ],
)
def test_no_resolved_without_a_sent_firing(case, active_polls, alerts, muted_until):
    cfg = config(**alerts)
    sent, book = drive(
        lambda i: i < len(active_polls) and bool(active_polls[i]),
        len(active_polls),
        cfg,
        key="gpu_memory",
        muted_until=muted_until,
    )
    opening = states(sent)
    expected = ["firing", "resolved"] if case == "rate-limited re-fire" else []
    assert opening == expected, case
    assert not book.get("gpu_memory").firing


def test_a_rate_limited_refire_goes_out_late_when_still_firing():
    cfg = config(min_interval=60.0)
    # FIRING at poll 2, clear polls 3-5 (RESOLVED at 5), active again from poll 6 on.
    sent, book = drive(lambda i: not 3 <= i <= 5, 60, cfg, key="gpu_memory")
    times = [(t - 1000.0, a.state) for t, a in sent]
    assert times[:2] == [(4.0, "firing"), (10.0, "resolved")]
    # Hysteresis is met at poll 8 (16 s), inside min_interval of the RESOLVED: the FIRING waits
    # for the first poll at least 60 s after the RESOLVED, and then goes out.
    assert times[2:] == [(70.0, "firing")]
    assert book.get("gpu_memory").firing and book.get("gpu_memory").fired_sent


def test_a_fire_held_by_a_silence_goes_out_when_the_silence_ends():
    cfg = config(min_interval=0.0)
    sent, book = drive(lambda i: True, 30, cfg, key="gpu_memory", muted_until=1000.0 + 20 * POLL)
    assert [(t - 1000.0, a.state) for t, a in sent] == [(40.0, "firing")]


def test_a_resolve_for_a_sent_firing_goes_out_while_silenced():
    # Nobody is left holding a stale FIRING: the all-clear ignores the silence.
    cfg = config(min_interval=0.0)
    sent, book = drive(lambda i: i < 5, 5, cfg, key="gpu_memory")
    assert states(sent) == ["firing"]
    book = alerting.silence(book, "gpu_memory", 5000.0)
    sent, book = drive(lambda i: True, 10, cfg, key="gpu_memory", book=book, start=1010.0)
    assert states(sent) == []  # still firing: silenced
    sent, book = drive(lambda i: False, 5, cfg, key="gpu_memory", book=book, start=1030.0)
    assert states(sent) == ["resolved"]


# ------------------------------------------------------------ texts


def test_resolve_text_describes_the_clearing_state_and_keeps_the_severity():
    cfg = config(min_interval=0.0)
    sent, _ = drive(lambda i: i < 3, 8, cfg, key="nvml_hung", severity="critical")
    firing, resolved = (a for _, a in sent)
    assert (firing.state, firing.severity, firing.summary) == ("firing", "critical", FIRING_TEXT)
    assert (resolved.state, resolved.severity, resolved.summary) == ("resolved", "critical", CLEAR_TEXT)


def test_reminders_repeat_the_firing_text():
    cfg = config(min_interval=0.0, reminder_interval=10.0)
    sent, _ = drive(lambda i: True, 12, cfg, key="gpu_memory")
    assert [(t - 1000.0, a.state) for t, a in sent] == [(4.0, "firing"), (14.0, "reminder")]
    assert {a.summary for _, a in sent} == {FIRING_TEXT}


# ------------------------------------------------------------ events


@pytest.mark.parametrize(
    "severity,gaps,expected_sent",
    [
        ("warning", [0.0, 10.0, 70.0], 2),  # the second is inside min_interval
        ("critical", [0.0, 10.0, 70.0], 3),  # critical events are never rate-limited
    ],
)
def test_events_are_sent_as_they_happen_and_never_resolve(severity, gaps, expected_sent):
    cfg = config(min_interval=60.0, resolve_hold=30.0)
    book = AlertBook()
    sent = []
    for gap in gaps:
        now = 1000.0 + gap
        actions, book = alerting.evaluate(
            [Condition("engine_restarted", True, severity, "engine restarted: dead", event=True)],
            book,
            cfg,
            now,
        )
        sent += actions
        actions, book = alerting.evaluate(
            [Condition("engine_restarted", False, severity, "", event=True)], book, cfg, now + 1
        )
        sent += actions
    assert [a.state for a in sent] == ["firing"] * expected_sent
    assert {(a.severity, a.summary) for a in sent} == {(severity, "engine restarted: dead")}
    assert not book.get("engine_restarted").firing


# ------------------------------------------------------------ persistence


def test_the_book_round_trips_through_the_state_file_mid_hold():
    cfg = config(min_interval=0.0)
    # Fired, then clear for a while: inside the 180 s kv_pressure hold.
    sent, book = drive(lambda i: i < 5, 20, cfg)
    assert states(sent) == ["firing"]
    entry = book.get("kv_pressure")
    assert entry.firing and entry.fired_sent and entry.clear_since is not None
    # The daemon restarts; the new process's monotonic clock reads 30 s more for the same instant.
    restored = book_from_json(dataclasses.asdict(book_info(book, offset=5000.0)), offset=5000.0 - 30.0)
    back = restored.get("kv_pressure")
    assert back.fired_sent and back.clear_since == pytest.approx(entry.clear_since + 30.0)
    # The hold keeps counting from the first clear poll across the restart.
    sent, _ = drive(lambda i: False, 100, cfg, book=restored, start=1040.0 + 30.0)
    assert states(sent) == ["resolved"]
    assert sent[0][0] == pytest.approx(entry.clear_since + 30.0 + 180.0)


@pytest.mark.parametrize(
    "raw,fired_sent",
    [
        ({"firing": True, "active_polls": 4, "since": 900.0, "last_sent_at": 900.0}, True),
        ({"firing": True, "active_polls": 4, "since": 900.0, "last_sent_at": None}, False),
        ({"firing": False, "inactive_polls": 9, "last_sent_at": 800.0}, False),
    ],
)
def test_a_book_written_before_fired_sent_existed_still_loads(raw, fired_sent):
    book = book_from_json({"entries": {"gpu_memory": raw}, "silenced": {}}, offset=0.0)
    entry = book.get("gpu_memory")
    assert entry.firing == raw["firing"]
    assert entry.fired_sent is fired_sent
    assert entry.clear_since is None


def test_a_restored_book_holds_severities_as_the_enum_and_an_unknown_one_is_garbage():
    book = book_from_json({"entries": {"gpu_lost": {"firing": True, "severity": "critical", "since": 900.0}}, "silenced": {}}, offset=0.0)
    assert book.get("gpu_lost").severity is Severity.CRITICAL
    # A severity this r3090d does not know is a damaged file: an empty book, as for other garbage, never a crash.
    assert book_from_json({"entries": {"gpu_lost": {"firing": True, "severity": "page"}}, "silenced": {}}, offset=0.0).entries == ()


def test_conditions_and_alerts_speak_the_vocabulary():
    """Every severity the core emits is a Severity, every state an AlertState: the text is theirs, not spelled again."""
    sent, _ = drive(lambda i: i < 5, 200, config(min_interval=0.0), key="gpu_memory", severity=Severity.CRITICAL)
    assert {type(a.severity) for _, a in sent} == {Severity}
    assert {type(a.state) for _, a in sent} == {AlertState}
    assert [a.state for _, a in sent] == [AlertState.FIRING, AlertState.RESOLVED]
