"""`r3090d`: run the daemon in the foreground (systemd runs exactly this)."""

from __future__ import annotations

import click

from r3090d.cli.common import config_option, instance_option


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_option
@instance_option
@click.option("--skip-preflight", is_flag=True, help="start the engine even if preflight fails (logged)")
def daemon(config_path, instance, skip_preflight) -> int:
    """Supervise vLLM: preflight, start, watch, restart."""
    from r3090d.service.boot import run

    return run(config_path=config_path, instance=instance, skip_preflight=skip_preflight)
