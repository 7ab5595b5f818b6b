"""The unit's OOM-kill count, from its cgroup's memory.events (cgroup v2).

The engine runs in the daemon's own cgroup (the service's), so a rise of
`oom_kill` in that cgroup's memory.events during an engine's life means the
kernel's OOM killer killed one of its processes. It is the only trace the unit
can see: ProtectKernelLogs hides the kernel's log, and when the victim is
EngineCore the API server exits 0.

A missing or unreadable file (cgroup v1, the memory controller off, the root
cgroup of a container) is a field of the answer, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"
_V2_ENTRY = "0::"  # /proc/self/cgroup's line for the unified hierarchy


@dataclass(frozen=True)
class OomKillCount:
    count: int | None  # None: not read, see error
    error: str | None = None


class OomKillCounter:
    """Reads `oom_kill` from memory.events of the cgroup /proc/self/cgroup names.
    Both paths are parameters so that a test can point them at files it writes."""

    def __init__(self, *, cgroup_root: str | Path = CGROUP_ROOT, self_cgroup: str | Path = SELF_CGROUP):
        self._root = Path(cgroup_root)
        self._self_cgroup = Path(self_cgroup)

    def read(self) -> OomKillCount:
        try:
            entries = self._self_cgroup.read_text().splitlines()
        except OSError as exc:
            return OomKillCount(None, f"cannot read {self._self_cgroup}: {exc.strerror or exc}")
        path = next((line[len(_V2_ENTRY) :] for line in entries if line.startswith(_V2_ENTRY)), None)
        if path is None:
            return OomKillCount(None, f"{self._self_cgroup} names no cgroup v2 (unified) group")
        events = self._root / path.lstrip("/") / "memory.events"
        try:
            text = events.read_text()
        except FileNotFoundError:
            return OomKillCount(None, f"no {events} (no memory controller for this cgroup)")
        except OSError as exc:
            return OomKillCount(None, f"cannot read {events}: {exc.strerror or exc}")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                try:
                    return OomKillCount(int(value))
                except ValueError:
                    break
        return OomKillCount(None, f"{events} has no oom_kill count")
