"""`r3090ctl config check`: the effective configuration, secrets redacted, and the exact argv."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import click

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.cli.common import UsageExit, config_option, ctl, emit_json, instance_option, load_config
from r3090d.config import ConfigError, steps
from r3090d.config.errors import toml_key
from r3090d.engineflags import flag_occurrence, flag_value

# vLLM starts with a max_model_len above the model's own when this is "1" or "true" in its environment.
VLLM_LONG_CONTEXT_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@ctl.group("config")
def config_group() -> None:
    """Configuration commands."""


@config_group.command("check")
@config_option
@instance_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.argument("file", required=False, metavar="[FILE]")
def check(config_path, instance, as_json, file) -> int:
    """Validate the config (FILE, or --config); print it (secrets redacted) and the vLLM command line (one per model in swap mode)."""
    if file is not None and config_path is not None and file != config_path:
        raise UsageExit(f"two config files given: {file} and --config {config_path}; give one")
    cfg = load_config(file or config_path, instance)
    from r3090d.effectors.channels import check_config as check_alerts

    check_alerts(cfg)  # syslog facility and address, SMTP password file
    try:
        version = argvmod.engine_version(cfg.engine.python)
    except argvmod.EngineNotInstalled as exc:
        raise ConfigError(cfg.source, "engine.python", str(exc), "point it at the venv vLLM is installed in (make engine)") from None
    engines = [_check_engine(cfg, index, name, engine, version) for index, (name, engine) in enumerate(configmod.engine_configs(cfg).items())]
    single = None if cfg.swap_mode else _check_engine(cfg, None, cfg.model_name, cfg, version)
    step_warnings = [f"{e.name}: {w}" for e in engines for w in e.warnings] if cfg.swap_mode else list(single.warnings)
    warnings = [*cfg.warnings, *step_warnings]
    for warning in warnings:  # removed keys, windows too short for the engine's step; stderr keeps --json clean
        click.echo(f"WARN {warning}", err=True)
    if as_json:
        doc = {"config": configmod.redacted(cfg), "vllm_version": str(version), "warnings": warnings}
        if single is not None:
            doc |= {"argv": single.argv, "longest_step": single.longest_step_json()}
        else:
            doc |= {"argv": None, "engines": [e.as_json() for e in engines]}
        emit_json(doc)
        return 0
    click.echo(f"# {cfg.source}: valid")
    click.echo(f"# vLLM {version} at {cfg.engine.python}")
    for section, values in configmod.redacted(cfg).items():
        if section == "models" or (section == "swap" and not cfg.swap_mode):
            continue  # the models are shown below, one line each; [swap] means nothing without them
        if isinstance(values, dict):
            click.echo(f"[{section}]")
            for k, v in values.items():
                click.echo(f"  {k} = {v!r}")
        else:
            click.echo(f"{section} = {values!r}")
    if single is not None:
        click.echo("argv: " + shlex.join(single.argv))
        if cfg.api_key:
            click.echo("environment: VLLM_API_KEY=<redacted> (from engine.api_key_file)")
        return 0
    click.echo(f"models: {len(engines)}, served by the router on {cfg.engine.host}:{cfg.engine.port}"
               + (" (API key from swap.api_key_file)" if cfg.api_key else ""))  # fmt: skip
    width = max(len(e.name) for e in engines)
    for e in engines:
        click.echo(f"  {e.name:<{width}}  {e.kind:<8}  {e.address}  profile {e.profile}  {e.model}")
    for e in engines:
        click.echo(f"argv {e.name}: " + shlex.join(e.argv))
        if e.api_key_from:
            click.echo(f"environment {e.name}: VLLM_API_KEY=<redacted> (from {e.api_key_from})")
    return 0


@dataclass(frozen=True)
class EngineCheck:
    """One engine's line of `config check`: what it serves, where, and the command line that starts it."""

    name: str
    kind: str
    model: str
    host: str
    port: int
    socket: str  # its unix socket (engine.listen = "uds"), else ""
    profile: str
    argv: list[str]
    step: steps.StepEstimate
    warnings: tuple[str, ...]
    api_key_from: str  # the setting its key was read from, or ""

    @property
    def address(self) -> str:
        return f"unix:{self.socket}" if self.socket else f"{self.host}:{self.port}"

    def longest_step_json(self) -> dict:
        return {"seconds": round(self.step.seconds, 2), "estimate": self.step.describe()}

    def as_json(self) -> dict:
        on_tcp = not self.socket
        return {"name": self.name, "kind": self.kind, "model": self.model, "listen": "tcp" if on_tcp else "uds",
                "host": self.host if on_tcp else None, "port": self.port if on_tcp else None, "socket": self.socket or None,
                "profile": self.profile, "argv": self.argv, "longest_step": self.longest_step_json(),
                "api_key_from": self.api_key_from}  # fmt: skip


