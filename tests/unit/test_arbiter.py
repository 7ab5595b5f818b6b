"""The arbiter of swap mode: engine views and `now` in, moves out. Tables of its rules, then a few
swaps played through to the end, then properties over any set of engines."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3090d.core.arbiter import (
    ArbiterConfig,
    Close,
    ColdStart,
    EngineView,
    Park,
    Plan,
    Residency,
    StopCold,
    StopWhy,
    Unpark,
    plan,
)

GPU = 15_000  # MiB an engine holds on the card
RSS = 2_000  # its base RSS
COST = GPU + RSS  # what it holds in host RAM parked
ROOMY = 10 * COST


def cfg(max_resident=1, min_residency=30.0, budget=ROOMY) -> ArbiterConfig:
    return ArbiterConfig(max_resident=max_resident, min_residency=min_residency, host_budget_mib=budget)


def engine(name, residency, gpu_mib=GPU, base_rss_mib=RSS, **kw) -> EngineView:
    return EngineView(name, residency, gpu_mib=gpu_mib, base_rss_mib=base_rss_mib, **kw)


def cold(name, **kw) -> EngineView:
    return engine(name, Residency.COLD, **kw)


def ready(name, since=0.0, **kw) -> EngineView:
    return engine(name, Residency.READY, resident_since=since, **kw)


def parked(name, at=0.0, **kw) -> EngineView:
    return engine(name, Residency.PARKED, parked_at=at, **kw)


def waits(since, n=1) -> dict:
    return {"waiting": n, "oldest_waiting_at": since}


NOW = 1000.0

# ------------------------------------------------------------------ the rules

RULES = [
    # Rule 8: nothing to do when nobody waits, whatever is resident, parked or cold.
    ("nobody-waits", (ready("a", inflight=3), parked("b"), cold("c")), cfg(), (), None, None),
    ("nobody-at-all", (), cfg(), (), None, None),
    # Rule 3: room on the card: the target comes in, resumed or cold-started.
    ("cold-start-on-an-empty-card", (cold("a", **waits(990)), cold("b")), cfg(), (ColdStart("a"),), "a", None),
    ("resume-a-parked-target", (parked("a", **waits(990)), cold("b")), cfg(), (Unpark("a"),), "a", None),
    # Rule 2: arrival order across models.
    ("fairness-three-waiting", (cold("a", **waits(993)), cold("b", **waits(991, 5)), parked("c", **waits(992))), cfg(),
     (ColdStart("b"),), "b", None),
    ("fairness-tie-by-name", (cold("b", **waits(991)), cold("a", **waits(991))), cfg(), (ColdStart("a"),), "a", None),
    ("fairness-swaps-out-for-the-oldest", (ready("x"), cold("a", **waits(993)), parked("c", **waits(992))), cfg(),
     (Park("x"),), "c", None),
    ("unreported-time-waits-last", (cold("a", waiting=1), cold("b", **waits(999))), cfg(), (ColdStart("b"),), "b", None),
    # Frozen requests are pending work: their turn is when their engine was parked.
    ("frozen-work-brings-a-parked-engine-back", (parked("a", at=950, inflight=2),), cfg(), (Unpark("a"),), "a", None),
    ("frozen-turn-before-a-later-waiter", (parked("a", at=950, inflight=2), cold("b", **waits(960))), cfg(),
     (Unpark("a"),), "a", None),
    ("frozen-turn-after-an-earlier-waiter", (parked("a", at=950, inflight=2), cold("b", **waits(940))), cfg(),
     (ColdStart("b"),), "b", None),
    ("frozen-and-waiting-take-the-older", (parked("a", at=980, inflight=1, **waits(930)), cold("b", **waits(940))),
     cfg(), (Unpark("a"),), "a", None),
    ("frozen-work-makes-room", (ready("x", last_used_at=999), parked("a", at=950, inflight=2)), cfg(), (Park("x"),),
     "a", None),
    # A parked engine without frozen requests is no demand by itself.
    ("parked-without-work-stays", (parked("a", at=950), cold("b")), cfg(), (), None, None),
    # Failed engines are never targets.
    ("failed-never-targeted", (cold("a", failed=True, **waits(900)), cold("b", **waits(950))), cfg(), (ColdStart("b"),),
     "b", None),
    ("failed-parked-never-resumed", (parked("a", failed=True, inflight=2, at=900),), cfg(), (), None, None),
    ("failed-residency-never-targeted", (engine("a", Residency.FAILED, **waits(900)),), cfg(), (), None, None),
    # Rule 4: the victim. An idle one first, least recently used first.
    ("idle-lru-victim", (ready("x", last_used_at=500), ready("y", last_used_at=400), cold("a", **waits(990))),
     cfg(max_resident=2), (Park("y"),), "a", None),
    ("never-used-is-least-recent", (ready("x", last_used_at=500), ready("y"), cold("a", **waits(990))),
     cfg(max_resident=2), (Park("y"),), "a", None),
    ("idle-before-busy", (ready("x", inflight=4, last_used_at=100), ready("y", last_used_at=999), cold("a", **waits(990))),
     cfg(max_resident=2), (Park("y"),), "a", None),
    # min_residency: a busy engine stays within it, goes past it; recheck_at says when.
    ("busy-within-min-residency-stays", (ready("x", since=980, inflight=3), cold("a", **waits(985))), cfg(), (), "a",
     1010.0),
    ("busy-at-min-residency-goes", (ready("x", since=970, inflight=3), cold("a", **waits(985))), cfg(), (Park("x"),), "a",
     None),
    ("waiting-counts-as-busy", (ready("x", since=980, **waits(999)), cold("a", **waits(985))), cfg(), (), "a", 1010.0),
    ("busy-lru-past-min-residency", (ready("x", since=900, inflight=1, last_used_at=999),
                                     ready("y", since=950, inflight=1, last_used_at=998), cold("a", **waits(990))),
     cfg(max_resident=2), (Park("y"),), "a", None),
    ("only-the-one-past-min-residency", (ready("x", since=900, inflight=1, last_used_at=990),
                                         ready("y", since=990, inflight=1, last_used_at=980), cold("a", **waits(990))),
     cfg(max_resident=2), (Park("x"),), "a", None),
    ("recheck-at-the-earliest", (ready("x", since=985, inflight=1), ready("y", since=975, inflight=1),
                                 cold("a", **waits(990))), cfg(max_resident=2), (), "a", 1005.0),
    ("no-resident-since-is-not-pinned", (ready("x", since=None, inflight=1), cold("a", **waits(990))), cfg(),
     (Park("x"),), "a", None),
    ("zero-min-residency", (ready("x", since=999.9, inflight=1), cold("a", **waits(990))), cfg(min_residency=0),
     (Park("x"),), "a", None),
    # Arrival order beats min_residency: requests waiting for the resident engine since before the target's turn go first.
    ("own-older-waiters-keep-it", (ready("x", since=999.9, **waits(980)), parked("a", at=990, inflight=3)),
     cfg(min_residency=0), (), "a", None),
    ("own-younger-waiters-do-not", (ready("x", since=999.9, **waits(995)), parked("a", at=990, inflight=3)),
     cfg(min_residency=0), (Park("x"),), "a", None),
    # max_resident = 2: a second engine comes in beside a busy one.
    ("max-resident-2-beside-a-busy-one", (ready("x", since=999, inflight=5), cold("a", **waits(990))),
     cfg(max_resident=2), (ColdStart("a"),), "a", None),
    ("max-resident-2-resume-beside", (ready("x", inflight=1), parked("a", **waits(990))), cfg(max_resident=2),
     (Unpark("a"),), "a", None),
    # Rule 5's fallback: no checkpoint here, so a drained stop (and a cold start later).
    ("no-checkpoint-stops-cold", (ready("x", can_checkpoint=False), parked("a", **waits(990))), cfg(),
     (StopCold("x", StopWhy.NO_CHECKPOINT),), "a", None),
    # A stop would cut what a busy engine runs (a drain is bounded): closed first, stopped once the router says it is idle.
    ("no-checkpoint-busy-past-min", (ready("x", since=0, inflight=2, can_checkpoint=False), cold("a", **waits(990))),
     cfg(), (Close("x", StopWhy.NO_CHECKPOINT),), "a", None),
    ("no-checkpoint-closed-and-idle-stops", (ready("x", since=0, waiting=1, oldest_waiting_at=995, can_checkpoint=False),
                                             cold("a", **waits(990))), cfg(), (StopCold("x", StopWhy.NO_CHECKPOINT),), "a", None),
    # Rule 5: host memory. LRU eviction, never one with frozen requests, NO_ROOM when it cannot fit.
    ("park-fits", (ready("x"), parked("p"), cold("a", **waits(990))), cfg(budget=2 * COST), (Park("x"),), "a", None),
    ("evict-lru-to-park", (ready("x"), parked("p", last_used_at=50), parked("q", last_used_at=40), cold("a", **waits(990))),
     cfg(budget=2 * COST), (StopCold("q", StopWhy.EVICT), Park("x")), "a", None),
    ("evict-two-to-park", (ready("x"), parked("p", last_used_at=50), parked("q", last_used_at=40), cold("a", **waits(990))),
     cfg(budget=COST), (StopCold("q", StopWhy.EVICT), StopCold("p", StopWhy.EVICT), Park("x")), "a", None),
    ("evict-skips-frozen", (ready("x"), parked("p", last_used_at=50), parked("q", last_used_at=40, inflight=1),
                            cold("a", **waits(990))),
     cfg(budget=2 * COST), (StopCold("p", StopWhy.EVICT), Park("x")), "q", None),
    ("evict-the-unwanted-first", (ready("x"), parked("p", last_used_at=10, **waits(995)), parked("q", last_used_at=40),
                                  cold("a", **waits(990))),
     cfg(budget=2 * COST), (StopCold("q", StopWhy.EVICT), Park("x")), "a", None),
    ("no-room-beside-frozen", (ready("x"), parked("p", inflight=1, at=999), cold("a", **waits(990))), cfg(budget=COST),
     (StopCold("x", StopWhy.NO_ROOM),), "a", None),
    ("no-room-evicts-nobody-in-vain", (ready("x", gpu_mib=3 * GPU), parked("p"), cold("a", **waits(990))),
     cfg(budget=2 * COST), (StopCold("x", StopWhy.NO_ROOM),), "a", None),
    ("no-budget-no-park", (ready("x"), cold("a", **waits(990))), cfg(budget=0), (StopCold("x", StopWhy.NO_ROOM),), "a",
     None),
    ("the-target-is-not-evicted-for-the-victim", (ready("x"), parked("a", **waits(990))), cfg(budget=COST + COST // 2),
     (StopCold("x", StopWhy.NO_ROOM),), "a", None),
    # Rule 7: the budget shrank. LRU parked engines without frozen requests go, demand or not.
    ("budget-shrank", (parked("p", last_used_at=30), parked("q", last_used_at=10), parked("r", last_used_at=20)),
     cfg(budget=COST), (StopCold("q", StopWhy.EVICT), StopCold("r", StopWhy.EVICT)), None, None),
    ("budget-shrank-frozen-stay", (parked("p", inflight=1), parked("q", last_used_at=10, inflight=2)), cfg(budget=0),
     (Unpark("p"),), "p", None),
    ("budget-shrank-then-the-swap", (ready("x"), parked("p", last_used_at=30), parked("q", last_used_at=10),
                                     cold("a", **waits(990))),
     cfg(budget=COST), (StopCold("q", StopWhy.EVICT), StopCold("p", StopWhy.EVICT), Park("x")), "a", None),
]  # fmt: skip


@pytest.mark.parametrize(("engines", "config", "moves", "target", "recheck_at"), [r[1:] for r in RULES],
                         ids=[r[0] for r in RULES])  # fmt: skip
def test_rules(engines, config, moves, target, recheck_at):
    got = plan(engines, config, NOW)
    assert names_and_kinds(got.moves) == names_and_kinds(moves), got.why
    assert (got.target, got.recheck_at) == (target, recheck_at), got.why
    assert got.why and "\n" not in got.why


def names_and_kinds(moves) -> list[tuple[str, str, str | None]]:
    """Moves without their free text: kind, engine, and a StopCold's reason."""
    return [(type(m).__name__, m.name, m.why if isinstance(m, StopCold | Close) else None) for m in moves]


