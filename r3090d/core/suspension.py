"""Suspend and resume, pure: lend the GPU by checkpointing the engine, and take it back.

`r3090ctl suspend` on a READY engine walks these stages (each tick, `advance()`
reads the snapshot and says what the policy must do; the driver calls run in
the suspender's worker process, never in the loop):

    SUSPENDING  draining       /healthz 503 (any phase but ready), the load balancer's
                               grace, then until vLLM reports nothing running or waiting,
                               up to suspend.drain_timeout
                checkpointing  lock + checkpoint of the engine's one GPU process
    SUSPENDED   suspended      the engine's GPU memory is in its host memory, its process
                               waits; or ("cold") there is no engine process any more
    RESUMING    checking       a fresh NVML reading must show free memory for what the
                               engine held, plus a margin; else refused, still SUSPENDED
                restoring      restore + unlock (a cold suspension starts the engine instead)
                verifying      one /health 200 and one passing inference probe, then READY
    either      querying       the worker ended without a result: ask the driver's state

Requests still running at the drain deadline are frozen with the engine, not
aborted: the API server keeps their connections open, the engine continues them
after resume, nothing is lost (only a client's own timeout can end them). vLLM's
/abort_requests exists only in its dev mode and would lose the work.

Failures: a driver error the worker could undo (kept_running) sends the engine
through `verifying` back to READY with a one-line error; a worker without a
driver (unavailable) touched nothing and READY follows at once; any other
failure restarts the engine cold with reason suspend_failed or resume_failed.
An engine that dies while suspended (its RSS grew by what it held on the GPU, so
the OOM killer may pick it) leaves the suspension standing "cold": resume then
starts a new engine, after the same room check.

While in these phases no liveness rule judges the engine and no probe is sent
but the one `verifying` sends (the policy never calls rules.assess here).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from r3090d.config.schema import Config
from r3090d.core import canary
from r3090d.core.actions import (
    Action,
    QueryEngineState,
    RequestGpuSample,
    ResetProbes,
    ResumeEngine,
    SaveBaseline,
    SaveSuspension,
    SendCanary,
    SendInferenceProbe,
    SleepEngine,
    StopEngine,
    SuspendEngine,
    SuspendRecord,
    UnpauseEngine,
    WakeEngine,
)
from r3090d.core.room import others_on_card, unique_processes
from r3090d.core.rules import Condition
from r3090d.core.snapshot import CanaryAnswer, HealthStatus, Snapshot
from r3090d.core.suspend_types import Outcome, ProcessState, SleepOp, SleepSample, SuspendSample
from r3090d.core.vocabulary import SUSPEND_PHASES, CanaryPurpose, Phase, RestartReason, Severity
from r3090d.engineflags import flag_value
from r3090d.units import GIB, MIB

HOW_TO_RESUME = "r3090ctl resume"
RESUME_MARGIN_BYTES = 512 * MIB  # headroom for the restored process's context and allocator
# The flags that spread the engine over several GPUs (each with its short alias): their sizes multiply.
PARALLEL_FLAGS = (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"))


class Stage(enum.StrEnum):
    DRAINING = "draining"
    BASELINING = "baselining"  # drained to nothing: the canary's baseline is taken again before the lock
    CHECKPOINTING = "checkpointing"
    SUSPENDED = "suspended"
    CHECKING = "checking"
    RESTORING = "restoring"
    QUERYING = "querying"
    VERIFYING = "verifying"
    CANARY = "canary"  # resumed, /health and the probe passed: the canary must match the baseline taken before the lock
    # A park by vLLM's sleep mode ([[models]].park = "sleep") in place of the checkpoint and the restore:
    SLEEPING = "sleeping"  # /pause?mode=wait, /sleep?level=1, /is_sleeping true
    UNPAUSING = "unpausing"  # the sleep failed: /resume, then a drained stop to cold
    WAKING = "waking"  # /wake_up, /resume; then verifying and the canary, as after a restore


# A sleep's exchange, and a wake's, must answer within swap.sleep_timeout; past it (and this slack, for the
# worker's own deadline to fire first) the loop gives up on it.
SLEEP_SLACK_S = 5.0


# The engine cannot drain in these: its GPU work is locked (a stop must be fast).
# A paused or sleeping engine cannot drain either.
FROZEN_STAGES = (Stage.CHECKPOINTING, Stage.SUSPENDED, Stage.CHECKING, Stage.RESTORING, Stage.QUERYING, Stage.SLEEPING, Stage.UNPAUSING,
                 Stage.WAKING)  # fmt: skip
# /health (and, draining, /metrics) are read in these; in the others nothing asks the engine.
PROBED_STAGES = (Stage.DRAINING, Stage.BASELINING, Stage.VERIFYING, Stage.CANARY)


class Result(enum.StrEnum):
    """How an operator's suspend or resume ended; `r3090ctl suspend|resume --wait` reports it."""

    SUSPENDED = "suspended"
    RESUMED = "resumed"
    STARTED_COLD = "started_cold"  # resume of a suspension without an engine process: a new engine starts
    REFUSED = "refused"  # nothing was done
    UNAVAILABLE = "unavailable"  # this host or config cannot checkpoint: nothing was done
    KEPT_RUNNING = "kept_running"  # the driver failed and undid its step: the engine serves as before
    FAILED = "failed"  # the engine restarts cold


