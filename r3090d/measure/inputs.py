"""What `plan` and `bench` measure against: a model directory's inputs, the GPU's size and bandwidth, a live engine's cache.

Bad or missing inputs raise PlanError with one line that names the flag or file to fix;
the CLI turns it into a usage error (exit 64).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from r3090d.cards import CARDS, card_for_name
from r3090d.core.snapshot import GpuStatus
from r3090d.measure import modelinfo, plancheck
from r3090d.measure import plan as planmod
from r3090d.measure.plan import GB, PlanError
from r3090d.units import GIB


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    shape: planmod.ModelShape
    measured_weight_bytes: int | None
    weight_note: str
    label: str


def read_model(path: str) -> ModelInputs:
    """A model directory (config.json, optional safetensors) or a bare config.json file."""
    p = Path(path).expanduser()
    if p.is_file():
        try:
            config = modelinfo.read_config(p)
        except modelinfo.ModelConfigError as exc:
            raise PlanError(f"cannot read {path}: {exc}") from None
        return ModelInputs(_shape(config, path), None, "config.json only", str(p))
    facts = modelinfo.read_model_dir(p)
    if not facts.is_dir:
        raise PlanError(f"--model {path}: {facts.error}")
    if facts.config is None:
        raise PlanError(f"--model {path}: no readable config.json ({facts.error})")
    measured = facts.weight_bytes if facts.weight_bytes else None
    if measured:
        note = f"measured: safetensors headers of {len([f for f in facts.weight_files if f.format == 'safetensors'])} file(s)"
    elif facts.weight_files:
        note = f"no complete safetensors set ({facts.error or 'other formats only'}): estimated"
    else:
        note = "no weight files: estimated"
    return ModelInputs(_shape(facts.config, path), measured, note, str(p))


def _shape(config, where: str) -> planmod.ModelShape:
    try:
        return planmod.shape_from_config(config)
    except PlanError as exc:
        raise PlanError(f"{where}: {exc}") from None


def gpu_from_nvml(index: int):
    """(memory bytes, NVML name) of GPU `index`, or (None, why)."""
    try:
        from r3090d.probes import nvml  # the only module that talks to NVML
    except ImportError as exc:
        return None, f"NVML probe unavailable ({exc})"
    sample = nvml.read_gpu(index, timeout_s=10.0)
    if sample.status is GpuStatus.OK and sample.memory_total:
        return (sample.memory_total, sample.name), ""
    return None, f"NVML: {sample.status.value}{': ' + sample.detail if sample.detail else ''}"


def resolve_hardware(gpu_memory_gib, bandwidth_gbs, *, need_memory: bool, card: str | None, gpu_index: int) -> planmod.Hardware:
    """Flags first, then NVML for the size and the card profile for the bandwidth."""
    memory = int(gpu_memory_gib * GIB) if gpu_memory_gib is not None else None
    bandwidth = bandwidth_gbs * GB if bandwidth_gbs is not None else None
    sources = []
    if memory is not None:
        sources.append("--gpu-memory-gib")
    if bandwidth is not None:
        sources.append("--bandwidth-gbs")
    nvml_why = ""
    gpu_name = None
    if memory is None or bandwidth is None:
        found, nvml_why = gpu_from_nvml(gpu_index)
        if found is not None:
            total, name = found
            gpu_name = name
            if memory is None:
                memory = total
                sources.append(f"NVML GPU {gpu_index} ({name})")
            profile = card_for_name(name) or CARDS.get(card or "")
            if bandwidth is None and profile is not None:
                bandwidth = profile.bandwidth_gbs * GB
                sources.append(f"card profile {profile.key}")
    missing = []
    if memory is None and need_memory:
        missing.append("--gpu-memory-gib G")
    if bandwidth is None:
        missing.append("--bandwidth-gbs B")
    if missing == ["--bandwidth-gbs B"] and gpu_name:
        raise PlanError(
            f"GPU {gpu_index} ({gpu_name}) is not in the card profiles ({', '.join(sorted(CARDS))}), "
            "so its memory bandwidth is unknown: give --bandwidth-gbs B (decimal GB/s)"
        )
    if missing:
        why = f" ({nvml_why})" if nvml_why else ""
        raise PlanError(
            f"no GPU to measure{why}: give {' and '.join(missing)} "
            "(an RTX 3090 is --gpu-memory-gib 24 --bandwidth-gbs 936)"
        )
    return planmod.Hardware(memory, bandwidth, ", ".join(sources))


def read_engine_cache(url: str, timeout: float = 5.0, model_name: str = "", uds: str = ""):
    """(EngineCache, None) from a live engine's /metrics, or (None, why). `uds`: the engine's unix socket."""
    # Imported here: httpx is not loaded for every r3090ctl command that imports this module.
    from r3090d.probes import engine as engine_probe
    from r3090d.probes.http import engine_client

    with engine_client(uds=uds) as client:  # the engine is reached directly, never through a proxy
        text, why = engine_probe.fetch_metrics(client, url, timeout)
    if text is None:
        return None, why
    sample = engine_probe.parse(text, model_name)
    if not sample.cache_config:
        return None, sample.error or "no vllm:cache_config_info in /metrics"
    return plancheck.engine_cache_from_labels(dict(sample.cache_config)), None
