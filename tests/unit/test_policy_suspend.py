"""The policy's suspend and resume: snapshots in, actions and phases out, through every stage and failure."""

from __future__ import annotations

import dataclasses

import pytest

from r3090d import config
from r3090d.core import policy, rules, suspension
from r3090d.core.actions import (
    QueryEngineState,
    RecordRestart,
    RequestGpuSample,
    ResetProbes,
    ResumeEngine,
    SaveSuspension,
    SendAlert,
    SendInferenceProbe,
    StartEngine,
    StopEngine,
    SuspendEngine,
    SuspendRecord,
)
from r3090d.core.snapshot import (
    ChildSample,
    GpuProcess,
    GpuSample,
    GpuStatus,
    InferenceProbeSample,
    MetricsSample,
)
from r3090d.core.suspend_types import Op, Outcome, ProcessState, SuspendSample
from r3090d.core.suspension import Result, Stage
from r3090d.core.vocabulary import Phase, RestartReason
from r3090d.service import commands
from r3090d.units import GIB, MIB
from tests.configs import bare_config
from tests.snapshots import HTTP_503, OK, REFUSED, SKIPPED, TIMEOUT, child, snap

API, CORE = 100, 101  # the engine's API server and its EngineCore, the one GPU process
TREE = (API, CORE, 102)
HELD = 15 * GIB


def cfg(*, suspend=None, watchdog=None, gpu_required=True, extra_args=(), alerts=None, canary=None) -> config.Config:
    """The stage machine alone: the canary's stages are tested in test_policy_canary.py."""
    return bare_config(
        canary={"enabled": False, **(canary or {})},
        engine={"extra_args": list(extra_args)},
        gpu={"required": gpu_required},
        watchdog={"lb_grace": 2.0, "stall_seconds": 10.0, "gpu_memory_alert_mib": 20000, **(watchdog or {})},
        suspend={"drain_timeout": 5.0, "verify_timeout": 20.0, "remind_after": 3600.0, **(suspend or {})},
        alerts={"min_interval": 0.0, "hysteresis_polls": 1, **(alerts or {})},
        daemon={"exporter_enabled": True},
    )


def card(now, procs=((CORE, HELD),), total=24 * GIB, taken_at=None, util=0):
    used = sum(b for _, b in procs)
    return GpuSample(GpuStatus.OK, taken_at=now if taken_at is None else taken_at, age_s=0.0, utilization_gpu=util,
                     processes=tuple(GpuProcess(p, b) for p, b in procs), graphics_processes=(),
                     memory_total=total, memory_used=used, memory_free=total - used - 300 * MIB)  # fmt: skip


def alive(gen=1, tree=TREE):
    return child(gen, pid=API, tree=tree)


def worker(op, started, outcome=None, state=None, error=""):
    return SuspendSample(op=op, pid=CORE, in_flight=outcome is None, started_at=started, finished_at=None if outcome is None else started + 1,
                         outcome=outcome, state=state, error=error)  # fmt: skip


IDLE = MetricsSample(running=0, waiting=0, generation_tokens_total=100.0, prompt_tokens_total=10.0, kv_usage=0.0)