@dataclass(frozen=True)
class SuspendResult:
    request: int  # the number the control reply gave the operator
    op: str  # "suspend" | "resume"
    result: Result
    detail: str
    at: float  # monotonic
    by_sleep: bool = False  # the park or unpark was by vLLM's sleep mode: the fleet counts its failures
    lost: bool = False  # the engine died under the operation (by sleep: counted as a failed sleep or wake)


@dataclass(frozen=True)
class Suspension:
    """A suspension under way or standing; PolicyState.suspension is None outside SUSPEND_PHASES."""

    stage: Stage
    stage_since: float
    request: int  # the operator request the current stage answers
    resuming: bool = False  # the operation under way is a resume (its failures are resume_failed)
    target: int | None = None  # the engine's GPU process, checkpointed or to be
    bytes: int = 0  # GPU memory the target held: what resuming needs free again
    since: float | None = None  # monotonic: when the engine became suspended
    since_wall: float | None = None
    cold: bool = False  # no engine process behind the suspension: resume starts one
    op_sent_at: float | None = None  # when the worker's operation was asked for
    frozen_requests: int = 0  # requests left running at the drain deadline, frozen with the engine
    error: str = ""  # the last refusal or failure, one line
    baseline: CanaryAnswer | None = None  # the canary's known answer: a resume must give it back
    baseline_for: tuple = ()  # the canary's request_key the baseline answered: another question at resume drops it
    canary_retried: bool = False  # CANARY: the comparison was sent again after an inconclusive (or no) answer
    parked: bool = False  # swap mode: the arbiter parked it to bring another model in, not the operator's suspension
    by_sleep: bool = False  # parked by vLLM's sleep mode: the engine runs, its weights in pinned host memory
    residual: int = 0  # by sleep: the GPU memory the sleeping engine still holds (its CUDA context), read after the sleep
    residual_read: bool = False

    @property
    def phase(self) -> Phase:
        if self.stage in (Stage.DRAINING, Stage.BASELINING, Stage.CHECKPOINTING, Stage.SLEEPING, Stage.UNPAUSING):
            return Phase.SUSPENDING
        if self.stage is Stage.SUSPENDED:
            return Phase.SUSPENDED
        if self.stage is Stage.QUERYING:
            return Phase.RESUMING if self.resuming else Phase.SUSPENDING
        return Phase.RESUMING

    def record(self, engine_pid: int | None) -> SuspendRecord:
        return SuspendRecord(pid=self.target or 0, engine_pid=engine_pid, bytes=self.bytes, since=self.since_wall or 0.0, baseline=self.baseline,
                             baseline_for=self.baseline_for, parked=self.parked)  # fmt: skip


@dataclass(frozen=True)
class Refusal:
    text: str
    unavailable: bool = False  # suspend can never work with this host or config (r3090ctl exits 69)


@dataclass(frozen=True)
class Move:
    """What one tick of a suspension asks of the policy."""

    suspension: Suspension | None  # None: the suspension is over
    phase: Phase
    actions: tuple[Action, ...] = ()
    result: SuspendResult | None = None  # an operator request answered this tick
    fail: tuple[RestartReason, str] | None = None  # restart the engine cold, for this reason
    start_cold: bool = False  # start a new engine now (a cold suspension resumed)
    event: Condition | None = None
    compared: canary.Comparison | None = None  # the canary's comparison after a resume, for its counters
    stop_cold: str | None = None  # a failed sleep: stop the engine drained and leave it cold, for this reason


# ------------------------------------------------------------------ checks


def parallel_size(extra_args: list | tuple) -> int:
    """Tensor x pipeline parallel size from engine.extra_args: above 1 the engine has several GPU processes."""
    size = 1
    for flags in PARALLEL_FLAGS:
        raw = flag_value(extra_args, *flags)
        try:
            size *= int(raw) if raw is not None else 1
        except ValueError:
            pass  # vLLM refuses it anyway
    return size


def unavailable_here(cfg: Config) -> Refusal | None:
    """Why suspend can never work with this config, or None (also for preflight and config check)."""
    if not cfg.gpu.required:
        return Refusal(f"there is no GPU to lend: gpu.required is false in {cfg.source or 'the config'}", unavailable=True)
    size = parallel_size(cfg.engine.extra_args)
    if size > 1:
        return Refusal(f"the engine runs on {size} GPUs (tensor/pipeline parallelism in engine.extra_args): "
                       "a multi-GPU engine cannot be checkpointed", unavailable=True)  # fmt: skip
    return None