# Rule 1: while an engine's GPU memory moves, no other swap begins.
TRANSITIONS = [Residency.STARTING, Residency.PARKING, Residency.RESUMING, Residency.STOPPING]


@pytest.mark.parametrize("moving", TRANSITIONS, ids=[t.value for t in TRANSITIONS])
@pytest.mark.parametrize(
    "others",
    [
        (cold("a", **waits(990)),),
        (parked("a", at=900, inflight=3),),
        (ready("y", since=0), cold("a", **waits(990))),
    ],
    ids=["cold-waits", "frozen-waits", "resident-past-min-waits"],
)
@pytest.mark.parametrize("max_resident", [1, 3])
def test_one_swap_at_a_time(moving, others, max_resident):
    got = plan((engine("x", moving), *others), cfg(max_resident=max_resident), NOW)
    assert got.moves == () and got.target == "a" and "x in transition" in got.why


def test_a_parked_engine_is_still_evicted_during_a_transition():
    engines = (
        engine("x", Residency.PARKING),
        parked("p", last_used_at=5),
        parked("q", at=995, inflight=1),
        cold("a", **waits(990)),
    )
    # x's cost is landing in host memory: 3 x COST parked over a budget of 2.
    got = plan(engines, cfg(budget=2 * COST), NOW)
    assert names_and_kinds(got.moves) == [("StopCold", "p", "evict")]
    assert got.target == "a" and "x in transition" in got.why


