"""The pure policy heals by itself: what ends a recoverable fault without a person.

A start succeeds once the engine served; XIDs by class; one start gate (a reset
hold, a fresh NVML reading after a death, room on the card); a give-up retries by
itself; a fast detector that fires twice widens its own window.
"""

from __future__ import annotations

import dataclasses

import pytest

from r3090d import config
from r3090d.config.errors import ConfigError
from r3090d.config.loading import from_dict
from r3090d.config.schema import EngineKind
from r3090d.core import policy
from r3090d.core.actions import RequestGpuSample, SendAlert, StartEngine, StopEngine
from r3090d.core.policy import Phase
from r3090d.core.snapshot import (
    CanarySample,
    ChildSample,
    GpuProcess,
    GpuSample,
    GpuStatus,
    InferenceProbeSample,
    MetricsSample,
)
from r3090d.core.vocabulary import RestartKind, RestartReason
from r3090d.core.xid import RecoveryAction
from r3090d.units import GIB, MIB
from tests.configs import bare_config
from tests.snapshots import REFUSED, child, drive_to_ready, snap

ENGINE = (100, 101)
CARD = 24 * GIB


def cfg(gpu_required=False, **watchdog) -> config.Config:
    return bare_config(gpu={"required": gpu_required}, watchdog=watchdog,
                       alerts={"min_interval": 0.0, "hysteresis_polls": 1})  # fmt: skip


def served(n: float, probes: int = 0, **fields) -> tuple[MetricsSample, InferenceProbeSample]:
    """/metrics with `n` completed requests (stop/length/repetition), and the daemon's probes sent so far."""
    return MetricsSample(served_total=n, running=0, waiting=0, generation_tokens_total=n, kv_usage=0.0, **fields), InferenceProbeSample(sent_total=probes)


def card(now, *, taken_at=None, procs=((101, 20 * GIB),), xids=(), action=None, free=None) -> GpuSample:
    used = sum(b for _, b in procs)
    return GpuSample(GpuStatus.OK, taken_at=now if taken_at is None else taken_at, age_s=0.0, utilization_gpu=50,
                     memory_total=CARD, memory_used=used, memory_free=CARD - used if free is None else free,
                     processes=tuple(GpuProcess(p, b) for p, b in procs), graphics_processes=(),
                     xid_errors=tuple(xids), recovery_action=action)  # fmt: skip


def dead(gen, *, cause=None, code=0) -> ChildSample:
    return ChildSample(pid=100, alive=False, exit_code=code, tree_pids=(), generation=gen, root_cause=cause,
                       root_cause_certain=cause is not None)  # fmt: skip


def keys(acts, key):
    return [(a.state, a.severity) for a in acts if isinstance(a, SendAlert) and a.key == key]


def starts(acts):
    return [a for a in acts if isinstance(a, StartEngine)]


class Run:
    """The policy driven tick by tick, with a clock."""

    def __init__(self, c, now=0.0):
        self.c = c
        self.acts, self.st = drive_to_ready(c, now)
        self.now = now + 1
        self.sent: list[SendAlert] = [a for a in self.acts if isinstance(a, SendAlert)]

    def tick(self, dt=0.5, **kw):
        self.now += dt
        self.acts, self.st = policy.decide(snap(self.now, **kw), self.st, self.c, self.now)
        self.sent += [a for a in self.acts if isinstance(a, SendAlert)]
        return self.acts

    def ready_again(self, gen, gpu=None):
        """Tick until a new engine is started (the card, if watched, fresh and free), then show it healthy: READY."""
        for _ in range(200):
            if starts(self.acts):
                break
            self.tick(ch=dead(gen - 1), health=REFUSED, **({"gpu": card(self.now + 0.5, procs=())} if gpu else {}))
        assert starts(self.acts), self.st
        self.tick(ch=child(gen), **({"gpu": gpu} if gpu else {}))
        assert self.st.phase is Phase.READY, self.st.phase


# ------------------------------------------------------------------ §0: served


