"""`r3090ctl plan`: predicted KV cache capacity and TPOT floor; against a running engine, the difference.

Exit codes: 0 the plan was made (and, with an engine, compared); 1 an engine was
named with --url but could not be read, so no comparison was made; 64 missing
or bad inputs (no model, no GPU size, unreadable config.json); 78 config errors.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib

import click

from r3090d import config as configmod
from r3090d import exitcodes
from r3090d.cli.common import UsageExit, config_option, ctl, emit_json, instance_option, load_config
from r3090d.config import ConfigError
from r3090d.engineflags import (
    VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
    VLLM_DEFAULT_MAX_NUM_SEQS,
    flag_switch,
    flag_value,
)
from r3090d.measure import inputs, plancheck
from r3090d.measure import plan as planmod
from r3090d.measure.plan import GB, KvBasis, PlanError
from r3090d.units import GIB, MIB


def _maybe_config(config_path, instance, model_path: str | None):
    """The config when one was named or the default file exists; None otherwise.

    With --model the config only lends defaults (profiles, the GPU), so one
    written before the model was chosen (a fresh install's, with no
    engine.model) still serves, and a broken default file that nobody named is
    reported and left out rather than stopping the plan.
    """
    explicit = config_path or os.environ.get(configmod.ENV_CONFIG)
    path = configmod.resolve_path(config_path, instance)
    if not explicit and not path.exists():
        return None
    try:
        try:
            return load_config(config_path, instance, check_files=False)
        except ConfigError as exc:
            if not model_path or exc.key != "engine.model":
                raise
        return _config_with_model(config_path, instance, model_path)
    except ConfigError as exc:
        if not model_path or explicit:
            raise
        click.echo(f"r3090ctl plan: not using {path}: {exc.one_line()}", err=True)
        return None


def _config_with_model(config_path, instance, model_path: str):
    """The config with --model standing in for its missing engine.model."""
    if instance is None:
        instance = configmod.instance_from_env()
    path = configmod.resolve_path(config_path, instance)
    data = tomllib.loads(path.read_text(encoding="utf-8"))  # load() has just read and parsed it
    engine = data.get("engine") if isinstance(data.get("engine"), dict) else {}
    data["engine"] = {**engine, "model": str(model_path)}
    return configmod.from_dict(data, path, instance, check_files=False)


# ------------------------------------------------------------------ rendering


def _gb(n: int | float | None) -> str:
    """Decimal first (bandwidth is decimal), binary in brackets, each labelled."""
    if n is None:
        return "-"
    if abs(n) < 0.1 * GB:
        return f"{n / 1e6:,.2f} MB ({n / MIB:,.2f} MiB)"
    return f"{n / GB:,.2f} GB ({n / GIB:,.2f} GiB)"


def _ms(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.1f} ms" if s >= 0.01 else f"{s * 1000:.3f} ms"


def plan_to_dict(plan: planmod.Plan, comparison: plancheck.Comparison | None, engine_error: str | None, model: inputs.ModelInputs) -> dict:
    data = {
        "model": {"path": model.label, **dataclasses.asdict(plan.shape)},
        "weights_note": model.weight_note,
        "settings": dataclasses.asdict(plan.settings),
        "hardware": dataclasses.asdict(plan.hardware),
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "block_bytes": plan.block_bytes,
        "budget_bytes": plan.budget_bytes,
        "overhead": {
            **dataclasses.asdict(plan.overhead),
            "total": plan.overhead.total,
            "low_total": plan.overhead.low_total,
            "high_total": plan.overhead.high_total,
        },
        "primary": dataclasses.asdict(plan.primary),
        "alternatives": [dataclasses.asdict(c) for c in plan.alternatives],
    }
    if comparison is not None:
        data["engine"] = dataclasses.asdict(comparison)
    if engine_error is not None:
        data["engine_error"] = engine_error
    return data


def render(plan: planmod.Plan, comparison, engine_error, model: inputs.ModelInputs, url: str | None) -> None:
    s, sh, hw = plan.settings, plan.shape, plan.hardware
    echo = click.echo
    echo(f"Model       {model.label}: {sh.architecture} ({sh.model_type or '?'}), {sh.torch_dtype}")
    echo(f"            {sh.num_layers} layers, {sh.num_attention_heads} heads, {sh.num_kv_heads} KV heads, head_dim {sh.head_dim}")
    for note in sh.notes:
        echo(f"            note: {note}")
    bw = f"{hw.bandwidth_bytes_per_s / GB:,.0f} GB/s" if hw.bandwidth_bytes_per_s else "bandwidth unknown"
    mem = f"{hw.memory_bytes / GIB:.2f} GiB ({hw.memory_bytes / GB:.2f} GB)" if hw.memory_bytes else "size not needed"
    echo(f"GPU         {mem}, {bw}  [{hw.source}]")
    echo(
        f"Settings    gpu_memory_utilization {s.gpu_memory_utilization:g}, max_model_len {s.max_model_len}, "
        f"max_num_seqs {s.max_num_seqs}, block size {s.block_size}, KV dtype {s.kv_cache_dtype}"
    )
    echo("")
    kv_b = plan.kv_bytes_per_token // (2 * sh.num_layers * sh.num_kv_heads * sh.head_dim)
    echo(f"KV per token   {plan.kv_bytes_per_token:,} B = 2 x {sh.num_layers} layers x {sh.num_kv_heads} KV heads x {sh.head_dim} x {kv_b} B")
    echo(f"KV per block   {plan.block_bytes:,} B ({s.block_size} tokens)")
    if s.kv_cache_memory_bytes is None:
        echo(f"Budget         {_gb(plan.budget_bytes)} = total x {s.gpu_memory_utilization:g}")
        echo(f"Overhead       {_gb(plan.overhead.total)}: {plan.overhead.description}")
        _render_assumptions(plan.overhead)
    echo("")
    columns = [plan.primary, *plan.alternatives]
    head = ["", *[c.scheme + (" (estimate)" if c is not plan.primary else "") for c in columns]]
    rows = [
        ["weights", *[_gb(c.weight_bytes) for c in columns]],
        ["KV memory", *[_gb(c.kv_memory_bytes) for c in columns]],
        ["KV blocks", *[f"{c.num_blocks:,}{_ends(c, lambda n: f'{n:,}')}" for c in columns]],
        ["KV tokens", *[f"{c.tokens:,}{_ends(c, lambda n: f'{n * s.block_size:,}')}" for c in columns]],
        [
            f"requests of {s.max_model_len} tokens",
            *[f"{c.max_concurrency:,.2f}{_ends(c, lambda n: f'{planmod.max_concurrency(n, s.block_size, s.max_model_len):,.2f}')}" for c in columns],
        ],
        ["TPOT floor", *[_ms(c.tpot_floor_s) for c in columns]],
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    echo("")
    for c in columns:
        echo(f"{c.scheme}: weights {c.weight_source}")
    echo(f"{plan.primary.scheme}: KV memory {plan.primary.kv_memory_source}")
    echo(f"{plan.primary.scheme}: KV blocks {_basis_line(plan.primary)}")
    if model.measured_weight_bytes is None:
        echo(f"weights: {model.weight_note}")
    if plan.primary.tpot_floor_s is not None:
        echo("TPOT floor = weight bytes / bandwidth (decimal GB); MBU = floor / measured TPOT")
    if plan.primary.num_blocks == 0:
        echo("WARNING: no KV memory is left: the engine would refuse to start")
    if comparison is not None:
        _render_comparison(plan, comparison, url)
    elif engine_error is not None:
        echo("")
        echo(f"Engine {url}: not compared: {engine_error}")


def _ends(c: planmod.Capacity, fmt) -> str:
    """ " (low to high)" after an estimated figure; nothing where nothing was assumed."""
    return f" ({fmt(c.num_blocks_low)} to {fmt(c.num_blocks_high)})" if c.basis is KvBasis.ESTIMATE else ""


def _basis_line(c: planmod.Capacity) -> str:
    """What the block figure rests on: "exact" only where the KV memory was given exactly."""
    if c.basis is KvBasis.EXACT:
        return "exact: the KV memory was given (--kv-cache-memory-bytes); blocks = bytes // block bytes"
    if c.basis is KvBasis.GIVEN_OVERHEAD:
        return "estimate from the given overhead (--overhead-gib): one figure, as good as the overhead given"
    return (
        f"estimate: {c.num_blocks_low:,} to {c.num_blocks_high:,}, point {c.num_blocks:,}: low with every assumed "
        "part above at its high end, high with every part at its low end; a running engine (--url) gives vLLM's own"
    )


def _render_assumptions(overhead: planmod.Overhead) -> None:
    """Each part the profile run measures and plan assumes: low / point / high, and why."""
    if not overhead.assumptions:
        return
    echo = click.echo
    echo(f"  assumed      {overhead.low_total / GIB:.2f} to {overhead.high_total / GIB:.2f} GiB, low / point / high:")
    for a in overhead.assumptions:
        ends = " / ".join(f"{b / GIB:.2f}" for b in (a.low_bytes, a.point_bytes, a.high_bytes))
        echo(f"    {a.part:<12} {ends} GiB: {a.reason}")


def _render_comparison(plan: planmod.Plan, c: plancheck.Comparison, url) -> None:
    echo = click.echo
    e = c.engine
    echo("")
    echo(f"Engine {url}: vLLM allocated (exact: its cache_config_info)")
    echo(f"  num_gpu_blocks {e.num_gpu_blocks}, block_size {e.block_size}, kv_cache_size_tokens {e.kv_cache_size_tokens}, kv_cache_memory_bytes {e.kv_cache_memory_bytes}")
    echo(f"  predicted blocks {c.predicted_blocks:,}, engine {e.num_gpu_blocks if e.num_gpu_blocks is not None else '-'}: difference {_signed(c.block_difference)} blocks")
    echo(f"  predicted tokens {c.predicted_tokens:,}, engine {c.engine_tokens if c.engine_tokens is not None else '-'}: difference {_signed(c.token_difference)} tokens")
    if c.kv_bytes_difference is not None:
        echo(f"  KV memory difference (engine - predicted) {_signed_gb(c.kv_bytes_difference)}")
    if c.implied_overhead_bytes is not None:
        echo(f"  vLLM's allocation implies activations/overhead of {_gb(c.implied_overhead_bytes)} (estimate used: {_gb(plan.overhead.total)})")
    if c.arithmetic_check_blocks is not None:
        echo(f"  vLLM's own KV bytes / predicted block bytes = {c.arithmetic_check_blocks:,} blocks")
    if c.range_position is not None:
        p = plan.primary
        echo(f"  engine blocks {c.range_position} the estimated range {p.num_blocks_low:,} to {p.num_blocks_high:,}")
    for note in c.notes:
        echo(f"  note: {note}")


def _signed(n) -> str:
    return "-" if n is None else f"{n:+,}"


def _signed_gb(n: int) -> str:
    return f"{n / GB:+,.3f} GB ({n / GIB:+,.3f} GiB)"


# ------------------------------------------------------------------- command


# The figures below are pinned by tests/unit/test_plan.py and test_plan_cli.py.
PLAN_EPILOG = """\
On a GPU the KV blocks are an estimate: vLLM's profile run measures the activation peak, non-torch memory and
CUDA graphs, which plan can only assume, so it prints a range: every assumed part at its high end, the point
estimate, every part at its low end. The figure is exact only against a running engine (--url: vLLM's
cache_config_info) or with --kv-cache-memory-bytes.

