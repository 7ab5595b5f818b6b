"""`r3090ctl config check`: the effective configuration, secrets redacted, and the exact argv."""

from __future__ import annotations

import shlex

import click

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.cli.common import config_option, ctl, emit_json, instance_option, load_config
from r3090d.config import ConfigError, steps
from r3090d.engineflags import flag_value


@ctl.group("config")
def config_group() -> None:
    """Configuration commands."""


@config_group.command("check")
@config_option
@instance_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def check(config_path, instance, as_json) -> int:
    """Validate the config; print it (secrets redacted) and the vLLM command line."""
    cfg = load_config(config_path, instance)
    from r3090d.effectors.channels import check_config as check_alerts

    check_alerts(cfg)  # syslog facility and address, SMTP password file
    try:
        version = argvmod.engine_version(cfg.engine.python)
    except argvmod.EngineNotInstalled as exc:
        raise ConfigError(cfg.source, "engine.python", str(exc), "point it at the venv vLLM is installed in (make engine)") from None
    argv = argvmod.build_argv(cfg, version)
    step = _longest_step(cfg)
    warnings = [*cfg.warnings, *steps.window_warnings(cfg.watchdog, step)]
    for warning in warnings:  # removed keys, windows too short for the engine's step; stderr keeps --json clean
        click.echo(f"WARN {warning}", err=True)
    if as_json:
        emit_json({"config": configmod.redacted(cfg), "vllm_version": str(version), "argv": argv, "warnings": warnings,
                   "longest_step": {"seconds": round(step.seconds, 2), "estimate": step.describe()}})  # fmt: skip
        return 0
    click.echo(f"# {cfg.source}: valid")
    click.echo(f"# vLLM {version} at {cfg.engine.python}")
    for section, values in configmod.redacted(cfg).items():
        if isinstance(values, dict):
            click.echo(f"[{section}]")
            for k, v in values.items():
                click.echo(f"  {k} = {v!r}")
        else:
            click.echo(f"{section} = {values!r}")
    click.echo("argv: " + shlex.join(argv))
    if cfg.api_key:
        click.echo("environment: VLLM_API_KEY=<redacted> (from engine.api_key_file)")
    return 0


def _longest_step(cfg) -> steps.StepEstimate:
    """The longest engine step these settings allow, from extra_args, the profile and the model directory."""
    from r3090d.measure import modelinfo
    from r3090d.measure.plan import PlanError, estimate_weights, shape_from_config
    from r3090d.preflight.checks import served_context

    raw = flag_value(cfg.engine.extra_args, "--max-num-batched-tokens")
    step_tokens = int(raw) if raw is not None and str(raw).isdigit() else None
    shape = params = None
    model = modelinfo.read_model_dir(cfg.engine.model)
    if model.config is not None:
        try:
            shape = shape_from_config(model.config)
            params = estimate_weights(shape).params  # logical parameters: a quantized file stores fewer elements
        except PlanError:
            params = model.parameter_count  # a family plan cannot count: what the safetensors hold, if read
    context, _ = served_context(cfg, shape.max_position_embeddings if shape else None)
    return steps.longest_step(step_tokens, context, params)