def test_an_engine_that_served_is_not_a_start_failure_five_faults_ten_seconds_after_ready():
    """The shipped settings (min_uptime 60 s, 5 start failures): each engine serves, then dies 10 s after ready."""
    r = Run(cfg())
    for gen in range(1, 8):
        m, p = served(0)
        r.tick(ch=child(gen), metrics=m, inference=p)  # the baseline
        m, p = served(150)
        r.tick(dt=10, ch=child(gen), metrics=m, inference=p)
        assert r.st.succeeded
        r.tick(ch=dead(gen))
        assert r.st.phase is Phase.STARTING and r.st.start_failures == 0, r.st.phase
        assert starts(r.acts)  # at once: no backoff
        r.ready_again(gen + 1)
    assert r.st.give_up_reason is None and r.st.restarts_total == 7


def test_the_daemons_own_probes_do_not_count_as_serving():
    r = Run(cfg(start_failures=2, same_cause_failures=100, backoff_initial=0.0))
    m, p = served(0, probes=0)
    r.tick(ch=child(1), metrics=m, inference=p)
    m, p = served(3, probes=3)  # three probes, each answered: vLLM counts them as completed
    r.tick(dt=10, ch=child(1), metrics=m, inference=p)
    assert not r.st.succeeded
    r.tick(ch=dead(1))
    assert r.st.start_failures == 1


@pytest.mark.parametrize("kind", [EngineKind.GENERATE, EngineKind.EMBED])
@pytest.mark.parametrize(
    "completed, probes, succeeded",
    [
        (150, 0, True),  # clients' requests: vLLM 0.32 counts a finished pooling request as stop, as a completion
        (3, 3, False),  # the daemon's own probes alone (an embedding for an embedding engine)
    ],
)
def test_a_start_succeeds_once_the_engine_served_whatever_its_kind(kind, completed, probes, succeeded):
    """A busy engine that dies 10 s after ready is restarted at once; one that served only the probes is a start failure."""
    c = cfg(start_failures=2, same_cause_failures=100, backoff_initial=0.0)
    c = dataclasses.replace(c, engine=dataclasses.replace(c.engine, kind=kind))
    r = Run(c)
    m, p = served(0)
    r.tick(ch=child(1), metrics=m, inference=p)
    m, p = served(completed, probes=probes)
    r.tick(dt=10, ch=child(1), metrics=m, inference=p)
    assert r.st.succeeded is succeeded
    r.tick(ch=dead(1))
    assert r.st.start_failures == (0 if succeeded else 1)


@pytest.mark.parametrize(
    "completed_in_the_death_poll, start_failures",
    [
        (1, 0),  # the first client's request completed, and the engine died, between two polls
        (0, 1),  # it died before serving anyone
    ],
)
def test_success_is_judged_before_a_death_seen_in_the_same_poll(completed_in_the_death_poll, start_failures):
    r = Run(cfg(start_failures=3, same_cause_failures=100, backoff_initial=0.0))
    m, p = served(0)
    r.tick(ch=child(1), metrics=m, inference=p)
    m, p = served(completed_in_the_death_poll)
    r.tick(ch=dead(1), metrics=m, inference=p)
    assert r.st.start_failures == start_failures


@pytest.mark.parametrize(
    "probe, canary, succeeded",
    [
        (InferenceProbeSample(sent_total=1, unanswered_total=1), CanarySample(), True),  # the probe got no answer: vLLM never counts it
        (InferenceProbeSample(sent_total=1), CanarySample(), False),  # in flight or answered: the completion may be the probe's
        (InferenceProbeSample(), CanarySample(sent_total=1, unanswered_total=1), True),
        (InferenceProbeSample(), CanarySample(sent_total=1), False),
    ],
)
def test_probes_are_counted_by_their_end(probe, canary, succeeded):
    r = Run(cfg())
    m, _ = served(0)
    r.tick(ch=child(1), metrics=m)  # the baseline, before any probe
    r.tick(ch=child(1), metrics=m, inference=probe, canary=canary)
    r.tick(ch=child(1), metrics=served(1)[0], inference=probe, canary=canary)  # one completed request
    assert r.st.succeeded is succeeded


