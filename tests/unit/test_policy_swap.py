"""The policy in swap mode: a COLD engine, its start and its drained stop to cold, a park without the reminder,
and the card left to core.card (decide with card=False)."""

from __future__ import annotations

import dataclasses

import pytest

from r3090d import config
from r3090d.core import policy, rules, suspension
from r3090d.core.actions import (
    RecordRestart,
    RequestGpuSample,
    SaveSuspension,
    SendAlert,
    StartEngine,
    StopEngine,
    SuspendEngine,
)
from r3090d.core.policy import Phase, PolicyState
from r3090d.core.snapshot import ChildSample, GpuProcess, GpuSample, GpuStatus, MetricsSample
from r3090d.core.suspend_types import Op, Outcome, ProcessState, SuspendSample
from r3090d.core.suspension import Stage, Suspension
from r3090d.core.vocabulary import RestartKind
from r3090d.core.xid import RecoveryAction, ResetHold
from r3090d.units import GIB, MIB
from tests.configs import bare_config
from tests.snapshots import HTTP_503, OK, REFUSED, SKIPPED, child, snap

API, CORE = 100, 101  # the engine's API server and its one GPU process
TREE = (API, CORE)
HELD = 15 * GIB
CARD_BYTES = 24 * GIB
OTHER = 4242  # a process outside the engine's tree
HOLD = ResetHold("XID 79 (GPU has fallen off the bus)", 1.0)
STOP_WHY = "stopped to cold to bring coder in"

# The alerts that judge the card itself: swap mode sends them once, from core.card, never per engine.
CARD_KEYS = frozenset({"gpu_lost", "nvml_hung", "gpu_memory", "gpu_temperature", "gpu_power", "gpu_throttle", "gpu_memory_growth",
                       "gpu_xid_application", "gpu_xid_row_remap", "gpu_xid_unknown", "gpu_reset_needed"})  # fmt: skip

IDLE = MetricsSample(
    running=0, waiting=0, generation_tokens_total=100.0, prompt_tokens_total=10.0, kv_usage=0.0
)
BUSY = MetricsSample(running=2, waiting=0, generation_tokens_total=100.0, prompt_tokens_total=10.0, kv_usage=0.1)


def cfg(**sections) -> config.Config:
    """A swap mode engine as unit_config makes it: no exporter (no load-balancer grace), the canary left to its own tests."""
    base = {
        "gpu": {"required": True},
        "canary": {"enabled": False},
        "daemon": {"exporter_enabled": False},
        "alerts": {"min_interval": 0.0, "hysteresis_polls": 1},
        "watchdog": {"gpu_memory_alert_mib": 20000},
        "suspend": {"drain_timeout": 2.0, "remind_after": 60.0},
    }
    for name, table in sections.items():
        base[name] = {**base.get(name, {}), **table}
    return bare_config(**base)


def card(now, procs=((CORE, HELD),), **fields) -> GpuSample:
    used = sum(b for _, b in procs)
    sample = GpuSample(GpuStatus.OK, taken_at=now, age_s=0.0, utilization_gpu=0, memory_total=CARD_BYTES, memory_used=used,
                       memory_free=CARD_BYTES - used, processes=tuple(GpuProcess(p, b) for p, b in procs), graphics_processes=())  # fmt: skip
    return dataclasses.replace(sample, **fields)


def alive(gen=1, **fields) -> ChildSample:
    return child(gen, pid=API, tree=TREE, **fields)


def gone(gen=1, code=0, **fields) -> ChildSample:
    return ChildSample(
        pid=API, alive=False, exit_code=code, tree_pids=(), generation=gen, **{"stop_requested": True, **fields}
    )


def alert_keys(acts) -> list[str]:
    return [a.key for a in acts if isinstance(a, SendAlert)]