Qwen2.5-7B BF16 on an RTX 3090 at 0.90 (the realtime profile) gives 5,295 to 8,120 blocks, point 7,136. A
published 3090 measurement of 5,306 blocks (utilization not stated) sits at the bottom: 2.88 GiB besides the
weights, every assumed part near its high end; at the point figures it would take a utilization of 0.835.
"""


@ctl.command("plan", epilog=PLAN_EPILOG)
@click.option("--model", "model_path", metavar="DIR", help="model directory (or its config.json); default: the config's engine.model")
@click.option("--profile", "profile_name", metavar="NAME", help="realtime, batch, a [profiles.NAME] of the config, or none (vLLM defaults)")
@config_option
@instance_option
@click.option("--gpu-memory-gib", type=click.FloatRange(min=0.1), help="GPU memory in GiB (default: NVML)")
@click.option("--bandwidth-gbs", type=click.FloatRange(min=0.1), help="memory bandwidth in decimal GB/s (default: the card profile)")
@click.option("--kv-cache-memory-bytes", type=click.IntRange(min=1), help="exact KV memory, as vLLM's flag: blocks = bytes // block bytes")
@click.option("--block-size", type=click.IntRange(min=1), help="tokens per KV block (vLLM: 16 on GPU, 128 on CPU)")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.01, 1.0), help="override the profile's")
@click.option("--max-model-len", type=click.IntRange(min=1), help="override the profile's")
@click.option("--max-num-seqs", type=click.IntRange(min=1), help="override the profile's")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), help=f"tokens of vLLM's profiling pass (default {planmod.DEFAULT_MAX_NUM_BATCHED_TOKENS})")
@click.option("--kv-cache-dtype", default=None, help="auto (the model dtype), bfloat16, float16, fp8, ...")
@click.option("--enforce-eager", is_flag=True, default=None, help="no CUDA graphs: none in the overhead estimate")
@click.option("--overhead-gib", type=click.FloatRange(min=0), help="replace the activation + overhead estimate")
@click.option("--url", help="a running engine to compare with (default: the config's engine, if reachable)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def plan_command(
    model_path, profile_name, config_path, instance, gpu_memory_gib, bandwidth_gbs, kv_cache_memory_bytes, block_size,
    gpu_memory_utilization, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_dtype, enforce_eager,
    overhead_gib, url, as_json,
) -> int:  # fmt: skip
    """Predict KV cache blocks, tokens, concurrency and the TPOT floor for a model on a card."""
    cfg = _maybe_config(config_path, instance, model_path)
    extra = list(cfg.engine.extra_args) if cfg else []
    model_path = model_path or (cfg.engine.model if cfg else None)
    if not model_path:
        raise UsageExit("no model: give --model DIR (or --config with engine.model)")
    try:
        model = inputs.read_model(model_path)
    except PlanError as exc:
        raise UsageExit(str(exc)) from None

    profile = _profile(cfg, profile_name, model.shape)
    if enforce_eager is None:
        enforce_eager = flag_switch(extra, "--enforce-eager")
    settings = planmod.Settings(
        gpu_memory_utilization=gpu_memory_utilization or profile.gpu_memory_utilization,
        max_model_len=max_model_len or profile.max_model_len,
        max_num_seqs=max_num_seqs or profile.max_num_seqs,
        block_size=block_size or _number_arg(extra, "--block-size") or planmod.DEFAULT_BLOCK_SIZE,
        kv_cache_dtype=kv_cache_dtype or flag_value(extra, "--kv-cache-dtype") or "auto",
        kv_cache_memory_bytes=kv_cache_memory_bytes or _number_arg(extra, "--kv-cache-memory-bytes"),
        max_num_batched_tokens=max_num_batched_tokens or _number_arg(extra, "--max-num-batched-tokens") or planmod.DEFAULT_MAX_NUM_BATCHED_TOKENS,
        enforce_eager=bool(enforce_eager),
        overhead_bytes=int(overhead_gib * GIB) if overhead_gib is not None else None,
    )
    try:
        hardware = inputs.resolve_hardware(
            gpu_memory_gib,
            bandwidth_gbs,
            need_memory=settings.kv_cache_memory_bytes is None,
            card=cfg.gpu.card if cfg else None,
            gpu_index=cfg.gpu.index if cfg else (instance or 0),
        )
        plan = planmod.make_plan(model.shape, settings, hardware, measured_weight_bytes=model.measured_weight_bytes, measured_source=model.weight_note)
    except PlanError as exc:
        raise UsageExit(str(exc)) from None

    engine_url = url or (cfg.engine_url if cfg else None)
    comparison = engine_error = None
    if engine_url:
        from_config = cfg is not None and not url
        cache, engine_error = inputs.read_engine_cache(engine_url, model_name=cfg.model_name if from_config else "",
                                                       uds=cfg.engine.uds if from_config else "")  # fmt: skip
        if cache is not None:
            comparison = plancheck.compare(plan, cache)
    if as_json:
        emit_json(plan_to_dict(plan, comparison, engine_error, model))
    else:
        render(plan, comparison, engine_error, model, cfg.engine_address if (cfg is not None and not url) else engine_url)
    if engine_error is not None and url:
        click.echo(f"r3090ctl plan: could not read the engine at {url}: {engine_error}", err=True)
        return exitcodes.WARNING
    return exitcodes.OK


def _number_arg(extra, flag: str, kind: type[int] | type[float] = int) -> int | float | None:
    """`flag`'s value in engine.extra_args as vLLM reads it, as a number; None when absent or no number."""
    raw = flag_value(extra, flag)
    try:
        return kind(raw) if raw is not None else None
    except ValueError:
        return None


def _profile(cfg, name: str | None, shape: planmod.ModelShape) -> configmod.Profile:
    profiles = configmod.resolve_profiles(cfg) if cfg else dict(configmod.BUILTIN_PROFILES)
    name = name or (cfg.profile if cfg else "realtime")
    if name == configmod.NO_PROFILE:
        # What engine.extra_args sets, as preflight reads it; else vLLM's own defaults:
        # utilization 0.9, the model's full context, 256 sequences.
        extra = cfg.engine.extra_args if cfg else ()
        return configmod.Profile(
            _number_arg(extra, "--gpu-memory-utilization", float) or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
            _number_arg(extra, "--max-model-len") or shape.max_position_embeddings or 4096,
            _number_arg(extra, "--max-num-seqs") or VLLM_DEFAULT_MAX_NUM_SEQS,
            True,
            True,
        )
    if name not in profiles:
        raise UsageExit(f"unknown profile {name!r}: use one of {', '.join(sorted(profiles))} or none")
    return profiles[name]
