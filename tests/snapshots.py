"""Snapshots for driving the pure policy by hand: what each tick of the daemon would have sampled.

Every builder fills what a test does not name with a quiet default: a live engine of
generation 1 (pid 100, its tree 100 and 101), /health answering 200, no engine metrics,
no GPU monitored and no inference probe sent, so that a test names only what it is about.
"""

from __future__ import annotations

from r3090d import config
from r3090d.core import policy
from r3090d.core.policy import Phase, PolicyState
from r3090d.core.snapshot import (
    ChildSample,
    GpuSample,
    GpuStatus,
    HealthSample,
    HealthStatus,
    InferenceProbeSample,
    MetricsSample,
    Snapshot,
)

# /health as the policy sees it: ready, not listening, no answer in time, answering but not ready,
# and not polled (no engine to ask).
OK = HealthSample(HealthStatus.OK, 200)
REFUSED = HealthSample(HealthStatus.REFUSED)
TIMEOUT = HealthSample(HealthStatus.TIMEOUT)
HTTP_503 = HealthSample(HealthStatus.HTTP, 503)
SKIPPED = HealthSample(HealthStatus.SKIPPED)


def child(gen=1, *, alive=True, tree=(100, 101), pid=100, **fields) -> ChildSample:
    """The engine of generation `gen`, started at monotonic 0; `fields` sets any other ChildSample field."""
    return ChildSample(pid=pid, alive=alive, started_at=0.0, tree_pids=tree, generation=gen, **fields)


def snap(now, ch=None, health=OK, metrics=None, gpu=None, inference=None, *, wall=None, **fields) -> Snapshot:
    """One tick's snapshot at monotonic `now` (and wall clock `wall`, by default `now`).

    What is left out is the quiet default: child(), /health OK, no metrics, GPU not monitored,
    no inference probe; `fields` sets the control-plane requests and the other Snapshot fields.
    """
    return Snapshot(
        now=now,
        wall=now if wall is None else wall,
        child=ch or child(),
        health=health,
        metrics=metrics or MetricsSample(),
        gpu=gpu or GpuSample(GpuStatus.DISABLED),
        inference=inference or InferenceProbeSample(),
        **fields,
    )


def drive_to_ready(c: config.Config, now=0.0) -> tuple[list, PolicyState]:
    """The policy driven from STOPPED to READY in two ticks: no engine yet, then the started one healthy.

    Returns the first tick's actions (those that start the engine) and the READY state.
    """
    st = policy.initial_state(now)
    started, st = policy.decide(snap(now, ch=ChildSample()), st, c, now)
    _, st = policy.decide(snap(now + 1), st, c, now + 1)
    assert st.phase is Phase.READY
    return started, st