@pytest.mark.parametrize("which", ["inference", "canary"])
def test_a_probe_refused_for_good_does_not_hide_the_next_clients_request(which):
    """A real probe against a port where nothing listens: it ends unanswered, and a client's request then counts."""
    from r3090d.core.vocabulary import CanaryPurpose
    from r3090d.probes.canary import CanaryProber
    from r3090d.probes.inference import InferenceProber
    from tests.waiting import wait_until

    c = cfg()
    if which == "inference":
        prober = InferenceProber("http://127.0.0.1:9", "m", "", 1.0)
        prober.send()
    else:
        prober = CanaryProber("http://127.0.0.1:9", "m", "", c.canary)
        prober.send(CanaryPurpose.CHECK)
    wait_until(lambda: prober.sample().finished_at is not None, 10, what="the probe refused")
    r = Run(c)
    m, _ = served(0)
    r.tick(ch=child(1), metrics=m)
    r.tick(ch=child(1), metrics=served(1)[0], **{which: prober.sample()})
    assert r.st.succeeded


def test_ready_for_min_uptime_is_a_success_without_traffic():
    r = Run(cfg(min_uptime=60.0))
    r.tick(dt=59, ch=child(1))
    assert not r.st.succeeded
    r.tick(dt=1, ch=child(1))
    assert r.st.succeeded


def test_a_death_before_serving_is_still_a_start_failure():
    """A deterministic crash on the first real batch: the requests aborted, nothing completed."""
    r = Run(cfg(start_failures=3, same_cause_failures=100, backoff_initial=0.0))
    for gen in (1, 2, 3):
        m, p = served(0)
        r.tick(ch=child(gen), metrics=m, inference=p)
        r.tick(dt=5, ch=child(gen), metrics=m, inference=p)
        r.tick(ch=dead(gen))
        if r.st.phase is Phase.GIVEN_UP:
            break
        r.ready_again(gen + 1)
    assert r.st.phase is Phase.GIVEN_UP and "3 start failures in a row" in r.st.give_up_reason


def test_the_same_certain_cause_after_success_backs_off_capped_and_never_gives_up():
    c = cfg(backoff_initial=1.0, backoff_max=4.0, start_failures=2, same_cause_failures=2)
    r = Run(c)
    delays = []
    for gen in range(1, 9):
        m, p = served(0)
        r.tick(ch=child(gen), metrics=m, inference=p)
        m, p = served(5)
        r.tick(ch=child(gen), metrics=m, inference=p)
        r.tick(ch=dead(gen, cause="RuntimeError: CUDA error: an illegal memory access was encountered"))
        t0 = r.now
        r.ready_again(gen + 1)
        delays.append(round(r.now - t0 - 0.5, 2))  # the start tick, less the READY tick
    assert r.st.give_up_reason is None
    assert delays[0] == 0.0 and max(delays) <= 4.0 and delays[-1] >= 3.5, delays


OOM_KILL = "the kernel's OOM killer killed the engine (signal 9)"


@pytest.mark.parametrize(
    "uptime, levels",
    [
        (10.0, [0, 1, 2, 3]),  # dying within min_uptime of ready, again and again: backs off
        (61.0, [0, 0, 0, 0]),  # healthy for min_uptime in between: each one is restarted at once
    ],
)
def test_a_healthy_min_uptime_clears_the_same_cause_backoff(uptime, levels):
    r = Run(cfg(min_uptime=60.0, backoff_initial=1.0, backoff_max=300.0))
    seen = []
    for gen in range(1, 5):
        m, p = served(0)
        r.tick(ch=child(gen), metrics=m, inference=p)
        m, p = served(5)
        r.tick(dt=uptime, ch=child(gen), metrics=m, inference=p)
        assert r.st.succeeded
        r.tick(ch=dead(gen, cause=OOM_KILL))
        seen.append(r.st.backoff_level)
        r.ready_again(gen + 1)
    assert seen == levels


# ------------------------------------------------------------------ §1: XIDs


def test_an_application_xid_after_a_crash_is_a_warning_and_the_engine_restarts():
    r = Run(cfg(gpu_required=True))
    r.tick(ch=dead(1), gpu=card(r.now, procs=(), taken_at=r.now - 1, xids=(31,)))
    assert keys(r.acts, "gpu_xid_application") == [("firing", "warning")]
    assert "XID 31 (GPU memory page fault)" in next(a.summary for a in r.acts if isinstance(a, SendAlert) and a.key == "gpu_xid_application")
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=()))
    assert starts(r.acts) and r.st.reset_hold is None