class Run:
    """One engine of a swap mode fleet, driven tick by tick: COLD at first, ticks default to what its engine is."""

    def __init__(self, c=None, *, card_too=False):
        self.c = c or cfg()
        self.card_too = card_too  # decide(card=...): swap mode passes False
        self.now = 0.0
        self.st = policy.initial_state(0.0, cold=True)
        self.engine = ChildSample()  # no process yet
        self.acts: list = []

    def tick(self, dt=0.5, **kw):
        self.now += dt
        up = self.engine.alive
        kw.setdefault("ch", self.engine)
        kw.setdefault("health", OK if up else SKIPPED)
        kw.setdefault("metrics", IDLE if up else MetricsSample())
        kw.setdefault("gpu", card(self.now, procs=((CORE, HELD),) if up else ()))
        self.acts, self.st = policy.decide(
            snap(self.now, wall=1000.0 + self.now, **kw), self.st, self.c, self.now, card=self.card_too, arbitrated=True
        )
        return self.acts

    def of(self, kind):
        return [a for a in self.acts if isinstance(a, kind)]

    def bring_in(self, gen=1):
        """COLD -> StartEngine -> READY."""
        self.tick(start_requested=True)
        assert self.of(StartEngine) and self.st.phase is Phase.STARTING and self.st.generation == gen
        self.engine = alive(gen)
        self.tick()
        assert self.st.phase is Phase.READY

    def park(self, request=1):
        """READY -> parked (SUSPENDED): the arbiter's suspend, drained with nothing running, checkpointed."""
        self.tick(suspend_requested=request, park=True)
        assert self.st.phase is Phase.SUSPENDING and self.st.suspension.parked
        while not self.of(SuspendEngine):
            self.tick()
        sent = self.now
        self.tick(suspender=SuspendSample(op=Op.SUSPEND, pid=CORE, started_at=sent + 0.01, finished_at=sent + 0.2, outcome=Outcome.SUSPENDED,
                                          state=ProcessState.CHECKPOINTED), gpu=card(self.now, procs=()))  # fmt: skip
        assert self.st.phase is Phase.SUSPENDED and self.st.suspension.parked


# ------------------------------------------------------------------ COLD


def test_initial_state_cold_waits_for_the_arbiter():
    assert policy.initial_state(5.0, cold=True) == PolicyState(phase=Phase.COLD, phase_since=5.0)
    assert policy.initial_state(5.0).phase is Phase.STOPPED
    assert not policy.probes_engine(policy.initial_state(5.0, cold=True))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"gpu": card(0, procs=((OTHER, 20 * GIB),))},  # another process holds the card
        # The card's business, not the engine's:
        {"gpu": card(0, procs=(), xid_errors=(79,), recovery_action=RecoveryAction.GPU_RESET)},
        {"gpu": GpuSample(GpuStatus.LOST, lost=True)},
        {"health": REFUSED},
        {"metrics": MetricsSample(error="connection refused")},
        {"ch": gone(1, code=-9)},  # the engine it had before: gone, nothing to restart
        {"maintenance": True},
        {"suspend_requested": 3},  # nothing to suspend: refused, still cold
    ],
    ids=[
        "quiet",
        "card-held",
        "xid-79",
        "gpu-lost",
        "health-refused",
        "metrics-failing",
        "old-engine-gone",
        "maintenance",
        "suspend",
    ],
)
def test_a_cold_engine_stays_cold_and_silent_until_asked(fields):
    r = Run()
    for _ in range(120):  # 20 min: past startup_timeout, min_uptime, give_up_retry's first minutes
        r.tick(dt=10.0, **fields)
        assert r.st.phase is Phase.COLD
        assert (
            not r.of(StartEngine)
            and not r.of(StopEngine)
            and not r.of(RecordRestart)
            and alert_keys(r.acts) == []
        )
    assert r.st.restarts_total == 0 and r.st.reset_hold is None and r.st.xid_seen == ()
    if "suspend_requested" in fields:
        assert r.st.suspend_last.result is suspension.Result.REFUSED and "cold" in r.st.suspend_last.detail