class Run:
    """The policy driven tick by tick; every tick's defaults are a healthy, idle, one-holder engine."""

    def __init__(self, c=None):
        self.c = c or cfg()
        self.now = 0.0
        self.st = policy.initial_state(0.0)
        self.acts: list = []
        self.tick(ch=ChildSample(), gpu=card(0.5, procs=()))  # the card before the engine's core is on it
        assert self.st.phase is Phase.STARTING
        self.tick()
        assert self.st.phase is Phase.READY

    def tick(self, dt=0.5, **kw):
        self.now += dt
        kw.setdefault("ch", alive())
        kw.setdefault("gpu", card(self.now))
        kw.setdefault("metrics", IDLE)
        self.acts, self.st = policy.decide(snap(self.now, wall=1000.0 + self.now, **kw), self.st, self.c, self.now)
        return self.acts

    def of(self, kind):
        return [a for a in self.acts if isinstance(a, kind)]

    def alerts(self, key):
        return [a.state for a in self.acts if isinstance(a, SendAlert) and a.key == key]

    # -- whole stages

    def suspend(self, request=1, outcome=Outcome.SUSPENDED, **worker_kw):
        """READY -> drained -> checkpoint asked -> the worker's outcome; returns when the outcome is applied."""
        self.tick(suspend_requested=request)
        assert self.st.phase is Phase.SUSPENDING and self.st.suspension.stage is Stage.DRAINING
        while not self.of(SuspendEngine):
            self.tick()
        sent = self.now
        self.tick(suspender=worker(Op.SUSPEND, sent + 0.01))  # in flight
        assert self.st.suspension.stage is Stage.CHECKPOINTING
        gpu = card(self.now + 0.5, procs=()) if outcome is Outcome.SUSPENDED else card(self.now + 0.5)
        self.tick(suspender=worker(Op.SUSPEND, sent + 0.01, outcome, **worker_kw), gpu=gpu)
        return sent

    def resume(self, request=2, *, room=True, outcome=Outcome.RESUMED, foreign=()):
        self.tick(resume_requested=request, gpu=card(self.now, procs=foreign))
        assert self.st.phase is Phase.RESUMING and self.of(RequestGpuSample)
        asked = self.now
        self.tick(gpu=card(asked - 1, procs=foreign))  # the reading from before the request does not count
        assert self.st.suspension.stage is Stage.CHECKING and not self.of(ResumeEngine)
        self.tick(gpu=card(self.now, procs=foreign), process_names=tuple((p, "sleep") for p, _ in foreign))
        if not room:
            return None
        assert self.of(ResumeEngine) == [ResumeEngine(CORE)]
        sent = self.now
        self.tick(suspender=worker(Op.RESUME, sent + 0.01, outcome), gpu=card(self.now))
        return sent


# ------------------------------------------------------------------ refusals, at once


@pytest.mark.parametrize(
    ("c", "gpu", "phase", "text", "unavailable"),
    [
        (cfg(gpu_required=False), None, Phase.READY, "there is no GPU to lend: gpu.required is false", True),
        (cfg(extra_args=["--tensor-parallel-size", "2"]), None, Phase.READY, "the engine runs on 2 GPUs", True),
        (cfg(extra_args=["-tp=4"]), None, Phase.READY, "the engine runs on 4 GPUs", True),
        (cfg(), card(0, procs=((CORE, HELD), (102, GIB))), Phase.READY, "2 engine processes hold GPU memory (pids 101, 102)", False),
        (cfg(), card(0, procs=((9999, HELD),)), Phase.READY, "no process of the engine holds GPU memory", False),
        (cfg(), GpuSample(GpuStatus.ERROR, "boom"), Phase.READY, "NVML gives no reading (error: boom)", False),
        (cfg(), None, Phase.STARTING, "the engine is starting, not ready: nothing to suspend", False),
        (cfg(), None, Phase.SUSPENDED, "already suspended (r3090ctl resume brings it back)", False),
    ],
    ids=["no-gpu", "tp2", "tp4", "two-holders", "no-holder", "nvml-error", "starting", "suspended"],
)
def test_suspend_is_refused_in_one_line(c, gpu, phase, text, unavailable):
    snapshot = snap(1, alive(), metrics=IDLE, gpu=gpu or card(1))
    pending = commands.Pending()
    reply = commands.answer_suspend({"cmd": "suspend"}, pending, c, phase=phase, suspended=None, snap=snapshot)
    assert reply["ok"] is False and text in reply["error"] and "\n" not in reply["error"]
    assert reply["unavailable"] is unavailable
    assert pending.suspend is None  # nothing reaches the policy