class _Holder(Protocol):
    pid: int
    used_bytes: int | None


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def can_resume(free_bytes: int | None, needed_bytes: int, margin: int = RESUME_MARGIN_BYTES,
               holders: Iterable[_Holder] = ()) -> tuple[bool, str]:  # fmt: skip
    """Whether the GPU can take the suspended engine back: free (from a fresh NVML sample) ≥ needed + margin.

    `holders`: the processes NVML lists on the GPU (GpuProcess works), named in the
    refusal so the operator sees who has the memory.
    """
    want = needed_bytes + margin
    if free_bytes is None:
        return False, f"free GPU memory is unknown (NVML did not answer); resuming needs {_gib(want)}"
    if free_bytes >= want:
        return True, f"{_gib(free_bytes)} free, {_gib(needed_bytes)} + {_gib(margin)} margin needed"
    held = sorted(holders, key=lambda h: h.used_bytes or 0, reverse=True)
    who = ", ".join(f"pid {h.pid} ({_gib(h.used_bytes)})" for h in held) if held else "no process NVML lists"
    return False, f"{_gib(free_bytes)} free, {_gib(needed_bytes)} + {_gib(margin)} margin needed; held by {who}"


def pick_target(gpu_processes: Iterable[_Holder], engine_pids: Iterable[int]) -> tuple[int | None, str]:
    """The one engine process to checkpoint: the engine's only process on the GPU.

    Several (tensor parallelism: NCCL and CUDA IPC) cannot be checkpointed: the
    driver answers NOT_SUPPORTED or hangs.
    """
    tree = set(engine_pids)
    on_gpu = sorted(p.pid for p in gpu_processes if p.pid in tree)
    if not on_gpu:
        return None, "no process of the engine holds GPU memory"
    if len(on_gpu) > 1:
        pids = ", ".join(map(str, on_gpu))
        return None, f"{len(on_gpu)} engine processes hold GPU memory (pids {pids}): a multi-GPU engine cannot be suspended"
    return on_gpu[0], ""


def target(snap: Snapshot) -> tuple[int | None, int, str]:
    """(pid, GPU bytes it holds, "") of the engine's one GPU process, or (None, 0, why not)."""
    g = snap.gpu
    if not g.usable:
        return None, 0, f"NVML gives no reading ({g.status.value}{': ' + g.detail if g.detail else ''}): cannot see which process holds the GPU"
    if g.processes is None:
        return None, 0, "NVML does not list the GPU's processes: cannot see which process holds the GPU"
    procs = unique_processes(g.processes + (g.graphics_processes or ()))
    pid, why = pick_target(procs, snap.child.tree_pids)
    if pid is None:
        return None, 0, why
    held = next(p.used_bytes for p in procs if p.pid == pid)
    # Without a per-process figure, all the card holds is what the room check must find again.
    return pid, held if held is not None else (g.memory_used or 0), ""


def suspend_refusal(cfg: Config, phase: Phase, snap: Snapshot) -> Refusal | None:
    """Why `r3090ctl suspend` is refused now, or None: answered at once, and checked again at the lock."""
    why = unavailable_here(cfg)
    if why is not None:
        return why
    if phase is Phase.SUSPENDED:
        return Refusal(f"the engine is already suspended ({HOW_TO_RESUME} brings it back)")
    if phase in SUSPEND_PHASES:
        return Refusal(f"the engine is {phase.value}: wait for it to finish")
    if phase is not Phase.READY:
        return Refusal(f"the engine is {phase.value}, not ready: nothing to suspend")
    pid, _, why = target(snap)
    return Refusal(why) if pid is None else None


def resume_refusal(phase: Phase, s: Suspension | None) -> Refusal | None:
    if phase is Phase.SUSPENDED and s is not None:
        return None
    if phase in SUSPEND_PHASES:
        return Refusal(f"the engine is {phase.value}: wait for it to finish")
    return Refusal(f"the engine is {phase.value}, not suspended: nothing to resume")


