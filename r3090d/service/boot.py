"""Starting the daemon: read the config, ask the engine's python for its vLLM, build the pieces, run."""

from __future__ import annotations

import logging

from r3090d import __version__, exitcodes
from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.effectors.journal import setup_logging
from r3090d.service.daemon import Daemon

log = logging.getLogger("r3090d")


def run(config_path: str | None, instance: int | None, skip_preflight: bool) -> int:
    setup_logging()
    if instance is None:
        instance = configmod.instance_from_env()
    cfg = configmod.load(configmod.resolve_path(config_path, instance), instance)
    try:
        version = argvmod.engine_version(cfg.engine.python)
    except argvmod.EngineNotInstalled as exc:
        log.error("preflight vllm FAIL: %s (fix: make engine, or set engine.python in %s); exit %d", exc, cfg.source, exitcodes.PREFLIGHT_PERMANENT)
        return exitcodes.PREFLIGHT_PERMANENT
    argv = [] if cfg.models else argvmod.build_argv(cfg, version)  # swap mode: each model's engine has its own
    for warning in cfg.warnings:
        log.warning("%s", warning)
    log.info("r3090d %s: config %s, vLLM %s, engine at %s", __version__, cfg.source, version, cfg.engine_address)
    from r3090d.effectors.alerts import AlertDispatcher

    gpu_monitor = None
    if cfg.gpu.required:
        from r3090d.probes.nvml import NvmlMonitor

        gpu_monitor = NvmlMonitor(cfg.gpu.index, cfg.watchdog.nvml_hung_after, period_s=cfg.watchdog.poll_interval)
        gpu_monitor.start()
    if cfg.models:
        from r3090d.service.swapdaemon import SwapDaemon

        log.info("swap mode: %d models behind the router on %s:%d (%s)", len(cfg.models), cfg.engine.host, cfg.engine.port,
                 ", ".join(m.name for m in cfg.models))  # fmt: skip
        daemon = SwapDaemon(cfg, argv, gpu_monitor=gpu_monitor, alerts=AlertDispatcher.from_config(cfg), engine_version=version)
    else:
        daemon = Daemon(cfg, argv, gpu_monitor=gpu_monitor, alerts=AlertDispatcher.from_config(cfg), engine_version=version)
    daemon.install_signals()
    return daemon.run(skip_preflight=skip_preflight)
