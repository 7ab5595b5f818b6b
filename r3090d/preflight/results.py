"""What preflight judges and what it says: the facts gathered, each check's verdict. Pure: no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from r3090d.core.hostmemory import HostMemory
from r3090d.core.snapshot import GpuSample, HostFacts
from r3090d.measure.modelinfo import ModelFacts


class Status(enum.StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    measured: str
    expected: str
    hint: str = ""
    permanent: bool = True  # for FAIL: True = needs a human; False = may clear by itself


@dataclass(frozen=True)
class PreflightFacts:
    gpu: GpuSample
    host: HostFacts
    engine_version: str | None = None  # vLLM version of engine.python
    engine_error: str | None = None  # why it could not be read
    own_pids: frozenset[int] = frozenset()  # the daemon's running engine tree
    pid_names: tuple[tuple[int, str], ...] = ()  # names of processes holding VRAM, where known
    # The driver's checkpoint state of the running engine's GPU process (the suspend worker's
    # "state" op), e.g. "pid 123: RUNNING", or "unavailable: why"; None when not asked.
    checkpoint_state: str | None = None
    ptrace_scope: int | None = None  # Yama's kernel.yama.ptrace_scope; None where Yama is not in the kernel
    host_memory: HostMemory | None = None  # MemAvailable and the cgroup's room, read in swap mode only
    models: tuple[tuple[str, ModelFacts | None], ...] = ()  # swap mode: each [[models]] entry's directory (None: a hub name)


