"""A plan against a live engine: vLLM's cache_config_info labels, and prediction minus allocation.

Pure arithmetic, like r3090d/measure/plan.py: the CLI reads the labels from the
engine's /metrics and prints the comparison. vLLM's own figures are the exact
ones; the plan's are what they are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from r3090d.measure.plan import KvBasis, Plan, blocks_for, kv_cache_size_tokens


@dataclass(frozen=True)
class EngineCache:
    """vLLM's cache_config_info labels, as numbers where they are numbers."""

    num_gpu_blocks: int | None
    block_size: int | None
    kv_cache_size_tokens: int | None
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float | None
    num_gpu_blocks_override: int | None
    cache_dtype: str | None


def _label_int(labels: dict, key: str) -> int | None:
    raw = labels.get(key)
    try:
        return int(float(raw)) if raw not in (None, "", "None") else None
    except ValueError:
        return None


def engine_cache_from_labels(labels: dict[str, str]) -> EngineCache:
    util = labels.get("gpu_memory_utilization")
    try:
        util_f = float(util) if util not in (None, "", "None") else None
    except ValueError:
        util_f = None
    return EngineCache(
        num_gpu_blocks=_label_int(labels, "num_gpu_blocks"),
        block_size=_label_int(labels, "block_size"),
        kv_cache_size_tokens=_label_int(labels, "kv_cache_size_tokens"),
        kv_cache_memory_bytes=_label_int(labels, "kv_cache_memory_bytes"),
        gpu_memory_utilization=util_f,
        num_gpu_blocks_override=_label_int(labels, "num_gpu_blocks_override"),
        cache_dtype=labels.get("cache_dtype"),
    )


class RangePosition(StrEnum):
    """Where vLLM's block count fell against the plan's estimated range."""

    BELOW = "below"  # the profile run charged more than every assumed part's high end
    INSIDE = "inside"
    ABOVE = "above"  # it charged less than every part's low end


@dataclass(frozen=True)
class Comparison:
    engine: EngineCache
    predicted_blocks: int
    predicted_tokens: int  # comparable with the engine's kv_cache_size_tokens
    engine_tokens: int | None
    block_difference: int | None  # engine - predicted
    token_difference: int | None
    engine_kv_bytes: int | None  # what vLLM allocated, from its blocks and our block bytes
    kv_bytes_difference: int | None  # engine - predicted KV memory
    implied_overhead_bytes: int | None  # budget - weights - engine KV, when the budget is known
    arithmetic_check_blocks: int | None  # engine KV bytes / our block bytes, when vLLM reports its KV bytes
    notes: tuple[str, ...]
    range_position: RangePosition | None = None  # None: no range estimated, another block size, or an override


def compare(plan: Plan, engine: EngineCache) -> Comparison:
    """Prediction minus allocation. Uses the engine's block size if it differs from the plan's."""
    notes: list[str] = []
    s = plan.settings
    block_size = s.block_size
    if engine.block_size and engine.block_size != s.block_size:
        notes.append(f"engine uses block size {engine.block_size}, plan assumed {s.block_size}: compared at the engine's")
        block_size = engine.block_size
    block_bytes = plan.kv_bytes_per_token * block_size
    predicted_blocks = blocks_for(plan.primary.kv_memory_bytes, block_bytes)
    if engine.num_gpu_blocks_override is not None:
        notes.append(f"engine runs with --num-gpu-blocks-override {engine.num_gpu_blocks_override}: its block count is not a measurement")
    predicted_tokens = kv_cache_size_tokens(predicted_blocks, block_size, s.max_model_len)
    engine_tokens = engine.kv_cache_size_tokens
    if engine_tokens is None and engine.num_gpu_blocks is not None:
        engine_tokens = engine.num_gpu_blocks * block_size
        predicted_tokens = predicted_blocks * block_size
        notes.append("engine does not report kv_cache_size_tokens: tokens = num_gpu_blocks x block_size")
    engine_kv = engine.num_gpu_blocks * block_bytes if engine.num_gpu_blocks is not None else None
    implied = None
    if engine_kv is not None and plan.budget_bytes is not None and s.kv_cache_memory_bytes is None:
        implied = plan.budget_bytes - plan.primary.weight_bytes - engine_kv
    check = None
    if engine.kv_cache_memory_bytes is not None:
        check = engine.kv_cache_memory_bytes // block_bytes
        if engine.num_gpu_blocks is not None and engine.num_gpu_blocks_override is None and check != engine.num_gpu_blocks:
            notes.append(
                f"vLLM's own KV bytes give {check} blocks by this arithmetic but it allocated {engine.num_gpu_blocks}: "
                "the per-token size differs (dtype, head_dim or layer count)"
            )
    position = None
    blocks = engine.num_gpu_blocks if engine.num_gpu_blocks_override is None else None  # an override measures nothing
    if plan.primary.basis is KvBasis.ESTIMATE and block_size == s.block_size and blocks is not None:
        low, high = plan.primary.num_blocks_low, plan.primary.num_blocks_high
        position = RangePosition.BELOW if blocks < low else RangePosition.ABOVE if blocks > high else RangePosition.INSIDE
    return Comparison(
        engine=engine,
        predicted_blocks=predicted_blocks,
        predicted_tokens=predicted_tokens,
        engine_tokens=engine_tokens,
        block_difference=None if engine.num_gpu_blocks is None else engine.num_gpu_blocks - predicted_blocks,
        token_difference=None if engine_tokens is None else engine_tokens - predicted_tokens,
        engine_kv_bytes=engine_kv,
        kv_bytes_difference=None if engine_kv is None else engine_kv - predicted_blocks * block_bytes,
        implied_overhead_bytes=implied,
        arithmetic_check_blocks=check,
        notes=tuple(notes),
        range_position=position,
    )