def _span(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def resume_room(s: Suspension, snap: Snapshot, cfg: Config) -> tuple[bool, str]:
    """can_resume() on this (fresh) reading; a refusal names who holds the memory, with process names."""
    g = snap.gpu
    margin = cfg.suspend.resume_margin_mib * MIB
    holders = others_on_card(g, snap.child.tree_pids)
    needed = max(0, s.bytes - s.residual) if s.by_sleep else s.bytes  # a sleeping engine holds its context still
    ok, reason = can_resume(g.memory_free, needed, margin, holders)
    if ok or g.memory_free is None:
        return ok, reason
    names = dict(snap.process_names)
    who = ", ".join(f"pid {h.pid} ({names.get(h.pid, '?')}, {_gib(h.used_bytes)})" for h in holders)
    who = who or "no process NVML lists (another container?)"
    return False, f"{_gib(g.memory_free)} free, {_gib(needed)} + {_gib(margin)} margin needed; held by {who}"


# ------------------------------------------------------------------ stages


def begin(snap: Snapshot, cfg: Config, now: float, request: int, baseline: CanaryAnswer | None = None, *, baseline_for: tuple = (),
          parked: bool = False, by_sleep: bool = False) -> Move:  # fmt: skip
    """READY and `r3090ctl suspend` accepted: start draining, or refuse if things changed since the reply.

    `by_sleep`: a park by vLLM's sleep mode, which needs no checkpoint driver nor one GPU process."""
    if by_sleep:
        pid, held, _ = target(snap)  # what it holds, where NVML says: its host cost once asleep
        return Move(Suspension(Stage.DRAINING, now, request, target=pid, bytes=held, baseline=baseline, baseline_for=baseline_for, parked=parked,
                               by_sleep=True), Phase.SUSPENDING)  # fmt: skip
    refusal = suspend_refusal(cfg, Phase.READY, snap)
    if refusal is not None:
        result = Result.UNAVAILABLE if refusal.unavailable else Result.REFUSED
        return Move(None, Phase.READY, result=SuspendResult(request, "suspend", result, refusal.text, now))
    pid, held, _ = target(snap)
    return Move(Suspension(Stage.DRAINING, now, request, target=pid, bytes=held, baseline=baseline, baseline_for=baseline_for, parked=parked),
                Phase.SUSPENDING)  # fmt: skip


def from_record(record: SuspendRecord, now: float, since: float) -> Suspension:
    """A daemon started with a suspension on record: no engine of its own, so a cold one."""
    return Suspension(Stage.SUSPENDED, now, 0, target=record.pid, bytes=record.bytes, since=since, since_wall=record.since, cold=True,
                      baseline=record.baseline, baseline_for=record.baseline_for, parked=record.parked)  # fmt: skip


def _stay(s: Suspension, actions: tuple[Action, ...] = ()) -> Move:
    return Move(s, s.phase, actions)


def _to(s: Suspension, stage: Stage, now: float, **changes) -> Suspension:
    return replace(s, stage=stage, stage_since=now, **changes)


def _finished(sample: SuspendSample | None, sent_at: float | None) -> SuspendSample | None:
    """The worker's result for the operation asked at `sent_at`, once it has one."""
    if sample is None or sent_at is None or sample.started_at is None or sample.started_at < sent_at or sample.in_flight:
        return None
    return sample


def _result(s: Suspension, result: Result, detail: str, now: float) -> SuspendResult:
    return SuspendResult(s.request, "resume" if s.resuming else "suspend", result, detail, now, by_sleep=s.by_sleep)


def _reason(s: Suspension) -> RestartReason:
    return RestartReason.RESUME_FAILED if s.resuming else RestartReason.SUSPEND_FAILED


def _fail(s: Suspension, detail: str, now: float) -> Move:
    what = "resume" if s.resuming else "suspend"
    return Move(None, s.phase, (SaveSuspension(None),), result=_result(s, Result.FAILED, f"{detail}; the engine restarts cold", now),
                fail=(_reason(s), f"{what} failed: {detail}"))  # fmt: skip


def _lost(s: Suspension, snap: Snapshot) -> bool:
    """The engine behind a suspension that is not already cold has gone."""
    child = snap.child
    return not s.cold and (not child.alive or (s.target is not None and s.target not in child.tree_pids))


def _gone_cold(s: Suspension, snap: Snapshot, now: float) -> Move:
    """The engine died while being suspended or while suspended: the suspension stands, without an engine."""
    child = snap.child
    code = f" with code {child.exit_code}" if child.exit_code is not None else ""
    if s.stage in (Stage.DRAINING, Stage.BASELINING):
        text = f"the engine exited{code} while draining for a suspend: the GPU is free; {HOW_TO_RESUME} starts it cold"
    else:
        text = f"the suspended engine exited{code} (OOM-killed? its host memory grew by {_gib(s.bytes)}); {HOW_TO_RESUME} starts it cold"
    since = s.since if s.since is not None else now
    # A request under way gets its answer: a suspend is done (the GPU is free), a resume is not.
    # Every stage of a request under way ends in its answer: one left unanswered would hold `suspend --wait`, and
    # swap mode's park or unpark, for ever.
    result = None
    if s.resuming:
        result = SuspendResult(s.request, "resume", Result.REFUSED, text, now, by_sleep=s.by_sleep, lost=True)
    elif s.stage is not Stage.SUSPENDED:  # draining, baselining, checkpointing, querying: the suspend under way
        result = SuspendResult(s.request, "suspend", Result.SUSPENDED, text, now, by_sleep=s.by_sleep, lost=True)
    s = _to(s, Stage.SUSPENDED, now, cold=True, since=since, since_wall=s.since_wall if s.since_wall is not None else snap.wall, error=text,
            resuming=False, op_sent_at=None)  # fmt: skip
    actions: list[Action] = [SaveSuspension(s.record(None))]
    if (child.alive or child.tree_pids) and not child.stopping:
        actions.append(StopEngine(drain=False, reason="suspended engine lost"))
    return Move(s, Phase.SUSPENDED, tuple(actions), result=result, event=Condition("suspended_engine_lost", True, Severity.WARNING, text, event=True))


def advance(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    """One tick of a suspension under way or standing; `grace` is the load balancer's (policy.lb_grace)."""
    handler = {
        Stage.DRAINING: _draining,
        Stage.BASELINING: _baselining,
        Stage.CHECKPOINTING: _checkpointing,
        Stage.SUSPENDED: _suspended,
        Stage.CHECKING: _checking,
        Stage.RESTORING: _restoring,
        Stage.QUERYING: _querying,
        Stage.VERIFYING: _verifying,
        Stage.CANARY: _canary,
        Stage.SLEEPING: _sleeping,
        Stage.UNPAUSING: _unpausing,
        Stage.WAKING: _waking,
    }[s.stage]
    return handler(s, snap, cfg, now, grace)


def _draining(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    if _lost(s, snap):
        return _gone_cold(s, snap, now)
    if now < s.stage_since + grace:
        return _stay(s)  # /healthz already says 503: the load balancer is taking the node out
    busy = snap.metrics.in_engine
    if busy != 0 and now < s.stage_since + grace + cfg.suspend.drain_timeout:
        return _stay(s)
    if busy == 0 and cfg.canary.enabled:
        # Nothing runs: the engine's known answer now is what a resume must give back.
        return _stay(_to(s, Stage.BASELINING, now, op_sent_at=now), (SendCanary(CanaryPurpose.BASELINE),))
    # Requests are frozen with the engine: the last baseline stands.
    return _lock(s, snap, cfg, now, busy if busy is not None else 0)


def _baselining(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    if _lost(s, snap):
        return _gone_cold(s, snap, now)
    done = canary.result(snap.canary, s.op_sent_at, cfg.canary, now)
    if done is None:
        return _stay(s)
    if done.answer is None:  # no answer: the last baseline stands
        return _lock(s, snap, cfg, now, snap.metrics.in_engine or 0)
    return _lock(replace(s, baseline=done.answer, baseline_for=canary.request_key(cfg.canary)), snap, cfg, now, snap.metrics.in_engine or 0, (SaveBaseline(done.answer),))


def _lock(s: Suspension, snap: Snapshot, cfg: Config, now: float, frozen: int, actions: tuple[Action, ...] = ()) -> Move:
    if s.by_sleep:
        pid, held, _ = target(snap)
        s = _to(s, Stage.SLEEPING, now, target=pid if pid is not None else s.target, bytes=held or s.bytes, op_sent_at=now, frozen_requests=0)
        return _stay(s, (*actions, SleepEngine(cfg.swap.sleep_timeout)))
    pid, held, why = target(snap)  # the tree or the card may have changed since the request
    if pid is None:
        return Move(None, Phase.READY, (*actions, ResetProbes()), result=_result(s, Result.REFUSED, why, now))
    s = _to(s, Stage.CHECKPOINTING, now, target=pid, bytes=held, op_sent_at=now, frozen_requests=frozen)
    return _stay(s, (*actions, SuspendEngine(pid, round(cfg.suspend.lock_timeout * 1000), frozen)))


def _checkpointing(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    done = _finished(snap.suspender, s.op_sent_at)
    if done is None:
        return _stay(s)  # the worker runs; the loop keeps ticking
    outcome, error = done.outcome, done.error or f"the worker reported {done.outcome}"
    if outcome is Outcome.SUSPENDED:
        if _lost(s, snap):
            return _gone_cold(replace(s, since=now, since_wall=snap.wall), snap, now)
        s = _to(s, Stage.SUSPENDED, now, since=now, since_wall=snap.wall, error="", op_sent_at=None)
        return Move(s, Phase.SUSPENDED, (SaveSuspension(s.record(snap.child.pid)),), result=_result(s, Result.SUSPENDED, _freed(s), now))
    return _after_error(s, done, snap, now, outcome, error)


def _freed(s: Suspension) -> str:
    frozen = f"; {s.frozen_requests} request(s) frozen with it, to finish after resume" if s.frozen_requests else ""
    return f"pid {s.target} suspended, {_gib(s.bytes)} of GPU memory freed{frozen}"


def _after_error(s: Suspension, done: SuspendSample, snap: Snapshot, now: float, outcome, error: str) -> Move:
    """A worker operation (suspend or resume) that did not do what was asked."""
    if outcome is Outcome.KEPT_RUNNING:
        s = _to(s, Stage.VERIFYING, now, error=error)
        what = "resume" if s.resuming else "suspend"
        result = None if s.resuming else _result(s, Result.KEPT_RUNNING, f"{what} failed, the engine kept running: {error}", now)
        return Move(s, Phase.RESUMING, (ResetProbes(),), result=result)
    if outcome in (Outcome.UNAVAILABLE, Outcome.REJECTED):
        result = Result.UNAVAILABLE if outcome is Outcome.UNAVAILABLE else Result.REFUSED
        if s.resuming:  # nothing was restored: still suspended
            s = _to(s, Stage.SUSPENDED, now, error=error, resuming=False, op_sent_at=None)
            return Move(s, Phase.SUSPENDED, (SaveSuspension(s.record(snap.child.pid)),), result=SuspendResult(s.request, "resume", result, error, now))
        return Move(None, Phase.READY, (ResetProbes(),), result=_result(s, result, f"suspend unavailable, nothing was done: {error}", now))
    if outcome is Outcome.FAILED:
        return _fail(s, error, now)
    # UNKNOWN (the worker ended without a result), or an answer that fits no operation: ask the driver.
    if s.target is None:
        return _fail(s, error, now)
    s = _to(s, Stage.QUERYING, now, error=error, op_sent_at=now)
    return _stay(s, (QueryEngineState(s.target),))


def _querying(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    done = _finished(snap.suspender, s.op_sent_at)
    if done is None:
        return _stay(s)
    state = done.state if done.outcome is Outcome.REPORTED else None
    if state is ProcessState.RUNNING and snap.child.alive:
        return _after_error(s, done, snap, now, Outcome.KEPT_RUNNING, s.error)
    if state is ProcessState.CHECKPOINTED:
        if _lost(s, snap):
            return _gone_cold(s, snap, now)
        if s.resuming:
            s = _to(s, Stage.SUSPENDED, now, resuming=False, op_sent_at=None)
            return Move(s, Phase.SUSPENDED, (SaveSuspension(s.record(snap.child.pid)),),
                        result=SuspendResult(s.request, "resume", Result.REFUSED, f"{s.error}; the engine is still suspended", now))  # fmt: skip
        s = _to(s, Stage.SUSPENDED, now, since=now, since_wall=snap.wall, op_sent_at=None)
        return Move(s, Phase.SUSPENDED, (SaveSuspension(s.record(snap.child.pid)),), result=_result(s, Result.SUSPENDED, _freed(s), now))
    said = f"the driver reports {state.name}" if state is not None else f"its state cannot be read ({done.error or done.outcome})"
    return _fail(s, f"{s.error}; {said}", now)


def _suspended(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    if _lost(s, snap):
        return _gone_cold(s, snap, now)
    child = snap.child
    actions: tuple[Action, ...] = ()
    if s.cold and (child.alive or child.tree_pids) and not child.stopping:
        actions = (StopEngine(drain=False, reason="suspended engine lost"),)  # what is left of it only holds memory
    if s.by_sleep and not s.residual_read:
        s = _residual(s, snap)
    if snap.resume_requested is None:
        return _stay(s, actions)
    s = _to(s, Stage.CHECKING, now, request=snap.resume_requested, resuming=True, error="")
    return _stay(s, (*actions, RequestGpuSample()))


LEFTOVERS_WAIT_S = 60.0  # a cold resume waits this long for what is left of the old engine to exit


def _checking(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    if _lost(s, snap):
        return _gone_cold(s, snap, now)  # answers this resume: the next one starts the engine cold
    g = snap.gpu
    fresh = g.usable and g.taken_at is not None and g.taken_at >= s.stage_since
    if not fresh:
        if now - s.stage_since <= cfg.watchdog.nvml_hung_after:
            return _stay(s)
        why = f"NVML gave no fresh reading within {cfg.watchdog.nvml_hung_after:.0f} s ({g.status.value}{': ' + g.detail if g.detail else ''})"
        return _refuse_resume(s, snap, now, why)
    ok, text = resume_room(s, snap, cfg)
    if not ok:
        return _refuse_resume(s, snap, now, text)
    if s.cold:
        child = snap.child
        if not child.tree_gone:  # what is left of the old engine holds the port and memory: it goes first
            if now - s.stage_since > LEFTOVERS_WAIT_S:
                return _refuse_resume(s, snap, now, f"what is left of the old engine (pids {', '.join(map(str, child.tree_pids))}) does not exit")
            stop = (StopEngine(drain=False, reason="suspended engine lost"),) if not child.stopping else ()
            return _stay(s, stop)
        return Move(None, Phase.STARTING, (SaveSuspension(None),), result=_result(s, Result.STARTED_COLD, f"no engine was left: starting one ({text})", now),
                    start_cold=True)  # fmt: skip
    if s.by_sleep:
        return _stay(_to(s, Stage.WAKING, now, op_sent_at=now), (WakeEngine(cfg.swap.sleep_timeout),))
    s = _to(s, Stage.RESTORING, now, op_sent_at=now)
    return _stay(s, (ResumeEngine(s.target),)) if s.target is not None else _fail(s, "no process on record to restore", now)


def _refuse_resume(s: Suspension, snap: Snapshot, now: float, why: str) -> Move:
    s = _to(s, Stage.SUSPENDED, now, resuming=False, error=f"resume refused: {why}")
    return Move(s, Phase.SUSPENDED, result=SuspendResult(s.request, "resume", Result.REFUSED, why, now))


def _restoring(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    done = _finished(snap.suspender, s.op_sent_at)
    if done is None:
        return _stay(s)
    if done.outcome is Outcome.RESUMED:
        return Move(_to(s, Stage.VERIFYING, now, error=""), Phase.RESUMING, (ResetProbes(),))
    return _after_error(s, done, snap, now, done.outcome, done.error or f"the worker reported {done.outcome}")


def _verifying(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    """One /health 200, then one inference probe that passes: then READY (and /healthz 200)."""
    what = "resume" if s.resuming else "the failed suspend"
    if not snap.child.alive:
        return _fail(s, f"the engine exited after {what}", now)
    if now - s.stage_since > cfg.suspend.verify_timeout:
        return _fail(s, f"no /health 200 and passing inference probe within {cfg.suspend.verify_timeout:.0f} s after {what}", now)
    if snap.health.status is not HealthStatus.OK:
        return _stay(s)
    inf = snap.inference
    sent = inf.sent_at is not None and inf.sent_at >= s.stage_since
    done = sent and inf.finished_at is not None and inf.finished_at >= inf.sent_at
    if not sent:
        return _stay(s, (SendInferenceProbe(),))
    if not done:
        return _stay(s)
    if inf.ok:
        if s.resuming and _comparable(s, cfg):
            return _stay(_to(s, Stage.CANARY, now, op_sent_at=now, canary_retried=False), (SendCanary(CanaryPurpose.CHECK),))
        return _ready(s, now)
    if inf.consecutive_failures >= cfg.watchdog.probe_failures:
        return _fail(s, f"{inf.consecutive_failures} inference probes failed after {what} ({inf.detail})", now)
    return _stay(s, (SendInferenceProbe(),))


def _ready(s: Suspension, now: float, compared: canary.Comparison | None = None, note: str = "") -> Move:
    after = f" (after: {s.error})" if s.error else ""  # a restore error the worker undid
    text = f"pid {s.target} resumed, {_gib(s.bytes)} back on the GPU{after}{note}"
    result = _result(s, Result.RESUMED, text, now) if s.resuming else None
    return Move(None, Phase.READY, (SaveSuspension(None),), result=result, compared=compared)


def held_baseline(s: Suspension, cfg: Config) -> CanaryAnswer | None:
    """The baseline the suspension carried, if it answered the canary's current question (a reload may have changed it)."""
    return s.baseline if s.baseline_for == canary.request_key(cfg.canary) else None


def _comparable(s: Suspension, cfg: Config) -> bool:
    cc, baseline = cfg.canary, held_baseline(s, cfg)
    return cc.enabled and baseline is not None and canary.confident_prefix(baseline, cc.margin_threshold) >= cc.min_prefix


def _canary(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    """The resumed engine must give back its known answer before it serves (/healthz 200)."""
    if not snap.child.alive:
        return _fail(s, "the engine exited after resume", now)
    done = canary.result(snap.canary, s.op_sent_at, cfg.canary, now)
    if done is None:
        return _stay(s)
    c = canary.compare(s.baseline, done.answer, cfg.canary) if done.answer is not None else None
    again = c is None or c.verdict is canary.Verdict.INCONCLUSIVE
    if again and not s.canary_retried:
        return _stay(_to(s, Stage.CANARY, now, op_sent_at=now, canary_retried=True), (SendCanary(CanaryPurpose.CHECK),))
    if c is None:
        # The probe passed: the engine answers. The periodic canary checks it later.
        return _ready(s, now, note=f"; the canary had no answer ({done.error}), the periodic check follows")
    if c.verdict is not canary.Verdict.MISMATCH:
        return _ready(s, now, c, "; the canary matched" if c.verdict is canary.Verdict.MATCH else "; the canary was inconclusive twice")
    text = c.text(cfg.canary.prompt)
    event = Condition("wrong_output", True, Severity.CRITICAL, f"the resumed engine serves wrong output: {text}; it restarts cold", event=True)
    return Move(None, s.phase, (SaveSuspension(None),), result=_result(s, Result.FAILED, f"wrong output after resume: {text}; the engine restarts cold", now),
                fail=(RestartReason.WRONG_OUTPUT, f"after resume: {text}"), event=event, compared=c)  # fmt: skip


# ------------------------------------------------------------------ park by sleep


def _slept(sample: SleepSample | None, op: SleepOp, sent_at: float | None) -> SleepSample | None:
    """The sleep worker's result for the exchange asked at `sent_at`, once it has one."""
    if sample is None or sent_at is None or sample.op is not op or sample.started_at is None or sample.started_at < sent_at or sample.in_flight:
        return None
    return sample


def _overdue(s: Suspension, cfg: Config, now: float) -> bool:
    return now - s.stage_since > cfg.swap.sleep_timeout + SLEEP_SLACK_S


@dataclass(frozen=True)
class _Exchange:
    """How a sleep worker's exchange stands: `wait` (no answer yet, not overdue), else done, ok or why not."""

    wait: bool
    ok: bool = False
    why: str = ""


def _exchange(s: Suspension, snap: Snapshot, cfg: Config, now: float, op: SleepOp) -> _Exchange:
    done = _slept(snap.sleeper, op, s.op_sent_at)
    if done is None and not _overdue(s, cfg, now):
        return _Exchange(wait=True)
    if done is not None and done.ok:
        return _Exchange(wait=False, ok=True)
    why = done.error if done is not None else f"no answer within {cfg.swap.sleep_timeout:.0f} s (swap.sleep_timeout)"
    return _Exchange(wait=False, why=why)


def _residual(s: Suspension, snap: Snapshot) -> Suspension:
    """What the sleeping engine still holds on the card, from the first NVML reading taken after the sleep."""
    g = snap.gpu
    if not (g.usable and g.taken_at is not None and g.taken_at >= s.stage_since):
        return s
    pid, held, _ = target(snap)
    return replace(s, residual=held if pid is not None else 0, residual_read=True)


def _sleeping(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    if _lost(s, snap):
        return _gone_cold(s, snap, now)
    x = _exchange(s, snap, cfg, now, SleepOp.SLEEP)
    if x.wait:
        return _stay(s)
    if x.ok:
        s = _to(s, Stage.SUSPENDED, now, since=now, since_wall=snap.wall, error="", op_sent_at=None)
        return Move(s, Phase.SUSPENDED, (SaveSuspension(s.record(snap.child.pid)), RequestGpuSample()),
                    result=_result(s, Result.SUSPENDED, f"asleep (level 1), {_gib(s.bytes)} of GPU memory freed", now))  # fmt: skip
    # The engine is paused (maybe asleep): it gets its scheduler back before the drained stop, so what it holds finishes.
    return _stay(_to(s, Stage.UNPAUSING, now, op_sent_at=now, error=f"sleep failed: {x.why}"), (UnpauseEngine(cfg.swap.sleep_timeout),))


def _unpausing(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    if _lost(s, snap):
        return _gone_cold(s, snap, now)
    x = _exchange(s, snap, cfg, now, SleepOp.UNPAUSE)
    if x.wait:
        return _stay(s)
    after = "" if x.ok else f"; its /resume failed too ({x.why})"
    text = f"{s.error}{after}; the engine is stopped drained, to cold"
    event = Condition("sleep_failed", True, Severity.WARNING, text, event=True)
    return Move(None, Phase.DRAINING, result=_result(s, Result.FAILED, text, now), stop_cold=f"park by sleep failed: {s.error}", event=event)


def _waking(s: Suspension, snap: Snapshot, cfg: Config, now: float, grace: float) -> Move:
    if _lost(s, snap):
        return _gone_cold(s, snap, now)
    x = _exchange(s, snap, cfg, now, SleepOp.WAKE)
    if x.wait:
        return _stay(s)
    if x.ok:
        return Move(_to(s, Stage.VERIFYING, now, error=""), Phase.RESUMING, (ResetProbes(),))
    return _fail(s, f"wake failed: {x.why}", now)


# ------------------------------------------------------------------ alerts


def conditions(s: Suspension | None, phase: Phase, snap: Snapshot, cfg: Config, now: float) -> list[Condition]:
    """suspended_long: a reminder after suspend.remind_after; suspend_stuck: a driver call past its deadline."""
    # Standing while suspended and while a resume checks for room (a refused one changes nothing);
    # kept through a daemon shutdown, which does not end the suspension either.
    # A parked engine (swap mode) is the arbiter's choice, not a card lent and forgotten: no reminder.
    since = s.since if s is not None and s.stage in (Stage.SUSPENDED, Stage.CHECKING) and not s.parked else None
    long = since is not None and now - since >= cfg.suspend.remind_after
    held = "no engine process (it starts cold)" if s is not None and s.cold else f"the engine holds {_gib(s.bytes if s else 0)} of host memory"
    out = [Condition(
        "suspended_long",
        long,
        Severity.WARNING,
        f"the engine has been suspended for {_span(now - (since or now))}, {held}; {HOW_TO_RESUME} brings it back" if long
        else "the engine is no longer suspended, or not for long",
        immediate=True,
    )]  # fmt: skip
    w = snap.suspender
    stuck = w is not None and w.in_flight and w.overdue
    took = now - w.started_at if stuck and w.started_at is not None else 0.0
    out.append(Condition(
        "suspend_stuck",
        stuck,
        Severity.CRITICAL,
        f"the GPU driver's {w.op} of pid {w.pid} has not returned for {took:.0f} s (step {w.step}): a driver call may be stuck" if stuck
        else "no suspend or resume is stuck in the GPU driver",
        immediate=True,
    ))  # fmt: skip
    return out
