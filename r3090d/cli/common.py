"""Shared CLI plumbing: the r3090ctl group, config loading, and exit-code mapping."""

from __future__ import annotations

import json
import sys

import click

from r3090d import config as configmod
from r3090d import exitcodes
from r3090d.config import ConfigError


class UsageExit(click.UsageError):
    exit_code = exitcodes.USAGE


def run_click(command: click.Command, args: list[str] | None = None) -> int:
    """Run a click command; map usage errors to 64 and config errors to 78."""
    try:
        rv = command.main(args=args, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.UsageError as exc:
        # click would exit 2, which monitoring plugins read as CRITICAL.
        exc.show()
        return exitcodes.USAGE
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except ConfigError as exc:
        click.echo(f"r3090d: config error: {exc.one_line()}", err=True)
        return exitcodes.CONFIG
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return exitcodes.OK
    if isinstance(rv, int):
        return rv
    return exitcodes.OK


def load_config(config_path: str | None, instance: int | None, *, check_files: bool = True):
    if instance is None:
        instance = configmod.instance_from_env()
    path = configmod.resolve_path(config_path, instance)
    return configmod.load(path, instance, check_files=check_files)


def emit_json(data) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


config_option = click.option(
    "--config",
    "config_path",
    metavar="FILE",
    help=f"config file (default: ${configmod.ENV_CONFIG} or {configmod.DEFAULT_PATH})",
)
instance_option = click.option(
    "--instance", type=click.IntRange(0, 63), default=None, help="address the r3090d@N instance (GPU N)"
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="r3090d")
def ctl() -> None:
    """Inspect and control r3090d, the vLLM supervisor."""
