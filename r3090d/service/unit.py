"""One engine under the daemon: its process tree, probes, suspender, canary baselines and policy state.

The daemon has one of these; in swap mode (several models on one card) one per model. Each goes
through today's policy on its own; what is the card's or the process's (signals, the control
plane, alerts, NVML, the state file) stays with the daemon.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

from r3090d import argv as argvmod
from r3090d import exitcodes
from r3090d.atomicfile import write_json_atomic
from r3090d.config import Config
from r3090d.core import policy
from r3090d.core.actions import (
    Exit,
    RecordRestart,
    SaveBaseline,
    SendAlert,
    SendCanary,
    SendInferenceProbe,
    StartEngine,
    StopEngine,
)
from r3090d.core.snapshot import Snapshot
from r3090d.core.vocabulary import Phase
from r3090d.effectors import alertformat
from r3090d.effectors.child import DRAIN_MARGIN_S, EngineProcess
from r3090d.service import baselines, commands, enginesocket, forensics, report
from r3090d.service.safedir import UnsafeDirectory
from r3090d.service.sampling import Sampler
from r3090d.service.state import HANDED_ON_FILE, carried_over
from r3090d.service.suspend import SuspendService

log = logging.getLogger("r3090d")

LOADING_LOG_EVERY_S = 10.0


class EngineUnit:
    def __init__(self, cfg: Config, argv: list[str], wake: threading.Event, *, gpu_monitor=None, engine_version=None,
                 name: str = "", cold: bool = False):  # fmt: skip
        self.name = name  # the served model's name in swap mode; "" for the one engine
        self.cfg = cfg
        self.argv = argv
        self.engine_version = engine_version
        self.engine = EngineProcess(wake)
        self.state_dir = Path(cfg.daemon.state_dir)
        self.suspend = SuspendService(cfg, self.state_dir, wake, self.engine.channel)
        self.sampler = Sampler(cfg, self.engine, gpu_monitor, wake, self.suspend)
        self.pending = commands.Pending()  # control-plane (and, in swap mode, arbiter) requests for the next decide()
        self.baselines = baselines.BaselineStore(self.state_dir)
        self.baseline_deps: dict | None = None  # what the current engine's canary baseline depends on
        self.baseline_beside = False  # the current engine's first answer differed from the stored one: its own are kept beside
        self._torch: tuple[str, str | None] | None = None  # (engine.python, its torch version), asked once
        self.last_snap: Snapshot | None = None  # what suspend's immediate answer is judged on
        self.last_restart_record: Path | None = None
        self.st = policy.initial_state(time.monotonic(), cold=cold)
        self._last_loading_log = 0.0
        self._handed_on: tuple | None = None  # what hand_on last wrote

    @property
    def label(self) -> str:
        """How log lines name this engine: nothing for the one engine, its model in swap mode."""
        return f"[{self.name}] " if self.name else ""

    def snapshot(self, *, shutdown: bool) -> Snapshot:
        snap = self.sampler.take(self.st.phase, shutdown=shutdown, pending=self.pending, probe=policy.probes_engine(self.st))
        self.last_snap = snap
        return snap

    def _deps(self, gpu_name: str | None, snap: Snapshot) -> dict:
        python = self.cfg.engine.python
        if self._torch is None or self._torch[0] != python:
            self._torch = (python, baselines.torch_version(python))
        return baselines.dependencies(self.cfg, self.argv, self.engine_version, gpu_name, driver=snap.gpu.driver_version, torch=self._torch[1],
                                      env=argvmod.engine_env(self.cfg, dict(os.environ)))  # fmt: skip

    def execute(self, actions, snap: Snapshot, *, alerts, gpu_name: str | None) -> int | None:
        """Carry out decide()'s actions for this engine; the exit code an Exit action asks for, else None."""
        exit_code = None
        for action in actions:
            if isinstance(action, StartEngine):
                log.info("%sstarting engine (%s)", self.label, action.reason)
                self.sampler.prober.reset()
                self.baseline_deps = self._deps(gpu_name, snap) if self.cfg.canary.enabled else None
                self.baseline_beside = False
                self.sampler.canary.reset(self.baselines.load(self.baseline_deps) if self.cfg.canary.enabled else None)
                env = argvmod.engine_env(self.cfg, dict(os.environ))
                if self.cfg.engine.uds:
                    self._clear_socket()
                self.engine.spawn(self.argv, env)
            elif isinstance(action, StopEngine):
                how = "drained" if action.drain else "fast"
                log.info("%sstopping engine (%s, %s)", self.label, how, action.reason)
                self.engine.stop(drain=action.drain, drain_timeout=self.cfg.engine.shutdown_timeout + DRAIN_MARGIN_S)
            elif isinstance(action, RecordRestart):
                cause = f"; root cause: {action.root_cause}" if action.root_cause else ""
                log.warning("%sengine restart: %s: %s%s", self.label, action.reason, action.detail, cause)
                self.last_restart_record = forensics.record(self.state_dir, action, snap, self.engine.log_tail(), self.sampler.last_metrics_text)
            elif isinstance(action, SendAlert):
                log.log(alertformat.log_level(action), "%salert %s %s: %s", self.label, action.key, action.state, action.summary)
                if alerts is not None:
                    alerts.submit(action)
            elif isinstance(action, SendInferenceProbe):
                self.sampler.prober.send()
            elif isinstance(action, SendCanary):
                self.sampler.canary.send(action.purpose)
            elif isinstance(action, SaveBaseline):
                if self.baseline_deps is None:  # an engine this daemon did not start (resumed from an earlier one)
                    self.baseline_deps = self._deps(gpu_name, snap)
                # Once its first answer differed from the stored one, none of this engine's replaces that one.
                self.baseline_beside = self.baseline_beside or action.start_mismatch
                self.baselines.save(self.baseline_deps, action.answer, beside=self.baseline_beside)
                if action.start_mismatch:
                    log.warning("%sthe canary's first answer differs from the one stored for this model and setup: kept beside it in %s; "
                                "the stored one stays the reference (remove the file to start afresh)", self.label, self.baselines.path)  # fmt: skip
            elif isinstance(action, Exit):
                exit_code = action.code
                if action.code == exitcodes.GAVE_UP:
                    log.error("giving up: %s (exit %d, daemon.exit_on_give_up)", action.reason, action.code)
            else:
                self.suspend.execute(action, snap.child, self.sampler)
        return exit_code

    def _clear_socket(self) -> None:
        try:
            enginesocket.clear_for_start(self.cfg.engine.uds)
        except UnsafeDirectory as exc:  # the engine then fails to bind, and its start fails as any other
            log.error("%s%s", self.label, exc)

    def log_transitions(self, old_phase: Phase, snap: Snapshot, status: str) -> bool:
        """The log lines of this tick's phase change; True when the engine has just become ready."""
        st, now = self.st, snap.now
        ready = st.phase is Phase.READY and old_phase not in (Phase.READY, Phase.RESUMING)  # a resume logs its own line
        if ready:
            took = now - (snap.child.started_at or now)
            log.info("%sengine ready in %.1f s (pid %s) at %s: %s", self.label, took, snap.child.pid, self.cfg.engine_address, status)
            if self.last_restart_record is not None:
                forensics.mark_ready(self.last_restart_record, now - (st.last_restart_at or now))
                self.last_restart_record = None
        if st.phase is Phase.GIVEN_UP and old_phase is not Phase.GIVEN_UP:
            if self.cfg.daemon.exit_on_give_up:
                log.error("%sgave up: %s; the daemon exits %d once the engine is stopped (daemon.exit_on_give_up)", self.label, st.give_up_reason, exitcodes.GAVE_UP)
            elif st.retry_at is not None:
                log.error("%sgave up: %s; the engine stays stopped, the daemon stays up; it tries again in %.0f s (watchdog.give_up_retry), "
                          "r3090ctl restart starts it now", self.label, st.give_up_reason, st.retry_at - now)  # fmt: skip
            else:
                log.error("%sgave up: %s; the engine stays stopped, the daemon stays up (r3090ctl restart starts it again)", self.label, st.give_up_reason)
        if st.phase is Phase.STARTING and now - self._last_loading_log >= LOADING_LOG_EVERY_S:
            self._last_loading_log = now
            log.info("%sloading model (%.0f s)", self.label, now - st.phase_since)
        return ready

    def carry_on(self, offset: float) -> None:
        """Swap mode, at boot: go on from the alert book and restart history an earlier daemon handed on (hand_on)."""
        book, history = carried_over(self.state_dir / HANDED_ON_FILE, offset)
        self.st = policy.carry_on(dataclasses.replace(self.st, alerts=book), history, self.cfg, time.monotonic())

    def hand_on(self, offset: float) -> None:
        """Swap mode: leave this engine's alert book and restart history for the next daemon, in its own state
        directory (the state file holds the node's document); written when they change, not every tick."""
        st = self.st
        carried = (st.alerts, st.restart_times, st.start_failures, st.same_cause_run, st.last_root_cause, st.restarts_total,
                   st.restarts_by_reason, st.last_restart_reason, st.last_restart_at)  # fmt: skip
        if carried == self._handed_on:
            return
        path = self.state_dir / HANDED_ON_FILE
        try:
            write_json_atomic(path, report.hand_on(st, offset))
        except OSError as exc:
            log.error("%scannot write %s: %s", self.label, path, exc)
            return
        self._handed_on = carried

    def kill_if_running(self) -> None:
        sample = self.engine.sample()
        if sample.alive or sample.tree_pids:
            log.error("%sdaemon leaving with the engine still running: killing its process group", self.label)
            self.engine.kill_now()
