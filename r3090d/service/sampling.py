"""One tick's readings, frozen into a Snapshot: the child, /health and /metrics, NVML, the probe, the host's load.

/health is asked only while an engine of ours should be answering (starting,
ready, or draining for a suspend, or being verified after one: `probe`);
/metrics once it is ready, as soon as /health first says 200, and while draining
for a suspend (its running and waiting counts end the drain). Nothing asks the
engine while its GPU work is locked or checkpointed.
"""

from __future__ import annotations

import threading
import time

from r3090d.config import Config
from r3090d.core.snapshot import GpuSample, GpuStatus, HealthSample, HealthStatus, MetricsSample, Snapshot
from r3090d.core.vocabulary import SUSPEND_PHASES, Phase
from r3090d.effectors.child import EngineProcess
from r3090d.probes.canary import CanaryProber
from r3090d.probes.engine import EngineProbe
from r3090d.probes.host import read_load
from r3090d.probes.inference import InferenceProber
from r3090d.service.commands import Pending

# Where a refusal or a wait names the GPU's other holders: while the GPU is lent, and
# around a restart (which may wait for the card).
NAMED_HOLDER_PHASES = (*SUSPEND_PHASES, Phase.RESTARTING, Phase.BACKOFF, Phase.WAITING_FOR_GPU)


class Sampler:
    def __init__(self, cfg: Config, engine: EngineProcess, gpu_monitor, wake: threading.Event, suspend=None):
        self.engine = engine
        self.gpu_monitor = gpu_monitor
        self.wake = wake
        self.suspend = suspend  # r3090d.service.suspend.SuspendService, or None
        self.last_metrics_text: str | None = None  # kept for the restart records
        self.prober: InferenceProber | None = None
        self.canary: CanaryProber | None = None
        self.configure(cfg)

    def configure(self, cfg: Config) -> None:
        """New probes for a new config (a reload): URLs, timeouts and the API key may have changed."""
        wd = cfg.watchdog
        uds = cfg.engine.uds
        self.probe = EngineProbe(cfg.engine_url, cfg.model_name, wd.health_timeout, wd.metrics_timeout, uds=uds)
        # The count of probes sent (and of those never answered) carries over: the engine's completed requests still hold them.
        old_prober = self.prober
        self.prober = InferenceProber(cfg.engine_url, cfg.model_name, cfg.api_key, wd.probe_timeout, wake=self.wake,
                                      sent_before=old_prober.sent_total if old_prober else 0,
                                      unanswered_before=old_prober.unanswered_total if old_prober else 0, kind=cfg.engine.kind, uds=uds)  # fmt: skip
        # So does the earlier engine's baseline the current engine's first canary is compared with.
        old = self.canary
        self.canary = CanaryProber(cfg.engine_url, cfg.model_name, cfg.api_key, cfg.canary, wake=self.wake,
                                   sent_before=old.sent_total if old else 0, unanswered_before=old.unanswered_total if old else 0,
                                   persisted=old.persisted if old else None, uds=uds)  # fmt: skip

    def gpu(self) -> GpuSample:
        return self.gpu_monitor.latest(time.monotonic()) if self.gpu_monitor else GpuSample(GpuStatus.DISABLED)

    def take(self, phase: Phase, *, shutdown: bool, pending: Pending, probe: bool | None = None) -> Snapshot:
        """`probe`: ask /health (policy.probes_engine); None: only while starting or ready."""
        now = time.monotonic()
        child = self.engine.sample()
        health = HealthSample(HealthStatus.SKIPPED)
        metrics = MetricsSample()
        if probe is None:
            probe = phase in (Phase.STARTING, Phase.READY)
        if child.alive and probe:
            health = self.probe.health()
            # Not after a /health timeout: a hung server would hold the tick for metrics_timeout too.
            if health.status is not HealthStatus.TIMEOUT and (phase in (Phase.READY, Phase.SUSPENDING) or health.status is HealthStatus.OK):
                metrics, self.last_metrics_text = self.probe.metrics()
        restart, maintenance, silences = pending.take()
        suspend, resume = pending.take_suspend()
        park, start, stop_cold, park_by_sleep = pending.take_swap()
        gpu = self.gpu()
        return Snapshot(
            now=now,
            wall=time.time(),
            child=child,
            health=health,
            metrics=metrics,
            gpu=gpu,
            inference=self.prober.sample(),
            canary=self.canary.sample(),
            host_load=read_load(),
            shutdown_requested=shutdown,
            restart_requested=restart,
            maintenance=maintenance,
            silences=silences,
            suspend_requested=suspend,
            resume_requested=resume,
            park=park,
            park_by_sleep=park_by_sleep,
            start_requested=start,
            stop_cold_requested=stop_cold,
            suspender=self.suspend.sample() if self.suspend is not None else None,
            sleeper=self.suspend.sleep_sample() if self.suspend is not None else None,
            # Names for a refused resume or a start waiting for the card ("held by pid N (name)"):
            # read only while the GPU is lent, or held by others.
            process_names=self.suspend.process_names(gpu) if self.suspend is not None and phase in NAMED_HOLDER_PHASES else (),
        )