@pytest.mark.parametrize(
    ("args", "size"),
    [([], 1), (["--tensor-parallel-size", "2"], 2), (["--tensor_parallel_size=2"], 2), (["-tp", "8"], 8),
     (["-pp", "2", "-tp", "2"], 4), (["--tensor-parallel-size", "x"], 1), (["--max-num-seqs", "2"], 1), (["-tp"], 1)],
)  # fmt: skip
def test_parallel_size_from_extra_args(args, size):
    assert suspension.parallel_size(args) == size


def test_accepted_requests_are_numbered_and_one_at_a_time():
    pending = commands.Pending()
    snapshot = snap(1, alive(), metrics=IDLE, gpu=card(1))
    reply = commands.answer_suspend({"cmd": "suspend"}, pending, cfg(), phase=Phase.READY, suspended=None, snap=snapshot)
    assert reply == {"ok": True, "message": "accepted: draining, then suspending the engine", "request": 1}
    again = commands.answer_suspend({"cmd": "suspend"}, pending, cfg(), phase=Phase.READY, suspended=None, snap=snapshot)
    assert not again["ok"] and "already accepted" in again["error"]
    assert pending.take_suspend() == (1, None)
    reply = commands.answer_suspend({"cmd": "resume"}, pending, cfg(), phase=Phase.READY, suspended=None, snap=snapshot)
    assert not reply["ok"] and reply["error"] == "the engine is ready, not suspended: nothing to resume"


# ------------------------------------------------------------------ the whole way round


def test_suspend_drains_past_the_lb_grace_then_checkpoints_the_one_gpu_process():
    r = Run()
    r.tick(suspend_requested=1)
    since = r.now
    assert r.st.phase is Phase.SUSPENDING and r.acts == []
    while r.now < since + 2.0:  # lb_grace: /healthz already 503, nothing asked of the driver yet
        r.tick(metrics=IDLE)
        assert not r.of(SuspendEngine) or r.now >= since + 2.0
    assert r.of(SuspendEngine) == [SuspendEngine(CORE, 10000, 0)]
    assert r.st.suspension.stage is Stage.CHECKPOINTING
    sent = r.now
    for _ in range(20):  # a slow checkpoint: the loop ticks on, quiet
        r.tick(suspender=worker(Op.SUSPEND, sent + 0.01), health=REFUSED)
        assert r.st.phase is Phase.SUSPENDING and r.acts == []
    r.tick(suspender=worker(Op.SUSPEND, sent + 0.01, Outcome.SUSPENDED, ProcessState.CHECKPOINTED), gpu=card(r.now, procs=()))
    assert r.st.phase is Phase.SUSPENDED
    assert r.of(SaveSuspension) == [SaveSuspension(SuspendRecord(pid=CORE, engine_pid=API, bytes=HELD, since=1000.0 + r.now))]
    assert r.st.suspend_last.result is Result.SUSPENDED and r.st.suspend_last.request == 1
    assert "15.0 GiB of GPU memory freed" in r.st.suspend_last.detail


def test_requests_still_running_at_the_drain_deadline_are_frozen_with_the_engine():
    r = Run()
    busy = dataclasses.replace(IDLE, running=1, waiting=2)
    r.tick(suspend_requested=1, metrics=busy)
    since = r.now
    while not r.of(SuspendEngine):
        r.tick(metrics=busy)
    assert r.now >= since + 2.0 + 5.0  # grace, then the whole drain_timeout
    assert r.of(SuspendEngine) == [SuspendEngine(CORE, 10000, 3)]
    assert r.st.suspension.frozen_requests == 3


