"""A park by vLLM's sleep mode ([[models]].park = "sleep"), tick by tick: the sleep step in place of the checkpoint,
the wake step in place of the restore, then the probe and the canary as after a restore; and every fall-back."""

from __future__ import annotations

import dataclasses

import pytest

from r3090d import config
from r3090d.core import policy
from r3090d.core.actions import (
    RecordRestart,
    RequestGpuSample,
    ResetProbes,
    ResumeEngine,
    SaveSuspension,
    SendCanary,
    SendInferenceProbe,
    SleepEngine,
    StartEngine,
    StopEngine,
    SuspendEngine,
    UnpauseEngine,
    WakeEngine,
)
from r3090d.core.snapshot import (
    CanaryAnswer,
    CanarySample,
    ChildSample,
    GpuProcess,
    GpuSample,
    GpuStatus,
    InferenceProbeSample,
    MetricsSample,
)
from r3090d.core.suspend_types import SleepOp, SleepSample
from r3090d.core.suspension import SLEEP_SLACK_S, Result, Stage
from r3090d.core.vocabulary import CanaryPurpose, Phase, RestartReason
from r3090d.units import GIB, MIB
from tests.configs import bare_config
from tests.snapshots import OK, SKIPPED, child, snap

API, CORE = 100, 101
TREE = (API, CORE)
HELD = 15 * GIB
RESIDUAL = 1200 * MIB  # what a sleeping engine keeps on the card
CARD_BYTES = 24 * GIB
IDLE = MetricsSample(
    running=0, waiting=0, generation_tokens_total=100.0, prompt_tokens_total=10.0, kv_usage=0.0
)
BASELINE = CanaryAnswer(token_ids=(1, 2, 3, 4, 5, 6), margins=(5.0,) * 6, runner_up=(9,) * 6, text="a b c")
CORRUPTED = CanaryAnswer(token_ids=(7, 7, 7, 7, 7, 7), margins=(5.0,) * 6, runner_up=(9,) * 6, text="x x x")


def cfg(**canary) -> config.Config:
    c = bare_config(
        gpu={"required": True},
        canary={"enabled": True, **canary},
        daemon={"exporter_enabled": False},
        alerts={"min_interval": 0.0, "hysteresis_polls": 1},
        watchdog={"gpu_memory_alert_mib": 20000},
        suspend={"drain_timeout": 2.0, "remind_after": 60.0, "verify_timeout": 20.0},
    )
    return dataclasses.replace(
        c, swap=dataclasses.replace(c.swap, sleep_timeout=10.0), park_mode=config.schema.ParkMode.SLEEP
    )


def card(now, procs=((CORE, HELD),)) -> GpuSample:
    used = sum(b for _, b in procs)
    return GpuSample(GpuStatus.OK, taken_at=now, age_s=0.0, utilization_gpu=0, memory_total=CARD_BYTES, memory_used=used,
                     memory_free=CARD_BYTES - used, processes=tuple(GpuProcess(p, b) for p, b in procs), graphics_processes=())  # fmt: skip


def done(op: SleepOp, at: float, ok=True, error="") -> SleepSample:
    return SleepSample(op=op, started_at=at + 0.01, finished_at=at + 0.2, ok=ok, error=error)


class Run:
    """One swap-mode engine with park = "sleep", READY with its canary baseline, driven tick by tick."""

    def __init__(self, c=None):
        self.c = c or cfg()
        self.now = 0.0
        self.engine = child(1, pid=API, tree=TREE)
        self.gpu = ((CORE, HELD),)
        st = policy.initial_state(0.0, cold=True)
        self.st = dataclasses.replace(st, phase=Phase.READY, phase_since=0.0, generation=1, ready_since=0.0,
                                      canary=dataclasses.replace(st.canary, baseline=BASELINE))  # fmt: skip
        self.acts: list = []

    def tick(self, dt=0.5, **kw):
        self.now += dt
        kw.setdefault("ch", self.engine)
        kw.setdefault("health", OK if self.engine.alive else SKIPPED)
        kw.setdefault("metrics", IDLE)
        kw.setdefault("gpu", card(self.now, self.gpu))
        self.acts, self.st = policy.decide(
            snap(self.now, wall=1000.0 + self.now, **kw),
            self.st,
            self.c,
            self.now,
            card=False,
            arbitrated=True,
        )
        return self.acts

    def of(self, kind):
        return [a for a in self.acts if isinstance(a, kind)]

    def to_sleeping(self) -> float:
        """READY -> the park by sleep: drained, the canary's baseline taken again, then the sleep asked."""
        self.tick(suspend_requested=1, park=True, park_by_sleep=True)
        assert self.st.phase is Phase.SUSPENDING and self.st.suspension.by_sleep
        while not self.of(SendCanary):
            self.tick()
        sent = self.now
        self.tick(canary=CanarySample(sent_at=sent, finished_at=sent + 0.1, answer=BASELINE))
        assert self.st.suspension.stage is Stage.SLEEPING
        assert self.of(SleepEngine) == [SleepEngine(10.0)] and not self.of(SuspendEngine)
        return self.now

    def sleep(self) -> None:
        sent = self.to_sleeping()
        self.gpu = ((CORE, RESIDUAL),)
        self.tick(sleeper=done(SleepOp.SLEEP, sent))
        assert self.st.phase is Phase.SUSPENDED and self.st.suspension.by_sleep

    def to_waking(self, request=2) -> float:
        self.tick(resume_requested=request)
        assert self.st.suspension.stage is Stage.CHECKING and self.of(RequestGpuSample)
        self.tick()  # a fresh reading: the room is there
        assert self.st.suspension.stage is Stage.WAKING
        assert self.of(WakeEngine) == [WakeEngine(10.0)] and not self.of(ResumeEngine)
        return self.now

    def verify(self) -> float:
        """Woken: /health, one probe, then the canary is sent; returns when it was."""
        assert self.st.suspension.stage is Stage.VERIFYING and self.of(ResetProbes)
        self.tick()
        assert self.of(SendInferenceProbe)
        probe_at = self.now
        self.tick(inference=InferenceProbeSample(sent_at=probe_at, finished_at=probe_at + 0.1, ok=True))
        assert self.st.suspension.stage is Stage.CANARY and self.of(SendCanary) == [
            SendCanary(CanaryPurpose.CHECK)
        ]
        return self.now


