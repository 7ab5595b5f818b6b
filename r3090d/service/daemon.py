"""The daemon: signals, the loop, and dispatching decide()'s actions.

Each tick: probes -> frozen Snapshot -> policy.decide -> effectors -> state file
and sd_notify. Signal handlers only queue the signal and wake the loop (as
gunicorn's arbiter does); one Event serves as both the sleep and the wake-up,
so an engine exit or a finished stop is handled at once, not at the next tick.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path

from r3090d import __version__, exitcodes
from r3090d.atomicfile import write_json_atomic
from r3090d.config import Config, EngineListen
from r3090d.config.models import socket_path
from r3090d.core import policy
from r3090d.core.snapshot import Snapshot
from r3090d.core.vocabulary import Phase
from r3090d.effectors.reaper import ChildReaper
from r3090d.effectors.systemd import Notifier, watchdog_warning
from r3090d.service import commands, enginesocket, resethold, safedir
from r3090d.service.control import start_plane
from r3090d.service.exporter import TickStats
from r3090d.service.preflight_runner import PreflightRunner
from r3090d.service.report import report, status_line
from r3090d.service.state import STATE_FILE, carried_over, wall_offset
from r3090d.service.statedoc import DaemonIdentity, PreflightSummary
from r3090d.service.unit import EngineUnit

log = logging.getLogger("r3090d")

STARTING_POLL_S = 0.1


def collect_garbage() -> None:
    """A full collection, once an engine start is over and off the crash-to-respawn path.

    CPython empties its free lists (up to 2,000 spare tuples of each size, about 4 MiB in
    all, and the lists, dicts and floats) and frees the cycles that reached the oldest
    generation only in a full collection. With the daemon's tens of thousands of
    long-lived objects one comes rarely, and each restart's churn (the start's refused
    probes, the engine's log, the restart record) fills the lists further; the memory
    allocator keeps the pages they fill, so the daemon's RSS crept up with every restart.
    """
    started = time.monotonic()
    found = gc.collect()
    log.debug("full garbage collection: %d unreachable objects, %.1f ms", found, (time.monotonic() - started) * 1e3)


class Daemon:
    def __init__(self, cfg: Config, argv: list[str], *, gpu_monitor=None, alerts=None, engine_version=None):
        self.cfg = cfg
        self.argv = argv
        # Asked once at start: the engine's python cannot change without a daemon
        # restart, and asking again costs seconds the loop does not have.
        self.engine_version = engine_version
        self.wake = threading.Event()
        self.signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.unit: EngineUnit | None = self.make_engines(gpu_monitor)
        # As PID 1 (a container's main process), orphans of the engine's tree are ours to
        # reap; the engine's own exit status stays with its waiter thread.
        self.reaper = ChildReaper(keep=self.kept_pids)
        self.notifier = Notifier()
        self.gpu_monitor = gpu_monitor
        self.alerts = alerts
        self.offset = wall_offset()
        self.identity = DaemonIdentity(pid=os.getpid(), started_at=time.time(), version=__version__, host=socket.gethostname())
        self.state_dir = Path(cfg.daemon.state_dir)
        self.state_path = self.state_dir / STATE_FILE
        self.shutdown = False
        self.preflight_summary: PreflightSummary | None = None
        # Control-plane requests: (request dict, reply callable), handled in the loop
        # so that every change of state happens in one thread.
        self.control_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.latest_doc: dict | None = None  # the last state document written
        self.gpu_identity: tuple | None = None  # (name, index, uuid) named in alerts, once NVML has answered
        self.tick_stats = TickStats()  # tick-duration histogram for the exporter
        self.boot_id = resethold.boot_id()

    def make_engines(self, gpu_monitor) -> EngineUnit | None:
        return EngineUnit(self.cfg, self.argv, self.wake, gpu_monitor=gpu_monitor, engine_version=self.engine_version)

    def kept_pids(self) -> tuple[int, ...]:
        """Children whose exit status is not the reaper's: the engine's first process."""
        return (self.engine.sample().pid,)

    # The one engine's pieces, by the names the reload and the tests use.
    @property
    def engine(self):
        return self.unit.engine

    @property
    def sampler(self):
        return self.unit.sampler

    @property
    def suspend(self):
        return self.unit.suspend

    @property
    def pending(self) -> commands.Pending:
        return self.unit.pending

    @property
    def last_snap(self) -> Snapshot | None:
        return self.unit.last_snap

    @property
    def st(self) -> policy.PolicyState:
        return self.unit.st

    @st.setter
    def st(self, value: policy.PolicyState) -> None:
        self.unit.st = value

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
                self.reload()  # on any failure the running engine and config stay as they are

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

    def reload(self) -> tuple[str, str]:
        """Apply the config file again: ("ok" | "error", one line); on any failure nothing changes."""
        return commands.reload(self)

    def control(self, request: dict) -> dict:
        if request.get("model") is not None:
            return {"ok": False, "error": f"this daemon serves one engine ({self.cfg.source} has no [[models]]): drop --model"}
        if request.get("cmd") == "reload":
            status, text = self.reload()
            return {"ok": status == "ok", "message" if status == "ok" else "error": text}
        if request.get("cmd") in ("suspend", "resume"):
            return commands.answer_suspend(request, self.pending, self.cfg, phase=self.st.phase, suspended=self.st.suspension, snap=self.last_snap)
        return commands.answer(request, self.pending, phase=self.st.phase, generation=self.engine.sample().generation,
                               exit_on_give_up=self.cfg.daemon.exit_on_give_up)  # fmt: skip

    # ------------------------------------------------------------ probing

    def snapshot(self, unit: EngineUnit) -> Snapshot:
        snap = unit.snapshot(shutdown=self.shutdown)
        if snap.gpu.usable:
            self.gpu_identity = (snap.gpu.name, snap.gpu.index, snap.gpu.uuid)
            if self.alerts is not None:
                self.alerts.set_gpu(*self.gpu_identity)  # every alert names the card; a no-op once known
        return snap

    # ---------------------------------------------------------- effecting

    def execute(self, actions, snap: Snapshot, unit: EngineUnit | None = None) -> int | None:
        gpu_name = self.gpu_identity[0] if self.gpu_identity else None
        return (unit or self.unit).execute(actions, snap, alerts=self.alerts, gpu_name=gpu_name)

    # ---------------------------------------------------------- preflight

    def preflight(self) -> int | None:
        """Check the host before the first start. None to go on, else the exit code."""
        runner = PreflightRunner(self.cfg, identity=self.identity, state_path=self.state_path, gpu_monitor=self.gpu_monitor,
                                 notifier=self.notifier, alerts=self.alerts, wait=self._wait_for_signals)  # fmt: skip
        code = runner.run()
        self.preflight_summary = runner.summary
        return code

    def _wait_for_signals(self, seconds: float) -> bool:
        self.wake.wait(seconds)
        self.wake.clear()
        self._handle_signals()
        return self.shutdown

    # --------------------------------------------------------------- loop

    def run(self, skip_preflight: bool = False) -> int:
        self.skip_preflight = skip_preflight
        try:
            # Another user able to swap control.sock or state.json could feed root's r3090ctl a fake state.
            safedir.ensure(self.cfg.daemon.state_dir, "daemon.state_dir")
            safedir.ensure(self.cfg.daemon.runtime_dir, "daemon.runtime_dir")
            if self.cfg.engine.listen is EngineListen.UDS:  # no other user may reach an engine's unkeyed routes
                enginesocket.ensure_directory(Path(socket_path(self.cfg.daemon.runtime_dir, 0)).parent)
        except safedir.UnsafeDirectory as exc:
            log.error("%s (config %s); exit %d", exc, self.cfg.source, exitcodes.CONFIG)
            self._close_helpers()
            return exitcodes.CONFIG
        self.warn_if_watchdog_too_short()
        code = self.boot()
        if code is not None:
            self._close_helpers()
            return code
        plane = start_plane(self)
        try:
            self.start_loop()
            while code is None:
                self.wake.clear()
                self.reaper.reap()
                self._handle_signals()
                self._handle_control()
                tick_start = time.monotonic()
                code = self.tick()
                if code is None:
                    self.wake.wait(max(0.0, tick_start + self.tick_interval() - time.monotonic()))
        finally:
            self.stop_engines()
            plane.stop()
        self._close_helpers()
        log.info("exit %d", code)
        return code

    def boot(self) -> int | None:
        """Before the loop: the suspension on record, else preflight; what an earlier daemon left. An exit code to stop."""
        suspended = self.suspend.boot_state(self.offset)  # the GPU is lent: no preflight, no engine until resume
        if suspended is not None:
            self.st = suspended
        else:
            code = self.preflight_or_skip()
            if code is not None:
                return code
        # A daemon restarted by systemd goes on from its predecessor's alerts and restarts: nothing it
        # sent is sent again, and nothing that still holds (a restart storm) is resolved by mistake.
        book, history = carried_over(self.state_path, self.offset)
        self.st = policy.carry_on(dataclasses.replace(self.st, alerts=book), history, self.cfg, time.monotonic())
        self.st = dataclasses.replace(self.st, reset_hold=self.load_reset_hold())
        return None

    def preflight_or_skip(self) -> int | None:
        if self.skip_preflight:
            log.warning("preflight skipped (--skip-preflight): starting vLLM without checking the host")
            return None
        return self.preflight()

    def load_reset_hold(self):
        hold = resethold.load(self.state_dir, boot=self.boot_id)
        if hold is not None:
            log.error("the GPU needs a reset (%s, recorded by an earlier daemon of this boot): no engine starts until "
                      "r3090ctl restart", hold.reason)  # fmt: skip
        return hold

    def start_loop(self) -> None:
        """What runs beside the loop once the control plane is up (swap mode: the router and its link)."""

    def stop_engines(self) -> None:
        self.unit.kill_if_running()

    def tick(self) -> int | None:
        """One turn of the loop for the one engine: snapshot, decide, act, publish. An exit code to stop."""
        tick_start = time.monotonic()
        snap = self.snapshot(self.unit)
        old_phase, old_hold = self.st.phase, self.st.reset_hold
        actions, self.st = policy.decide(snap, self.st, self.cfg, snap.now)
        if self.st.reset_hold != old_hold:
            resethold.save(self.state_dir, self.st.reset_hold, boot=self.boot_id)
        code = self.execute(actions, snap)
        if self.alerts is not None:
            # Alertmanager's channel re-sends what fires on its own clock, local silences and rate limits aside.
            self.alerts.sync(self.st.alerts.firing(), wall_offset=self.offset)
        self._after_tick(old_phase, self.st, snap, time.monotonic() - tick_start)
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
        wd = self.cfg.watchdog
        warning = watchdog_warning(self.notifier.watchdog_interval_s, self.tick_interval() + wd.health_timeout + wd.metrics_timeout)
        if warning:
            log.warning("%s", warning)

    def _after_tick(self, old_phase: Phase, st: policy.PolicyState, snap: Snapshot, tick_s: float) -> None:
        if self.unit.log_transitions(old_phase, snap, status_line(st, snap)):
            collect_garbage()
        # A give-up or a suspension still lets the unit become active: the daemon is up,
        # alerting and answering, and `systemctl status` shows why through STATUS=.
        # So does a wait for the card (held by others, or needing a reset): a boot that finds the
        # card taken must not keep the unit "activating" for ever.
        waiting = st.phase in (Phase.WAITING_FOR_GPU, Phase.RESET_NEEDED)
        active = waiting or st.phase in (Phase.READY, Phase.SUSPENDED) or (st.phase is Phase.GIVEN_UP and not self.cfg.daemon.exit_on_give_up)
        self.notifier.tick(status_line(st, snap), active=active, busy=st.phase in (Phase.SHUTTING_DOWN, Phase.GIVEN_UP, Phase.DRAINING))
        self.write_state(st, snap, tick_s)

    def write_state(self, st: policy.PolicyState, snap: Snapshot, tick_s: float) -> None:
        self.tick_stats.observe(tick_s)
        doc = report(st, snap, self.cfg, identity=self.identity, offset=self.offset, written_at=time.time(), tick_s=tick_s,
                     preflight=self.preflight_summary, telemetry=self.tick_stats.to_json(),
                     suspend=self.suspend.publish(st, snap, self.offset)).to_json()  # fmt: skip
        self.latest_doc = doc
        self.write_doc(doc)

    def write_doc(self, doc: dict) -> None:
        try:
            write_json_atomic(self.state_path, doc)
        except OSError as exc:
            log.error("cannot write %s: %s", self.state_path, exc)
