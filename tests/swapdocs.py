"""State documents of swap mode, built from the document's own types: what a swap-mode daemon publishes.

Three models behind the router: `chat` resident and ready, `coder` parked in host
memory with one request frozen in it, `embed` cold. The last swap brought `chat`
in from `coder` in 9.8 s. Times are relative to `now` (NOW by default). Change any
part with `swap_doc(models=..., swap=...)` or `with_model`; `as_json` gives what a
reader gets.
"""

from __future__ import annotations

import dataclasses
import json

from r3090d.config.schema import EngineKind
from r3090d.core.arbiter import Residency
from r3090d.core.snapshot import GpuSample, GpuStatus, HealthSample, HealthStatus, MetricsSample
from r3090d.core.suspension import Result, Stage
from r3090d.core.vocabulary import Phase
from r3090d.service.statedoc import (
    SWAP_BUCKETS,
    CanaryInfo,
    DaemonInfo,
    EngineInfo,
    Histogram,
    LastRequest,
    ModelDoc,
    ProbeInfo,
    RestartsInfo,
    RouterInfo,
    StateDocument,
    SuspendInfo,
    SwapInfo,
    SwapRecord,
    Thresholds,
)
from r3090d.units import GIB

NOW = 1_800_000_000.0


def engine(phase: Phase, now: float, *, pid: int | None = None, model: str = "/srv/models/x", port: int = 18100, **changes) -> EngineInfo:
    info = EngineInfo(state=phase.value, phase=phase, since=now - 60, pid=pid, tree_pids=[pid] if pid else [], model=model,
                      url=f"http://127.0.0.1:{port}", ready_since=now - 60 if phase is Phase.READY else None, generation=1)  # fmt: skip
    return dataclasses.replace(info, **changes)


def chat(now: float = NOW) -> ModelDoc:
    """Resident and ready, two requests running."""
    return ModelDoc(
        name="chat", kind=EngineKind.GENERATE, residency=Residency.READY, port=18100, last_used=now - 12, gpu_bytes=15 * GIB,
        swaps_in=4, swaps_out=3, inflight=2,
        engine=engine(Phase.READY, now, pid=501, model="/srv/models/qwen-chat", port=18100),
        restarts=RestartsInfo(total=1, by_reason={"kv": 1}, last_reason="kv", last_at=now - 3600, backoff_level=0),
        health=HealthSample(HealthStatus.OK, 200, 0.01),
        inference=ProbeInfo(ok=True, latency_s=0.05, finished_at=now - 5),
        canary=CanaryInfo(enabled=True, interval_s=600.0, baseline_tokens=16, checks=5, last_verdict="match", last_match_at=now - 30, last_ok_at=now - 30),
        metrics=MetricsSample(kv_usage=0.25, num_gpu_blocks=1000, free_blocks=749.25, running=2.0, waiting=0.0),
    )  # fmt: skip


def coder(now: float = NOW) -> ModelDoc:
    """Parked by the arbiter: suspended with its GPU memory in host memory, a request frozen in it."""
    return ModelDoc(
        name="coder", kind=EngineKind.GENERATE, residency=Residency.PARKED, port=18101, last_used=now - 180, host_bytes=16 * GIB,
        gpu_bytes=15 * GIB, swaps_in=3, swaps_out=4, inflight=1, frozen=1,
        engine=engine(Phase.SUSPENDED, now, pid=601, model="/srv/models/qwen-coder", port=18101),
        restarts=RestartsInfo(backoff_level=0),
        canary=CanaryInfo(enabled=True, interval_s=600.0, baseline_tokens=16, checks=3, last_verdict="match", last_match_at=now - 200, last_ok_at=now - 200),
        suspend=SuspendInfo(stage=Stage.SUSPENDED, since=now - 170, pid=602, gpu_bytes=15 * GIB, host_rss_bytes=16 * GIB, frozen_requests=1,
                            how_to_resume="r3090ctl resume", last=LastRequest(7, "suspend", Result.SUSPENDED, "parked", now - 170), parked=True),
        metrics=MetricsSample(kv_usage=0.95, num_gpu_blocks=1000, free_blocks=49.95, running=1.0, waiting=3.0),  # from before it was parked
    )  # fmt: skip


def embed(now: float = NOW) -> ModelDoc:
    """Cold: no process, started when its model is asked for."""
    return ModelDoc(
        name="embed", kind=EngineKind.EMBED, residency=Residency.COLD, port=18102,
        engine=engine(Phase.COLD, now, model="/srv/models/bge", port=18102),
        restarts=RestartsInfo(backoff_level=0),
    )  # fmt: skip


def swap_info(now: float = NOW) -> SwapInfo:
    """Seven swaps, none failed; the last brought chat in from coder in 9.8 s."""
    last = SwapRecord(from_model="coder", to_model="chat", ok=True, seconds=9.8, drain_s=0.1, checkpoint_s=6.3, restore_s=2.5, canary_s=0.4,
                      routing_s=0.01, frozen_requests=1, at=now - 170)  # fmt: skip
    return SwapInfo(
        total=7, failed=0, last=last,
        latency=Histogram.empty(SWAP_BUCKETS).observed(9.8).observed(4.0).observed(31.0),
        host_budget_bytes=48 * GIB, host_parked_bytes=16 * GIB,
        router=RouterInfo(pid=400, up=True, linked=True, address="0.0.0.0:8000"),
        max_resident=1, queue_timeout=120.0,
    )  # fmt: skip


def swap_doc(now: float = NOW, **changes) -> StateDocument:
    doc = StateDocument(
        written_at=now - 1,
        daemon=DaemonInfo(pid=100, started_at=now - 7200, version="0.1.0", config="/etc/r3090d/r3090d.toml", host="gpu1", poll_interval=2.0),
        # The top-level engine describes no engine in swap mode.
        engine=EngineInfo(state="swap", model="", url="http://127.0.0.1:8000"),
        thresholds=Thresholds(gpu_memory_alert_bytes=23 * GIB, kv_min_free_blocks=100, restart_storm_restarts=3, restart_storm_window_s=3600.0),
        gpu=GpuSample(GpuStatus.OK, index=0, name="RTX 3090", memory_total=24 * GIB, memory_used=16 * GIB, utilization_gpu=40, temperature_c=60),
        models=[chat(now), coder(now), embed(now)],
        swap=swap_info(now),
    )  # fmt: skip
    return dataclasses.replace(doc, **changes)


def with_model(doc: StateDocument, name: str, **changes) -> StateDocument:
    """The document with one model's fields changed."""
    return dataclasses.replace(doc, models=[dataclasses.replace(m, **changes) if m.name == name else m for m in doc.models])


def as_json(doc: StateDocument) -> dict:
    """What a reader gets: the document through JSON, with the daemon writing the engine's phase as "swap"."""
    raw = json.loads(json.dumps(doc.to_json()))
    if raw["engine"]["state"] == "swap":
        raw["engine"]["phase"] = "swap"
    return raw
