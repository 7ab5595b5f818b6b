"""Whether the card has room for an engine to start: one pure check for preflight and every automatic start.

vLLM refuses to start when the free memory on the device is below
gpu_memory_utilization x the card ("Free memory on device ... is less than desired
GPU memory utilization"). A desktop session or a borrower's job that holds the card
when the engine restarts makes every start fail the same way, so an automatic start
waits for the room instead of spending start failures. Only processes outside the
engine's tree count as holders: another process's small context leaves room.
"""

from __future__ import annotations

from dataclasses import dataclass

from r3090d.config.schema import Config
from r3090d.core.snapshot import GpuProcess, GpuSample
from r3090d.engineflags import VLLM_DEFAULT_GPU_MEMORY_UTILIZATION, flag_value
from r3090d.units import GIB, MIB

# The engine's own CUDA context and allocator slack beyond its share of the card.
ENGINE_CONTEXT_MARGIN = GIB // 2


def gpu_memory_utilization(cfg: Config) -> float:
    """The share of the card the engine will ask for: the profile's, else the flag's, else vLLM's default."""
    profile = cfg.active_profile
    if profile is not None:
        return profile.gpu_memory_utilization
    raw = flag_value(cfg.engine.extra_args, "--gpu-memory-utilization")
    try:
        return float(raw) if raw is not None else VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    except ValueError:
        return VLLM_DEFAULT_GPU_MEMORY_UTILIZATION


def unique_processes(procs) -> list[GpuProcess]:
    """One entry per pid (NVML may list a process as both compute and graphics): the larger figure."""
    best: dict[int, GpuProcess] = {}
    for p in procs:
        seen = best.get(p.pid)
        if seen is None or (p.used_bytes or 0) > (seen.used_bytes or 0):
            best[p.pid] = p
    return list(best.values())


def others_on_card(gpu: GpuSample, own_pids) -> list[GpuProcess]:
    """The card's processes outside `own_pids` (compute and graphics, one entry per pid), largest first."""
    own = set(own_pids)
    procs = unique_processes((gpu.processes or ()) + (gpu.graphics_processes or ()))
    return sorted((p for p in procs if p.pid not in own), key=lambda p: (-(p.used_bytes or 0), p.pid))


@dataclass(frozen=True)
class Holder:
    pid: int
    name: str | None
    used_bytes: int | None

    def text(self) -> str:
        used = f"{self.used_bytes / MIB:.0f} MiB" if self.used_bytes is not None else "? MiB"
        return f"pid {self.pid} ({self.name + ', ' if self.name else ''}{used})"


@dataclass(frozen=True)
class Room:
    fits: bool
    need: int  # bytes free the engine needs to start
    free: int  # bytes free now
    holders: tuple[Holder, ...] = ()  # processes outside the engine's tree, largest first

    def text(self) -> str:
        have = f"{self.free / MIB:.0f} MiB free, {self.need / MIB:.0f} MiB needed"
        if not self.holders:
            return have
        return f"{have}; held by {', '.join(h.text() for h in self.holders)}"


def engine_room(gpu: GpuSample, cfg: Config, own_pids: tuple[int, ...] = (),
                names: tuple[tuple[int, str], ...] = ()) -> Room | None:  # fmt: skip
    """The room for a new engine on this reading; None when NVML does not say (nothing to judge on)."""
    if not gpu.usable or gpu.memory_total is None or gpu.memory_free is None:
        return None
    need = int(gpu_memory_utilization(cfg) * gpu.memory_total) + ENGINE_CONTEXT_MARGIN
    known = dict(names)
    holders = tuple(Holder(p.pid, known.get(p.pid), p.used_bytes) for p in others_on_card(gpu, own_pids))
    return Room(fits=gpu.memory_free >= need, need=need, free=gpu.memory_free, holders=holders)