def test_while_suspended_no_liveness_rule_fires_and_no_probe_is_sent():
    r = Run(cfg(watchdog={"probe_idle_seconds": 1.0, "gpu_idle_stall_seconds": 1.0, "min_free_blocks": 100, "kv_low_polls": 1}))
    r.suspend()
    frozen = MetricsSample(running=1, waiting=0, generation_tokens_total=100.0, prompt_tokens_total=10.0, free_blocks=0.0, kv_usage=1.0)
    borrower = card(0, procs=((4242, 23 * GIB),))
    for health in (REFUSED, TIMEOUT, HTTP_503):
        for _ in range(40):  # 20 s each: over stall_seconds, hang_timeout, the probe's idle time
            r.tick(health=health, metrics=frozen, gpu=dataclasses.replace(borrower, taken_at=r.now + 0.5))
            assert r.st.phase is Phase.SUSPENDED
            assert not r.of(RecordRestart) and not r.of(StopEngine) and not r.of(SendInferenceProbe) and not r.of(StartEngine)
            assert r.alerts("gpu_memory") == []  # the borrower's 23 GiB are over the 20000 MiB alert
    assert r.st.restarts_total == 0


def test_suspended_long_reminds_after_remind_after_and_resolves_on_resume():
    r = Run(cfg(suspend={"remind_after": 30.0}))
    r.suspend()
    fired = []
    start = r.now
    while r.now < start + 40:
        r.tick(gpu=card(r.now, procs=()))
        fired += [(r.now - start, s) for s in r.alerts("suspended_long")]
    assert [s for _, s in fired] == ["firing"] and 30 <= fired[0][0] <= 31
    firing = r.st.alerts.get("suspended_long")
    assert "r3090ctl resume brings it back" in firing.summary and "15.0 GiB of host memory" in firing.summary
    r.resume(room=False, foreign=((4242, 20 * GIB),))  # a refused resume ends nothing
    assert r.st.alerts.get("suspended_long").firing
    r.tick(resume_requested=3, gpu=card(r.now, procs=()))
    assert r.alerts("suspended_long") == []
    r.tick(gpu=card(r.now, procs=()))
    assert r.of(ResumeEngine) and r.alerts("suspended_long") == ["resolved"]


def test_resume_checks_a_fresh_reading_restores_then_needs_health_and_a_probe():
    r = Run()
    r.suspend()
    sent = r.resume()
    assert r.st.phase is Phase.RESUMING and r.st.suspension.stage is Stage.VERIFYING
    assert r.of(ResetProbes)
    r.tick(health=REFUSED)
    assert r.st.phase is Phase.RESUMING and not r.of(SendInferenceProbe)
    r.tick(health=OK)
    assert r.of(SendInferenceProbe)
    probe_at = r.now
    r.tick(inference=InferenceProbeSample(sent_at=probe_at, ok=None))
    assert r.st.phase is Phase.RESUMING and r.acts == []
    r.tick(inference=InferenceProbeSample(sent_at=probe_at, finished_at=r.now, ok=True))
    assert r.st.phase is Phase.READY and sent < r.now
    assert r.of(SaveSuspension) == [SaveSuspension(None)]
    assert r.st.suspend_last.result is Result.RESUMED and r.st.suspend_last.request == 2
    # The watch starts afresh: what stood still while suspended is not a stall.
    assert r.st.watch == rules.WatchState(ready_at=r.now) and r.st.ready_since == r.now
    stalled = dataclasses.replace(IDLE, running=1)
    ready_at = r.now
    while r.st.phase is Phase.READY:
        r.tick(metrics=stalled)
    # A stall counted from before the suspension would restart at once; this one waits its full time.
    assert r.now - ready_at >= r.c.watchdog.gpu_idle_stall_seconds
    assert [a.reason for a in r.of(RecordRestart)] == ["gpu_idle"]


def test_resume_is_refused_while_another_process_holds_the_memory():
    r = Run()
    r.suspend()
    r.resume(room=False, foreign=((4242, 20 * GIB),))
    assert r.st.phase is Phase.SUSPENDED and not r.of(ResumeEngine)
    last = r.st.suspend_last
    assert last.result is Result.REFUSED and last.request == 2
    assert last.detail == "3.7 GiB free, 15.0 GiB + 0.5 GiB margin needed; held by pid 4242 (sleep, 20.0 GiB)"
    assert r.st.suspension.error.startswith("resume refused: ")
    r.resume(request=3)  # the borrower left
    assert r.st.suspension.stage is Stage.VERIFYING


