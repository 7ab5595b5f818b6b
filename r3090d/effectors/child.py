"""The engine's process tree: spawn it in its own session, watch it, stop it in order.

The tree is r3090d.effectors.launcher -> vLLM's API server -> EngineCore ->
workers. The launcher (the process spawned here, whose pid is the engine's pid
and group id) makes the checkpoint calls as the ancestor of every engine
process, relays the API server's end as its own, and passes SIGTERM on to it
alone. None of them call setsid, so the whole tree shares one process group,
and the engine runs in a new session made for it. The group id is therefore the
handle on every process the engine ever started, including orphans reparented
to init after the launcher exits (on a GPU those orphans keep holding VRAM).

Nothing here blocks the caller: exits are seen by a waiter thread the moment they
happen, and stop sequences run in a stopper thread. Both set `wake` so the loop
reacts at once rather than at its next tick.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

import psutil

from r3090d import procstat
from r3090d.core import rootcause
from r3090d.core.snapshot import ChildSample
from r3090d.effectors import launcher
from r3090d.probes.cgroup import OomKillCount, OomKillCounter
from r3090d.vllmlines import VLLM_LOGGER, VllmLineClassifier

log = logging.getLogger("r3090d.engine")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

# After SIGTERM to the group, before SIGKILL. A fast stop is for an engine judged
# hung, frozen or half dead (a drained stop has its own deadline), which cannot act
# on SIGTERM: every second of grace is a second more of outage. One second still
# lets a process that can (an orphaned worker, vLLM's resource tracker) remove its
# shared-memory files before the SIGKILL.
FAST_STOP_GRACE_S = 1.0
DRAIN_MARGIN_S = 10.0  # beyond vLLM's --shutdown-timeout before SIGKILL
REAP_TIMEOUT_S = 15.0  # SIGKILLed processes in D state can take a while to go
# After the API server's exit, the longest wait for the reader to take in what
# it printed last. With a pidfd the reader says when it has, and the bound is
# only a safety net; without one it waits for EOF, which an orphan holding the
# pipe delays, so the wait is short.
OUTPUT_DRAIN_S = 10.0
OUTPUT_DRAIN_WITHOUT_PIDFD_S = 0.5
# After the launcher's exit, the longest wait for its reply pipe to close: what it
# said last (that the API server could not be started) is read by then.
REPLY_CLOSE_S = 2.0


def group_members(pgid: int) -> tuple[int, ...]:
    """Live (non-zombie) processes whose process group is `pgid`.

    kill(0) answers "nobody left" without a scan; only when something (perhaps
    a zombie) is still in the group is /proc read.
    Reads /proc through r3090d.procstat, not psutil: this runs several times on
    the crash-to-respawn path, and psutil is about 16 times slower at it.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return ()
    except PermissionError:
        pass
    try:
        procs = list(procstat.scan())
    except OSError:
        return _group_members_psutil(pgid)
    return tuple(sorted(p.pid for p in procs if p.live and p.pgrp == pgid))


