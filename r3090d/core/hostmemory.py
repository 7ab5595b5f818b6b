"""The host memory parked engines may hold: the budget, and how many engines fit in it. Pure.

A parked engine keeps in host RAM everything it held on the GPU (the driver's
checkpoint copies it there) plus its own base RSS (Python, the tokenizer, the
weights' host-side bookkeeping). The budget is the lower of the cgroup's room
(memory.max - memory.current, where a limit is set) and MemAvailable, less a
margin for everything else on the host. Both readings already count what parked
engines hold (they live in the service's cgroup), so a budget for all parked
engines together adds their holdings back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# An engine's host RSS outside its GPU memory before one has run to measure it: the API
# server and EngineCore with torch, CUDA's host-side state and the tokenizer come to about
# 1.5-2 GiB for a 7B model on vLLM 0.x; the higher figure, so preflight does not promise room
# that is not there.
ESTIMATED_BASE_RSS_MIB = 2048
# Host memory kept out of the budget: the daemon, the router, the page cache the next cold
# start reads weights through, and whatever else the host runs.
DEFAULT_HOST_MARGIN_MIB = 4096


@dataclass(frozen=True)
class HostMemory:
    """One reading of the host's memory, in MiB; a figure that could not be read is None, with why in `errors`."""

    mem_available_mib: int | None = None  # /proc/meminfo MemAvailable
    cgroup_max_mib: int | None = None  # memory.max of this process's cgroup; None: no limit ("max") or unread
    cgroup_current_mib: int | None = None  # memory.current of this process's cgroup
    errors: tuple[str, ...] = ()

    def budget_mib(self, margin_mib: int, *, held_by_parked_mib: int = 0) -> int:
        return host_budget_mib(
            self.mem_available_mib,
            self.cgroup_max_mib,
            self.cgroup_current_mib,
            margin_mib,
            held_by_parked_mib=held_by_parked_mib,
        )


def parked_cost_mib(gpu_mib: int, base_rss_mib: int) -> int:
    """What one engine holds in host RAM while parked."""
    return max(0, gpu_mib) + max(0, base_rss_mib)


def host_budget_mib(
    mem_available_mib: int | None,
    cgroup_max_mib: int | None,
    cgroup_current_mib: int | None,
    margin_mib: int,
    *,
    held_by_parked_mib: int = 0,
) -> int:
    """The host memory all parked engines together may hold, in MiB, never below 0.

    The lower of the cgroup's room (max - current, only where a limit is set and
    current was read) and MemAvailable, plus what parked engines already hold (both
    readings count it as used), less the margin. With neither reading there is no
    known room: 0, so nothing is parked (a swap is then a drained stop and a cold start).
    """
    rooms = []
    if mem_available_mib is not None:
        rooms.append(mem_available_mib)
    if cgroup_max_mib is not None and cgroup_current_mib is not None:
        rooms.append(cgroup_max_mib - cgroup_current_mib)
    if not rooms:
        return 0
    return max(0, min(rooms) + max(0, held_by_parked_mib) - max(0, margin_mib))


def parkable_count(budget_mib: int, engine_costs_mib: Iterable[int]) -> int:
    """How many of these engines can be parked at once within the budget: the cheapest first."""
    count = total = 0
    for cost in sorted(max(0, c) for c in engine_costs_mib):
        if total + cost > budget_mib:
            break
        total += cost
        count += 1
    return count