def test_resume_without_a_fresh_reading_is_refused_after_nvml_hung_after():
    r = Run(cfg(watchdog={"nvml_hung_after": 3.0}))
    r.suspend()
    r.tick(resume_requested=2)
    asked = r.now
    while r.st.phase is Phase.RESUMING:
        r.tick(gpu=card(asked - 1))
    assert r.now > asked + 3.0 and r.st.suspend_last.result is Result.REFUSED
    assert "NVML gave no fresh reading within 3 s" in r.st.suspend_last.detail


# ------------------------------------------------------------------ failures


@pytest.mark.parametrize(
    ("outcome", "phase", "result"),
    [
        (Outcome.KEPT_RUNNING, Phase.RESUMING, Result.KEPT_RUNNING),  # unlocked by the worker: verify, then serve
        (Outcome.UNAVAILABLE, Phase.READY, Result.UNAVAILABLE),  # nothing touched
        (Outcome.FAILED, Phase.RESTARTING, Result.FAILED),  # cold restart
    ],
)
def test_suspend_failures(outcome, phase, result):
    r = Run()
    r.suspend(outcome=outcome, error="lock: CUDA_ERROR_TIMEOUT (909)")
    assert r.st.phase is phase
    assert r.st.suspend_last.result is result and "lock: CUDA_ERROR_TIMEOUT (909)" in r.st.suspend_last.detail
    if outcome is Outcome.FAILED:
        assert r.of(StopEngine) == [StopEngine(drain=False, reason="suspend_failed")]
        assert [a.reason for a in r.of(RecordRestart)] == ["suspend_failed"]
        assert r.of(SaveSuspension) == [SaveSuspension(None)]
        assert r.alerts("engine_restarted") == ["firing"]
        assert dict(r.st.restarts_by_reason) == {"suspend_failed": 1}
    if outcome is Outcome.KEPT_RUNNING:
        assert r.of(ResetProbes)
        r.tick()
        assert r.of(SendInferenceProbe)
        probe_at = r.now
        r.tick(inference=InferenceProbeSample(sent_at=probe_at, finished_at=r.now, ok=True))
        assert r.st.phase is Phase.READY and r.st.restarts_total == 0


@pytest.mark.parametrize(
    ("state", "phase", "result"),
    [
        (ProcessState.RUNNING, Phase.RESUMING, Result.KEPT_RUNNING),
        (ProcessState.CHECKPOINTED, Phase.SUSPENDED, Result.SUSPENDED),
        (ProcessState.LOCKED, Phase.RESTARTING, Result.FAILED),
        (None, Phase.RESTARTING, Result.FAILED),  # the state cannot be read
    ],
)
def test_a_worker_without_a_result_is_followed_by_a_state_query(state, phase, result):
    r = Run()
    sent = r.suspend(outcome=Outcome.UNKNOWN, error="the worker exited with status 1 without a result")
    assert r.of(QueryEngineState) == [QueryEngineState(CORE)] and r.st.suspension.stage is Stage.QUERYING
    asked = r.now
    r.tick(suspender=worker(Op.SUSPEND, sent + 0.01, Outcome.UNKNOWN))  # the old result is not the answer
    assert r.st.suspension.stage is Stage.QUERYING
    outcome = Outcome.REPORTED if state is not None else Outcome.FAILED
    r.tick(suspender=dataclasses.replace(worker(Op.STATE, asked + 0.01, outcome, state), pid=CORE))
    assert r.st.phase is phase and r.st.suspend_last.result is result