@pytest.mark.parametrize(
    ("fields", "state", "phase", "reason"),
    [
        ({"start_requested": True}, {}, Phase.STARTING, "brought in for its model"),
        # The operator's restart of a cold engine is demand for the arbiter (the fleet asks it in), never a start
        # of its own: the resident engine may hold the card.
        ({"restart_requested": RestartKind.DRAIN}, {}, Phase.COLD, None),
        ({"restart_requested": RestartKind.FAST}, {}, Phase.COLD, None),
        # After an old engine of generation 3: generation 4 next.
        ({"start_requested": True, "ch": gone(3)}, {}, Phase.STARTING, "brought in for its model"),
        # The start gate: the caller's reset hold, maintenance, another process holding the room it needs.
        ({"start_requested": True}, {"reset_hold": HOLD}, Phase.RESET_NEEDED, None),
        ({"start_requested": True, "maintenance": True}, {}, Phase.BACKOFF, None),
        (
            {"start_requested": True, "gpu": card(100.0, procs=((OTHER, 20 * GIB),))},  # a reading after the ask
            {},
            Phase.WAITING_FOR_GPU,
            None,
        ),
        ({"start_requested": True, "gpu": GpuSample(GpuStatus.LOST, lost=True)}, {}, Phase.BACKOFF, None),
    ],
    ids=[
        "asked",
        "operator-drain",
        "operator-fast",
        "after-an-old-engine",
        "reset-hold",
        "maintenance",
        "card-held",
        "gpu-lost",
    ],
)
def test_a_cold_engine_starts_when_asked_through_the_start_gate(fields, state, phase, reason):
    r = Run()
    r.tick()
    r.st = dataclasses.replace(r.st, **state)
    before = r.st.generation
    r.tick(**fields)
    assert r.st.phase is phase
    if reason is None:
        assert r.of(StartEngine) == [] and r.st.generation == before
        assert "gpu_reset_needed" not in alert_keys(r.acts)  # card=False: the hold is the card's alert
    else:
        assert r.of(StartEngine) == [StartEngine(reason=reason)]
        assert r.st.generation == fields.get("ch", ChildSample()).generation + 1
    assert not r.of(RecordRestart) and r.st.restarts_total == 0


def test_a_cold_start_judges_the_room_on_a_reading_taken_after_the_ask():
    """The engine that left was on the card until just now: a reading from before the ask still shows it."""
    r = Run()
    r.tick()
    stale = card(r.now, procs=((OTHER, 20 * GIB),))  # the parked engine, as NVML last saw it
    r.tick(start_requested=True, gpu=stale)
    assert r.st.phase is Phase.COLD and not r.of(StartEngine) and r.of(RequestGpuSample)
    assert "gpu_room" not in alert_keys(r.acts)
    r.tick(start_requested=True)  # a fresh reading: the card is free
    assert r.of(StartEngine) and r.st.phase is Phase.STARTING


def test_a_started_cold_engine_becomes_ready_and_served():
    r = Run()
    r.bring_in()
    assert r.st.ready_since == r.now and r.st.restarts_total == 0


def test_a_start_held_by_the_callers_reset_hold_is_cold_once_the_caller_clears_it():
    """card=False: the engine judges no XID, but the hold the card level hands it still stops every start."""
    r = Run()
    r.st = dataclasses.replace(r.st, reset_hold=HOLD)
    r.tick(start_requested=True)
    assert r.st.phase is Phase.RESET_NEEDED
    for _ in range(20):
        r.tick(dt=10.0)
        assert r.st.phase is Phase.RESET_NEEDED and not r.of(StartEngine) and alert_keys(r.acts) == []
    r.st = dataclasses.replace(r.st, reset_hold=None)  # the card level's hold cleared (r3090ctl restart)
    r.tick()
    assert r.st.phase is Phase.COLD and not r.of(StartEngine)  # back to the arbiter, not started by itself
    r.tick(start_requested=True)
    assert r.of(StartEngine) and r.st.phase is Phase.STARTING


def test_the_same_held_state_alerts_gpu_reset_needed_only_with_card_true():
    for card_too, keys in ((True, ["gpu_reset_needed"]), (False, [])):
        r = Run(card_too=card_too)
        r.st = dataclasses.replace(r.st, reset_hold=HOLD)
        r.tick(start_requested=True, gpu=card(0.5, procs=()))
        assert r.st.phase is Phase.RESET_NEEDED and not r.of(StartEngine)
        assert alert_keys(r.acts) == keys


# ------------------------------------------------------------------ a drained stop to cold


