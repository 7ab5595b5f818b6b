"""The host memory a parked engine can go into: MemAvailable and this process's cgroup (v2) limit.

Engines run in the daemon's cgroup, so a parked engine's host copy of its GPU
memory counts against that cgroup's memory.max, and against any ancestor's: the
tightest room (max - current) over the cgroup and its ancestors is the one that
binds. "max" in memory.max means no limit at that level.

Every failure (no /proc/meminfo, cgroup v1, the memory controller off, a file
that does not parse) is a field of the reading, never an exception.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from r3090d.core.hostmemory import HostMemory
from r3090d.probes.cgroup import CGROUP_ROOT, SELF_CGROUP
from r3090d.units import MIB

MEMINFO = "/proc/meminfo"
UNIFIED_ENTRY = "0::"  # /proc/self/cgroup's line for the cgroup v2 (unified) hierarchy
NO_LIMIT = "max"


def read_host_memory(
    *,
    meminfo: str | Path = MEMINFO,
    cgroup_root: str | Path = CGROUP_ROOT,
    self_cgroup: str | Path = SELF_CGROUP,
) -> HostMemory:
    """One reading; the paths are parameters so that a test can point them at files it writes."""
    errors: list[str] = []
    available = _mem_available_mib(Path(meminfo), errors)
    limit, current = _cgroup_room(Path(cgroup_root), Path(self_cgroup), errors)
    return HostMemory(available, limit, current, tuple(errors))


def _mem_available_mib(meminfo: Path, errors: list[str]) -> int | None:
    try:
        text = meminfo.read_text()
    except OSError as exc:
        errors.append(f"cannot read {meminfo}: {exc.strerror or exc}")
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name != "MemAvailable":
            continue
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            return int(parts[0]) * 1024 // MIB
        errors.append(f"{meminfo}: MemAvailable does not parse: {rest.strip()!r}")
        return None
    errors.append(f"{meminfo} has no MemAvailable")
    return None


def _own_cgroup(self_cgroup: Path, errors: list[str]) -> PurePosixPath | None:
    try:
        entries = self_cgroup.read_text().splitlines()
    except OSError as exc:
        errors.append(f"cannot read {self_cgroup}: {exc.strerror or exc}")
        return None
    path = next((line[len(UNIFIED_ENTRY) :] for line in entries if line.startswith(UNIFIED_ENTRY)), None)
    if path is None:
        errors.append(f"{self_cgroup} names no cgroup v2 (unified) group")
        return None
    return PurePosixPath("/") / path.strip().lstrip("/")


def _read_bytes(path: Path) -> int | str | None:
    """A memory.* file's number, NO_LIMIT, or None when there is no such file; OSError/ValueError otherwise."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return NO_LIMIT if text == NO_LIMIT else int(text)


def _cgroup_room(root: Path, self_cgroup: Path, errors: list[str]) -> tuple[int | None, int | None]:
    """(memory.max, memory.current) in MiB of the level with the least room, over this process's
    cgroup and its ancestors; (None, current) when no level sets a limit, (None, None) when unread."""
    own = _own_cgroup(self_cgroup, errors)
    if own is None:
        return None, None
    own_current: int | None = None
    tightest: tuple[int, int] | None = None  # (max, current) in bytes
    for level in (own, *own.parents):
        directory = root / str(level).lstrip("/")
        try:
            limit = _read_bytes(directory / "memory.max")
            current = _read_bytes(directory / "memory.current")
        except (OSError, ValueError) as exc:
            errors.append(
                f"cannot read the memory files in {directory}: {getattr(exc, 'strerror', None) or exc}"
            )
            if level == own:
                return None, None
            continue  # an ancestor's limit unread: the levels read still bind
        if level == own:
            if not isinstance(current, int):
                errors.append(f"no {directory / 'memory.current'} (no memory controller for this cgroup)")
                return None, None
            own_current = current
        if isinstance(limit, int) and isinstance(current, int):
            if tightest is None or limit - current < tightest[0] - tightest[1]:
                tightest = (limit, current)
    if tightest is None:
        return None, own_current // MIB if own_current is not None else None
    return tightest[0] // MIB, -(-tightest[1] // MIB)  # the room rounded down: current rounded up