def test_xid_79_holds_every_start_until_the_operator_restarts():
    r = Run(cfg(gpu_required=True))
    r.tick(ch=dead(1), gpu=card(r.now, procs=(), xids=(79,)))
    assert keys(r.acts, "gpu_reset_needed") == [("firing", "critical")]
    for _ in range(40):
        r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=()))
        assert not starts(r.acts)
    assert r.st.phase is Phase.RESET_NEEDED and "XID 79 (GPU has fallen off the bus)" in r.st.reset_hold.reason
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=()), restart_requested=RestartKind.FAST)
    assert starts(r.acts) and r.st.reset_hold is None and r.st.phase is Phase.STARTING
    for _ in range(100):
        r.tick(ch=child(2), gpu=card(r.now + 0.5))
    assert [(a.state, a.severity) for a in r.sent if a.key == "gpu_reset_needed"] == [("firing", "critical"), ("resolved", "critical")]


def test_the_drivers_recovery_action_holds_on_an_xid_outside_the_table():
    r = Run(cfg(gpu_required=True))
    r.tick(ch=dead(1), gpu=card(r.now, procs=(), xids=(140,), action=RecoveryAction.GPU_RESET))
    assert keys(r.acts, "gpu_xid_unknown") == [("firing", "critical")]
    assert "unknown XID 140" in next(a.summary for a in r.acts if isinstance(a, SendAlert) and a.key == "gpu_xid_unknown")
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=()))
    assert r.st.phase is Phase.RESET_NEEDED and "recovery action is gpu reset" in r.st.reset_hold.reason


def test_an_unknown_xid_alone_does_not_hold_starts():
    r = Run(cfg(gpu_required=True))
    r.tick(ch=dead(1), gpu=card(r.now, procs=(), xids=(140,), action=RecoveryAction.NONE))
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=()))
    assert starts(r.acts)


def test_row_remapping_warns_and_the_engine_keeps_serving():
    r = Run(cfg(gpu_required=True))
    r.tick(ch=child(1), gpu=card(r.now, xids=(63,)))
    assert keys(r.acts, "gpu_xid_row_remap") == [("firing", "warning")]
    assert r.st.phase is Phase.READY and r.st.reset_hold is None


def test_a_start_after_a_death_waits_for_an_nvml_reading_taken_after_it():
    """XID 79 arrives with the next poll: it is seen before the replacement spawns."""
    r = Run(cfg(gpu_required=True))
    r.tick(ch=dead(1), gpu=card(r.now, procs=(), taken_at=r.now - 1.5))  # the reading predates the death
    assert not starts(r.acts) and any(isinstance(a, RequestGpuSample) for a in r.acts)
    r.tick(dt=0.2, ch=dead(1), gpu=card(r.now, procs=(), xids=(79,)))
    assert not starts(r.acts) and r.st.phase is Phase.RESET_NEEDED


def test_a_fresh_reading_that_never_comes_does_not_block_for_ever():
    r = Run(cfg(gpu_required=True))
    stale = r.now - 1
    for _ in range(100):
        r.tick(ch=dead(1), gpu=card(r.now, procs=(), taken_at=stale))
        if starts(r.acts):
            break
    assert starts(r.acts) and r.now - stale <= policy.FRESH_SAMPLE_WAIT_S + 2


def test_a_reset_hold_refuses_a_resume_of_a_cold_suspension_and_the_initial_start_waits():
    c = cfg(gpu_required=True)
    st = dataclasses.replace(policy.initial_state(0.0), reset_hold=policy.ResetHold("XID 79 (GPU has fallen off the bus)", 1.0))
    acts, st = policy.decide(snap(0, ch=ChildSample(), gpu=card(0, procs=())), st, c, 0)
    assert not starts(acts) and st.phase is Phase.RESET_NEEDED


# ------------------------------------------------------------------ §2: room