@pytest.mark.parametrize(
    ("outcome", "phase", "result"),
    [
        (Outcome.FAILED, Phase.RESTARTING, Result.FAILED),
        (Outcome.UNAVAILABLE, Phase.SUSPENDED, Result.UNAVAILABLE),
        (Outcome.KEPT_RUNNING, Phase.RESUMING, None),  # verified, then RESUMED
    ],
)
def test_resume_failures(outcome, phase, result):
    r = Run()
    r.suspend()
    r.resume(outcome=outcome)
    assert r.st.phase is phase
    assert (r.st.suspend_last.result if r.st.suspend_last.op == "resume" else None) is result
    if outcome is Outcome.FAILED:
        assert [a.reason for a in r.of(RecordRestart)] == ["resume_failed"]
        assert RestartReason.RESUME_FAILED.value in dict(r.st.restarts_by_reason)


def test_verify_fails_after_probe_failures_or_the_verify_timeout():
    r = Run(cfg(watchdog={"probe_failures": 2}))
    r.suspend()
    r.resume()
    r.tick()
    probe_at = r.now
    r.tick(inference=InferenceProbeSample(sent_at=probe_at, finished_at=r.now, ok=False, detail="HTTP 500", consecutive_failures=1))
    assert r.of(SendInferenceProbe) and r.st.phase is Phase.RESUMING  # one more try
    r.tick(inference=InferenceProbeSample(sent_at=r.now, finished_at=r.now + 0.1, ok=False, detail="HTTP 500", consecutive_failures=2))
    assert r.st.phase is Phase.RESTARTING and [a.reason for a in r.of(RecordRestart)] == ["resume_failed"]

    r = Run()
    r.suspend()
    r.resume()
    start = r.now
    while r.st.phase is Phase.RESUMING:
        r.tick(health=REFUSED)
    assert r.now > start + 20.0 and r.st.phase is Phase.RESTARTING
    assert "within 20 s after resume" in r.st.suspend_last.detail


# ------------------------------------------------------------------ cold suspensions


def test_an_engine_that_dies_while_suspended_stays_down_and_resume_starts_it_cold():
    r = Run()
    r.suspend()
    dead = ChildSample(pid=API, alive=False, exit_code=-9, tree_pids=(), generation=1)
    r.tick(ch=dead, gpu=card(r.now, procs=()))
    assert r.st.phase is Phase.SUSPENDED and r.st.suspension.cold
    assert r.alerts("suspended_engine_lost") == ["firing"]
    assert r.of(SaveSuspension)[0].record.engine_pid is None
    for _ in range(20):
        r.tick(ch=dead, gpu=card(r.now, procs=()))
        assert not r.of(StartEngine) and r.st.restarts_total == 0
    r.tick(ch=dead, resume_requested=2, gpu=card(r.now, procs=()))
    r.tick(ch=dead, gpu=card(r.now, procs=()))
    assert r.of(StartEngine) and r.st.phase is Phase.STARTING and r.st.generation == 2
    assert r.of(SaveSuspension) == [SaveSuspension(None)] and r.st.suspend_last.result is Result.STARTED_COLD


def test_an_engine_that_dies_while_draining_leaves_the_gpu_free_and_answers_the_request():
    r = Run()
    r.tick(suspend_requested=4)
    r.tick(ch=ChildSample(pid=API, alive=False, exit_code=1, tree_pids=(CORE,), generation=1))
    assert r.st.phase is Phase.SUSPENDED and r.st.suspension.cold
    assert (r.st.suspend_last.request, r.st.suspend_last.result) == (4, Result.SUSPENDED)
    assert r.of(StopEngine) == [StopEngine(drain=False, reason="suspended engine lost")]  # its orphan only holds memory
    assert not r.of(RecordRestart) and r.st.restarts_total == 0