@pytest.mark.parametrize(
    "exit_",
    [
        gone(1, code=0),
        gone(1, code=-15),
        gone(1, code=1, root_cause="RuntimeError: boom", root_cause_certain=True),
    ],
    ids=["clean", "sigterm", "error-on-the-way-out"],
)
def test_stop_cold_on_a_ready_engine_drains_then_leaves_it_cold(exit_):
    r = Run()
    r.bring_in()
    r.tick(stop_cold_requested=STOP_WHY, metrics=BUSY)
    assert r.of(StopEngine) == [StopEngine(drain=True, reason=STOP_WHY)]
    assert r.st.phase is Phase.DRAINING and r.st.cold_after and r.st.old_tree == TREE
    assert not r.of(RecordRestart) and "engine_restarted" not in alert_keys(r.acts)
    stopping = alive(1, stopping=True)
    for _ in range(10):  # streams finishing
        r.tick(ch=stopping)
        assert r.st.phase is Phase.DRAINING and r.acts == []
    r.tick(ch=dataclasses.replace(exit_, tree_pids=(CORE,)))  # the API server is gone, its EngineCore not yet
    assert r.st.phase is Phase.DRAINING
    r.engine = exit_
    r.tick()
    assert r.st.phase is Phase.COLD and not r.st.cold_after
    assert r.st.restart_reason is None and r.st.old_tree == ()
    for _ in range(60):  # no restart, no backoff, no give-up: it stays cold
        r.tick(dt=10.0)
        assert r.st.phase is Phase.COLD and r.acts == []
    assert (
        r.st.restarts_total == 0
        and r.st.restart_times == ()
        and r.st.start_failures == 0
        and r.st.backoff_level == 0
    )
    r.bring_in(gen=2)  # and comes back when asked


@pytest.mark.parametrize(("metrics", "drain"), [(IDLE, False), (BUSY, True), (MetricsSample(), True),
                                              (MetricsSample(error="timeout"), True)], ids=["idle", "busy", "unsaid", "unread"])
def test_stop_cold_is_fast_only_when_the_engines_own_metrics_say_nothing_runs(metrics, drain):
    r = Run()
    r.bring_in()
    r.tick(stop_cold_requested=STOP_WHY, metrics=metrics)
    assert r.of(StopEngine) == [StopEngine(drain=drain, reason=STOP_WHY)]


def test_stop_cold_loses_to_an_operators_restart_in_the_same_tick():
    r = Run()
    r.bring_in()
    r.tick(stop_cold_requested=STOP_WHY, restart_requested=RestartKind.DRAIN)
    assert r.st.phase is Phase.DRAINING and not r.st.cold_after
    assert [a.reason for a in r.of(RecordRestart)] == ["requested"]


@pytest.mark.parametrize(
    ("frozen_engine", "actions"),
    [
        # Frozen: nothing to drain.
        (alive(1), [StopEngine(drain=False, reason=STOP_WHY), SaveSuspension(None)]),
        (gone(1, code=-9), [SaveSuspension(None)]),  # died while parked: nothing left to stop
    ],
    ids=["frozen-engine", "engine-died-while-parked"],
)
def test_stop_cold_on_a_parked_engine_stops_it_fast_and_drops_the_suspension(frozen_engine, actions):
    r = Run()
    r.bring_in()
    r.park()
    r.engine = frozen_engine
    r.tick()  # a parked engine that died is now a cold suspension
    assert r.st.phase is Phase.SUSPENDED
    r.tick(stop_cold_requested=STOP_WHY)
    assert [a for a in r.acts if not isinstance(a, SendAlert)] == actions
    assert r.st.phase is Phase.DRAINING and r.st.cold_after and r.st.suspension is None
    r.engine = gone(1, code=-9)
    r.tick()
    assert r.st.phase is Phase.COLD and not r.st.cold_after
    assert not r.of(RecordRestart) and not r.of(StartEngine) and r.st.restarts_total == 0


def test_stop_cold_is_not_taken_while_a_park_is_under_way():
    """Only a standing suspension is evicted: a checkpoint under way is not interrupted."""
    r = Run()
    r.bring_in()
    r.tick(suspend_requested=1, park=True)
    while not r.of(SuspendEngine):
        r.tick()
    r.tick(
        stop_cold_requested=STOP_WHY,
        suspender=SuspendSample(op=Op.SUSPEND, pid=CORE, in_flight=True, started_at=r.now),
    )
    assert (
        r.st.phase is Phase.SUSPENDING
        and r.st.suspension.stage is Stage.CHECKPOINTING
        and not r.of(StopEngine)
    )


# ------------------------------------------------------------------ a park is not an operator's suspension


