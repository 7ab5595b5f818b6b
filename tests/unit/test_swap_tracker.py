"""Swap mode's service, its pure parts: each phase as the arbiter sees it, a model's engine config, and the
swaps timed stage by stage (SwapTracker fed units tick by tick)."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from r3090d import config
from r3090d.config.models import engine_configs
from r3090d.core.arbiter import Residency
from r3090d.core.policy import PolicyState
from r3090d.core.suspension import Stage, Suspension
from r3090d.core.vocabulary import Phase
from r3090d.router.link import EngineState
from r3090d.service.fleet import residency, unit_config
from r3090d.service.statedoc import SWAP_BUCKETS, SwapProgress, SwapRecord
from r3090d.service.swaps import SwapTracker

# ------------------------------------------------------------------ residency: every phase


RESIDENCY = {
    Phase.STOPPED: Residency.COLD,
    Phase.COLD: Residency.COLD,
    Phase.STARTING: Residency.STARTING,
    Phase.WAITING_FOR_GPU: Residency.WAITING,  # held by processes outside r3090d: in nobody's way (arbiter rule 1)
    Phase.RESTARTING: Residency.STARTING,
    Phase.BACKOFF: Residency.STARTING,
    Phase.DRAINING: Residency.STARTING,  # a drained restart: it comes back by itself
    Phase.READY: Residency.READY,
    Phase.SUSPENDING: Residency.PARKING,
    Phase.SUSPENDED: Residency.PARKED,
    Phase.RESUMING: Residency.RESUMING,
    Phase.GIVEN_UP: Residency.FAILED,
    Phase.RESET_NEEDED: Residency.FAILED,
    Phase.SHUTTING_DOWN: Residency.STOPPING,
}


def test_the_table_covers_every_phase():
    assert set(RESIDENCY) == set(Phase)


@pytest.mark.parametrize("phase", list(Phase), ids=[p.value for p in Phase])
def test_every_phase_has_a_residency_and_a_link_state(phase):
    where = residency(PolicyState(phase=phase))
    assert isinstance(where, Residency) and where is RESIDENCY[phase]
    assert EngineState(where.value).value == where.value  # the router's table can carry it


@pytest.mark.parametrize(("cold_after", "where"), [(True, Residency.STOPPING), (False, Residency.STARTING)])
def test_draining_is_stopping_only_on_its_way_to_cold(cold_after, where):
    assert residency(PolicyState(phase=Phase.DRAINING, cold_after=cold_after)) is where


# ------------------------------------------------------------------ unit_config


def swap_cfg() -> config.Config:
    return config.from_dict(
        {
            "models": [{"name": "chat", "model": "/m/chat"}, {"name": "coder", "model": "/m/coder"}],
            "swap": {"drain_timeout": 3.5},
            "suspend": {"drain_timeout": 30.0, "verify_timeout": 40.0},
            "daemon": {"exit_on_give_up": True},
            "watchdog": {"give_up_retry": 0},
        },
        check_files=False,
    )


def test_unit_config_takes_the_swaps_drain_and_never_exits_on_a_give_up():
    cfg = swap_cfg()
    ucfg = engine_configs(cfg)["chat"]
    assert (ucfg.suspend.drain_timeout, ucfg.daemon.exit_on_give_up) == (30.0, True)  # what it starts from
    out = unit_config(cfg, ucfg)
    assert out.suspend == dataclasses.replace(ucfg.suspend, drain_timeout=3.5)
    assert out.daemon == dataclasses.replace(ucfg.daemon, exit_on_give_up=False)
    assert out.engine == ucfg.engine and out.watchdog == ucfg.watchdog and out.canary == ucfg.canary


def test_unit_config_generates_a_key_when_the_model_has_none_and_keeps_its_own():
    cfg = swap_cfg()
    ucfg = engine_configs(cfg)["chat"]
    assert ucfg.api_key == ""
    first, second = unit_config(cfg, ucfg).api_key, unit_config(cfg, ucfg).api_key
    # 32 random bytes, fit for the environment.
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", first) and first != second
    own = dataclasses.replace(ucfg, api_key="sk-chat-own")
    assert unit_config(cfg, own).api_key == "sk-chat-own"


# ------------------------------------------------------------------ SwapTracker


@dataclasses.dataclass
class Unit:
    st: PolicyState


def at(phase: Phase, stage: Stage | None = None, frozen: int = 0, **fields) -> Unit:
    """An engine in `phase`, with a parked suspension in `stage` where one stands (`frozen`: the requests the drain's
    deadline left running in it)."""
    s = (
        Suspension(stage, 0.0, 1, parked=True, resuming=phase is Phase.RESUMING, frozen_requests=frozen)
        if stage is not None
        else None
    )
    return Unit(dataclasses.replace(PolicyState(), phase=phase, suspension=s, **fields))


READY = at(Phase.READY)
COLD = at(Phase.COLD)
PARKED = at(Phase.SUSPENDED, Stage.SUSPENDED)


class Moves:
    """The arbiter's moves as Fleet._request hands them to the tracker."""

    @staticmethod
    def park(t, target="coder", outgoing="chat"):
        return lambda tr: tr.begin(target, outgoing, t, parked=True)

    @staticmethod
    def unpark(t, target="coder"):
        return lambda tr: tr.begin(target, None, t, parked=True, bring_in=True)

    @staticmethod
    def stop_cold(t, target="coder", outgoing="chat"):
        return lambda tr: tr.begin(target, outgoing, t, parked=False)

    @staticmethod
    def cold_start(t, target="coder"):
        return lambda tr: tr.begin(target, None, t, parked=False, bring_in=True)


