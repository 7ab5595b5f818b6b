"""The daemon's loop: wiring only.

Each tick: probes -> frozen Snapshot -> policy.decide -> effectors -> state file
and sd_notify. Signal handlers only queue the signal and wake the loop (as
gunicorn's arbiter does); one Event serves as both the sleep and the wake-up,
so an engine exit or a finished stop is handled at once, not at the next tick.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from r3090d import __version__, exitcodes
from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.config import MIB, Config, ConfigError
from r3090d.core import policy
from r3090d.core.actions import Exit, RecordRestart, SendAlert, SendInferenceProbe, StartEngine, StopEngine
from r3090d.core.snapshot import EngineSample, GpuSample, GpuStatus, HealthSample, HealthStatus, Snapshot
from r3090d.core.vocabulary import Phase, RestartKind
from r3090d.effectors.child import DRAIN_MARGIN_S, EngineProcess
from r3090d.effectors.reaper import ChildReaper
from r3090d.effectors.systemd import Notifier
from r3090d.probes.engine import EngineProbe
from r3090d.probes.inference import InferenceProber
from r3090d.service import forensics, safedir
from r3090d.service.control import start_plane
from r3090d.service.exporter import TickStats
from r3090d.service.state import (
    STATE_FILE,
    book_from_json,
    book_to_json,
    plain,
    read_json,
    wall_offset,
    write_json_atomic,
)

log = logging.getLogger("r3090d")

LOADING_LOG_EVERY_S = 10.0
STARTING_POLL_S = 0.1


def setup_logging() -> None:
    from r3090d.service import journal

    # The journal stamps each line and wants its priority as a "<N>" prefix;
    # a terminal or a file gets a time stamp instead. JOURNAL_STREAM alone is not
    # enough: a shell started from a journal-connected service inherits it.
    if journal.stderr_is_journal():
        formatter: logging.Formatter = journal.JournalFormatter("%(levelname)s %(name)s: %(message)s")
        sys.excepthook = journal.log_uncaught
        threading.excepthook = journal.log_uncaught_in_thread
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.getLogger(journal.VLLM_LOGGER).setLevel(logging.DEBUG)


class Daemon:
    def __init__(self, cfg: Config, argv: list[str], *, gpu_monitor=None, alerts=None, engine_version=None):
        self.cfg = cfg
        self.argv = argv
        # Asked once at start: the engine's python cannot change without a daemon
        # restart, and asking again costs seconds the loop does not have.
        self.engine_version = engine_version
        self.wake = threading.Event()
        self.signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.engine = EngineProcess(self.wake)
        # As PID 1 (a container's main process), orphans of the engine's tree are ours to
        # reap; the engine's own exit status stays with its waiter thread.
        self.reaper = ChildReaper(keep=lambda: (self.engine.sample().pid,))
        self.notifier = Notifier()
        self.gpu_monitor = gpu_monitor
        self.alerts = alerts
        self.offset = wall_offset()
        self.started_wall = time.time()
        self.state_dir = Path(cfg.daemon.state_dir)
        self.state_path = self.state_dir / STATE_FILE
        self._make_probes(cfg)
        self.last_metrics_text: str | None = None
        self.last_restart_record: Path | None = None
        self.pending_restart: RestartKind | None = None
        self.pending_maintenance: bool | None = None
        self.pending_silences: list[tuple[str, float]] = []
        self.shutdown = False
        self.preflight_summary: dict | None = None
        # Control-plane requests: (request dict, reply callable), handled in the loop
        # so that every change of state happens in one thread.
        self.control_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.latest_doc: dict | None = None  # the last state document written
        self.gpu_identity: tuple | None = None  # (name, index, uuid) named in alerts, once NVML has answered
        self.tick_stats = TickStats()  # tick-duration histogram and XID count for the exporter
        self.st = policy.initial_state(time.monotonic())
        self._last_loading_log = 0.0

    def _make_probes(self, cfg: Config) -> None:
        wd = cfg.watchdog
        self.probe = EngineProbe(cfg.engine_url, cfg.model_name, wd.health_timeout, wd.metrics_timeout)
        self.prober = InferenceProber(cfg.engine_url, cfg.model_name, cfg.api_key, wd.probe_timeout, wake=self.wake)

    # ------------------------------------------------------------ signals

    def install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._queue_signal)

    def _queue_signal(self, signum, _frame) -> None:
        self.signals.put(signum)
        self.wake.set()

    def _handle_signals(self) -> None:
        while True:
            try:
                signum = self.signals.get_nowait()
            except queue.Empty:
                return
            if signum in (signal.SIGTERM, signal.SIGINT):
                if not self.shutdown:
                    log.info("%s: stopping the engine (drained) and exiting", signal.Signals(signum).name)
                    self.notifier.stopping("stopping: draining the engine")
                self.shutdown = True
            elif signum == signal.SIGHUP:
                self.reload()

    def reload(self) -> tuple[str, str]:
        """Re-read the config; on any failure the running engine and config stay as they are."""
        try:
            new, new_argv = self._load_for_reload()
        except Exception as exc:  # any failure, even one nobody foresaw, must leave the engine running
            text = exc.one_line() if isinstance(exc, ConfigError) else (str(exc) if isinstance(exc, argvmod.EngineNotInstalled) else f"{type(exc).__name__}: {exc}")
            log.error("reload refused, keeping the running config: %s", text)
            return "error", f"refused, the running config stays: {text}"
        engine_changed = new_argv != self.argv or new.engine.env != self.cfg.engine.env or new.api_key != self.cfg.api_key
        alerts_changed = new.alerts != self.cfg.alerts
        self.cfg, self.argv = new, new_argv
        self._make_probes(new)
        for warning in new.warnings:
            log.warning("%s", warning)
        applied = "watchdog settings"
        if alerts_changed and self.alerts is not None:
            self._replace_alert_dispatcher(new)
            applied = "watchdog and alert settings"
        if engine_changed and self.st.phase is Phase.GIVEN_UP:
            log.info("reload: applied (%s); engine settings changed, used at the next r3090ctl restart", applied)
            return "ok", "applied; the engine stays stopped after the give-up until r3090ctl restart"
        if engine_changed:
            log.info("reload: applied (%s); engine settings changed, drained restart", applied)
            self.pending_restart = RestartKind.CONFIG
            return "ok", "applied; engine settings changed, drained restart"
        log.info("reload: applied (%s)", applied)
        return "ok", f"applied without an engine restart ({applied})"

    def _load_for_reload(self) -> tuple[Config, list[str]]:
        new = configmod.load(self.cfg.source, self.cfg.instance)
        if new.engine.python != self.cfg.engine.python:
            # Asking a new python for its vLLM version can take seconds, and the loop
            # must keep its watchdog pings: switching engines is a daemon restart.
            raise ConfigError(new.source, "engine.python", "a reload cannot switch the engine's python",
                              "restart the daemon (systemctl restart r3090d) to switch engines")  # fmt: skip
        version = self.engine_version or argvmod.engine_version(new.engine.python)
        return new, argvmod.build_argv(new, version)

    def _replace_alert_dispatcher(self, cfg: Config) -> None:
        """New channels for new alert settings; the old dispatcher delivers what it holds, off the loop."""
        from r3090d.effectors.alerts import AlertDispatcher

        old, self.alerts = self.alerts, AlertDispatcher.from_config(cfg)
        if self.gpu_identity is not None:
            self.alerts.set_gpu(*self.gpu_identity)
        threading.Thread(target=old.close, name="alerts-retire", daemon=True).start()

    def submit_control(self, request: dict, reply) -> None:
        """Called from the control server's thread; `reply(dict)` is called from the loop."""
        self.control_queue.put((request, reply))
        self.wake.set()

    def _handle_control(self) -> None:
        while True:
            try:
                request, reply = self.control_queue.get_nowait()
            except queue.Empty:
                return
            try:
                reply(self.control(request))
            except Exception as exc:  # a broken reply channel must not take the loop down
                log.warning("control reply failed: %s", exc)

    def control(self, request: dict) -> dict:
        cmd = request.get("cmd")
        if cmd == "restart":
            generation = self.engine.sample().generation
            if self.st.phase is Phase.GIVEN_UP and not self.cfg.daemon.exit_on_give_up:
                self.pending_restart = RestartKind.FAST
                return {"ok": True, "message": "starting the engine again after the give-up, from zero failures", "generation": generation}
            if self.st.phase is not Phase.READY:
                return {"ok": False, "error": f"engine is {self.st.phase.value}, not ready; nothing to restart"}
            self.pending_restart = RestartKind.DRAIN if request.get("drain", True) else RestartKind.FAST
            return {"ok": True, "message": f"{self.pending_restart.value} restart requested", "generation": generation}
        if cmd == "maintenance":
            on = request.get("on")
            if not isinstance(on, bool):
                return {"ok": False, "error": "maintenance needs on: true or false"}
            self.pending_maintenance = on
            return {"ok": True, "message": f"maintenance {'on' if on else 'off'}"}
        if cmd == "silence":
            key, seconds = request.get("alert"), request.get("seconds")
            if not isinstance(key, str) or not isinstance(seconds, int | float) or isinstance(seconds, bool) or not 0 < seconds <= 30 * 86400:
                return {"ok": False, "error": "silence needs alert: <name> and seconds: 1..2592000"}
            self.pending_silences.append((key, float(seconds)))  # applied by decide, on its own clock
            return {"ok": True, "message": f"{key} silenced for {seconds:.0f} s"}
        if cmd == "reload":
            status, text = self.reload()
            return {"ok": status == "ok", "message" if status == "ok" else "error": text}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    # ------------------------------------------------------------ probing

    def snapshot(self, st: policy.PolicyState) -> Snapshot:
        now = time.monotonic()
        child = self.engine.sample()
        health = HealthSample(HealthStatus.SKIPPED)
        engine = EngineSample()
        if child.alive and st.phase in (Phase.STARTING, Phase.READY):
            health = self.probe.health()
            if st.phase is Phase.READY or health.status is HealthStatus.OK:
                engine, self.last_metrics_text = self.probe.metrics()
        gpu = self.gpu_monitor.latest(time.monotonic()) if self.gpu_monitor else GpuSample(GpuStatus.DISABLED)
        if gpu.usable:
            self.gpu_identity = (gpu.name, gpu.index, gpu.uuid)
            if self.alerts is not None:
                self.alerts.set_gpu(*self.gpu_identity)  # every alert names the card; a no-op once known
        snap = Snapshot(
            now=now,
            wall=time.time(),
            child=child,
            health=health,
            engine=engine,
            gpu=gpu,
            inference=self.prober.sample(),
            shutdown_requested=self.shutdown,
            restart_requested=self.pending_restart,
            maintenance=self.pending_maintenance,
            silences=tuple(self.pending_silences),
        )
        self.pending_silences = []
        self.pending_restart = None
        self.pending_maintenance = None
        return snap

    # ---------------------------------------------------------- effecting

    def execute(self, actions, snap: Snapshot) -> int | None:
        exit_code = None
        for action in actions:
            if isinstance(action, StartEngine):
                log.info("starting engine (%s)", action.reason)
                self.prober.reset()
                env = argvmod.engine_env(self.cfg, dict(os.environ))
                self.engine.spawn(self.argv, env)
            elif isinstance(action, StopEngine):
                how = "drained" if action.drain else "fast"
                log.info("stopping engine (%s, %s)", how, action.reason)
                self.engine.stop(drain=action.drain, drain_timeout=self.cfg.engine.shutdown_timeout + DRAIN_MARGIN_S)
            elif isinstance(action, RecordRestart):
                cause = f"; root cause: {action.root_cause}" if action.root_cause else ""
                log.warning("engine restart: %s: %s%s", action.reason, action.detail, cause)
                try:
                    self.last_restart_record = forensics.write_record(
                        self.state_dir,
                        reason=action.reason,
                        detail=action.detail,
                        root_cause=action.root_cause,
                        snapshot=snap,
                        log_tail=self.engine.log_tail(),
                        metrics_text=self.last_metrics_text,
                        gpu=snap.gpu,
                    )
                except OSError as exc:
                    log.error("cannot write the restart record in %s: %s", self.state_dir, exc)
            elif isinstance(action, SendAlert):
                # A resolve is good news: INFO, so `journalctl -p warning` lists only problems.
                level = logging.INFO if action.state == "resolved" else logging.ERROR if action.severity == "critical" else logging.WARNING
                log.log(level, "alert %s %s: %s", action.key, action.state, action.summary)
                if self.alerts is not None:
                    self.alerts.submit(action)
            elif isinstance(action, SendInferenceProbe):
                self.prober.send()
            elif isinstance(action, Exit):
                exit_code = action.code
                if action.code == exitcodes.GAVE_UP:
                    log.error("giving up: %s (exit %d, daemon.exit_on_give_up)", action.reason, action.code)
        return exit_code

    # ---------------------------------------------------------- preflight

    def preflight(self) -> int | None:
        """Check the host before the first start. None to go on, else the exit code.

        A permanent failure exits 69 (systemd leaves it alone); a transient one
        (port busy, VRAM still held by a dying process) is re-checked until
        preflight.transient_give_up_s, then exits 75 so systemd tries again later.
        """
        from r3090d.preflight import checks
        from r3090d.preflight import gather as preflight_facts

        pf = self.cfg.preflight
        deadline = time.monotonic() + pf.transient_give_up_s
        while True:
            gpu = self.gpu_monitor.latest(time.monotonic()) if self.gpu_monitor else None
            if gpu is not None and gpu.status is GpuStatus.PENDING:
                gpu = None  # no reading from the worker yet: take one of its own
            results = preflight_facts.run(self.cfg, (), gpu=gpu)
            self.preflight_summary = {
                "exit_code": checks.exit_code(results),
                "checks": [plain(r) for r in results],
                "at": time.time(),
            }
            for r in results:
                if r.status in (checks.Status.WARN, checks.Status.FAIL):
                    log.warning("preflight %s %s: %s (expected %s)%s", r.name, r.status.value.upper(), r.measured, r.expected, f"; {r.hint}" if r.hint else "")
            permanent = checks.failures(results, permanent=True)
            transient = checks.failures(results, permanent=False)
            if permanent:
                return self._preflight_failed(permanent, exitcodes.PREFLIGHT_PERMANENT)
            if not transient:
                log.info("preflight passed (%d checks)", len(results))
                return None
            if time.monotonic() >= deadline:
                return self._preflight_failed(transient, exitcodes.TEMPFAIL)
            what = "; ".join(f"{r.name}: {r.measured}" for r in transient)
            self.write_preflight_doc(waiting=what)
            self.notifier.status(f"waiting for preflight: {what}")
            self.notifier.extend_timeout(pf.transient_retry_s + 30)
            log.info("preflight: waiting for %s; re-checking in %.0f s", what, pf.transient_retry_s)
            self.wake.wait(pf.transient_retry_s)
            self.wake.clear()
            self._handle_signals()
            if self.shutdown:
                return exitcodes.OK

    def _preflight_failed(self, failed, code: int) -> int:
        text = "; ".join(f"{r.name}: {r.measured} (expected {r.expected}){' - ' + r.hint if r.hint else ''}" for r in failed)
        log.error("preflight failed, not starting vLLM: %s (exit %d)", text, code)
        if self.alerts is not None:
            self.alerts.submit(SendAlert(key="preflight_failed", severity="critical", state="firing", summary=f"preflight failed: {text}"))
        self.write_preflight_doc()
        return code

    def write_preflight_doc(self, waiting: str | None = None) -> None:
        """Leave the verdict where `r3090ctl status` looks, though the loop has not run:
        what preflight waits for (re-written at each re-check), or why it failed."""
        doc = read_json(self.state_path) or {}
        doc.update({"written_at": time.time(), "preflight": self.preflight_summary})
        doc.setdefault("engine", {})["phase"] = "stopped"
        doc["engine"]["state"] = "stopped"
        doc["daemon"] = {
            "pid": os.getpid(),
            "started_at": self.started_wall,
            "version": __version__,
            "instance": self.cfg.instance,
            "config": self.cfg.source,
            # the document is re-written at each re-check: that is its freshness
            "poll_interval": self.cfg.preflight.transient_retry_s,
        }
        doc["waiting"] = {"for": waiting, "since": doc.get("waiting", {}).get("since") or time.time()} if waiting else None
        failed = [c["name"] for c in self.preflight_summary["checks"] if c["status"] == "fail"]
        doc["give_up_reason"] = None if waiting else "preflight failed: " + "; ".join(failed)
        try:
            write_json_atomic(self.state_path, doc)
        except OSError as exc:
            log.error("cannot write %s: %s", self.state_path, exc)

    # --------------------------------------------------------------- loop

    def run(self, skip_preflight: bool = False) -> int:
        try:
            # Another user able to swap control.sock or state.json could feed root's r3090ctl a fake state.
            safedir.ensure(self.cfg.daemon.state_dir, "daemon.state_dir")
            safedir.ensure(self.cfg.daemon.runtime_dir, "daemon.runtime_dir")
        except safedir.UnsafeDirectory as exc:
            log.error("%s (config %s); exit %d", exc, self.cfg.source, exitcodes.CONFIG)
            self._close_helpers()
            return exitcodes.CONFIG
        self.warn_if_watchdog_too_short()
        if skip_preflight:
            log.warning("preflight skipped (--skip-preflight): starting vLLM without checking the host")
        else:
            code = self.preflight()
            if code is not None:
                self._close_helpers()
                return code
        previous = read_json(self.state_path) or {}
        self.st = dataclasses.replace(self.st, alerts=book_from_json(previous.get("alert_book"), self.offset))
        code = None
        plane = start_plane(self)
        try:
            while code is None:
                self.wake.clear()
                self.reaper.reap()
                self._handle_signals()
                self._handle_control()
                tick_start = time.monotonic()
                snap = self.snapshot(self.st)
                old_phase = self.st.phase
                actions, self.st = policy.decide(snap, self.st, self.cfg, snap.now)
                code = self.execute(actions, snap)
                self._after_tick(old_phase, self.st, snap, time.monotonic() - tick_start)
                if code is None:
                    self.wake.wait(max(0.0, tick_start + self.tick_interval() - time.monotonic()))
        finally:
            sample = self.engine.sample()
            if sample.alive or sample.tree_pids:
                log.error("daemon leaving with the engine still running: killing its process group")
                self.engine.kill_now()
            plane.stop()
        self._close_helpers()
        log.info("exit %d", code)
        return code

    def _close_helpers(self) -> None:
        if self.alerts is not None:
            # A give-up's critical alert must leave before the process does.
            if not self.alerts.flush(10.0):
                log.error("alerts still undelivered at exit; see the drops logged above")
            self.alerts.close()
        if self.gpu_monitor is not None:
            self.gpu_monitor.close()

    def tick_interval(self) -> float:
        """The poll interval, shortened if systemd's watchdog wants pings more often.

        While the engine starts, /health is polled every STARTING_POLL_S: a refused
        connection costs nothing, and READY=1 then follows /health 200 at once."""
        interval = self.cfg.watchdog.poll_interval
        if self.st.phase is Phase.STARTING:
            interval = min(interval, STARTING_POLL_S)
        if self.notifier.watchdog_interval_s:
            interval = min(interval, self.notifier.watchdog_interval_s / 2)
        return interval

    def warn_if_watchdog_too_short(self) -> None:
        wd, limit = self.cfg.watchdog, self.notifier.watchdog_interval_s
        worst = self.tick_interval() + wd.health_timeout + wd.metrics_timeout
        if limit and worst > limit / 2:
            log.warning(
                "WatchdogSec=%.0f is short for this config: a tick can take %.1f s (poll + health and metrics timeouts); "
                "raise WatchdogSec or lower watchdog.health_timeout/metrics_timeout",
                limit,
                worst,
            )

    def _after_tick(self, old_phase: Phase, st: policy.PolicyState, snap: Snapshot, tick_s: float) -> None:
        now = snap.now
        if st.phase is Phase.READY and old_phase is not Phase.READY:
            took = now - (snap.child.started_at or now)
            log.info("engine ready in %.1f s (pid %s) at %s: %s", took, snap.child.pid, self.cfg.engine_url, self.status_line(st, snap))
            if self.last_restart_record is not None:
                forensics.mark_ready(self.last_restart_record, now - (st.last_restart_at or now))
                self.last_restart_record = None
        if st.phase is Phase.GIVEN_UP and old_phase is not Phase.GIVEN_UP:
            log.error("gave up: %s; the engine stays stopped, the daemon stays up (r3090ctl restart starts it again)", st.give_up_reason)
        line = self.status_line(st, snap)
        if st.phase is Phase.READY or (st.phase is Phase.GIVEN_UP and not self.cfg.daemon.exit_on_give_up):
            # A give-up still lets the unit become active: the daemon is up, alerting
            # and answering, and `systemctl status` shows why through STATUS=.
            self.notifier.ready(line)
        elif not self.notifier.ready_sent or st.phase in (Phase.SHUTTING_DOWN, Phase.GIVEN_UP, Phase.DRAINING):
            # Loading (before READY) and stopping both count against systemd's timeouts.
            self.notifier.extend_timeout()
        if st.phase is Phase.STARTING and now - self._last_loading_log >= LOADING_LOG_EVERY_S:
            self._last_loading_log = now
            log.info("loading model (%.0f s)", now - st.phase_since)
        self.notifier.status(line)
        self.notifier.watchdog()
        self.write_state(st, snap, tick_s)

    def status_line(self, st: policy.PolicyState, snap: Snapshot) -> str:
        now = snap.now
        if st.phase is Phase.STARTING:
            return f"loading model ({now - st.phase_since:.0f} s)"
        if st.phase is Phase.GIVEN_UP:
            return f"gave up, engine stopped: {st.give_up_reason}"
        parts = [("maintenance " if st.maintenance else "") + st.phase.value]
        e = snap.engine
        if e.kv_usage is not None:
            parts.append(f"kv {e.kv_usage * 100:.0f}% ({e.free_blocks or 0:.0f} free blocks)")
        g = snap.gpu
        if g.memory_used is not None and g.memory_total:
            parts.append(f"gpu {g.memory_used / 2**20:.0f}/{g.memory_total / 2**20:.0f} MiB")
        if st.restarts_total:
            parts.append(f"restarts {st.restarts_total} (last: {st.last_restart_reason})")
        return ", ".join(parts)

    def write_state(self, st: policy.PolicyState, snap: Snapshot, tick_s: float) -> None:
        off = self.offset
        self.tick_stats.observe(tick_s, snap.gpu.xid_errors)

        def wall(t):
            return None if t is None else t + off

        firing = {k: {"severity": e.severity, "summary": e.summary, "since": wall(e.since)} for k, e in st.alerts.firing().items()}
        doc = {
            "format": 1,
            "written_at": time.time(),
            "daemon": {
                "pid": os.getpid(),
                "started_at": self.started_wall,
                "version": __version__,
                "instance": self.cfg.instance,
                "config": self.cfg.source,
                "host": socket.gethostname(),
                "tick_seconds": round(tick_s, 4),
                "poll_interval": self.cfg.watchdog.poll_interval,
            },
            "engine": {
                "state": "maintenance" if st.maintenance and st.phase is Phase.READY else st.phase.value,
                "phase": st.phase.value,
                "maintenance": st.maintenance,
                "since": wall(st.phase_since),
                "pid": snap.child.pid if snap.child.alive else None,
                "tree_pids": list(snap.child.tree_pids),
                "model": self.cfg.model_name,
                "url": self.cfg.engine_url,
                "ready_since": wall(st.ready_since),
                "generation": st.generation,
            },
            "restarts": {
                "total": st.restarts_total,
                "by_reason": dict(st.restarts_by_reason),
                "last_reason": st.last_restart_reason,
                "last_at": wall(st.last_restart_at),
                "last_root_cause": st.last_root_cause,
                "backoff_level": st.backoff_level,
                "start_failures": st.start_failures,
                "recent": len(st.restart_times),
            },
            "next_action": self.next_action(st, snap),
            "watch": {"gpu_signal_off": st.watch.gpu_signal_off if self.cfg.gpu.required else None},
            "give_up_reason": st.give_up_reason,
            "xid_seen": list(st.xid_seen),
            "health": plain(snap.health),
            "inference": self._probe_report(snap),
            "thresholds": {
                "gpu_memory_alert_bytes": self.cfg.watchdog.gpu_memory_alert_mib * MIB,
                "kv_min_free_blocks": self.cfg.watchdog.min_free_blocks,
            },
            "metrics": plain(snap.engine),
            "gpu": plain(snap.gpu),
            "alerts": {"firing": firing, "silenced": {k: u + off for k, u in st.alerts.silenced}},
            "alert_book": book_to_json(st.alerts, off),
            "preflight": self.preflight_summary,
            "telemetry": self.tick_stats.to_json(),
        }
        self.latest_doc = doc
        try:
            write_json_atomic(self.state_path, doc)
        except OSError as exc:
            log.error("cannot write %s: %s", self.state_path, exc)

    def _probe_report(self, snap: Snapshot) -> dict:
        """The last finished inference probe, in wall time: for the exporter's latency gauge and status."""
        inf = snap.inference
        finished = inf.finished_at is not None and inf.sent_at is not None and inf.finished_at >= inf.sent_at
        return {
            "ok": inf.ok,
            "latency_s": round(inf.finished_at - inf.sent_at, 4) if finished else None,
            "finished_at": inf.finished_at + self.offset if finished else None,
            "detail": inf.detail,
            "consecutive_failures": inf.consecutive_failures,
        }

    def next_action(self, st: policy.PolicyState, snap: Snapshot) -> str | None:
        if st.phase is Phase.BACKOFF and st.next_start_at is not None:
            return f"start engine in {max(0.0, st.next_start_at - snap.now):.0f} s"
        if st.phase is Phase.DRAINING and st.stop_due_at is not None:
            return f"drained stop of the engine in {max(0.0, st.stop_due_at - snap.now):.0f} s (load balancer grace)"
        if st.phase in (Phase.RESTARTING, Phase.DRAINING):
            return "start engine once the old process tree is gone"
        if st.phase is Phase.STARTING:
            return f"give up waiting for /health in {max(0.0, st.phase_since + self.cfg.engine.startup_timeout - snap.now):.0f} s"
        return None