@pytest.mark.parametrize(("park", "reminded"), [(True, False), (False, True)], ids=["parked", "operators"])
def test_a_parked_suspension_never_reminds_however_long_it_stands(park, reminded):
    r = Run()
    r.bring_in()
    r.tick(suspend_requested=1, park=park)
    assert r.st.suspension.parked is park
    while not r.of(SuspendEngine):
        r.tick()
    sent = r.now
    r.tick(suspender=SuspendSample(op=Op.SUSPEND, pid=CORE, started_at=sent + 0.01, finished_at=sent + 0.2, outcome=Outcome.SUSPENDED,
                                   state=ProcessState.CHECKPOINTED), gpu=card(r.now, procs=()))  # fmt: skip
    assert r.st.phase is Phase.SUSPENDED
    fired = []
    for _ in range(24 * 60):  # a day, remind_after is a minute
        r.tick(dt=60.0, gpu=card(r.now, procs=()))
        fired += [a.state for a in r.acts if isinstance(a, SendAlert) and a.key == "suspended_long"]
    assert r.st.phase is Phase.SUSPENDED and r.st.suspension.parked is park
    if reminded:  # fires once, then its hourly reminders
        assert fired[0] == "firing" and set(fired[1:]) == {"reminder"} and len(fired) >= 20
    else:
        assert fired == []


@pytest.mark.parametrize("stage", [Stage.SUSPENDED, Stage.CHECKING])
@pytest.mark.parametrize("cold", [False, True], ids=["frozen", "cold"])
@pytest.mark.parametrize(("parked", "long"), [(True, False), (False, True)], ids=["parked", "operators"])
def test_suspended_long_by_stage_and_who_suspended(stage, cold, parked, long):
    c = cfg()
    s = Suspension(
        stage, 0.0, 1, target=CORE, bytes=HELD, since=0.0, since_wall=1000.0, cold=cold, parked=parked
    )
    conds = {x.key: x for x in suspension.conditions(s, s.phase, snap(10_000.0, alive()), c, 10_000.0)}
    assert conds["suspended_long"].active is long


# ------------------------------------------------------------------ card=False: the card is judged elsewhere


@pytest.mark.parametrize(
    ("gpu", "keys"),
    [
        (card(0, procs=((CORE, 22 * GIB),)), {"gpu_memory"}),  # over the 20000 MiB alert
        (card(0, temperature_c=90), {"gpu_temperature"}),
        (card(0, power_w=349.0, power_limit_w=350.0), {"gpu_power"}),
        (card(0, clock_event_reasons=("hw_slowdown",)), {"gpu_throttle"}),
        (GpuSample(GpuStatus.LOST, lost=True), {"gpu_lost"}),
        (GpuSample(GpuStatus.OK, hung=True, age_s=30.0), {"nvml_hung"}),
        (card(0, xid_errors=(31,)), {"gpu_xid_application"}),
        (card(0, xid_errors=(63,)), {"gpu_xid_row_remap"}),
        (card(0, xid_errors=(140,)), {"gpu_xid_unknown"}),
        (card(0, xid_errors=(79,)), {"gpu_reset_needed"}),
        (card(0, recovery_action=RecoveryAction.NODE_REBOOT), {"gpu_reset_needed"}),
    ],
    ids=["memory", "temperature", "power", "throttle", "lost", "nvml-hung", "xid-application", "xid-row-remap", "xid-unknown",
         "xid-reset", "recovery-action"],
)  # fmt: skip
def test_one_gpu_snapshot_gives_the_gpu_alerts_with_card_true_and_none_with_card_false(gpu, keys):
    r = Run()
    r.bring_in()
    ready = r.st
    gpu = dataclasses.replace(gpu, taken_at=r.now + 0.5) if gpu.taken_at is not None else gpu
    tick = snap(r.now + 0.5, alive(), metrics=IDLE, gpu=gpu)
    with_card, st_card = policy.decide(tick, ready, r.c, r.now + 0.5, card=True)
    without, st_no = policy.decide(tick, ready, r.c, r.now + 0.5, card=False)
    assert set(alert_keys(with_card)) & CARD_KEYS == keys
    assert set(alert_keys(without)) & CARD_KEYS == set()
    assert st_no.reset_hold is None and st_no.xid_seen == () and st_no.xid_counts == ()
    assert (st_card.reset_hold is not None) is (keys == {"gpu_reset_needed"})
    assert st_card.phase is st_no.phase is Phase.READY  # the engine serves on either way


def test_memory_growth_is_judged_with_card_true_only():
    c = cfg(watchdog={"growth_window": 60.0, "min_uptime": 1.0})
    fired = {}
    for card_too in (True, False):
        r = Run(c, card_too=card_too)
        r.bring_in()
        keys = []
        for i in range(30):  # 10 MiB a second: it crosses 20000 MiB in well under growth_horizon
            r.tick(dt=1.0, gpu=card(r.now + 1.0, procs=((CORE, 10 * GIB + i * 10 * MIB),)))
            keys += alert_keys(r.acts)
        fired[card_too] = keys
    assert fired == {True: ["gpu_memory_growth"], False: []}