def test_an_engine_that_dies_while_a_resume_checks_answers_that_resume_and_goes_cold():
    r = Run()
    r.suspend()
    r.tick(resume_requested=2, gpu=card(r.now, procs=()))
    r.tick(ch=ChildSample(pid=API, alive=False, exit_code=-9, tree_pids=(), generation=1), gpu=card(r.now, procs=()))
    assert r.st.phase is Phase.SUSPENDED and r.st.suspension.cold
    assert (r.st.suspend_last.request, r.st.suspend_last.result) == (2, Result.REFUSED)
    assert "starts it cold" in r.st.suspend_last.detail


def test_a_cold_resume_waits_for_the_old_engines_leftovers_then_gives_up_on_them():
    r = Run()
    r.suspend()
    orphan = ChildSample(pid=API, alive=False, exit_code=-9, tree_pids=(CORE,), generation=1)
    r.tick(ch=orphan, gpu=card(r.now, procs=()))
    assert r.of(StopEngine) and r.st.suspension.cold
    r.tick(ch=orphan, resume_requested=2, gpu=card(r.now, procs=()))
    asked = r.now
    r.tick(ch=orphan, gpu=card(r.now, procs=()))
    assert r.of(StopEngine) and not r.of(StartEngine) and r.st.phase is Phase.RESUMING
    stopping = dataclasses.replace(orphan, stopping=True)
    while r.st.phase is Phase.RESUMING:
        r.tick(ch=stopping, gpu=card(r.now, procs=()))
        assert not r.of(StopEngine) and not r.of(StartEngine)
    assert r.now - asked > suspension.LEFTOVERS_WAIT_S and r.st.phase is Phase.SUSPENDED
    assert r.st.suspend_last.detail == "what is left of the old engine (pids 101) does not exit"


def test_a_daemon_started_with_a_suspension_on_record_keeps_the_engine_down():
    c = cfg()
    record = SuspendRecord(pid=CORE, engine_pid=API, bytes=HELD, since=500.0)
    st = policy.suspended_state(record, 10.0, since=-490.0)
    nothing = ChildSample()
    for t in range(11, 30):
        acts, st = policy.decide(snap(t, nothing, SKIPPED, gpu=card(t, procs=())), st, c, t)
        assert st.phase is Phase.SUSPENDED and not [a for a in acts if isinstance(a, StartEngine | StopEngine)]
    assert st.suspension.cold and st.suspension.bytes == HELD
    acts, st = policy.decide(snap(30, nothing, SKIPPED, gpu=card(30, procs=()), resume_requested=1), st, c, 30)
    acts, st = policy.decide(snap(31, nothing, SKIPPED, gpu=card(31, procs=())), st, c, 31)
    assert [type(a) for a in acts if not isinstance(a, SendAlert)] == [SaveSuspension, StartEngine]


# ------------------------------------------------------------------ other commands while suspended


def test_restart_is_refused_maintenance_toggles_and_silence_works_while_suspended():
    r = Run()
    r.suspend()
    reply = commands.answer({"cmd": "restart"}, commands.Pending(), phase=r.st.phase, generation=1, exit_on_give_up=False)
    assert reply == {"ok": False, "error": "the engine is suspended: r3090ctl resume first (a new engine needs the lent GPU memory too)"}
    r.tick(maintenance=True, silences=(("suspended_long", 60.0),), gpu=card(r.now, procs=()))
    assert r.st.maintenance and r.st.phase is Phase.SUSPENDED and r.acts == []
    assert dict(r.st.alerts.silenced)["suspended_long"] > r.now
    restart, text = commands.reload_outcome(Phase.SUSPENDED, True, "watchdog settings")
    assert restart is None and "take effect when it next starts" in text


def test_shutdown_stops_a_suspended_engine_fast_and_keeps_the_record():
    r = Run()
    r.suspend()
    r.tick(shutdown_requested=True, gpu=card(r.now, procs=()))
    assert r.of(StopEngine) == [StopEngine(drain=False, reason="shutdown")] and not r.of(SaveSuspension)
    assert r.st.phase is Phase.SHUTTING_DOWN

    r = Run()
    r.tick(suspend_requested=1)
    r.tick(shutdown_requested=True)
    assert r.of(StopEngine) == [StopEngine(drain=True, reason="shutdown")]  # still draining: not locked


