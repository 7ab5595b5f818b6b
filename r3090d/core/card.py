"""The card's own state in swap mode, pure: one GPU under several engines.

With one engine the policy judges the card along with the engine (core.policy.decide). With
several, each engine's policy judges only its engine, and this judges the card once per tick:
XIDs by class, the driver's recovery action and the reset hold they set, and the GPU's own alerts
(lost, NVML hung or failing, memory, temperature, power, throttling). The reset hold is handed to every
engine's policy, so no engine starts on a card that needs a reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from r3090d.config.schema import Config
from r3090d.core import alerting, rules
from r3090d.core.actions import Action
from r3090d.core.policy import gpu_faults, reset_condition
from r3090d.core.snapshot import Snapshot
from r3090d.core.vocabulary import Phase
from r3090d.core.xid import ResetHold, XidClass


@dataclass(frozen=True)
class CardState:
    alerts: alerting.AlertBook = field(default_factory=alerting.AlertBook)
    xid_seen: tuple[int, ...] = ()
    xid_counts: tuple[tuple[XidClass, int], ...] = ()
    reset_hold: ResetHold | None = None
    blind: rules.Blindness = field(default_factory=rules.Blindness)  # NVML failing: one watchdog_blind for the card


def decide_card(snap: Snapshot, st: CardState, cfg: Config, now: float, *, serving: bool) -> tuple[list[Action], CardState]:
    """`snap`: any engine's snapshot of this tick (they share the GPU sample); `serving`: an engine is resident and ready.

    Memory growth is not judged: every swap moves the card's memory by an engine's size.
    """
    events: list[rules.Condition] = []
    st = gpu_faults(snap, st, cfg, events)
    phase = Phase.READY if serving else Phase.COLD
    conds = rules.card_conditions(snap, rules.WatchState(), cfg, phase) + events + [reset_condition(st.reset_hold)]
    if cfg.gpu.required:
        st = replace(st, blind=rules.track_blindness(snap, st.blind, cfg, engine_ready=False))  # the card's NVML only
        conds.append(rules.blindness_condition(st.blind, cfg))
    actions, book = alerting.evaluate(conds, st.alerts, cfg, now)
    return list(actions), replace(st, alerts=book)


def _is_card_key(key: str) -> bool:
    """The card's alerts are the GPU's (gpu_*), NVML's own (nvml_hung) and NVML's blindness (watchdog_blind)."""
    return key.startswith("gpu_") or key in ("nvml_hung", "watchdog_blind")


def card_alerts(book: alerting.AlertBook) -> alerting.AlertBook:
    """What the card goes on from of an earlier daemon's alert book: a book written in single mode also holds the
    engine's alerts, which no condition of the card would ever resolve."""
    return alerting.AlertBook(
        entries=tuple((k, e) for k, e in book.entries if _is_card_key(k)),
        silenced=tuple((k, until) for k, until in book.silenced if _is_card_key(k)),
    )


def cleared(st: CardState) -> CardState:
    """The operator says the card was reset (r3090ctl restart while the hold stands)."""
    return replace(st, reset_hold=None)