def play(tracker: SwapTracker, script, routing_s=0.002) -> list[SwapProgress | None]:
    """Each row a tick, as Fleet.tick runs it: the tracker observes (time, chat, coder), the arbiter's move of this
    tick (or None) follows, and a swap that has just ended learns how long the router's table took."""
    seen = []
    for t, chat, coder, move in script:
        if tracker.observe({"chat": chat, "coder": coder}, t):
            tracker.routed(routing_s)
        if move is not None:
            move(tracker)
        seen.append(tracker.progress())
    return seen


PARK_SWAP = [
    (10.0, READY, PARKED, Moves.park(10.0)),  # the decision: chat still ready, two requests in flight
    (10.5, at(Phase.SUSPENDING, Stage.DRAINING), PARKED, None),
    (11.0, at(Phase.SUSPENDING, Stage.DRAINING), PARKED, None),
    (11.25, at(Phase.SUSPENDING, Stage.BASELINING), PARKED, None),
    (11.5, at(Phase.SUSPENDING, Stage.CHECKPOINTING, frozen=2), PARKED, None),  # the drain's deadline: two frozen
    (13.0, at(Phase.SUSPENDING, Stage.CHECKPOINTING, frozen=2), PARKED, None),
    (13.5, PARKED, PARKED, Moves.unpark(13.5)),  # chat parked; coder's resume asked this tick
    (14.0, PARKED, at(Phase.RESUMING, Stage.CHECKING), None),
    (15.0, PARKED, at(Phase.RESUMING, Stage.RESTORING), None),
    (15.5, PARKED, at(Phase.RESUMING, Stage.VERIFYING), None),
    (16.0, PARKED, at(Phase.RESUMING, Stage.CANARY), None),
    (16.5, PARKED, READY, None),
]
PARK_STAGES = [None, "draining chat", "draining chat", "draining chat", "parking chat", "parking chat", "parking chat",
               "restoring coder", "restoring coder", "checking coder", "checking coder"]  # fmt: skip

