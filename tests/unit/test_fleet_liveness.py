"""Swap mode's liveness, stated as invariants over a hypothesis state machine: the fleet, the arbiter and each
engine's policy run for real over simulated engines, card, router and time (tests/fleetsim.py), while rules
send requests, cancel them, kill engines in any phase, fail starts, bring a foreign process onto the card,
restart or swap a model as the operator, and kill the router.

After every tick the machine checks:

- the card: the engines' memory never exceeds it;
- one swap at a time, and the open swap's target is still wanted (requests wait for it or are frozen in it, the
  operator asked for it, or it is on its way in), and it ends within LIVENESS_S;
- a model is closing (no new requests sent to it) only while the plan closes or stops it, or someone waits;
- liveness: a model with waiting requests (or brought in by hand), not failed, is served within LIVENESS_S of
  its oldest request, counted from the last disruption (a death, a failed start, an operator's restart, the
  foreign holder leaving) and while no foreign process holds the card;
- a park or unpark under way (a model record's park_request) ends within PARK_S;
- an engine in transition (starting, parking, resuming, stopping: the arbiter moves nothing meanwhile) gets out of
  it within TRANSITION_S, counted from the last disruption, while no foreign process holds the card.

R3090D_LIVENESS_EXAMPLES (default 300, some 20 s on a loaded 2-core machine while nothing fails) and
R3090D_LIVENESS_STEPS (default 60) set how many examples run and how long each is. A failure is shrunk to its
shortest example, which takes minutes: the shortest sequence of steps is worth it.
"""

from __future__ import annotations

import logging
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from r3090d.core.arbiter import IN_TRANSITION, Close, Residency, StopCold
from r3090d.service import commands
from r3090d.service.fleet import residency
from tests.fleetsim import ENGINE_MIB, MODELS, Sim, swap_config

MAX_TICK_S = 5.0
WORK_TICKS = 6  # the longest request, in ticks of its engine running
TROUBLES = (
    "latency",
    "engine dies",
    "engine dies of a known cause",
    "starts fail",
    "checkpoint fails",
    "foreign holder comes",
    "foreign holder goes",
    "router dies",
)
EXAMPLES = int(os.environ.get("R3090D_LIVENESS_EXAMPLES", "300"))
STEPS = int(os.environ.get("R3090D_LIVENESS_STEPS", "60"))


def _bounds(sim: Sim) -> tuple[float, float, float]:
    """(LIVENESS_S, PARK_S, TRANSITION_S) from the config and the simulation's slowest latency (3 ticks).

    One swap: the resident engine's min_residency, its drain (or, closed, its longest request), the canary's
    baseline, the checkpoint or the drained stop, the target's start (or restore) and its canary: some 8 ticks and
    4 latencies; a model may wait for every other model's swap before its own."""
    cfg = sim.cfg
    ticks = (8 + 4 * 3 + WORK_TICKS) * MAX_TICK_S
    one_swap = cfg.swap.min_residency + cfg.swap.drain_timeout + 2 * cfg.canary.timeout + ticks
    liveness = len(sim.units) * one_swap
    park = cfg.swap.drain_timeout + 2 * cfg.canary.timeout + cfg.suspend.verify_timeout + 12 * MAX_TICK_S
    # One engine's move (a start with its backoff and failures, a park, a resume, a drained stop): its own timeouts.
    transition = (
        cfg.engine.startup_timeout
        + cfg.swap.drain_timeout
        + cfg.suspend.verify_timeout
        + 2 * cfg.canary.timeout
    )
    transition += cfg.watchdog.backoff_max + 12 * MAX_TICK_S
    return liveness, park, transition


def closing(fleet) -> list[str]:
    return sorted(name for name, rec in fleet.models.items() if rec.closing)


def wanted(fleet) -> dict[str, float]:
    return {name: rec.wanted_at for name, rec in fleet.models.items() if rec.wanted_at is not None}


def parks_under_way(fleet) -> dict[str, int]:
    return {name: rec.park_request for name, rec in fleet.models.items() if rec.park_request is not None}