def test_the_reasons_read_as_sentences():
    got = plan((ready("x", since=0, inflight=2), cold("a", **waits(990))), cfg(), NOW)
    assert got.why == got.moves[0].why
    assert got.why == ("a waits 10.0 s; x makes room, busy (2 in flight, 0 waiting) past its minimum residency: "
                       "park it (17000 MiB of host memory)")  # fmt: skip
    got = plan((ready("x", since=980, inflight=2), cold("a", **waits(990))), cfg(), NOW)
    assert got.why == ("a waits 10.0 s; every resident engine is busy and within its minimum residency "
                       "until 10.0 s from now")  # fmt: skip
    got = plan((ready("x"), cold("a", **waits(990))), cfg(budget=COST - 1), NOW)
    assert "host memory cannot hold its 17000 MiB parked (budget 16999 MiB)" in got.moves[0].detail
    assert got.why == got.moves[0].detail


# ------------------------------------------------------------ swaps played out


class Card:
    """A world the plans act on: each move completes at once, and a resident engine takes its waiting
    requests (they become in flight) and finishes them when told."""

    def __init__(self, engines, config, now=NOW):
        self.engines = {e.name: e for e in engines}
        self.config = config
        self.now = now
        self.log: list[str] = []

    def step(self) -> Plan:
        got = plan(tuple(self.engines.values()), self.config, self.now)
        for move in got.moves:
            self.log.append(f"{type(move).__name__} {move.name}")
            self._apply(move)
        for name, e in self.engines.items():
            if e.residency is Residency.READY and e.waiting:
                self.engines[name] = dataclasses.replace(e, inflight=e.inflight + e.waiting, waiting=0,
                                                         oldest_waiting_at=None, last_used_at=self.now)  # fmt: skip
        return got

    def _apply(self, move) -> None:
        e = self.engines[move.name]
        if isinstance(move, Park):
            e = dataclasses.replace(e, residency=Residency.PARKED, parked_at=self.now, resident_since=None)
        elif isinstance(move, ColdStart | Unpark):
            e = dataclasses.replace(e, residency=Residency.READY, resident_since=self.now, parked_at=None)
        else:
            e = dataclasses.replace(e, residency=Residency.COLD, parked_at=None, inflight=0)
        self.engines[move.name] = e

    def arrive(self, name, n=1) -> None:
        e = self.engines[name]
        oldest = e.oldest_waiting_at if e.waiting else self.now
        self.engines[name] = dataclasses.replace(e, waiting=e.waiting + n, oldest_waiting_at=oldest)

    def finish(self, name) -> None:
        self.engines[name] = dataclasses.replace(self.engines[name], inflight=0, last_used_at=self.now)