def test_a_park_by_sleep_sleeps_instead_of_checkpointing_and_keeps_the_engine_running():
    r = Run()
    sent = r.to_sleeping()
    r.tick()  # the worker runs: nothing else is asked
    assert r.st.suspension.stage is Stage.SLEEPING and r.acts == []
    r.gpu = ((CORE, RESIDUAL),)
    r.tick(sleeper=done(SleepOp.SLEEP, sent))
    assert r.st.phase is Phase.SUSPENDED
    s = r.st.suspension
    assert s.parked and s.by_sleep and s.bytes == HELD and not s.cold
    assert r.of(RequestGpuSample) and len(r.of(SaveSuspension)) == 1 and not r.of(StopEngine)
    assert (r.st.suspend_last.result, r.st.suspend_last.by_sleep) == (Result.SUSPENDED, True)
    r.tick()  # the reading after the sleep: what it still holds on the card
    assert r.st.suspension.residual == RESIDUAL and r.st.suspension.residual_read
    for _ in range(10):  # asleep: alive, never stopped, never probed
        r.tick(dt=5.0)
        assert r.st.phase is Phase.SUSPENDED and not r.of(StopEngine) and not r.of(SendInferenceProbe)


def test_a_wake_is_verified_and_the_canary_must_match_before_ready():
    r = Run()
    r.sleep()
    r.tick()
    sent = r.to_waking()
    r.gpu = ((CORE, HELD),)
    r.tick(sleeper=done(SleepOp.WAKE, sent))
    canary_at = r.verify()
    r.tick(canary=CanarySample(sent_at=canary_at, finished_at=canary_at + 0.1, answer=BASELINE))
    assert r.st.phase is Phase.READY and r.st.suspension is None
    assert (r.st.suspend_last.op, r.st.suspend_last.result, r.st.suspend_last.by_sleep) == (
        "resume",
        Result.RESUMED,
        True,
    )
    assert "canary matched" in r.st.suspend_last.detail and not r.of(StopEngine)


def test_the_wake_needs_room_only_for_what_the_sleep_gave_up():
    r = Run()
    r.sleep()
    r.tick()
    r.tick(resume_requested=2)
    # 14.5 GiB free: the sleeping engine's 15 GiB less its 1.2 GiB residual, plus the 0.5 GiB margin, fit; 15 GiB would not.
    other = CARD_BYTES - RESIDUAL - 14 * GIB - 512 * MIB
    r.tick(gpu=card(r.now, ((CORE, RESIDUAL), (4242, other))))
    assert r.st.suspension.stage is Stage.WAKING


def test_a_wrong_answer_after_a_wake_restarts_the_engine_cold():
    r = Run()
    r.sleep()
    sent = r.to_waking()
    r.tick(sleeper=done(SleepOp.WAKE, sent))
    canary_at = r.verify()
    r.tick(canary=CanarySample(sent_at=canary_at, finished_at=canary_at + 0.1, answer=CORRUPTED))
    assert (r.st.suspend_last.result, r.st.suspend_last.by_sleep) == (Result.FAILED, True)
    assert [a.reason for a in r.of(RecordRestart)] == [RestartReason.WRONG_OUTPUT]
    assert r.of(StopEngine) and not r.of(StopEngine)[0].drain and r.st.suspension is None