def _check_engine(cfg, index: int | None, name: str, engine, version) -> EngineCheck:
    """One engine's checks: its argv for the installed vLLM, its context against its model, its longest step.

    `engine` is the engine's own Config (cfg itself outside swap mode); for models[index] an
    error names that entry's keys, not the [engine] ones the derived Config holds them in."""
    from r3090d.measure import modelinfo

    try:
        argv = argvmod.build_argv(engine, version)
        model = modelinfo.read_model_dir(engine.engine.model)
        if model.config is not None:
            _check_context(engine, model.config, Path(model.path) / "config.json")
    except ConfigError as exc:
        if index is None:
            raise
        raise _in_entry(exc, cfg, index) from None
    step = _longest_step(engine, model)
    where = f"models[{index}]." if index is not None else "engine."
    api_key_from = f"{where}api_key_file" if engine.api_key else ""
    e = engine.engine
    return EngineCheck(name, str(e.kind), e.model, e.host, e.port, e.uds, engine.profile, argv, step,
                       tuple(steps.window_warnings(engine.watchdog, step)), api_key_from)  # fmt: skip


def _in_entry(exc: ConfigError, cfg, index: int) -> ConfigError:
    """An error about a derived engine Config, keyed as the [[models]] entry it came from."""
    key = exc.key or ""
    where = f"models[{index}]"
    if key.startswith("engine.extra_args"):
        key = where + key.removeprefix("engine")
    elif key == "profile" and cfg.models[index].profile:
        key = f"{where}.profile"
    return ConfigError(exc.path, key or None, exc.problem, exc.fix)


def _check_context(cfg, model_config: dict, config_json: Path) -> None:
    """Raise ConfigError when the context these settings ask for is longer than vLLM starts the model with."""
    from r3090d.measure.plan import context_limit
    from r3090d.preflight.checks import served_context

    limit = context_limit(model_config)
    context, _ = served_context(cfg, None)
    if limit is None or context is None or context <= limit.tokens:
        return
    if cfg.engine.env.get(VLLM_LONG_CONTEXT_ENV, "").strip().lower() in ("1", "true"):
        return  # vLLM's own override: it warns and starts
    why = (f"is above the model's context limit of {limit.tokens} tokens ({limit.source} in {config_json}): "
           f"vLLM refuses to start with it")  # fmt: skip
    profile = cfg.active_profile
    if profile is None:
        index, _ = flag_occurrence(cfg.engine.extra_args, "--max-model-len")
        raise ConfigError(cfg.source, f"engine.extra_args[{index}]", f"--max-model-len {context} {why}", f"lower it to {limit.tokens} or less")
    if "max_model_len" in cfg.profiles.get(cfg.profile, {}):
        raise ConfigError(cfg.source, f"profiles.{toml_key(cfg.profile)}.max_model_len", f"{context} {why}", f"lower it to {limit.tokens} or less")
    raise ConfigError(cfg.source, "profile", f"profile {cfg.profile!r} serves max_model_len = {context}, which {why}",
                      f"set [profiles.{toml_key(cfg.profile)}] max_model_len = {limit.tokens} or less")  # fmt: skip


def _longest_step(cfg, model) -> steps.StepEstimate:
    """The longest engine step these settings allow, from extra_args, the profile and the model directory."""
    from r3090d.measure.plan import PlanError, estimate_weights, shape_from_config
    from r3090d.preflight.checks import served_context

    raw = flag_value(cfg.engine.extra_args, "--max-num-batched-tokens")
    step_tokens = int(raw) if raw is not None and str(raw).isdigit() else None
    shape = params = None
    if model.config is not None:
        try:
            shape = shape_from_config(model.config)
            params = estimate_weights(shape).params  # logical parameters: a quantized file stores fewer elements
        except PlanError:
            params = model.parameter_count  # a family plan cannot count: what the safetensors hold, if read
    context, _ = served_context(cfg, shape.max_position_embeddings if shape else None)
    return steps.longest_step(step_tokens, context, params)