def test_with_card_false_the_engine_itself_is_still_judged():
    r = Run()
    r.bring_in()
    r.tick(health=HTTP_503)
    assert r.st.phase is Phase.RESTARTING and [a.reason for a in r.of(RecordRestart)] == ["dead"]
    assert "engine_restarted" in alert_keys(r.acts)


def test_card_false_leaves_the_condition_list_without_the_cards():
    c = cfg()
    tick = snap(1.0, alive(), metrics=IDLE, gpu=card(1.0, temperature_c=95, xid_errors=(79,)))
    life = rules.LifecycleFacts(
        phase=Phase.READY, backoff_remaining=None, restart_reason=None, give_up_reason=None
    )
    keys = {x.key for x in rules.conditions(tick, rules.WatchState(), c, 1.0, life, card=False)}
    assert keys and not keys & CARD_KEYS


# ------------------------------------------------------------------ every start through the arbiter


def given_up(r: Run) -> None:
    """A cold start that fails start_failures times in a row: GIVEN_UP, its retry due in give_up_retry."""
    r.tick(start_requested=True)
    for gen in range(1, r.c.watchdog.start_failures + 1):
        assert r.st.phase is Phase.STARTING, r.st.phase
        r.tick(ch=gone(gen, code=1), health=REFUSED)
        while r.st.phase in (Phase.RESTARTING, Phase.BACKOFF):
            r.tick(dt=5.0, ch=gone(gen, code=1), health=SKIPPED)
    assert r.st.phase is Phase.GIVEN_UP


def test_a_give_ups_retry_leaves_the_engine_cold_for_the_arbiter_and_a_failed_retry_gives_up_again():
    """The retry starts nothing itself (the resident engine may hold the card): the engine is cold, no longer failed,
    and its model's next request brings it in through the arbiter; a retry that fails gives up again."""
    r = Run(cfg(watchdog={"give_up_retry": 60.0, "start_failures": 2, "backoff_initial": 1.0}))
    given_up(r)
    gen = r.st.generation
    r.engine = gone(gen, code=1)
    r.tick(dt=61.0, health=SKIPPED)
    assert r.st.phase is Phase.COLD and not r.of(StartEngine) and r.st.retrying
    for _ in range(10):
        r.tick(dt=30.0, health=SKIPPED)
        assert r.st.phase is Phase.COLD and not r.of(StartEngine)
    r.tick(start_requested=True, health=SKIPPED)
    assert r.of(StartEngine) and r.st.phase is Phase.STARTING
    r.tick(ch=gone(gen + 1, code=1), health=REFUSED)
    assert r.st.phase is Phase.GIVEN_UP and r.st.retry_at is not None


def test_the_operators_restart_of_a_given_up_engine_leaves_it_cold_and_no_longer_failed():
    r = Run(cfg(watchdog={"give_up_retry": 0.0, "start_failures": 2, "backoff_initial": 1.0}))
    given_up(r)
    r.engine = gone(r.st.generation, code=1)
    r.tick(restart_requested=RestartKind.FAST, health=SKIPPED)
    assert r.st.phase is Phase.COLD and not r.of(StartEngine)
    assert r.st.give_up_reason is None and r.st.start_failures == 0


def test_a_start_waiting_for_the_gpu_gives_its_place_up_when_the_arbiter_says_and_the_operator_cannot_force_it():
    r = Run()
    held = card(1.0, procs=((OTHER, 20 * GIB),))
    r.tick(start_requested=True, gpu=dataclasses.replace(held, taken_at=1.0))
    assert r.st.phase is Phase.WAITING_FOR_GPU
    r.tick(restart_requested=RestartKind.FAST, gpu=dataclasses.replace(held, taken_at=r.now + 0.5))
    assert r.st.phase is Phase.WAITING_FOR_GPU and not r.of(StartEngine)  # no start over the others' memory
    r.tick(stop_cold_requested="another model's turn", gpu=dataclasses.replace(held, taken_at=r.now + 0.5))
    assert r.st.phase is Phase.COLD and not r.of(StartEngine) and not r.of(StopEngine)
