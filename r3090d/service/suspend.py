"""Suspend and resume, the daemon's side: the worker, the record that outlives the daemon, the state section's facts.

decide() (r3090d.core.suspension) says what to do; this module does it, off the
loop: each driver operation runs in the engine's launcher (its ancestor), and the loop
reads its progress as a frozen SuspendSample every tick, so it keeps writing
state and feeding systemd's watchdog however long a checkpoint takes.

The suspension is kept in state_dir/suspended.json (SUSPENDED_FILE) from the
checkpoint until the engine serves again. A daemon that starts and finds it
does not start the engine (nor run preflight, which would find the GPU lent):
the engine stays down until `r3090ctl resume`, which starts it cold. Under
systemd a daemon restart takes the engine with it (KillMode=mixed); elsewhere an
engine the previous daemon left behind is killed here, since nothing can adopt it
and it holds the port and the host memory its GPU bytes moved into.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from r3090d import procstat
from r3090d.atomicfile import write_json_atomic
from r3090d.config import Config
from r3090d.core import policy
from r3090d.core.actions import (
    QueryEngineState,
    RequestGpuSample,
    ResetProbes,
    ResumeEngine,
    SaveSuspension,
    SleepEngine,
    SuspendEngine,
    SuspendRecord,
    UnpauseEngine,
    WakeEngine,
)
from r3090d.core.policy import PolicyState
from r3090d.core.snapshot import CanaryAnswer, ChildSample, GpuSample, Snapshot
from r3090d.core.suspend_types import Op, SleepOp, SleepSample, SuspendSample
from r3090d.core.suspension import HOW_TO_RESUME, Result, Stage, SuspendResult
from r3090d.core.vocabulary import SUSPEND_PHASES
from r3090d.effectors.launcher import LauncherChannel
from r3090d.effectors.sleeper import Sleeper
from r3090d.effectors.suspender import Suspender
from r3090d.effectors.suspender_worker import Command
from r3090d.service.baselines import answer_from_json, answer_to_json
from r3090d.service.state import read_json
from r3090d.service.statedoc import STANDING_STAGES, LastRequest, SuspendInfo, WorkerInfo, WorkerStep

log = logging.getLogger("r3090d")

SUSPENDED_FILE = "suspended.json"
RECORD_FORMAT = 1


def _baseline(raw) -> CanaryAnswer | None:
    """The canary's baseline kept with the suspension; one that does not read is dropped (the resume then skips the canary)."""
    try:
        return answer_from_json(raw) if raw is not None else None
    except ValueError:
        log.warning("the suspension's canary baseline is unreadable: the resume is not compared")
        return None


