"""Collect the facts preflight judges: the impure half of r3090d.preflight.checks."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from r3090d import argv as argvmod
from r3090d.config import Config
from r3090d.core.snapshot import GpuSample, GpuStatus
from r3090d.preflight.checks import CheckResult, PreflightFacts, run_checks
from r3090d.probes import nvml as nvmlprobe
from r3090d.probes.host import gather_host

DEFAULT_NVML_TIMEOUT_S = 10.0


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
    host = gather_host(cfg.engine.host, cfg.engine.port, cfg.engine.model, root)
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
        own_pids=frozenset(own_pids),
        pid_names=_process_names(gpu),
    )


def run(cfg: Config, own_pids: Iterable[int] = (), **kwargs) -> list[CheckResult]:
    return run_checks(gather(cfg, own_pids, **kwargs), cfg)
