"""One tick's readings, frozen into a Snapshot: the child, /health and /metrics, NVML, the probe.

/health is asked only while an engine of ours should be answering (starting or
ready); /metrics once it is ready, or as soon as /health first says 200.
"""

from __future__ import annotations

import threading
import time

from r3090d.config import Config
from r3090d.core.snapshot import EngineSample, GpuSample, GpuStatus, HealthSample, HealthStatus, Snapshot
from r3090d.core.vocabulary import Phase
from r3090d.effectors.child import EngineProcess
from r3090d.probes.engine import EngineProbe
from r3090d.probes.inference import InferenceProber
from r3090d.service.commands import Pending


class Sampler:
    def __init__(self, cfg: Config, engine: EngineProcess, gpu_monitor, wake: threading.Event):
        self.engine = engine
        self.gpu_monitor = gpu_monitor
        self.wake = wake
        self.last_metrics_text: str | None = None  # kept for the restart records
        self.configure(cfg)

    def configure(self, cfg: Config) -> None:
        """New probes for a new config (a reload): URLs, timeouts and the API key may have changed."""
        wd = cfg.watchdog
        self.probe = EngineProbe(cfg.engine_url, cfg.model_name, wd.health_timeout, wd.metrics_timeout)
        self.prober = InferenceProber(cfg.engine_url, cfg.model_name, cfg.api_key, wd.probe_timeout, wake=self.wake)

    def gpu(self) -> GpuSample:
        return self.gpu_monitor.latest(time.monotonic()) if self.gpu_monitor else GpuSample(GpuStatus.DISABLED)

    def take(self, phase: Phase, *, shutdown: bool, pending: Pending) -> Snapshot:
        now = time.monotonic()
        child = self.engine.sample()
        health = HealthSample(HealthStatus.SKIPPED)
        engine = EngineSample()
        if child.alive and phase in (Phase.STARTING, Phase.READY):
            health = self.probe.health()
            if phase is Phase.READY or health.status is HealthStatus.OK:
                engine, self.last_metrics_text = self.probe.metrics()
        restart, maintenance, silences = pending.take()
        return Snapshot(
            now=now,
            wall=time.time(),
            child=child,
            health=health,
            engine=engine,
            gpu=self.gpu(),
            inference=self.prober.sample(),
            shutdown_requested=shutdown,
            restart_requested=restart,
            maintenance=maintenance,
            silences=silences,
        )
