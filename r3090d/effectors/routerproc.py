"""The router's process (swap mode): started, watched and restarted by the daemon.

The router (`python -m r3090d.router`) is the node's public endpoint in swap mode; the
daemon's own checks never go through it. It runs in its own session so that a signal to
the daemon's terminal does not reach it, and a waiter thread wakes the loop the moment it
exits, so a dead router is started again within the loop's next turn, not its next poll.
It is given the daemon's pid (--parent) and stops when the daemon dies (r3090d.router), so a
killed daemon outside systemd does not leave it holding the public port; call keep_running
from the loop's thread, which lives as long as the daemon: the router's parent-death signal
comes when the thread that forked it ends. The link accepts only this router (`running_pid`).
A router that keeps dying at once is started again after a growing delay (up to
MAX_RESTART_DELAY_S), never in a busy loop.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("r3090d")

STOP_TIMEOUT_S = 10.0  # SIGTERM lets its streams end; then SIGKILL
QUICK_DEATH_S = 5.0  # a router that dies sooner than this after its start counts toward the delay
MAX_RESTART_DELAY_S = 5.0


@dataclass(frozen=True)
class RouterSample:
    pid: int | None
    alive: bool
    restarts: int
    last_restart_at: float | None  # wall clock
    last_exit: str  # how the last one ended, one line; "" if none has


class RouterProcess:
    def __init__(self, argv: list[str], env: dict[str, str], wake: threading.Event):
        self.argv = argv
        self.env = env
        self.wake = wake
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.quick_deaths = 0
        self.last_restart_at: float | None = None
        self.last_exit = ""
        self.next_start_at = 0.0
        self.stopping = False

    def sample(self) -> RouterSample:
        alive = self.proc is not None and self.proc.poll() is None
        return RouterSample(self.proc.pid if self.proc else None, alive, self.restarts, self.last_restart_at, self.last_exit)

    def running_pid(self) -> int | None:
        """The pid of the router started last while it runs (the one process the link accepts); None otherwise.

        Read by the link's thread: returncode is set by the waiter once the process is reaped,
        so a dead router's pid, which the kernel may give to another process, is not returned.
        """
        proc = self.proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def keep_running(self, now: float) -> None:
        """Start the router, or start it again if it died (after the delay a run of quick deaths earns)."""
        if self.stopping:
            return
        if self.proc is not None and self.proc.poll() is None:
            return
        if self.proc is not None:
            code = self.proc.returncode
            self.last_exit = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            quick = now - self.started_at < QUICK_DEATH_S
            self.quick_deaths = self.quick_deaths + 1 if quick else 0
            self.next_start_at = now + (min(MAX_RESTART_DELAY_S, 0.25 * 2 ** (self.quick_deaths - 1)) if self.quick_deaths > 1 else 0.0)
            log.error("router (pid %d) %s; starting it again%s", self.proc.pid, self.last_exit,
                      f" in {self.next_start_at - now:.1f} s" if self.next_start_at > now else "")  # fmt: skip
            self.proc = None
            self.restarts += 1
            self.last_restart_at = time.time()
        if now < self.next_start_at:
            return
        self._spawn(now)

    def _spawn(self, now: float) -> None:
        try:
            argv = [*self.argv, "--parent", str(os.getpid())]
            self.proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            log.error("cannot start the router: %s", exc)
            self.next_start_at = now + MAX_RESTART_DELAY_S
            return
        self.started_at = now
        log.info("router started (pid %d)", self.proc.pid)
        proc = self.proc
        threading.Thread(target=self._wait, args=(proc,), name="router-waiter", daemon=True).start()

    def _wait(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self.wake.set()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; called as the daemon leaves."""
        self.stopping = True
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("router (pid %d) did not stop in %.0f s: killing it", proc.pid, STOP_TIMEOUT_S)
            proc.kill()
            proc.wait()


def router_argv(host: str, port: int, link: str, queue_timeout: float, max_body_bytes: int, api_key_file: str) -> list[str]:
    """The router's command line: addresses and limits only, never a key (the key file's path at most)."""
    argv = [sys.executable, "-m", "r3090d.router", "--host", host, "--port", str(port), "--link", link,
            "--queue-timeout", f"{queue_timeout:g}", "--max-body-bytes", str(max_body_bytes)]  # fmt: skip
    if api_key_file:
        argv += ["--api-key-file", api_key_file]
    return argv


def router_env(base: dict[str, str]) -> dict[str, str]:
    """Ours without systemd's notify variables (the router must not speak for the unit)."""
    env = {k: v for k, v in base.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONUNBUFFERED"] = "1"
    return env