def test_a_foreign_holder_across_a_crash_makes_the_restart_wait_then_start_without_a_start_failure():
    r = Run(cfg(gpu_required=True, start_failures=2))
    for n in (0, 5):  # the engine served: its death is no start failure, and neither is the wait
        m, p = served(n)
        r.tick(ch=child(1), metrics=m, inference=p, gpu=card(r.now + 0.5))
    borrower = ((4242, 12 * GIB),)
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=borrower), process_names=((4242, "python3"),))
    for _ in range(20):
        r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=borrower), process_names=((4242, "python3"),))
        assert not starts(r.acts)
    assert r.st.phase is Phase.WAITING_FOR_GPU
    assert "pid 4242 (python3, 12288 MiB)" in r.st.gpu_wait.text()
    assert any(a.key == "gpu_room" and a.state == "firing" for a in r.sent)
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=()))
    assert starts(r.acts) and r.st.start_failures == 0
    r.tick(ch=child(2), gpu=card(r.now + 0.5))
    assert r.st.phase is Phase.READY
    for _ in range(100):
        r.tick(ch=child(2), gpu=card(r.now + 0.5))
    assert [a.state for a in r.sent if a.key == "gpu_room"] == ["firing", "resolved"]


def test_a_card_held_by_others_at_boot_makes_the_initial_start_wait_then_start():
    """Preflight leaves a taken card to the gate: the first start waits, naming the holder, as a restart does."""
    c = cfg(gpu_required=True)
    borrower = ((4242, 12 * GIB),)
    st = policy.initial_state(0.0)
    acts, st = policy.decide(snap(0, ch=ChildSample(), gpu=card(0, procs=borrower), process_names=((4242, "python3"),)), st, c, 0)
    assert not starts(acts) and st.phase is Phase.WAITING_FOR_GPU
    assert "pid 4242 (python3, 12288 MiB)" in st.gpu_wait.text()
    acts, st = policy.decide(snap(1, ch=ChildSample(), gpu=card(1, procs=())), st, c, 1)
    assert starts(acts) == [StartEngine(reason="initial start")] and st.phase is Phase.STARTING


def test_a_small_foreign_context_leaves_room_and_the_start_goes_on():
    r = Run(cfg(gpu_required=True))
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=((4242, 300 * MIB),)))
    assert starts(r.acts)


def test_the_operator_starts_now_while_waiting_for_the_gpu():
    r = Run(cfg(gpu_required=True))
    borrower = ((4242, 12 * GIB),)
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=borrower))
    assert r.st.phase is Phase.WAITING_FOR_GPU
    r.tick(ch=dead(1), gpu=card(r.now + 0.5, procs=borrower), restart_requested=RestartKind.FAST)
    assert starts(r.acts)


# ------------------------------------------------------------------ §3: give-up retry


def give_up(r: Run, gen: int, cause="OSError: model directory not found"):
    """Start failures with the same certain cause until the policy gives up."""
    while r.st.phase is not Phase.GIVEN_UP:
        r.tick(ch=dead(gen, cause=cause, code=1), health=REFUSED)
        for _ in range(100):
            if r.st.phase is Phase.GIVEN_UP or starts(r.acts):
                break
            r.tick(ch=dead(gen, cause=cause, code=1), health=REFUSED)
        gen += 1 if starts(r.acts) else 0
    return gen


def test_a_give_up_retries_every_give_up_retry_and_a_success_clears_it():
    c = cfg(give_up_retry=100.0, backoff_initial=0.0, backoff_max=0.0)
    r = Run(c)
    gen = give_up(r, 1)
    assert keys(r.acts, "gave_up") == [("firing", "critical")] and r.st.retry_at == pytest.approx(r.now + 100)
    # A failed attempt: still given up, the new cause recorded, the alert neither resolved nor fired again.
    r.tick(dt=100, ch=dead(gen), health=REFUSED)
    assert starts(r.acts) and r.st.retry_attempts == 1
    gen += 1
    r.tick(ch=dead(gen, cause="OSError: still not mounted", code=1), health=REFUSED)
    assert r.st.phase is Phase.GIVEN_UP and "still not mounted" in r.st.give_up_reason and "automatic retry 1 failed" in r.st.give_up_reason
    # A successful attempt.
    r.tick(dt=100, ch=dead(gen), health=REFUSED)
    assert starts(r.acts) and r.st.retry_attempts == 2
    gen += 1
    r.tick(ch=child(gen))
    assert r.st.phase is Phase.READY and r.st.gave_up_unresolved  # ready, but not yet a success
    m, p = served(0)
    r.tick(ch=child(gen), metrics=m, inference=p)
    m, p = served(2)
    r.tick(ch=child(gen), metrics=m, inference=p)
    assert r.st.succeeded and r.st.give_up_reason is None and r.st.retry_attempts == 0 and r.st.retry_at is None
    gave_up = [a.state for a in r.sent if a.key == "gave_up"]
    assert gave_up == ["firing", "resolved"], gave_up