class FleetLiveness(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self._begin(Sim())

    @initialize(parked=st.integers(0, 1), min_residency=st.sampled_from([0.0, 10.0]))
    def configure(self, parked, min_residency):
        """Host memory for one parked engine (a swap parks), or none (every swap stops, closing a busy engine
        first); a busy engine kept resident swap.min_residency, or swapped out at once."""
        self._begin(Sim(swap_config(parked=parked, min_residency=min_residency)))

    def _begin(self, sim: Sim) -> None:
        self.sim = sim
        self.liveness_s, self.park_s, self.transition_s = _bounds(self.sim)
        self.moving_since: dict[
            str, float
        ] = {}  # engines in transition (starting, parking, resuming, stopping), since
        self.calm_since = self.sim.clock()  # the last disruption
        # When each model was last seen not failed after failed: its liveness counts from then.
        self.serving_since = dict.fromkeys(MODELS, self.sim.clock())
        self.failed = dict.fromkeys(MODELS, False)
        self.parks_seen: dict[tuple[str, int], float] = {}
        self.after_tick = False

    # ------------------------------------------------------------------ helpers

    @property
    def now(self) -> float:
        return self.sim.clock()

    def disrupted(self) -> None:
        self.calm_since = self.now
        self.after_tick = False

    def _tick(self, dt: float) -> None:
        self.sim.tick(dt)
        for name, unit in self.sim.units.items():
            failed = residency(unit.st) is Residency.FAILED
            if self.failed[name] and not failed:
                self.serving_since[name] = self.now
            self.failed[name] = failed
            if residency(unit.st) in IN_TRANSITION:
                self.moving_since.setdefault(name, self.now)
            else:
                self.moving_since.pop(name, None)
        self.after_tick = True

    # ------------------------------------------------------------------ rules
    # Few rules, so that time and requests (what every bug needs) are drawn often; the rarer events are one rule each
    # for the world's troubles and the operator's commands.

    @rule(model=st.sampled_from(MODELS), count=st.integers(1, 3), work=st.integers(1, WORK_TICKS))
    def requests_arrive(self, model, count, work):
        for _ in range(count):
            self.sim.router.arrive(model, work)
        self.after_tick = False

    @rule(data=st.data(), count=st.integers(1, 5))
    def clients_leave(self, data, count):
        """The newest `count` clients waiting for one model (one that has some) give up."""
        waiting = sorted(m for m, lane in self.sim.router.waiting.items() if lane)
        if waiting:
            self.sim.router.leave(data.draw(st.sampled_from(waiting), label="model"), count)
            self.after_tick = False

    @rule(dt=st.floats(0.5, MAX_TICK_S))
    def tick(self, dt):
        self._tick(dt)

    @rule(n=st.integers(1, 15))
    def settle(self, n):
        for _ in range(n):
            self._tick(MAX_TICK_S)

    @rule(what=st.sampled_from(TROUBLES), model=st.sampled_from(MODELS), size=st.integers(1, 3))
    def trouble(self, what, model, size):
        """Something the fleet does not choose: `size` is the latency in ticks, the failing starts, the foreign MiB."""
        sim, engine = self.sim, self.sim.units[model].engine
        card = sim.world.card
        if what == "latency":
            sim.world.latency = size
            return
        if what in ("engine dies", "engine dies of a known cause") and engine.alive:
            known = what == "engine dies of a known cause"
            engine.die(
                "RuntimeError: CUDA error: an illegal memory access was encountered" if known else None, known
            )
        elif what == "starts fail":
            engine.failing_starts = min(size, 2)  # two in a row with one cause: a give-up
        elif what == "checkpoint fails":
            self.sim.units[model].worker.fail_next = True
        elif what == "foreign holder comes" and not card.foreign:
            card.foreign[99] = max(
                0, min(size * 1200, card.free_mib())
            )  # 1200 MiB leaves room for an engine, more not
            self.after_tick = False
            return
        elif what == "foreign holder goes" and card.foreign:
            card.foreign.clear()
        elif what == "router dies":
            sim.router.die()
        else:
            return
        self.disrupted()

    @rule(cmd=st.sampled_from(("restart", "swap")), model=st.sampled_from(MODELS))
    def operator(self, cmd, model):
        """r3090ctl restart|swap --model, answered as SwapDaemon.control answers them."""
        self.after_tick = False
        if cmd == "swap":
            self.sim.fleet.bring_in(model)
            return
        unit = self.sim.units[model]
        reply = commands.answer(
            {"cmd": "restart"},
            unit.pending,
            phase=unit.st.phase,
            generation=unit.engine.generation,
            exit_on_give_up=False,
        )
        if reply["ok"]:
            self.disrupted()

    # ------------------------------------------------------------------ invariants

    def _wanted(self, name: str) -> bool:
        fleet, router = self.sim.fleet, self.sim.router
        unit = fleet.units[name]
        where = residency(unit.st)
        frozen = where is Residency.PARKED and len(router.inflight.get(name, ())) > 0
        # READY but not yet routable (its first canary under way) is still coming in: the swap ends once it is routed.
        on_its_way = (
            where in (Residency.STARTING, Residency.RESUMING, Residency.READY) or fleet.models[name].coming
        )
        return bool(router.waiting.get(name)) or frozen or fleet.models[name].wanted_at is not None or on_its_way

    def _describe(self) -> str:
        fleet, router = self.sim.fleet, self.sim.router
        parts = []
        for name, unit in fleet.units.items():
            s = unit.st.suspension
            stage = f"/{s.stage.value}" if s is not None else ""
            parts.append(f"{name}: {unit.st.phase.value}{stage} waiting {len(router.waiting.get(name, ()))} inflight "
                         f"{len(router.inflight.get(name, ()))}")  # fmt: skip
        swap = fleet.swaps.current
        swap_text = (
            f"{swap.from_model}->{swap.to_model} since {self.now - swap.started_at:.0f} s" if swap else "none"
        )
        return (f"at +{self.now - 1000:.0f} s, calm for {self.now - self.calm_since:.0f} s; {'; '.join(parts)}; swap {swap_text}; "
                f"parks {parks_under_way(fleet)}; closing {closing(fleet)}; wanted {sorted(wanted(fleet))}; plan: {fleet.plan.why!r}")  # fmt: skip

    @invariant()
    def the_card_holds_what_it_has(self):
        card = self.sim.world.card
        assert card.used_mib() <= card.total_mib, (
            f"the card is overcommitted: {card.holders()} MiB; {self._describe()}"
        )
        holding = [e for e in card.engines if e.held_mib]
        assert len(holding) * ENGINE_MIB <= card.total_mib

    @precondition(lambda self: self.after_tick)
    @invariant()
    def an_open_swap_has_a_wanted_target(self):
        swap = self.sim.fleet.swaps.current
        if swap is None:
            return
        assert swap.to_model is None or self._wanted(swap.to_model), (
            f"swap to {swap.to_model} open, and nothing wants {swap.to_model} any more: {self._describe()}"
        )
        assert self.now - max(swap.started_at, self.calm_since) <= self.liveness_s, (
            f"swap open for over {self.liveness_s:.0f} s: {self._describe()}"
        )

    @precondition(lambda self: self.after_tick)
    @invariant()
    def a_closing_model_is_being_closed(self):
        fleet = self.sim.fleet
        planned = {m.name for m in fleet.plan.moves if isinstance(m, Close | StopCold)}
        for name in closing(fleet):
            assert name in planned, (
                f"{name} is closing (sent nothing new) while the plan neither closes nor stops it: {self._describe()}"
            )

    @precondition(lambda self: self.after_tick)
    @invariant()
    def a_waiting_model_is_served_in_time(self):
        if self.sim.world.card.foreign:
            return  # a foreign process may hold the card for as long as it likes
        fleet, router = self.sim.fleet, self.sim.router
        for name in MODELS:
            if self.failed[name]:
                continue
            oldest = [r.arrived for r in router.waiting.get(name, ())]
            if fleet.models[name].wanted_at is not None:
                oldest.append(fleet.models[name].wanted_at)
            if not oldest:
                continue
            since = max(min(oldest), self.calm_since, self.serving_since[name])
            assert self.now - since <= self.liveness_s, (
                f"{name} not served {self.now - since:.0f} s after its oldest request (bound {self.liveness_s:.0f} s): {self._describe()}"
            )

    @precondition(lambda self: self.after_tick)
    @invariant()
    def a_transition_ends(self):
        """The arbiter moves nothing while an engine is in transition: each transition must end by itself."""
        if self.sim.world.card.foreign:
            return  # a start may wait for a foreign process as long as it holds the card
        for name, since in self.moving_since.items():
            since = max(since, self.calm_since)
            assert self.now - since <= self.transition_s, (
                f"{name} {residency(self.sim.units[name].st).value} for {self.now - since:.0f} s "
                f"(bound {self.transition_s:.0f} s): {self._describe()}"
            )

    @precondition(lambda self: self.after_tick)
    @invariant()
    def a_park_ends(self):
        parks = parks_under_way(self.sim.fleet)
        for key in list(self.parks_seen):
            if parks.get(key[0]) != key[1]:
                del self.parks_seen[key]
        for name, request in parks.items():
            since = self.parks_seen.setdefault((name, request), self.now)
            assert self.now - since <= self.park_s, (
                f"the park or unpark of {name} (request {request}) under way for {self.now - since:.0f} s: {self._describe()}"
            )


@pytest.fixture(autouse=True)
def _quiet_daemon_log():
    """The fleet logs every swap; thousands of simulated ones are not worth keeping."""
    log = logging.getLogger("r3090d")
    old = log.level
    log.setLevel(logging.CRITICAL)
    yield
    log.setLevel(old)


FleetLiveness.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_fleet_liveness = FleetLiveness.TestCase