def _baseline_for(raw) -> tuple:
    """The canary question the kept baseline answered; an older record without it has none (the resume takes a new baseline)."""
    return tuple(raw) if isinstance(raw, list) else ()


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, its identity."""
    st = procstat.read(pid)
    return st.start_ticks if st is not None else None


@dataclass
class SuspendService:
    cfg: Config
    state_dir: Path
    wake: threading.Event
    launcher: Callable[[], LauncherChannel | None]  # the running engine's launcher, which makes the driver calls
    suspender: Suspender = field(init=False)
    sleeper: Sleeper = field(init=False)  # a park by vLLM's sleep mode (swap mode, [[models]].park = "sleep")
    _queued: Command | None = field(default=None, init=False)
    _logged_stage: Stage | None = field(default=None, init=False)
    _logged_last: SuspendResult | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.suspender = Suspender(deadline_s=self.cfg.suspend.operation_timeout, wake=self.wake, launcher=self.launcher)
        self.sleeper = Sleeper(lambda: self.cfg.engine_url, self.cfg.api_key, self.wake, uds=lambda: self.cfg.engine.uds or "")

    @property
    def path(self) -> Path:
        return self.state_dir / SUSPENDED_FILE

    # ------------------------------------------------------------- the worker

    def sample(self) -> SuspendSample:
        """The worker's progress; first starts a queued operation if the worker is free again."""
        if self._queued is not None and self.suspender.start(self._queued):
            self._queued = None
        return self.suspender.sample()

    def execute(self, action, child: ChildSample, sampler) -> None:
        """One of decide()'s suspend actions; `sampler` (service.sampling.Sampler) holds the prober and the NVML monitor."""
        if isinstance(action, ResetProbes):
            sampler.prober.reset()
        elif isinstance(action, RequestGpuSample):
            if sampler.gpu_monitor is not None:
                sampler.gpu_monitor.request()
        elif isinstance(action, SuspendEngine):
            frozen = f"; {action.frozen_requests} request(s) still running are frozen with it and finish after resume" if action.frozen_requests else ""
            log.info("suspending the engine: lock and checkpoint of pid %d%s", action.pid, frozen)
            self._start(Command(Op.SUSPEND, action.pid, action.lock_timeout_ms))
        elif isinstance(action, ResumeEngine):
            log.info("resuming the engine: restore and unlock of pid %d", action.pid)
            self._start(Command(Op.RESUME, action.pid))
        elif isinstance(action, QueryEngineState):
            log.warning("the suspend worker ended without a result: asking the driver for pid %d's state", action.pid)
            self._start(Command(Op.STATE, action.pid))
        elif isinstance(action, SaveSuspension):
            self.save(action.record, child)
        elif isinstance(action, SleepEngine | WakeEngine | UnpauseEngine):
            self._sleep_op(action)

    def sleep_sample(self) -> SleepSample:
        return self.sleeper.sample()

    def _sleep_op(self, action: SleepEngine | WakeEngine | UnpauseEngine) -> None:
        op = {SleepEngine: SleepOp.SLEEP, WakeEngine: SleepOp.WAKE, UnpauseEngine: SleepOp.UNPAUSE}[type(action)]
        words = {SleepOp.SLEEP: "parking the engine by sleep: pause (waiting for what runs), sleep level 1",
                 SleepOp.WAKE: "waking the sleeping engine: wake_up, resume",
                 SleepOp.UNPAUSE: "the sleep failed: resuming the paused engine before its drained stop"}  # fmt: skip
        log.log(logging.WARNING if op is SleepOp.UNPAUSE else logging.INFO, "%s", words[op])
        if not self.sleeper.start(op, action.timeout_s):
            log.warning("the sleep worker is busy with an earlier exchange: %s is not sent (its deadline answers for it)", op.value)

    def _start(self, command: Command) -> None:
        if not self.suspender.start(command):
            # One operation at a time: a late one still runs; this one starts once it ends.
            log.warning("the suspend worker is busy with an earlier operation: %s of pid %d waits for it", command.op, command.pid)
            self._queued = command

    # ------------------------------------------------------------- the record

    def save(self, record: SuspendRecord | None, child: ChildSample) -> None:
        if record is None:
            try:
                self.path.unlink()
                log.info("suspension over: %s removed", self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.error("cannot remove %s: %s (fix: remove it by hand, or the next daemon keeps the engine down)", self.path, exc.strerror)
            return
        engine_pid = record.engine_pid
        data = {"format": RECORD_FORMAT, "pid": record.pid, "engine_pid": engine_pid, "bytes": record.bytes, "since": record.since,
                "engine_started": _start_ticks(engine_pid) if engine_pid else None,
                "baseline": answer_to_json(record.baseline) if record.baseline is not None else None, "baseline_for": list(record.baseline_for),
                "parked": record.parked}  # fmt: skip
        try:
            write_json_atomic(self.path, data)
        except OSError as exc:
            log.error("cannot write %s: %s: a daemon restart would not know the engine is suspended", self.path, exc.strerror or exc)

    def load(self) -> SuspendRecord | None:
        """The suspension a previous daemon left, or None. An engine it left running is killed (see the module doc)."""
        if not self.path.exists():
            return None
        raw = read_json(self.path)
        try:
            record = SuspendRecord(pid=int(raw["pid"]), engine_pid=raw.get("engine_pid"), bytes=int(raw["bytes"]), since=float(raw["since"]),
                                   baseline=_baseline(raw.get("baseline")), baseline_for=_baseline_for(raw.get("baseline_for")),
                                   parked=raw.get("parked") is True)  # fmt: skip
            if record.bytes < 0 or record.pid < 0 or not (record.engine_pid is None or isinstance(record.engine_pid, int)):
                raise ValueError("out of range")
        except (TypeError, KeyError, ValueError):
            # Lending the GPU was asked for; keep to that. Resuming then checks only the margin.
            log.error("%s is unreadable: the engine stays down as suspended (fix: r3090ctl resume, or remove the file)", self.path)
            return SuspendRecord(pid=0, engine_pid=None, bytes=0, since=time.time())
        self._kill_left_behind(record, raw.get("engine_started"))
        return record

    def boot_state(self, offset: float) -> PolicyState | None:
        """The policy's first state for a daemon that finds a suspension on record, else None."""
        record = self.load()
        if record is None:
            return None
        # Preflight would find the GPU lent, and the engine waits for resume anyway: neither runs now.
        log.warning("the engine is suspended (%s): it stays down, and preflight waits, until %s", self.path, HOW_TO_RESUME)
        return policy.suspended_state(record, time.monotonic(), record.since - offset)

    def _kill_left_behind(self, record: SuspendRecord, started) -> None:
        pid = record.engine_pid
        if not pid or started is None or _start_ticks(pid) != started:
            return  # gone, or the pid now belongs to another process
        log.warning("the suspended engine of the previous daemon (group %d) is still running: killing it; r3090ctl resume starts a new one", pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError) as exc:
            log.error("cannot kill the left-behind engine group %d: %s", pid, exc)

    # ------------------------------------------------------------- reading

    @staticmethod
    def process_names(gpu: GpuSample) -> tuple[tuple[int, str], ...]:
        """Names of the GPU's processes, for "held by pid N (name)"."""
        names = []
        for p in (gpu.processes or ()) + (gpu.graphics_processes or ()):
            try:
                names.append((p.pid, psutil.Process(p.pid).name()))
            except (psutil.Error, OSError):
                pass
        return tuple(names)

    def publish(self, st: PolicyState, snap: Snapshot, offset: float) -> SuspendInfo:
        """Each tick: log what changed; the state document's suspend section, for report()."""
        s = st.suspension
        stage = s.stage if s is not None and st.phase in SUSPEND_PHASES else None
        if stage is not self._logged_stage and stage is not None:
            log.info("suspend: %s (%s)", stage.value, st.phase.value)
        self._logged_stage = stage
        last = st.suspend_last
        if last is not None and last != self._logged_last:
            level = logging.INFO if last.result in (Result.SUSPENDED, Result.RESUMED, Result.STARTED_COLD) else logging.WARNING
            log.log(level, "%s request %d: %s: %s", last.op, last.request, last.result.value, last.detail)
        self._logged_last = last
        return self.document(st, snap, offset)

    def document(self, st: PolicyState, snap: Snapshot, offset: float) -> SuspendInfo:
        s = st.suspension
        last = st.suspend_last
        # Its RSS, measured while the suspension stands: what the exporter's r3090d_suspended_host_bytes shows.
        held = s is not None and s.stage in STANDING_STAGES and not s.cold
        return SuspendInfo(
            stage=s.stage if s else None,
            since=s.since_wall if s else None,
            cold=bool(s and s.cold),
            pid=s.target if s else None,
            gpu_bytes=s.bytes if s else 0,
            host_rss_bytes=_rss(s.target) if held and s.target else None,
            frozen_requests=s.frozen_requests if s else 0,
            parked=bool(s and s.parked),
            error=s.error if s else "",
            how_to_resume=HOW_TO_RESUME if s and s.stage is Stage.SUSPENDED else None,
            last=LastRequest(last.request, last.op, last.result, last.detail, last.at + offset) if last else None,
            worker=_worker(snap.suspender),
            remind_after_s=self.cfg.suspend.remind_after,
        )


def _rss(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.Error, OSError):
        return None


def _worker(sample: SuspendSample | None) -> WorkerInfo | None:
    if sample is None or sample.op is None:
        return None
    steps = tuple(WorkerStep(r.step.value, r.ok, round(r.took_s, 4), r.error) for r in sample.steps)
    duration = sample.duration_s
    return WorkerInfo(
        op=sample.op.value,
        pid=sample.pid,
        in_flight=sample.in_flight,
        overdue=sample.overdue,
        step=sample.step.value if sample.step else None,
        steps=steps,
        outcome=sample.outcome.value if sample.outcome else None,
        state=sample.state.name if sample.state is not None else None,
        error=sample.error,
        duration_s=round(duration, 4) if duration is not None else None,
    )