COLD_SWAP = [
    (20.0, READY, COLD, Moves.stop_cold(20.0)),  # a drained stop: whatever runs finishes, nothing is frozen
    (20.5, at(Phase.DRAINING, cold_after=True), COLD, None),
    (22.0, at(Phase.DRAINING, cold_after=True), COLD, None),
    (22.5, COLD, COLD, Moves.cold_start(22.5)),
    (23.0, COLD, at(Phase.STARTING), None),
    (24.0, COLD, at(Phase.WAITING_FOR_GPU), None),
    (30.0, COLD, at(Phase.STARTING), None),
    (30.5, COLD, READY, None),
]


@pytest.mark.parametrize(
    ("script", "record"),
    [
        (PARK_SWAP, SwapRecord(from_model="chat", to_model="coder", cold=False, ok=True, seconds=6.502, drain_s=1.25, checkpoint_s=1.75,
                               restore_s=1.5, canary_s=1.5, routing_s=0.002, frozen_requests=2)),
        (COLD_SWAP, SwapRecord(from_model="chat", to_model="coder", cold=True, ok=True, seconds=10.502, stop_s=2.0, start_s=8.0,
                               routing_s=0.002)),
        ([(5.0, COLD, COLD, Moves.cold_start(5.0)), (5.5, COLD, at(Phase.STARTING), None), (9.0, COLD, READY, None)],
         SwapRecord(from_model=None, to_model="coder", cold=True, ok=True, seconds=4.002, start_s=4.0, routing_s=0.002)),
        ([(5.0, PARKED, PARKED, Moves.unpark(5.0)), (5.5, PARKED, at(Phase.RESUMING, Stage.RESTORING), None),
          (6.5, PARKED, at(Phase.RESUMING, Stage.QUERYING), None), (7.0, PARKED, READY, None)],
         SwapRecord(from_model=None, to_model="coder", ok=True, seconds=2.002, restore_s=2.0, routing_s=0.002)),
    ],
    ids=["park-and-unpark", "drained-stop-and-cold-start", "cold-start-alone", "unpark-alone"],
)  # fmt: skip
def test_a_swap_is_timed_stage_by_stage_until_the_target_is_ready(script, record):
    """Each tick's time goes to the stage the engines are seen in at that tick (the last tick's, ending at the
    target ready, to the stage seen last); the whole swap is every tick's, and the router's table after the last."""
    tracker = SwapTracker()
    before = time.time()
    play(tracker, script)
    last = tracker.last
    assert dataclasses.replace(last, at=None) == record
    assert before <= last.at <= time.time()
    assert last.seconds == round(script[-1][0] - script[0][0] + 0.002, 3)
    assert (tracker.total, tracker.failed, tracker.current, tracker.progress()) == (1, 0, None, None)


def test_progress_names_the_stage_and_engine_while_under_way():
    tracker = SwapTracker()
    assert tracker.progress() is None
    before = time.time()
    seen = play(tracker, PARK_SWAP)
    assert [p.stage or None for p in seen[:-1]] == PARK_STAGES
    assert {(p.from_model, p.to_model) for p in seen[:-1]} == {("chat", "coder")}
    assert {p.since for p in seen[:-1]} == {seen[0].since} and before <= seen[0].since <= time.time()
    assert seen[-1] is None


@pytest.mark.parametrize(
    ("end", "error"),
    [
        (at(Phase.GIVEN_UP, give_up_reason="3 start failures in a row (last: exited: engine exited during start with code 1)"),
         "3 start failures in a row (last: exited: engine exited during start with code 1)"),
        (at(Phase.RESET_NEEDED), "coder is reset-needed"),
    ],
    ids=["given-up", "reset-needed"],
)  # fmt: skip
def test_a_target_that_cannot_start_ends_the_swap_failed(end, error):
    tracker = SwapTracker()
    play(tracker, [(1.0, COLD, COLD, Moves.cold_start(1.0)), (1.5, COLD, at(Phase.STARTING), None),
                   (4.0, COLD, at(Phase.BACKOFF), None), (6.0, COLD, at(Phase.RESTARTING), None), (7.0, COLD, end, None)])  # fmt: skip
    last = tracker.last
    assert (last.ok, last.error, last.to_model, last.cold, last.seconds, last.start_s, last.routing_s) == (
        False,
        error,
        "coder",
        True,
        6.0,
        5.0,
        None,
    )
    assert (tracker.total, tracker.failed, tracker.current) == (1, 1, None)
    assert tracker.latency.count == 0