@pytest.mark.parametrize("answer", ["error", "overdue"])
def test_a_failed_wake_restarts_the_engine_cold(answer):
    r = Run()
    r.sleep()
    sent = r.to_waking()
    if answer == "error":
        r.tick(sleeper=done(SleepOp.WAKE, sent, ok=False, error="POST /wake_up: HTTP 500"))
    else:
        r.tick(sleeper=SleepSample(op=SleepOp.WAKE, in_flight=True, started_at=sent + 0.01))
        assert r.st.suspension.stage is Stage.WAKING
        r.tick(
            dt=10.0 + SLEEP_SLACK_S,
            sleeper=SleepSample(op=SleepOp.WAKE, in_flight=True, started_at=sent + 0.01),
        )
    last = r.st.suspend_last
    assert (last.op, last.result, last.by_sleep) == ("resume", Result.FAILED, True)
    assert ("HTTP 500" if answer == "error" else "sleep_timeout") in last.detail
    assert [a.reason for a in r.of(RecordRestart)] == [RestartReason.RESUME_FAILED]


@pytest.mark.parametrize("answer", ["error", "overdue"])
def test_a_failed_sleep_resumes_the_engine_then_stops_it_drained_to_cold(answer):
    r = Run()
    sent = r.to_sleeping()
    if answer == "error":
        r.tick(sleeper=done(SleepOp.SLEEP, sent, ok=False, error="POST /sleep?level=1: HTTP 500"))
    else:
        r.tick(
            dt=10.0 + SLEEP_SLACK_S + 0.5,
            sleeper=SleepSample(op=SleepOp.SLEEP, in_flight=True, started_at=sent + 0.01),
        )
    # Paused (maybe asleep): its scheduler back first, so that what it holds finishes in the drained stop.
    assert r.st.suspension.stage is Stage.UNPAUSING and r.of(UnpauseEngine) == [UnpauseEngine(10.0)]
    assert not r.of(StopEngine) and r.st.suspend_last is None  # answered once the engine is on its way out
    unpause_at = r.now
    r.tick(sleeper=done(SleepOp.UNPAUSE, unpause_at))
    assert r.st.phase is Phase.DRAINING and r.st.cold_after and r.st.suspension is None
    assert [a.drain for a in r.of(StopEngine)] == [True] and not r.of(RecordRestart)
    last = r.st.suspend_last
    assert (last.request, last.op, last.result, last.by_sleep) == (1, "suspend", Result.FAILED, True)
    assert "sleep failed" in last.detail and "drained" in last.detail
    r.engine = ChildSample(pid=API, alive=False, exit_code=0, tree_pids=(), generation=1, stop_requested=True)
    r.gpu = ()
    r.tick(health=SKIPPED)
    assert r.st.phase is Phase.COLD and not r.of(StartEngine)


def test_a_failed_sleep_whose_resume_hangs_too_is_stopped_after_the_deadline():
    r = Run()
    sent = r.to_sleeping()
    r.tick(sleeper=done(SleepOp.SLEEP, sent, ok=False, error="GET /is_sleeping answered false"))
    assert r.of(UnpauseEngine)
    r.tick(sleeper=SleepSample(op=SleepOp.UNPAUSE, in_flight=True, started_at=r.now))
    assert r.st.suspension.stage is Stage.UNPAUSING
    r.tick(dt=10.0 + SLEEP_SLACK_S)
    assert r.st.phase is Phase.DRAINING and [a.drain for a in r.of(StopEngine)] == [True]
    assert "its /resume failed too" in r.st.suspend_last.detail


@pytest.mark.parametrize("stage", [Stage.SLEEPING, Stage.SUSPENDED, Stage.WAKING])
def test_an_engine_that_dies_asleep_leaves_a_cold_suspension(stage):
    r = Run()
    if stage is Stage.SLEEPING:
        r.to_sleeping()
    else:
        r.sleep()
        if stage is Stage.WAKING:
            r.to_waking()
    r.engine = ChildSample(pid=API, alive=False, exit_code=-9, tree_pids=(), generation=1)
    r.tick(health=SKIPPED)
    assert r.st.phase is Phase.SUSPENDED and r.st.suspension.cold
    if stage is Stage.SUSPENDED:
        assert (
            r.st.suspend_last.request == 1 and not r.st.suspend_last.lost
        )  # nothing was under way: the sleep's answer stands
    else:  # the operation under way is answered, as lost under a sleep or a wake: the fleet counts it
        assert r.st.suspend_last.lost and r.st.suspend_last.by_sleep


def test_without_park_by_sleep_a_park_checkpoints_as_before():
    r = Run()
    r.tick(suspend_requested=1, park=True)
    assert not r.st.suspension.by_sleep
    while r.st.suspension.stage is not Stage.CHECKPOINTING:
        r.tick(canary=CanarySample(sent_at=r.now, finished_at=r.now, answer=BASELINE))
    assert r.of(SuspendEngine) and not r.of(SleepEngine)
