"""/proc/PID/stat, read in one place: a process's state, parent, group and start time.

The daemon uses it on the crash-to-respawn path (its process group's members) and
for a suspended engine's identity; tests and benchmarks use it to watch real
processes. Reading the file directly costs about 10 µs a process, where psutil's
process_iter costs about 16 ms for a hundred.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

GONE_STATES = ("Z", "X")  # zombie, dead: nothing left to run or to signal


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    state: str  # one letter: R running, S sleeping, D in the kernel, T stopped, Z zombie...
    ppid: int
    pgrp: int
    start_ticks: int  # clock ticks since boot: with the pid, a process's identity (pids are reused)

    @property
    def live(self) -> bool:
        return self.state not in GONE_STATES


def parse(pid: int, raw: bytes) -> ProcStat | None:
    """The fields of one /proc/PID/stat text, or None if it is not one (pure)."""
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so the
    # fields are counted from the last ")".
    close = raw.rfind(b")")
    fields = raw[close + 2 :].split()
    try:
        comm = raw[raw.find(b"(") + 1 : close].decode(errors="replace")
        return ProcStat(pid, comm, fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def read(pid: int) -> ProcStat | None:
    """The process now, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return parse(pid, raw)


def scan() -> Iterator[ProcStat]:
    """Every process in /proc (one that ends during the scan is left out); OSError if /proc cannot be listed."""
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := read(int(name))) is not None:
            yield st
