"""A drained restart publishes DRAINING and holds the engine's SIGTERM for lb_grace.

The load balancer health-checks /healthz, which answers 503 from the first tick
in DRAINING; StopEngine must not go out before lb_grace has passed, or new
requests would still be routed to an engine that is already stopping.
"""

from __future__ import annotations

from r3090d import config
from r3090d.core import policy
from r3090d.core.actions import SendAlert, StartEngine, StopEngine
from r3090d.core.policy import Phase
from r3090d.core.snapshot import ChildSample, MetricsSample
from tests.configs import bare_config
from tests.snapshots import drive_to_ready, snap


def cfg(lb_grace=5.0, exporter=True, **watchdog) -> config.Config:
    return bare_config(watchdog={"lb_grace": lb_grace, **watchdog}, daemon={"exporter_enabled": exporter})


def stops(actions):
    return [a for a in actions if isinstance(a, StopEngine)]


def ready(c):
    return drive_to_ready(c)[1]


def test_requested_drained_restart_holds_sigterm_for_lb_grace():
    c = cfg(lb_grace=5.0)
    st = ready(c)
    acts, st = policy.decide(snap(10.0, restart_requested="drain"), st, c, 10.0)
    assert st.phase is Phase.DRAINING
    assert stops(acts) == []
    # Every tick inside the grace: still DRAINING, still no SIGTERM.
    for now in (11.0, 12.5, 14.99):
        acts, st = policy.decide(snap(now), st, c, now)
        assert st.phase is Phase.DRAINING
        assert stops(acts) == [], now
    acts, st = policy.decide(snap(15.0), st, c, 15.0)
    assert stops(acts) == [StopEngine(drain=True, reason="requested")]
    assert st.phase is Phase.DRAINING and st.stop_due_at is None
    # Sent once only, while the engine drains.
    acts, st = policy.decide(snap(16.0), st, c, 16.0)
    assert stops(acts) == []
    # Tree gone: the new engine starts.
    gone = ChildSample(pid=100, alive=False, exit_code=0, exited_at=17.0, stop_requested=True, generation=1)
    acts, st = policy.decide(snap(17.0, ch=gone), st, c, 17.0)
    assert any(isinstance(a, StartEngine) for a in acts)
    assert st.phase is Phase.STARTING


def test_kv_leak_restart_is_drained_through_the_grace_too():
    c = cfg(lb_grace=3.0, min_free_blocks=100, kv_low_polls=2, kv_cooldown=0.0)
    st = ready(c)
    leak = MetricsSample(kv_usage=0.95, num_gpu_blocks=1000, free_blocks=50.0, running=0, waiting=0, generation_tokens_total=5.0)
    now = 2.0
    while st.phase is Phase.READY:
        acts, st = policy.decide(snap(now, metrics=leak), st, c, now)
        now += 1.0
    t0 = now - 1.0
    assert st.phase is Phase.DRAINING and st.restart_reason == "kv"
    assert stops(acts) == []
    acts, st = policy.decide(snap(t0 + 2.9, metrics=leak), st, c, t0 + 2.9)
    assert stops(acts) == []
    acts, st = policy.decide(snap(t0 + 3.0, metrics=leak), st, c, t0 + 3.0)
    assert stops(acts) == [StopEngine(drain=True, reason="kv")]


def test_no_grace_when_exporter_is_off_or_grace_zero_or_fast():
    for c, how in ((cfg(lb_grace=5.0, exporter=False), "drain"), (cfg(lb_grace=0.0), "drain"), (cfg(lb_grace=5.0), "fast")):
        st = ready(c)
        acts, st = policy.decide(snap(10.0, restart_requested=how), st, c, 10.0)
        assert stops(acts) == [StopEngine(drain=how == "drain", reason="requested")], (c.watchdog.lb_grace, c.daemon.exporter_enabled, how)


def test_engine_dying_during_the_grace_is_stopped_at_once():
    c = cfg(lb_grace=30.0)
    st = ready(c)
    _, st = policy.decide(snap(10.0, restart_requested="drain"), st, c, 10.0)
    # The API server exits on its own; its orphans (EngineCore) are still there.
    orphaned = ChildSample(pid=100, alive=False, exit_code=1, exited_at=11.0, tree_pids=(101,), generation=1)
    acts, st = policy.decide(snap(11.0, ch=orphaned), st, c, 11.0)
    assert stops(acts) == [StopEngine(drain=False, reason="requested")]
    assert st.stop_due_at is None


def test_shutdown_during_the_grace_drains_now():
    c = cfg(lb_grace=30.0)
    st = ready(c)
    _, st = policy.decide(snap(10.0, restart_requested="drain"), st, c, 10.0)
    acts, st = policy.decide(snap(11.0, shutdown_requested=True), st, c, 11.0)
    assert stops(acts) == [StopEngine(drain=True, reason="shutdown")]
    assert st.phase is Phase.SHUTTING_DOWN


def test_grace_does_not_count_alerts_twice():
    c = cfg(lb_grace=2.0)
    st = ready(c)
    acts, st = policy.decide(snap(10.0, restart_requested="drain"), st, c, 10.0)
    sent = [a.key for a in acts if isinstance(a, SendAlert)]
    acts, st = policy.decide(snap(12.0), st, c, 12.0)
    sent += [a.key for a in acts if isinstance(a, SendAlert)]
    assert sent.count("engine_restarted") == 1
    assert st.restarts_total == 1
