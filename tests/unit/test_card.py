"""The card judged once for all engines (core.card): the same XID classes, reset hold and GPU alerts as the
single-engine policy, a hold only the operator clears, and the engine-level conditions left to each engine."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from r3090d import config
from r3090d.core import alerting, policy, rules
from r3090d.core.actions import SendAlert
from r3090d.core.card import CardState, card_alerts, cleared, decide_card
from r3090d.core.policy import Phase
from r3090d.core.snapshot import GpuProcess, GpuSample, GpuStatus, MetricsSample
from r3090d.core.xid import RecoveryAction, ResetHold, XidClass
from r3090d.units import GIB, MIB
from tests.configs import bare_config
from tests.snapshots import child, drive_to_ready, snap

API, CORE = 100, 101
TREE = (API, CORE)
CARD_BYTES = 24 * GIB
IDLE = MetricsSample(
    running=0, waiting=0, generation_tokens_total=100.0, prompt_tokens_total=10.0, kv_usage=0.0
)


def cfg(**watchdog) -> config.Config:
    return bare_config(gpu={"required": True}, canary={"enabled": False}, alerts={"min_interval": 0.0, "hysteresis_polls": 1},
                       watchdog={"gpu_memory_alert_mib": 20000, **watchdog})  # fmt: skip


def card(now, procs=((CORE, 15 * GIB),), **fields) -> GpuSample:
    used = sum(b for _, b in procs)
    sample = GpuSample(GpuStatus.OK, taken_at=now, age_s=0.0, utilization_gpu=0, memory_total=CARD_BYTES, memory_used=used,
                       memory_free=CARD_BYTES - used, processes=tuple(GpuProcess(p, b) for p, b in procs), graphics_processes=())  # fmt: skip
    return dataclasses.replace(sample, **fields)


def sent(actions) -> list[tuple[str, str, str, str]]:
    return sorted(
        (a.key, a.severity.value, a.state.value, a.summary) for a in actions if isinstance(a, SendAlert)
    )


# ------------------------------------------------------------------ the same verdicts as the single-engine policy


@pytest.mark.parametrize(
    "gpu",
    [
        card(2, xid_errors=(31,)),
        card(2, xid_errors=(13, 31)),
        card(2, xid_errors=(43, 45)),  # what killing a frozen engine logs
        card(2, xid_errors=(79,)),
        card(2, xid_errors=(48,)),
        card(2, xid_errors=(119, 120)),
        card(2, xid_errors=(63,)),
        card(2, xid_errors=(140,)),
        card(2, xid_errors=(140,), recovery_action=RecoveryAction.GPU_RESET),
        card(2, recovery_action=RecoveryAction.NODE_REBOOT),
        card(2, recovery_action=RecoveryAction.DRAIN_AND_RESET),
        card(2, recovery_action=RecoveryAction.DRAIN_P2P),  # not a holding action
        card(2, recovery_action=RecoveryAction.NONE),
        card(2, xid_errors=(31, 79, 63, 140)),
        card(2, procs=((CORE, 22 * GIB),)),
        card(2, temperature_c=90),
        card(2, power_w=349.0, power_limit_w=350.0),
        card(2, clock_event_reasons=("hw_thermal_slowdown", "gpu_idle")),
        GpuSample(GpuStatus.LOST, lost=True, detail="GpuIsLost"),
        GpuSample(GpuStatus.OK, hung=True, age_s=30.0),
        card(2),
    ],
    ids=["app-31", "app-13-31", "app-43-45", "reset-79", "reset-48", "reset-gsp", "row-remap-63", "unknown-140",
         "unknown-with-gpu-reset", "node-reboot", "drain-and-reset", "drain-p2p", "recovery-none", "every-class",
         "memory", "temperature", "power", "throttle", "lost", "nvml-hung", "quiet"],
)  # fmt: skip
def test_the_card_gives_the_alerts_and_hold_the_single_engine_policy_gives(gpu):
    c = cfg()
    _, ready = drive_to_ready(c)
    tick = snap(2.0, child(1, pid=API, tree=TREE), metrics=IDLE, gpu=gpu, wall=5000.0)
    engine_actions, engine = policy.decide(tick, ready, c, 2.0, card=True)
    card_actions, held = decide_card(tick, CardState(), c, 2.0, serving=True)
    assert sent(card_actions) == sent(engine_actions)
    assert held.reset_hold == engine.reset_hold
    assert held.xid_seen == engine.xid_seen and held.xid_counts == engine.xid_counts


@pytest.mark.parametrize(
    ("xids", "action", "hold", "counts"),
    [
        ((31, 13), None, None, {XidClass.APPLICATION: 2}),
        ((79,), None, "XID 79 (GPU has fallen off the bus)", {XidClass.RESET: 1}),
        ((63, 64), None, None, {XidClass.ROW_REMAP: 2}),
        ((140,), None, None, {XidClass.UNKNOWN: 1}),
        ((), RecoveryAction.GPU_RESET, "the driver's recovery action is gpu reset", {}),
        ((48, 79), None, "XID 48 (Double Bit ECC Error)", {XidClass.RESET: 2}),  # the first reason stands
    ],
)
def test_xids_by_class_and_the_hold_they_set(xids, action, hold, counts):
    _, st = decide_card(snap(1.0, gpu=card(1.0, xid_errors=xids, recovery_action=action), wall=7000.0), CardState(), cfg(), 1.0,
                        serving=True)  # fmt: skip
    assert (st.reset_hold.reason if st.reset_hold else None) == hold
    assert st.reset_hold is None or st.reset_hold.since_wall == 7000.0
    assert dict(st.xid_counts) == counts and st.xid_seen == tuple(sorted(set(xids)))


def test_the_hold_stands_through_quiet_ticks_until_cleared():
    c = cfg()
    now = 1.0
    acts, st = decide_card(
        snap(now, gpu=card(now, xid_errors=(79,)), wall=100.0), CardState(), c, now, serving=True
    )
    assert [(a.key, a.state.value) for a in acts] == [("gpu_reset_needed", "firing")]
    for _ in range(100):
        now += 1.0
        acts, st = decide_card(
            snap(now, gpu=card(now, xid_errors=(61,) if now == 50 else ())), st, c, now, serving=False
        )
        assert acts == [] and st.reset_hold == ResetHold("XID 79 (GPU has fallen off the bus)", 100.0)
    st = cleared(st)
    assert st.reset_hold is None and st.xid_seen == (61, 79) and dict(st.xid_counts) == {XidClass.RESET: 2}
    acts, st = decide_card(snap(now + 1, gpu=card(now + 1)), st, c, now + 1, serving=False)
    assert [(a.key, a.state.value) for a in acts] == [("gpu_reset_needed", "resolved")]
    acts, st = decide_card(
        snap(now + 2, gpu=card(now + 2, xid_errors=(79,)), wall=200.0), st, c, now + 2, serving=False
    )
    # A new hold, with its own time.
    assert st.reset_hold == ResetHold("XID 79 (GPU has fallen off the bus)", 200.0)
    assert [(a.key, a.state.value) for a in acts] == [("gpu_reset_needed", "firing")]


def test_cleared_without_a_hold_changes_nothing():
    assert cleared(CardState()) == CardState()


def test_no_gpu_required_no_card_verdicts():
    c = bare_config(gpu={"required": False}, alerts={"min_interval": 0.0, "hysteresis_polls": 1})
    acts, st = decide_card(
        snap(1.0, gpu=card(1.0, xid_errors=(79, 31), temperature_c=99)), CardState(), c, 1.0, serving=True
    )
    assert acts == [] and st.reset_hold is None and st.xid_seen == ()


@pytest.mark.parametrize("serving", [True, False])
def test_memory_growth_is_never_judged_by_the_card_and_left_out_when_nothing_serves(serving):
    """Every swap moves the card's memory by an engine's size: growth means nothing there."""
    c = cfg(growth_window=60.0)
    st = CardState()
    keys = []
    for i in range(120):  # 100 MiB a second, far past what the single-engine policy calls growth
        acts, st = decide_card(
            snap(float(i), gpu=card(float(i), procs=((CORE, 10 * GIB + i * 100 * MIB),))),
            st,
            c,
            float(i),
            serving=serving,
        )
        keys += [a.key for a in acts]
    assert "gpu_memory_growth" not in keys
    assert ("gpu_memory_growth" in dict(st.alerts.entries)) is serving
    assert "gpu_memory" in keys  # what the card holds is judged either way: it crossed 20000 MiB


# ------------------------------------------------------------------ rules: the card's conditions apart


GPUS = {
    "hot-full-throttled": card(1, procs=((CORE, 22 * GIB),), temperature_c=90, power_w=349.0, power_limit_w=350.0,
                               clock_event_reasons=("hw_slowdown",)),
    "quiet": card(1),
    "lost": GpuSample(GpuStatus.LOST, lost=True),
    "hung": GpuSample(GpuStatus.OK, hung=True, age_s=30.0),
    "disabled": GpuSample(GpuStatus.DISABLED),
}  # fmt: skip


@pytest.mark.parametrize("phase", [Phase.READY, Phase.STARTING, Phase.SUSPENDED, Phase.COLD, Phase.GIVEN_UP])
@pytest.mark.parametrize("gpu", list(GPUS), ids=list(GPUS))
def test_conditions_with_card_are_those_without_plus_card_conditions(phase, gpu):
    c = cfg()
    tick = snap(1.0, child(1, pid=API, tree=TREE), metrics=IDLE, gpu=GPUS[gpu])
    w = rules.WatchState(memory_points=((0.0, 10 * GIB), (30.0, 12 * GIB), (60.0, 14 * GIB)))  # growing
    life = rules.LifecycleFacts(phase=phase, backoff_remaining=None, restart_reason=None, give_up_reason=None)
    with_card = rules.conditions(tick, w, c, 60.0, life, card=True)
    without = rules.conditions(tick, w, c, 60.0, life, card=False)
    of_card = rules.card_conditions(tick, w, c, phase)
    assert collections.Counter(with_card) == collections.Counter(without) + collections.Counter(of_card)
    assert not {x.key for x in without} & {x.key for x in of_card}
    assert {"gave_up", "restart_storm", "watchdog_blind", "engine_backoff"} <= {x.key for x in without}


@pytest.mark.parametrize(
    ("gpu", "phase", "keys"),
    [
        # No growth alert: it is over the limit already.
        ("hot-full-throttled", Phase.READY, {"gpu_memory", "gpu_temperature", "gpu_power", "gpu_throttle"}),
        ("hot-full-throttled", Phase.COLD, {"gpu_memory", "gpu_temperature", "gpu_power", "gpu_throttle"}),
        # The lent card's memory is not ours to judge.
        ("hot-full-throttled", Phase.SUSPENDED, {"gpu_temperature", "gpu_power", "gpu_throttle"}),
        ("quiet", Phase.READY, {"gpu_memory_growth"}),  # 15 GiB, growing 68 MiB/s toward 20000 MiB
        ("quiet", Phase.COLD, set()),  # growth is judged for a READY engine only
        ("lost", Phase.COLD, {"gpu_lost"}),
        ("hung", Phase.COLD, {"nvml_hung"}),
    ],
)
def test_card_conditions_active_by_reading_and_phase(gpu, phase, keys):
    w = rules.WatchState(memory_points=((0.0, 10 * GIB), (30.0, 12 * GIB), (60.0, 14 * GIB)))
    conds = rules.card_conditions(snap(1.0, gpu=GPUS[gpu]), w, cfg(), phase)
    assert {x.key for x in conds if x.active} == keys


def test_card_conditions_without_a_gpu_required_are_none():
    c = bare_config(gpu={"required": False})
    assert (
        rules.card_conditions(snap(1.0, gpu=GPUS["hot-full-throttled"]), rules.WatchState(), c, Phase.READY)
        == []
    )


# ------------------------------------------------------------------ NVML blindness: the card's, once


BROKEN_NVML = GpuSample(GpuStatus.ERROR, "nvmlDeviceGetMemoryInfo: Unknown Error")


def blind_keys(actions) -> list[tuple[str, str]]:
    return [(a.key, a.state.value) for a in actions if isinstance(a, SendAlert) and a.key == "watchdog_blind"]


def test_nvml_blindness_is_one_watchdog_blind_of_the_card():
    c = cfg(blind_polls=3)
    st = CardState()
    fired = []
    for t in range(1, 6):
        acts, st = decide_card(snap(float(t), gpu=BROKEN_NVML), st, c, float(t), serving=False)
        fired += [(t, *k) for k in blind_keys(acts)]
    assert fired == [(3, "watchdog_blind", "firing")]  # at the third failing poll
    entry = dict(st.alerts.entries)["watchdog_blind"]
    assert "NVML failing for" in entry.summary and "Unknown Error" in entry.summary
    acts, st = decide_card(snap(6.0, gpu=card(6.0)), st, c, 6.0, serving=False)
    assert blind_keys(acts) == [("watchdog_blind", "resolved")]


def test_an_engine_judged_apart_from_the_card_is_not_blind_for_nvml_but_for_its_metrics():
    c = cfg(blind_polls=3)
    _, st = drive_to_ready(c)
    keys = []
    for t in range(2, 8):
        acts, st = policy.decide(snap(float(t), child(1, pid=API, tree=TREE), metrics=IDLE, gpu=BROKEN_NVML), st, c, float(t), card=False)
        keys += blind_keys(acts)
    assert keys == []  # swap mode: the card's alert, not one per model
    broken_metrics = MetricsSample(error="connection refused")
    for t in range(8, 14):
        acts, st = policy.decide(snap(float(t), child(1, pid=API, tree=TREE), metrics=broken_metrics, gpu=card(float(t))), st, c,
                                 float(t), card=False)  # fmt: skip
        keys += blind_keys(acts)
    assert keys == [("watchdog_blind", "firing")]
    assert "NVML" not in dict(st.alerts.entries)["watchdog_blind"].summary


# ------------------------------------------------------------------ the card's alert book across a daemon restart


def test_every_alert_the_card_gives_is_kept_by_the_card_from_a_carried_book():
    c = cfg(blind_polls=1)
    keys = set()
    samples = [*GPUS.values(), BROKEN_NVML, card(2, xid_errors=(13, 63, 79, 140)), card(2, recovery_action=RecoveryAction.GPU_RESET)]
    for gpu in samples:
        acts, st = decide_card(snap(2.0, gpu=gpu, wall=10.0), CardState(), c, 2.0, serving=True)
        keys |= {a.key for a in acts if isinstance(a, SendAlert)} | {k for k, _ in st.alerts.entries}
    assert {"gpu_lost", "nvml_hung", "watchdog_blind", "gpu_reset_needed", "gpu_temperature"} <= keys
    book = alerting.AlertBook(entries=tuple(sorted((k, alerting.AlertEntry(firing=True)) for k in keys)))
    assert card_alerts(book) == book


def test_a_single_engine_book_carried_into_swap_mode_leaves_the_engines_alerts_behind():
    """A daemon switched from one engine to swap mode: the card takes its GPU alerts on; the engine's would never resolve."""
    book = alerting.AlertBook(
        entries=(("dead", alerting.AlertEntry(firing=True)), ("gpu_memory", alerting.AlertEntry(firing=True)),
                 ("restart_storm", alerting.AlertEntry(firing=True))),
        silenced=(("gpu_temperature", 50.0), ("kv_pressure", 50.0)),
    )  # fmt: skip
    kept = card_alerts(book)
    assert list(kept.firing()) == ["gpu_memory"] and kept.silenced == (("gpu_temperature", 50.0),)