def run(config_path: str | None, instance: int | None, skip_preflight: bool) -> int:
    setup_logging()
    if instance is None:
        instance = configmod.instance_from_env()
    cfg = configmod.load(configmod.resolve_path(config_path, instance), instance)
    try:
        version = argvmod.engine_version(cfg.engine.python)
    except argvmod.EngineNotInstalled as exc:
        log.error("preflight vllm FAIL: %s (fix: make engine, or set engine.python in %s); exit %d", exc, cfg.source, exitcodes.PREFLIGHT_PERMANENT)
        return exitcodes.PREFLIGHT_PERMANENT
    argv = argvmod.build_argv(cfg, version)
    for warning in cfg.warnings:
        log.warning("%s", warning)
    log.info("r3090d %s: config %s, vLLM %s, engine at %s", __version__, cfg.source, version, cfg.engine_url)
    from r3090d.effectors.alerts import AlertDispatcher

    gpu_monitor = None
    if cfg.gpu.required:
        from r3090d.probes.nvml import NvmlMonitor

        gpu_monitor = NvmlMonitor(cfg.gpu.index, cfg.watchdog.nvml_hung_after, period_s=cfg.watchdog.poll_interval)
        gpu_monitor.start()
    daemon = Daemon(cfg, argv, gpu_monitor=gpu_monitor, alerts=AlertDispatcher.from_config(cfg), engine_version=version)
    daemon.install_signals()
    return daemon.run(skip_preflight=skip_preflight)
