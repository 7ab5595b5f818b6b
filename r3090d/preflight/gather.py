"""Collect the facts preflight judges: the impure half of r3090d.preflight.checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from r3090d import argv as argvmod
from r3090d.config import Config
from r3090d.core.hostmemory import HostMemory
from r3090d.core.room import unique_processes
from r3090d.core.snapshot import GpuSample, GpuStatus
from r3090d.core.suspend_types import Outcome
from r3090d.core.suspension import pick_target
from r3090d.effectors.suspender import Suspender
from r3090d.measure.modelinfo import read_model_dir
from r3090d.preflight.checks import CheckResult, PreflightFacts, run_checks
from r3090d.probes import nvml as nvmlprobe
from r3090d.probes.host import gather_host
from r3090d.probes.hostmem import read_host_memory

DEFAULT_NVML_TIMEOUT_S = 10.0
CHECKPOINT_STATE_TIMEOUT_S = 15.0  # the worker loads libcuda and calls cuInit: seconds on a busy host


def read_mem_available(root: Path | str = "/") -> int | None:
    """/proc/meminfo MemAvailable in bytes: what a suspended engine's GPU memory must fit into."""
    try:
        text = (Path(root) / "proc" / "meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            parts = rest.split()
            try:
                return int(parts[0]) * 1024 if parts and parts[-1] == "kB" else None
            except ValueError:
                return None
    return None


def read_ptrace_scope(root: Path | str = "/") -> int | None:
    """Yama's kernel.yama.ptrace_scope (0-3); None where the kernel has no Yama (or it cannot be read)."""
    try:
        return int((Path(root) / "proc" / "sys" / "kernel" / "yama" / "ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def checkpoint_state(gpu: GpuSample, own_pids: Iterable[int]) -> str | None:
    """Ask the driver (through the suspend worker, never in this process) about the running engine's
    one GPU process: "pid N: RUNNING", or "unavailable: why". None when no engine of ours is on the GPU."""
    if not gpu.usable or not gpu.processes or not own_pids:
        return None
    pid, _ = pick_target(unique_processes(gpu.processes + (gpu.graphics_processes or ())), own_pids)
    if pid is None:
        return None
    suspender = Suspender(deadline_s=CHECKPOINT_STATE_TIMEOUT_S)
    suspender.query(pid)
    sample = suspender.wait(CHECKPOINT_STATE_TIMEOUT_S)
    if sample.outcome is Outcome.REPORTED and sample.state is not None:
        return f"pid {pid}: {sample.state.name}"
    if sample.outcome is Outcome.UNAVAILABLE:
        return f"unavailable: {sample.error}"
    return None  # no answer in time, or an error about this pid: says nothing about the host


def _process_names(gpu: GpuSample) -> tuple[tuple[int, str], ...]:
    names = []
    for proc in gpu.processes or ():
        try:
            names.append((proc.pid, psutil.Process(proc.pid).name()))
        except (psutil.Error, OSError):
            pass
    return tuple(names)


def gather(
    cfg: Config,
    own_pids: Iterable[int] = (),
    *,
    gpu: GpuSample | None = None,
    nvml: Any = None,
    root: Path | str = "/",
) -> PreflightFacts:
    """Everything run_checks needs. Pass `gpu` to reuse a reading (the daemon's NvmlMonitor.latest()).

    Without one, a single bounded NVML reading is taken (nvml: a module
    standing in for pynvml; None imports pynvml).
    """
    if gpu is None:
        if not cfg.gpu.required:
            gpu = GpuSample(GpuStatus.DISABLED, "gpu.required = false", index=cfg.gpu.index)
        else:
            timeout = min(DEFAULT_NVML_TIMEOUT_S, cfg.watchdog.nvml_hung_after)
            kwargs = {"nvml": nvml} if nvml is not None else {}
            gpu = nvmlprobe.read_gpu(cfg.gpu.index, timeout, **kwargs)
    own_pids = frozenset(own_pids)
    host = gather_host(cfg.engine.host, cfg.engine.port, root)
    host = dataclasses.replace(host, mem_available_bytes=read_mem_available(root), model=model_facts(cfg.engine.model))
    version = error = None
    try:
        version = str(argvmod.engine_version(cfg.engine.python))
    except argvmod.EngineNotInstalled as exc:
        error = str(exc)
    return PreflightFacts(
        gpu=gpu,
        host=host,
        engine_version=version,
        engine_error=error,
        own_pids=own_pids,
        pid_names=_process_names(gpu),
        checkpoint_state=checkpoint_state(gpu, own_pids) if cfg.gpu.required else None,
        ptrace_scope=read_ptrace_scope(root),
        host_memory=_host_memory(root) if getattr(cfg, "models", ()) else None,
        models=tuple((m.name, model_facts(m.model)) for m in getattr(cfg, "models", ())),
    )


def _host_memory(root: Path | str) -> HostMemory:
    """What parked engines may hold (swap mode): MemAvailable and this process's cgroup, under `root`."""
    root = Path(root)
    return read_host_memory(
        meminfo=root / "proc" / "meminfo",
        cgroup_root=root / "sys" / "fs" / "cgroup",
        self_cgroup=root / "proc" / "self" / "cgroup",
    )


def run(cfg: Config, own_pids: Iterable[int] = (), **kwargs) -> list[CheckResult]:
    return run_checks(gather(cfg, own_pids, **kwargs), cfg)


def model_facts(model: str | None):
    """What the model's directory says of it (measure/modelinfo.py); None for a hub name."""
    return read_model_dir(model) if model and _is_local_path(model) else None


def _is_local_path(model: str) -> bool:
    """engine.model is a directory path, not a hub name such as Qwen/Qwen2.5-7B-Instruct."""
    return model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()