def test_a_swap_is_one_step_at_a_time_and_the_target_waits_for_the_gpu():
    """Park, and only once the outgoing engine has left the GPU the target comes in."""
    engines = (ready("x", last_used_at=900), cold("a", **waits(990)))
    first = plan(engines, cfg(), NOW)
    assert names_and_kinds(first.moves) == [("Park", "x", None)]
    parking = (dataclasses.replace(engines[0], residency=Residency.PARKING), engines[1])
    assert plan(parking, cfg(), NOW + 1).moves == ()
    gone = (dataclasses.replace(engines[0], residency=Residency.PARKED, parked_at=NOW + 5), engines[1])
    assert names_and_kinds(plan(gone, cfg(), NOW + 5).moves) == [("ColdStart", "a", None)]


def test_three_models_waiting_are_served_in_arrival_order():
    card = Card((ready("x", last_used_at=900), cold("a"), cold("b"), cold("c")), cfg(min_residency=0))
    for name in ("c", "a", "b"):
        card.arrive(name)
        card.now += 1
    while card.step().moves:
        for name in ("a", "b", "c", "x"):
            card.finish(name)
    assert card.log == ["Park x", "ColdStart c", "Park c", "ColdStart a", "Park a", "ColdStart b"]


def test_one_busy_model_never_starves_another():
    """x and a both always have work in flight and new work arriving: each holds the GPU for its
    min_residency, then the other's turn comes (its frozen requests are demand too)."""
    card = Card((ready("x", since=NOW, inflight=4), cold("a")), cfg(min_residency=30), NOW)
    card.arrive("a")
    ticks = []
    for _ in range(125):  # one tick a second
        card.now += 1
        for name in ("x", "a"):
            card.arrive(name)
        card.step()
        ticks.append(next((n for n, e in card.engines.items() if e.residency is Residency.READY), "-"))
    runs = [(name, len(list(run))) for name, run in itertools.groupby(ticks)]
    # x began resident at NOW; each park leaves one tick with nobody resident (the target comes in the next plan).
    gap = ("-", 1)
    assert runs == [("x", 29), gap, ("a", 30), gap, ("x", 30), gap, ("a", 30), gap, ("x", 2)], runs
    a = card.engines["a"]
    assert a.residency is Residency.PARKED and a.inflight > 0  # frozen: pending work for its next turn


