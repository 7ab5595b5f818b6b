"""Reaping adopted orphans when r3090d is PID 1 (a container's main process).

When vLLM's API server dies, its EngineCore and workers are re-parented to
PID 1. Under systemd or tini, PID 1 reaps them; when r3090d itself is PID 1,
nobody else will, and every engine crash would leave zombies behind (each
holds a pid until its parent waits for it).

Not every child is ours to reap:

- the engine's main process: its exit status belongs to the waiter thread in
  `effectors.child` (`Popen.wait()`). Reaped here, Popen would see ECHILD and
  report exit code 0, so a crash would read as a clean exit. The caller
  names such pids through `keep()`;
- children in r3090d's own process group: anything the daemon starts with
  `subprocess` without a session of its own, whose Popen waits for it. They
  are spared for the same reason, so a future helper command cannot have its
  status stolen. The engine's tree runs in a session of its own, and the
  orphans it leaves behind are never in our group.

How zombies are found: `waitid(P_ALL, WNOHANG | WNOWAIT)` peeks at one
waitable child without reaping it. It is cheap and answers "nothing to do"
on almost every tick, but it always names the same child first: while the
engine's main process waits as a zombie for its waiter thread, a peek cannot
see past it to an orphan queued behind. So when a peek finds anything, the
zombies are listed from /proc (state Z, parent r3090d) and each one not kept
is reaped with `waitpid(pid, WNOHANG)`, whatever order the kernel keeps them
in. Only where /proc is not this pid namespace's (`/proc/self` names another
pid: a PID namespace without its own /proc mount) are peeks used alone; there
a zombie queued behind a kept one is reaped at the first call after the
waiter thread has taken the engine's status.

Call `reap()` from the loop thread only, the one that spawns the engine: a
spawn running in parallel could hand back a pid that `keep()` does not name yet.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("r3090d.reaper")

# A bound on one call's passes, so that children exiting faster than they are
# reaped cannot hold the loop; whatever is left waits for the next tick.
MAX_PASSES = 64


@dataclass(frozen=True)
class Reaped:
    pid: int
    exit_code: int  # as Popen.returncode: the exit status, or -N for death by signal N


class ChildReaper:
    """Reaps zombie children that nobody in this process waits for.

    keep: returns the pids whose status another thread will collect (None
    entries are ignored), asked only when a zombie has been found.
    active: None means "only when this process is PID 1".
    """

    def __init__(self, keep: Callable[[], Iterable[int | None]], *, active: bool | None = None, proc: str | Path = "/proc"):
        self.active = os.getpid() == 1 if active is None else active
        self._keep = keep
        self._proc = Path(proc)
        self.reaped_total = 0

    def reap(self) -> tuple[Reaped, ...]:
        """Reap every zombie child that is not kept; never blocks. Returns what was reaped."""
        if not self.active:
            return ()
        reaped: list[Reaped] = []
        for _ in range(MAX_PASSES):
            first = _peek()
            if first is None:
                break
            keep = {pid for pid in self._keep() if pid is not None}
            own_group = os.getpgrp()
            zombies = self._zombie_children()
            if zombies is None:
                # No /proc of our own: only the child the peek named can be seen.
                zombies = (first,)
            done = [r for pid in zombies if pid not in keep and _group(pid) != own_group for r in _reap(pid)]
            if not done:
                break  # only kept children (or our own group's) are waitable
            reaped.extend(done)
        self.reaped_total += len(reaped)
        for r in reaped:
            log.debug("reaped orphan pid %d (exit code %d)", r.pid, r.exit_code)
        return tuple(reaped)

    def _zombie_children(self) -> tuple[int, ...] | None:
        """Our zombie children from /proc, or None when /proc is not this pid namespace's."""
        me = os.getpid()
        try:
            if os.readlink(self._proc / "self") != str(me):
                return None
            names = os.listdir(self._proc)
        except OSError:
            return None
        found = []
        for name in names:
            if not name.isdigit():
                continue
            try:
                stat = (self._proc / name / "stat").read_bytes()
            except OSError:
                continue  # gone meanwhile
            # pid (comm) state ppid ...; comm may contain spaces and parentheses.
            fields = stat[stat.rfind(b")") + 2 :].split(b" ", 2)
            if len(fields) >= 2 and fields[0] == b"Z" and int(fields[1]) == me:
                found.append(int(name))
        return tuple(sorted(found))


def _peek() -> int | None:
    """The pid of one waitable (exited) child, left unreaped; None when there is none."""
    try:
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None  # no children at all
    return info.si_pid if info is not None else None


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)  # answers for a zombie too
    except OSError:
        return None


def _reap(pid: int) -> tuple[Reaped, ...]:
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return ()  # not our child (any more): reaped by someone else meanwhile
    if got == 0:
        return ()  # still running
    return (Reaped(got, os.waitstatus_to_exitcode(status)),)