def test_the_latency_histogram_counts_ok_swaps_only():
    tracker = SwapTracker()
    play(tracker, PARK_SWAP, routing_s=0.0)  # 6.5 s
    play(
        tracker,
        [
            (40.0, COLD, COLD, Moves.cold_start(40.0)),
            (41.0, COLD, at(Phase.GIVEN_UP, give_up_reason="gave up"), None),
        ],
    )
    play(tracker, COLD_SWAP, routing_s=0.0)  # 10.5 s
    assert (tracker.total, tracker.failed) == (3, 1)
    h = tracker.latency
    assert (h.count, h.sum) == (2, 17.0)
    assert dict(h.buckets) == {upper: (upper >= 6.5) + (upper >= 10.5) for upper in map(float, SWAP_BUCKETS)}
    assert tracker.last.ok and tracker.last.cold


def test_a_second_swap_waits_for_the_first_and_nothing_is_timed_without_one():
    tracker = SwapTracker()
    assert tracker.observe({"chat": READY, "coder": COLD}, 1.0) is False
    tracker.routed(0.5)  # no swap ended: nothing to add it to
    assert tracker.current is None and tracker.last is None
    Moves.park(2.0)(tracker)
    # Another model's move while chat→coder is under way: not this swap's.
    Moves.cold_start(2.0, target="emb")(tracker)
    assert (tracker.current.from_model, tracker.current.to_model, tracker.current.cold) == (
        "chat",
        "coder",
        False,
    )


def test_an_unpark_that_starts_the_engine_cold_is_recorded_cold():
    tracker = SwapTracker()
    lost = at(Phase.SUSPENDED, Stage.SUSPENDED)
    lost = Unit(dataclasses.replace(lost.st, suspension=dataclasses.replace(lost.st.suspension, cold=True)))
    play(tracker, [(1.0, READY, lost, Moves.park(1.0)), (1.5, at(Phase.SUSPENDING, Stage.CHECKPOINTING), lost, None),
                   (2.0, PARKED, lost, Moves.unpark(2.0)), (2.5, PARKED, at(Phase.RESUMING, Stage.CHECKING), None),
                   (3.0, PARKED, at(Phase.STARTING), None), (8.5, PARKED, at(Phase.STARTING), None),
                   (9.0, PARKED, READY, None)])  # fmt: skip
    assert tracker.last.ok and tracker.last.start_s == 6.5
    assert tracker.last.cold  # SwapRecord.cold: "the target started cold (...), not resumed"


def test_the_latency_histogram_observes_each_swaps_seconds_routing_included():
    tracker = SwapTracker()
    play(tracker, PARK_SWAP, routing_s=0.25)
    assert tracker.last.seconds == 6.75 and tracker.last.routing_s == 0.25
    # statedoc: the histogram is "SwapRecord.seconds of each swap".
    assert tracker.latency.sum == tracker.last.seconds


def test_a_request_that_ends_inside_the_drain_is_not_counted_frozen():
    """Frozen is what the drain's deadline left running (the suspension's count), not what ran at the decision."""
    tracker = SwapTracker()
    play(tracker, [(1.0, READY, PARKED, Moves.park(1.0)), (1.5, at(Phase.SUSPENDING, Stage.DRAINING), PARKED, None),
                   (2.0, at(Phase.SUSPENDING, Stage.CHECKPOINTING, frozen=0), PARKED, None), (3.0, PARKED, PARKED, Moves.unpark(3.0)),
                   (4.0, PARKED, at(Phase.RESUMING, Stage.RESTORING), None), (5.0, PARKED, READY, None)])  # fmt: skip
    assert tracker.last.ok and tracker.last.frozen_requests == 0