def test_frozen_requests_finish_after_the_engine_returns():
    card = Card((ready("x", since=0, inflight=3, last_used_at=NOW), cold("a")), cfg(min_residency=10))
    card.arrive("a")
    card.step()
    x = card.engines["x"]
    assert x.residency is Residency.PARKED and x.inflight == 3  # frozen, not lost
    card.step()
    assert card.engines["a"].residency is Residency.READY
    card.finish("a")
    card.now += 1
    card.step()  # a is idle: x's frozen work is demand, and x comes back
    card.step()
    assert card.engines["x"].residency is Residency.READY and card.engines["x"].inflight == 3
    assert card.log == ["Park x", "ColdStart a", "Park a", "Unpark x"]


# ------------------------------------------------------------------ properties

NAMES = ("a", "b", "c", "d", "e")
RESIDENCIES = list(Residency)
TIMES = st.one_of(st.none(), st.floats(0, 2 * NOW, allow_nan=False))


@st.composite
def engine_views(draw, name):
    residency = draw(st.sampled_from(RESIDENCIES))
    waiting = draw(st.integers(0, 3))
    return EngineView(
        name=name,
        residency=residency,
        gpu_mib=draw(st.integers(0, 3 * GPU)),
        base_rss_mib=draw(st.integers(0, 2 * RSS)),
        inflight=draw(st.integers(0, 3)),
        waiting=waiting,
        oldest_waiting_at=draw(TIMES) if waiting else None,
        last_used_at=draw(TIMES),
        resident_since=draw(TIMES) if residency is Residency.READY else None,
        parked_at=draw(TIMES) if residency is Residency.PARKED else None,
        can_checkpoint=draw(st.booleans()),
        failed=draw(st.booleans()) if residency is not Residency.FAILED else True,
    )