def test_a_request_the_phase_cannot_take_is_refused_with_its_number():
    r = Run()
    r.tick(resume_requested=7)
    assert r.st.phase is Phase.READY
    assert (r.st.suspend_last.request, r.st.suspend_last.result) == (7, Result.REFUSED)


def test_a_driver_call_past_its_deadline_alerts_suspend_stuck():
    r = Run()
    r.tick(suspend_requested=1)
    while not r.of(SuspendEngine):
        r.tick()
    stuck = dataclasses.replace(worker(Op.SUSPEND, r.now + 0.01), overdue=True)
    r.tick(suspender=stuck)
    assert r.alerts("suspend_stuck") == ["firing"] and r.st.phase is Phase.SUSPENDING
    assert "has not returned" in r.st.alerts.get("suspend_stuck").summary


# Every stage of a suspend or resume under way, the engine dying in it: (stage, resuming, the worker's last word).
# The worker's word is what it says once the engine under it has gone (a call that fails, or no result at all).
DYING_IN = [
    (Stage.DRAINING, False, None),
    (Stage.BASELINING, False, None),
    (Stage.CHECKPOINTING, False, Outcome.UNKNOWN),
    (Stage.CHECKPOINTING, False, Outcome.FAILED),
    (Stage.CHECKPOINTING, False, Outcome.SUSPENDED),
    (Stage.QUERYING, False, Outcome.FAILED),
    (Stage.CHECKING, True, None),
    (Stage.RESTORING, True, Outcome.UNKNOWN),
    (Stage.RESTORING, True, Outcome.FAILED),
    (Stage.QUERYING, True, Outcome.FAILED),
    (Stage.VERIFYING, True, None),
    (Stage.CANARY, True, None),
]


@pytest.mark.parametrize("parked", [False, True], ids=["single", "swap"])
@pytest.mark.parametrize(("stage", "resuming", "outcome"), DYING_IN, ids=lambda v: getattr(v, "value", str(v)))
def test_an_engine_that_dies_in_any_stage_answers_the_request_under_way(stage, resuming, outcome, parked):
    """`suspend --wait` (and swap mode's park or unpark) waits for the answer: no stage may leave it without one."""
    c = cfg(canary={"enabled": True})
    request = 7
    s = suspension.Suspension(stage, 10.0, request, resuming=resuming, target=CORE, bytes=HELD, op_sent_at=10.0, parked=parked,
                              since=5.0 if resuming else None)  # fmt: skip
    st = dataclasses.replace(policy.initial_state(0.0), phase=s.phase, phase_since=10.0, generation=1, suspension=s)
    dead = child(1, pid=API, alive=False, tree=(), exit_code=-9)
    w = worker(Op.RESUME if resuming else Op.SUSPEND, 10.01, outcome) if outcome is not None else None
    now = 10.0
    for _ in range(5):
        now += 0.5
        acts, st = policy.decide(snap(now, ch=dead, gpu=card(now, procs=()), metrics=IDLE, suspender=w), st, c, now, card=not parked)
        if any(isinstance(a, QueryEngineState) for a in acts):  # the driver, asked of a process that has gone, cannot say
            w = SuspendSample(op=Op.STATE, pid=CORE, started_at=now + 0.01, finished_at=now + 0.02, outcome=Outcome.FAILED,
                              error="no such process")  # fmt: skip
        if st.suspend_last is not None and st.suspend_last.request == request:
            break
    assert st.suspend_last is not None and st.suspend_last.request == request, f"{stage} left request {request} unanswered ({st.phase})"
    assert st.suspend_last.op == ("resume" if resuming else "suspend")
