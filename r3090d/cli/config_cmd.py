"""`r3090ctl config check`: the effective configuration, secrets redacted, and the exact argv."""

from __future__ import annotations

import shlex

import click

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.cli.common import config_option, ctl, emit_json, instance_option, load_config
from r3090d.config import ConfigError


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
    for warning in cfg.warnings:  # removed keys the file still uses; stderr keeps --json output clean
        click.echo(f"WARN {warning}", err=True)
    if as_json:
        emit_json({"config": configmod.redacted(cfg), "vllm_version": str(version), "argv": argv})
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
