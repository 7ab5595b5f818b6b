"""Swap mode's fleet, case by case, over the simulated engines, router and clock of tests/fleetsim.py."""

from __future__ import annotations

import pytest

from r3090d.core.arbiter import Residency
from r3090d.service.fleet import residency
from tests.fleetsim import Sim, swap_config

pytestmark = pytest.mark.filterwarnings("ignore")


def settle(sim: Sim, until, ticks: int = 200, dt: float = 0.5) -> None:
    for _ in range(ticks):
        if until():
            return
        sim.tick(dt)
    raise AssertionError(f"not reached in {ticks} ticks: {sim.fleet.plan.why!r}")


def test_a_model_is_unroutable_from_the_tick_its_stop_is_decided():
    """An idle engine's stop is fast (SIGTERM, SIGKILL a second later): a request the router sent it between the
    decision and the stop would be cut. From the decision on, its requests wait at the router."""
    sim = Sim(swap_config(parked=0, min_residency=0.0))  # no host room to park: the idle victim is stopped cold
    sim.router.arrive("chat", 1)
    settle(sim, lambda: not sim.router.waiting.get("chat") and not sim.router.inflight.get("chat"))
    assert residency(sim.units["chat"].st) is Residency.READY and sim.router.routable("chat")
    sim.router.arrive("coder", 1)
    settle(sim, lambda: sim.units["chat"].pending.stop_cold is not None, ticks=20, dt=0.1)
    # The tick that decided the stop has published its table: chat's policy takes the stop only in the next one.
    assert residency(sim.units["chat"].st) is Residency.READY
    assert not sim.router.routable("chat"), "routable between its stop's decision and the stop"
    sim.router.arrive("chat", 1)
    assert sim.router.inflight.get("chat", []) == [] and len(sim.router.waiting["chat"]) == 1  # it waits, not cut
    failed = sim.router.failed
    settle(sim, lambda: sim.router.routable("coder") and not sim.router.waiting.get("coder"))
    assert sim.router.failed == failed  # nothing was cut by the stop