def test_give_up_retry_zero_keeps_waiting_for_the_operator():
    r = Run(cfg(give_up_retry=0.0, backoff_initial=0.0, backoff_max=0.0))
    gen = give_up(r, 1)
    r.tick(dt=10_000, ch=dead(gen), health=REFUSED)
    assert not starts(r.acts) and r.st.phase is Phase.GIVEN_UP and r.st.retry_at is None


def test_a_restart_accepted_after_a_give_up_kills_a_tree_that_outlived_it_then_starts():
    r = Run(cfg(give_up_retry=0.0, backoff_initial=0.0, backoff_max=0.0))
    gen = give_up(r, 1)
    lingering = ChildSample(pid=100, alive=False, exit_code=1, tree_pids=(101,), generation=gen)
    r.tick(ch=lingering, health=REFUSED, restart_requested=RestartKind.FAST)
    assert [type(a) for a in r.acts if isinstance(a, StopEngine | StartEngine)] == [StopEngine]
    r.tick(ch=dataclasses.replace(lingering, stopping=True), health=REFUSED)
    assert not starts(r.acts)
    r.tick(ch=dead(gen), health=REFUSED)
    assert starts(r.acts) and r.st.phase is Phase.STARTING


def test_exit_on_give_up_with_a_retry_is_a_config_error_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        from_dict({"engine": {"model": "/m"}, "daemon": {"exit_on_give_up": True}, "watchdog": {"give_up_retry": 600}}, check_files=False)
    assert "watchdog.give_up_retry" in str(err.value) and "daemon.exit_on_give_up" in str(err.value)
    assert from_dict({"engine": {"model": "/m"}, "daemon": {"exit_on_give_up": True}, "watchdog": {"give_up_retry": 0}}, check_files=False).daemon.exit_on_give_up


# ------------------------------------------------------------------ §4: detectors widen


def frozen(tokens=500.0) -> MetricsSample:
    return MetricsSample(running=2, waiting=0, generation_tokens_total=tokens, prompt_tokens_total=10.0, kv_usage=0.1, free_blocks=900, served_total=0.0)


def idle_card(now) -> GpuSample:
    return dataclasses.replace(card(now, procs=((101, 8 * GIB),)), utilization_gpu=0)


def trip_gpu_idle(r: Run, gen: int) -> float:
    """Requests running, the GPU idle: seconds until gpu_idle restarts the engine."""
    t0 = r.now
    for _ in range(400):
        r.tick(dt=0.5, ch=child(gen, tree=ENGINE), metrics=frozen(), gpu=idle_card(r.now + 0.5))
        if r.st.phase is not Phase.READY:
            break
    assert r.st.restart_reason == RestartReason.GPU_IDLE, r.st.restart_reason
    return r.now - t0