def _group_members_psutil(pgid: int) -> tuple[int, ...]:
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return tuple(sorted(members))


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class EngineProcess:
    """Owns at most one engine process tree at a time."""

    def __init__(self, wake: threading.Event, *, log_lines: int = 200, echo=None, oom_kills: OomKillCounter | None = None):
        self._wake = wake
        self._oom_kills = oom_kills if oom_kills is not None else OomKillCounter()
        self._oom_at_start = self._oom_at_exit = OomKillCount(None)
        self._oom_unreadable_told = False
        self._lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._echo = echo  # callable(line) for the engine's output, or None to use logging
        self._proc: subprocess.Popen | None = None
        self._pgid: int | None = None
        self._generation = 0
        self._started_at: float | None = None
        self._exit_code: int | None = None
        self._exited_at: float | None = None
        self._stop_requested = False
        self._stopper: threading.Thread | None = None
        self._spawn_error: str | None = None
        self._channel: launcher.LauncherChannel | None = None

    # ------------------------------------------------------------- spawning

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> None:
        """Start `argv` (vLLM's API server) under the engine's launcher.

        Call it from a thread that lives as long as the daemon (the loop's): the
        launcher's parent-death signal comes when the thread that forked it ends.
        """
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                raise RuntimeError("engine already running")
            self._generation += 1
            self._stop_requested = False
            self._exit_code = None
            self._exited_at = None
            self._spawn_error = None
            self._started_at = time.monotonic()
            self._tail.clear()  # a root cause must come from this engine's own output
            self._oom_at_start, self._oom_at_exit = self._oom_kills.read(), OomKillCount(None)
            if self._oom_at_start.error and not self._oom_unreadable_told:
                self._oom_unreadable_told = True
                log.warning("an OOM kill of the engine cannot be told from another death: %s", self._oom_at_start.error)
            control_r, control_w = os.pipe()
            reply_r, reply_w = os.pipe()
            launcher_argv = [sys.executable, "-m", launcher.MODULE, "--control-fd", str(control_r), "--reply-fd", str(reply_w),
                             "--parent", str(os.getpid()), "--", *argv]  # fmt: skip
            try:
                proc = subprocess.Popen(
                    launcher_argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(control_r, reply_w),
                )
            except OSError as exc:
                for fd in (control_r, control_w, reply_r, reply_w):
                    os.close(fd)
                self._proc = None
                self._pgid = None
                self._channel = None
                self._spawn_error = f"cannot start {launcher_argv[0]}: {exc.strerror or exc}"
                self._exited_at = time.monotonic()
                self._wake.set()
                return
            os.close(control_r)
            os.close(reply_w)
            self._channel = channel = launcher.LauncherChannel(control_w, reply_r)
            self._proc = proc
            self._pgid = proc.pid  # session leader: pgid == pid
            generation = self._generation
            exit_fd = _exit_fd(proc.pid)  # before the waiter can reap it
        drained = threading.Event()
        threading.Thread(target=self._read_output, args=(proc, exit_fd, drained), name="engine-output", daemon=True).start()
        drain_s = OUTPUT_DRAIN_S if exit_fd is not None else OUTPUT_DRAIN_WITHOUT_PIDFD_S
        threading.Thread(target=self._wait_exit, args=(proc, channel, generation, drained, drain_s), name="engine-waiter",
                         daemon=True).start()  # fmt: skip

    def _read_output(self, proc: subprocess.Popen, exit_fd: int | None, drained: threading.Event) -> None:
        """Relay the engine's output, line by line, until EOF; set `drained` once
        the API server has exited and all it wrote is in the tail.

        Its last lines are the ones that say why it died, and the exit is
        published (and the root cause read) only after `drained`. Orphans may
        hold the pipe open long after, so EOF cannot be the sign: the exit is
        seen on a pidfd, and then the pipe is read until it is empty, which
        takes in everything the dead process wrote.
        """
        assert proc.stdout is not None
        # Relayed at vLLM's own level, so the journal stores an EngineCore traceback
        # at priority 3 and `journalctl -p warning` shows it. One per engine process:
        # an open traceback must not outlive the output it belongs to.
        levels = VllmLineClassifier()
        relay = logging.getLogger(VLLM_LOGGER)

        def take(raw: bytes) -> None:
            line = raw.decode("utf-8", "replace")
            self._tail.append(line)
            if self._echo is not None:
                self._echo(line)
            else:
                relay.log(levels.classify(line).logging_level, "[vllm] %s", line)

        pipe = proc.stdout.fileno()
        os.set_blocking(pipe, False)
        poller = select.poll()
        poller.register(pipe, select.POLLIN)
        if exit_fd is not None:
            poller.register(exit_fd, select.POLLIN)
        partial = b""
        try:
            while True:
                ready = {fd for fd, _ in poller.poll()}
                data, left = _read_available(pipe)
                *lines, partial = (partial + data).split(b"\n")
                for raw in lines:
                    take(raw)
                if left is _Pipe.EOF:
                    if partial:
                        take(partial)
                    return
                if exit_fd is not None and exit_fd in ready and left is _Pipe.EMPTY:
                    poller.unregister(exit_fd)
                    drained.set()
        finally:
            drained.set()
            if exit_fd is not None:
                os.close(exit_fd)

    def _wait_exit(self, proc: subprocess.Popen, channel: launcher.LauncherChannel, generation: int, drained: threading.Event,
                   drain_s: float) -> None:  # fmt: skip
        code = proc.wait()
        channel.close()
        channel.closed.wait(REPLY_CLOSE_S)
        drained.wait(drain_s)
        oom_at_exit = self._oom_kills.read()  # the kill is counted before its SIGKILL is sent
        with self._lock:
            if generation == self._generation:
                self._oom_at_exit = oom_at_exit
                self._exit_code = code
                self._spawn_error = channel.spawn_error
                self._exited_at = time.monotonic()
        self._wake.set()

    def channel(self) -> launcher.LauncherChannel | None:
        """The running launcher's command pipes; None when no engine runs (nothing to checkpoint)."""
        with self._lock:
            return self._channel if self._proc is not None and self._exited_at is None else None

    # -------------------------------------------------------------- stopping

    def stop(self, *, drain: bool, drain_timeout: float) -> None:
        """Start a stop sequence in the background (no-op if one is running)."""
        with self._lock:
            self._stop_requested = True
            if self._stopper is not None and self._stopper.is_alive():
                return
            proc, pgid = self._proc, self._pgid
            if pgid is None:
                return
            self._stopper = threading.Thread(
                target=self._stop_sequence, args=(proc, pgid, drain, drain_timeout), name="engine-stopper", daemon=True
            )
            self._stopper.start()

    def _stop_sequence(self, proc: subprocess.Popen, pgid: int, drain: bool, drain_timeout: float) -> None:
        try:
            main_alive = proc.poll() is None
            if not main_alive:
                # The API server is gone: whatever is left of its group is an orphan
                # that can only hold memory. Nothing to drain.
                log.info("engine pid %d already exited; killing what is left of group %d", pgid, pgid)
            elif drain:
                # SIGTERM to the API server alone: it drains its engine. SIGTERM to the
                # whole group would kill EngineCore at once and abort every stream.
                log.info("drained stop: SIGTERM to engine pid %d, up to %.0f s", proc.pid, drain_timeout)
                _send(proc, signal.SIGTERM)
                self._wait_main(proc, drain_timeout)
            else:
                log.info("fast stop: SIGTERM to engine group %d", pgid)
                _signal_group(pgid, signal.SIGTERM)
                self._wait_main(proc, FAST_STOP_GRACE_S)
            left = group_members(pgid)
            if left:
                _signal_group(pgid, signal.SIGKILL)
                log.info("SIGKILL to engine group %d (left: %s)", pgid, ", ".join(map(str, left)))
            deadline = time.monotonic() + REAP_TIMEOUT_S
            while group_members(pgid):
                if time.monotonic() > deadline:
                    log.error("engine group %d still has %s after SIGKILL", pgid, group_members(pgid))
                    break
                _signal_group(pgid, signal.SIGKILL)
                time.sleep(0.002)
            try:
                proc.wait(timeout=REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        finally:
            self._wake.set()

    def _wait_main(self, proc: subprocess.Popen, timeout: float) -> None:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    # -------------------------------------------------------------- sampling

    def sample(self) -> ChildSample:
        with self._lock:
            proc, pgid = self._proc, self._pgid
            # Alive until the waiter publishes the exit with its code, after the
            # reader has taken in the last lines: never "dead, code unknown".
            alive = proc is not None and self._exited_at is None
            stopping = self._stopper is not None and self._stopper.is_alive()
            fields = dict(
                pid=proc.pid if proc is not None else None,
                alive=alive,
                started_at=self._started_at,
                exit_code=self._exit_code,
                exited_at=self._exited_at,
                stop_requested=self._stop_requested,
                stopping=stopping,
                spawn_error=self._spawn_error,
                generation=self._generation,
            )
            if self._spawn_error is not None:
                fields["root_cause"], fields["root_cause_certain"] = self._spawn_error, True
            elif self._exit_code is not None:
                why = rootcause.explain(
                    killed_by=signal_name(-self._exit_code) if self._exit_code < 0 else None,
                    log_lines=list(self._tail),  # a copy: the reader thread appends
                    oom_kills_at_start=self._oom_at_start.count,
                    oom_kills_at_exit=self._oom_at_exit.count,
                )
                fields.update(root_cause=why.cause, root_cause_certain=why.cause is not None, last_log_line=why.last_log_line)
        tree = group_members(pgid) if pgid is not None else ()
        # The whole tree's: vLLM computes in its EngineCore process, not in the API server.
        return ChildSample(tree_pids=tree, cpu_seconds=procstat.cpu_seconds(tree), **fields)

    def log_tail(self) -> list[str]:
        return list(self._tail)

    def kill_now(self) -> None:
        """Last resort on the daemon's way out: SIGKILL the group and reap it."""
        pgid = self._pgid
        if pgid is None:
            return
        _signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + REAP_TIMEOUT_S
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass


def _exit_fd(pid: int) -> int | None:
    """A pidfd that turns readable when `pid` exits; None where the kernel
    (before 5.3) or a seccomp filter refuses one."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


class _Pipe(enum.Enum):
    """What is left in a pipe after a read."""

    EMPTY = "empty"  # nothing, for now
    MORE = "more"  # the read stopped at its bound
    EOF = "eof"  # every writer has closed it


READ_BOUND = 1 << 20  # bytes per read round: an engine that floods its output is relayed as it goes


def _read_available(fd: int) -> tuple[bytes, _Pipe]:
    """What the non-blocking pipe `fd` holds now, up to READ_BOUND, and what is left."""
    chunks: list[bytes] = []
    size = 0
    while size < READ_BOUND:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return b"".join(chunks), _Pipe.EMPTY
        if not chunk:
            return b"".join(chunks), _Pipe.EOF
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), _Pipe.MORE


def _send(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