@st.composite
def worlds(draw):
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=len(NAMES)))
    engines = tuple(draw(engine_views(n)) for n in names)
    config = ArbiterConfig(
        max_resident=draw(st.integers(1, 3)),
        min_residency=draw(st.floats(0, 100)),
        host_budget_mib=draw(st.integers(0, 4 * COST)),
    )
    return engines, config, draw(st.floats(0, 2 * NOW))


def resident_count(engines) -> int:
    return sum(e.residency in (Residency.READY, Residency.STARTING, Residency.RESUMING) for e in engines)


def host_total(engines) -> int:
    return sum(e.parked_cost_mib for e in engines if e.residency in (Residency.PARKED, Residency.PARKING))


@settings(deadline=None, derandomize=True, max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_plans_keep_the_budget_and_the_frozen_work(world):
    engines, config, now = world
    got = plan(engines, config, now)
    by_name = {e.name: e for e in engines}
    moved = [m.name for m in got.moves]
    # A name moves once; only a target evicted for the budget is then cold-started in the same plan.
    assert len(moved) == len(set(moved)) or moved.count(got.target) == 2
    after = dict(by_name)
    for move in got.moves:
        before = after[move.name]
        if isinstance(move, StopCold):
            assert not before.frozen  # rule 6
            if move.why is StopWhy.EVICT:
                assert before.residency is Residency.PARKED
            elif move.why is StopWhy.YIELD:
                assert before.residency is Residency.WAITING  # nothing runs in it yet
            else:
                assert before.residency is Residency.READY
            after[move.name] = dataclasses.replace(before, residency=Residency.COLD)
        elif isinstance(move, Park):
            assert before.residency is Residency.READY and before.can_checkpoint
            after[move.name] = dataclasses.replace(before, residency=Residency.PARKED)
        elif isinstance(move, Close):
            assert before.residency is Residency.READY and before.inflight > 0  # nothing it runs is cut
        else:
            assert isinstance(move, Unpark | ColdStart) and move.name == got.target and not before.failed
            assert before.residency is (Residency.PARKED if isinstance(move, Unpark) else Residency.COLD)
            after[move.name] = dataclasses.replace(before, residency=Residency.READY)
    gpu_moves = [m for m in got.moves if not (isinstance(m, StopCold) and m.why is StopWhy.EVICT)]
    assert len(gpu_moves) <= 1  # one swap step at a time
    if gpu_moves:
        assert not any(e.residency in (Residency.STARTING, Residency.PARKING, Residency.RESUMING, Residency.STOPPING)
                       for e in engines)  # fmt: skip
    if resident_count(engines) <= config.max_resident:
        assert resident_count(after.values()) <= config.max_resident
    # The host budget holds after the plan, unless only frozen engines are left over it (and nothing was parked).
    if host_total(after.values()) > config.host_budget_mib:
        assert not any(isinstance(m, Park) for m in got.moves)
        in_host = [e for e in after.values() if e.residency in (Residency.PARKED, Residency.PARKING)]
        assert all(e.frozen or e.residency is Residency.PARKING for e in in_host)
    wanted = [
        e
        for e in engines
        if e.wants_gpu and not e.failed and e.residency in (Residency.COLD, Residency.PARKED)
    ]
    if not wanted:
        assert got.target is None and not gpu_moves  # rule 8


def test_an_engine_waiting_for_memory_held_outside_blocks_nothing_and_yields_its_place():
    """Its start waits for a process r3090d does not own: not a move in transition (rule 1), and the first to make
    room (rule 4), unless its own requests came first."""
    waiting = EngineView("a", Residency.WAITING, gpu_mib=15000)
    target = EngineView("b", Residency.COLD, waiting=1, oldest_waiting_at=10.0)
    got = plan((waiting, target), ArbiterConfig(max_resident=1, host_budget_mib=64000), 12.0)
    assert got.moves == (StopCold("a", StopWhy.YIELD, got.moves[0].detail),) and got.target == "b"
    first = dataclasses.replace(waiting, waiting=2, oldest_waiting_at=5.0)
    assert plan((first, target), ArbiterConfig(max_resident=1, host_budget_mib=64000), 12.0).moves == ()