def test_gpu_idle_firing_twice_in_a_row_doubles_its_window_up_to_8x_and_narrows_after_success():
    c = cfg(gpu_required=True, gpu_idle_stall_seconds=5.0, stall_seconds=1000.0, probe_idle_seconds=1000.0, min_uptime=60.0, poll_interval=0.5,
            start_failures=100, same_cause_failures=100, backoff_initial=0.0, backoff_max=0.0)  # fmt: skip
    r = Run(c)
    windows = []
    for gen in range(1, 6):
        windows.append(trip_gpu_idle(r, gen))
        r.tick(ch=dead(gen), gpu=card(r.now + 0.5, procs=()))
        r.ready_again(gen + 1, gpu=card(r.now + 0.5, procs=((101, 8 * GIB),)))
    assert windows == [5.5, 5.5, 10.5, 20.5, 40.5], windows  # 5 s, 5 s, then 2x, 4x, 8x (+ the first idle poll)
    widened = [(a.state, a.summary) for a in r.sent if a.key == "detector_widened"]
    assert len(widened) == 1 and widened[0][0] == "firing", widened  # one alert; its reminders carry the current window
    assert "its window is 10 s, 2x watchdog.gpu_idle_stall_seconds = 5 s" in widened[0][1]
    assert "raise watchdog.gpu_idle_stall_seconds" in widened[0][1]
    (now,) = [c.summary for c in policy._hold_conditions(r.st, c) if c.key == "detector_widened"]
    assert "its window is 40 s, 8x" in now
    assert dict(r.st.detector_scale) == {RestartReason.GPU_IDLE: 8}
    # Healthy for min_uptime: back to 1x.
    for _ in range(130):
        r.tick(ch=child(6, tree=ENGINE), gpu=card(r.now + 0.5, procs=((101, 8 * GIB),)))
    assert r.st.detector_scale == () and r.st.watch.gpu_idle_scale == 1
    assert [a.state for a in r.sent if a.key == "detector_widened"] == ["firing", "resolved"]
    assert trip_gpu_idle(r, 6) == 5.5


def test_a_detector_that_fires_on_an_engine_that_served_does_not_widen():
    c = cfg(gpu_required=True, gpu_idle_stall_seconds=5.0, stall_seconds=1000.0, probe_idle_seconds=1000.0, poll_interval=0.5)
    r = Run(c)
    for gen in range(1, 4):
        m, p = served(0)
        r.tick(ch=child(gen, tree=ENGINE), metrics=m, inference=p, gpu=card(r.now + 0.5, procs=((101, 8 * GIB),)))
        m, p = served(10)
        r.tick(ch=child(gen, tree=ENGINE), metrics=m, inference=p, gpu=card(r.now + 0.5, procs=((101, 8 * GIB),)))
        trip_gpu_idle(r, gen)
        r.tick(ch=dead(gen), gpu=card(r.now + 0.5, procs=()))
        r.ready_again(gen + 1, gpu=card(r.now + 0.5, procs=((101, 8 * GIB),)))
    assert r.st.detector_scale == ()


def test_exit_on_give_up_says_that_the_daemon_exits():
    c = bare_config(watchdog={"give_up_retry": 0, "backoff_initial": 0.0, "backoff_max": 0.0}, daemon={"exit_on_give_up": True},
                    alerts={"min_interval": 0.0})  # fmt: skip
    r = Run(c)
    give_up(r, 1)
    (gave_up,) = [a.summary for a in r.sent if a.key == "gave_up"]
    assert "the daemon exits with code 79" in gave_up and "stays stopped" not in gave_up


def test_probes_sent_before_a_reload_still_count_as_the_daemons_own():
    """A reload builds a new prober: the count of probes sent goes on, so the engine does not seem to have served."""
    from r3090d.probes.inference import InferenceProber
    from tests.waiting import wait_until

    old = InferenceProber("http://127.0.0.1:9", "m", "", 1.0)  # nothing listens: each probe fails at once
    for n in (1, 2):
        old.send()
        wait_until(lambda n=n: old.sample().finished_at is not None and old.sample().consecutive_failures == n, 10, what=f"probe {n} over")
    new = InferenceProber("http://127.0.0.1:9", "m", "", 1.0, sent_before=old.sent_total)
    assert old.sample().sent_total == 2 and new.sample().sent_total == 2


def test_the_baseline_is_the_reading_that_came_with_ready_so_the_first_poll_counts():
    c = cfg(start_failures=2, same_cause_failures=100, backoff_initial=0.0)
    st = policy.initial_state(0.0)
    _, st = policy.decide(snap(0, ch=ChildSample()), st, c, 0)
    m, p = served(0)
    _, st = policy.decide(snap(1, metrics=m, inference=p), st, c, 1)  # /health 200, with /metrics read
    assert st.phase is Phase.READY and st.served_base == 0
    m, p = served(1)  # a client's request completed within the first poll
    _, st = policy.decide(snap(2, metrics=m, inference=p), st, c, 2)
    assert st.succeeded
