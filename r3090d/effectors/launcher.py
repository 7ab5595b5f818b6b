"""The engine's launcher: `python -m r3090d.effectors.launcher --control-fd R --reply-fd W --parent PID -- <vLLM argv>`.

The CUDA driver's checkpoint calls apply ptrace's access rules to their target:
under Yama's ptrace_scope = 1 only an ancestor of a process may act on it. The
daemon therefore starts this small process in the engine's new session, and it
starts vLLM's API server as its child, so the process that makes the driver
calls is an ancestor of every engine process:

    r3090d -> launcher -> API server -> EngineCore -> workers

What it does, and what it leaves as it was:

- it is a child subreaper: a process of the tree whose parent exits is
  reparented here, not to init, and so stays a descendant;
- SIGTERM and SIGINT go on to the API server alone, as the daemon sent them
  before: a drained stop still drains;
- the API server's end is relayed: exit N exits N; death by signal S re-raises
  S here, so the daemon reads -S as it would from the API server itself;
- when the daemon dies (PR_SET_PDEATHSIG: SIGHUP here) it SIGKILLs the whole
  group, itself included, so no engine outlives its daemon. Its own death by
  any other means the daemon sees as the engine's, and stops the group;
- checkpoint commands come on the control pipe, one JSON line each, and run in
  a thread of this process (a forked helper would be a sibling again) through
  suspender_worker's own command handling; progress lines go back on the reply
  pipe. One operation at a time: the next line is read when one ends;
- it writes nothing on stdout or stderr: the API server inherits both, so the
  daemon reads vLLM's output unchanged. A failure to start the API server is
  the one message, sent on the reply pipe (SPAWN_ERROR) before exiting
  EXIT_SPAWN_FAILED.

The daemon's end of the pipes is `LauncherChannel` at the bottom.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

from r3090d.core.suspend_types import Outcome
from r3090d.effectors.parentdeath import PR_SET_CHILD_SUBREAPER, die_with, prctl
from r3090d.effectors.suspender_worker import DONE, Command, Line, handle

MODULE = "r3090d.effectors.launcher"
DAEMON_GONE = signal.SIGHUP  # the launcher's parent-death signal
EXIT_SPAWN_FAILED = 127  # as a shell's "command not found"; the reason goes on the reply pipe
SPAWN_ERROR = "spawn_error"  # the key of the reply line that says the API server could not be started


# ------------------------------------------------------------- the launcher's side


def _kill_group(_signum=None, _frame=None) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)  # the launcher goes with it


def _serve(control: int, reply: int) -> None:
    """Run each command line read from `control`, in turn, until the daemon closes it."""
    lock = threading.Lock()

    def emit(line: Line) -> None:
        # The daemon may have gone: the sequence still runs to its end, so an engine
        # is never left locked because nobody was listening.
        with lock:
            try:
                os.write(reply, (line.to_json() + "\n").encode())
            except OSError:
                pass

    with os.fdopen(control, "r", encoding="utf-8") as lines:
        for text in lines:
            try:
                handle(text, emit)
            except Exception as exc:  # noqa: BLE001 - the daemon must get an answer, or the operation stays in flight
                emit(Line(DONE, 0.0, ok=False, error=f"{type(exc).__name__}: {exc}", outcome=Outcome.UNKNOWN))


def _relay(status: int) -> None:
    """End this process as the API server ended (see the module doc)."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        os._exit(code)
    signum = -code
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the engine's crash, not the launcher's: no core of this process
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose action cannot be changed
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not to terminate: the shell's encoding


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="start vLLM as r3090d's engine (started by r3090d)")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True, help="the daemon's pid")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)

    signal.signal(DAEMON_GONE, _kill_group)
    if not die_with(args.parent, DAEMON_GONE):
        _kill_group()  # the daemon died before the signal was asked for: nobody would see this engine
    prctl(PR_SET_CHILD_SUBREAPER, 1)

    try:
        # stdin, stdout and stderr inherited; the pipes (and every other descriptor) closed.
        server = subprocess.Popen(args.command, close_fds=True)
    except OSError as exc:
        reason = f"cannot start {args.command[0]}: {exc.strerror or exc}"
        os.write(args.reply_fd, (json.dumps({SPAWN_ERROR: reason}) + "\n").encode())
        return EXIT_SPAWN_FAILED

    def forward(signum, _frame) -> None:
        try:
            os.kill(server.pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    threading.Thread(target=_serve, args=(args.control_fd, args.reply_fd), name="checkpoint", daemon=True).start()
    while True:
        # Every child: the API server, and orphans of its tree adopted as subreaper.
        pid, status = os.waitpid(-1, 0)
        if pid == server.pid:
            _relay(status)


# ------------------------------------------------------------------- the daemon's side


class LauncherChannel:
    """The daemon's end of one launcher's pipes: checkpoint commands out, progress lines back.

    A reader thread takes every reply line as it comes, so a launcher that dies
    mid-operation ends the exchange (EOF) instead of leaving a reader blocked.
    """

    def __init__(self, control: int, reply: int):
        self._control = control
        self._replies: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self.spawn_error: str | None = None
        self.closed = threading.Event()  # set once the launcher's end of the reply pipe is closed: it has exited
        threading.Thread(target=self._read, args=(reply,), name="launcher-replies", daemon=True).start()

    def _read(self, reply: int) -> None:
        with os.fdopen(reply, "r", encoding="utf-8", errors="replace") as lines:
            for text in lines:
                if SPAWN_ERROR in (said := _json_object(text)):
                    self.spawn_error = str(said[SPAWN_ERROR])
                else:
                    self._replies.put(text)
        self._replies.put(None)
        self.closed.set()

    def exchange(self, command: Command) -> Iterator[str]:
        """Send `command`; yield its progress lines up to its last (step "done"), or until the launcher exits."""
        with self._send_lock:
            try:
                os.write(self._control, (command.to_json() + "\n").encode())
            except OSError:
                return  # the launcher has exited: the caller reports no result
        while (text := self._replies.get()) is not None:
            yield text
            if _json_object(text).get("step") == DONE:
                return
        self._replies.put(None)  # still closed for the next caller

    def close(self) -> None:
        try:
            os.close(self._control)
        except OSError:
            pass


def _json_object(text: str) -> dict:
    try:
        said = json.loads(text)
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


if __name__ == "__main__":
    sys.exit(main())
