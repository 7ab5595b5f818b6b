"""Shared CLI plumbing: the r3090ctl group, config loading, and exit-code mapping.

Errors print one line on stderr; when `--json` is anywhere on the command line
they print `{"error": ..., "exit_code": N}` on stdout instead, so a script that
parses stdout always gets JSON. Health commands (status, preflight) turn every
error of their own into 3 (UNKNOWN): a monitoring plugin must exit 0-3.
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import click

from r3090d import __version__, exitcodes
from r3090d import config as configmod
from r3090d.config import ConfigError
from r3090d.effectors import journal

JSON_FLAG = "--json"


class UsageExit(click.UsageError):
    exit_code = exitcodes.USAGE


class CommandError(click.ClickException):
    """A failure with its own exit code, told in one line: `r3090ctl status: <message>`."""

    def __init__(self, message: str, exit_code: int, command: str = "r3090ctl"):
        super().__init__(message)
        self.exit_code = exit_code
        self.command = command

    def show(self, file=None) -> None:
        click.echo(f"{self.command}: {self.message}", err=True)


class HealthCommand(click.Command):
    """A command read by monitoring plugins: its usage and config errors exit 3 (UNKNOWN), not 64 or 78."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            exc.exit_code = exitcodes.UNKNOWN
            raise

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            exc.exit_code = exitcodes.UNKNOWN
            raise
        except ConfigError as exc:
            raise CommandError(f"config error: {exc.one_line()}", exitcodes.UNKNOWN, ctx.command_path) from None


@dataclass(frozen=True)
class ErrorReport:
    message: str
    exit_code: int


def wants_json(args: Sequence[str]) -> bool:
    """--json anywhere before a lone `--`: errors must then be JSON on stdout too."""
    for arg in args:
        if arg == "--":
            return False
        if arg == JSON_FLAG or arg.startswith(JSON_FLAG + "="):
            return True
    return False


def _usage_exit_code(exc: click.UsageError) -> int:
    # click's own usage errors say 2, which monitoring plugins read as CRITICAL.
    return exitcodes.USAGE if exc.exit_code == click.UsageError.exit_code else exc.exit_code


def _emit_error(report: ErrorReport, as_json: bool, show) -> int:
    if as_json:
        click.echo(json.dumps({"error": report.message, "exit_code": report.exit_code}, sort_keys=True))
    else:
        show()
    return report.exit_code


def run_click(command: click.Command, args: list[str] | None = None, *, prog_name: str | None = None) -> int:
    """Run a click command; map usage errors to 64 and config errors to 78 (health commands: 3)."""
    argv = list(sys.argv[1:] if args is None else args)
    as_json = wants_json(argv)
    try:
        rv = command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.UsageError as exc:
        return _emit_error(ErrorReport(exc.format_message(), _usage_exit_code(exc)), as_json, exc.show)
    except click.ClickException as exc:
        return _emit_error(ErrorReport(exc.format_message(), exc.exit_code), as_json, exc.show)
    except ConfigError as exc:
        report = ErrorReport(f"config error: {exc.one_line()}", exitcodes.CONFIG)
        # Under the journal this line must carry its priority, or `journalctl -p err` misses it.
        return _emit_error(report, as_json, lambda: click.echo(journal.for_stderr(f"r3090d: {report.message}", journal.Priority.ERR), err=True))
    except KeyboardInterrupt:
        return 130
    if isinstance(rv, int):
        return rv
    return exitcodes.OK


class _ReaderGoneGuard(io.RawIOBase):
    """Standard output on a pipe: once the reader has gone, the rest goes to /dev/null.

    `r3090ctl config check --json | head -c 10` must neither print a
    BrokenPipeError nor lose the command's own exit code (a health command's
    0-3 still counts), so a write into a closed pipe is not an error: fd 1 is
    pointed at /dev/null and the command finishes. Loops that print until
    stopped ask reader_gone() and end.
    """

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd
        self.gone = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        try:
            return os.write(self.fd, data)
        except BrokenPipeError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.fd)
            os.close(null)
            self.gone = True
            return len(data)


_guard: _ReaderGoneGuard | None = None


def guard_stdout() -> None:
    """Route stdout through _ReaderGoneGuard when it is a pipe or a socket (where readers can leave)."""
    global _guard
    try:
        fd = sys.stdout.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, ValueError, OSError):
        return
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)) or _guard is not None:
        return
    old = sys.stdout
    old.flush()
    _guard = _ReaderGoneGuard(fd)
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(_guard), encoding=old.encoding, errors=old.errors, line_buffering=old.line_buffering, write_through=False
    )


def reader_gone() -> bool:
    """Whoever read stdout has closed it (only known once a write failed)."""
    return _guard is not None and _guard.gone


def finish(code: int) -> int:
    """Flush what is left; the exit code is the command's, whether or not anyone still reads."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        # stdout was not a guarded pipe (a socket pair set up oddly, say): silence it.
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    return code


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
json_option = click.option("--json", "as_json", is_flag=True, help="machine-readable output")

def subcommand_defaults(group: click.Group, given: dict[str, object]) -> dict[str, dict]:
    """A click default_map that hands the group's options to every subcommand that has them.

    given: option flag -> value, e.g. {"--config": "F"}. `r3090ctl --config F
    status` then means `r3090ctl status --config F`; an option given after the
    subcommand still wins. A --json that takes an optional value (bench's
    `--json [FILE]`) gets its flag value, not True.
    """
    tree: dict[str, dict] = {}
    for name, command in group.commands.items():
        entry: dict[str, object] = {}
        for param in command.params:
            flag = next((opt for opt in param.opts if opt in given), None)
            if flag is None or param.name is None:
                continue
            value = given[flag]
            if isinstance(param, click.Option) and value is True and not param.is_flag and isinstance(param.flag_value, str):
                value = param.flag_value
            entry[param.name] = value
        if isinstance(command, click.Group):
            entry.update(subcommand_defaults(command, given))
        tree[name] = entry
    return tree


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="r3090ctl")
@click.option(
    "--config",
    "config_path",
    metavar="FILE",
    help=f"config file, for every subcommand (default: ${configmod.ENV_CONFIG} or {configmod.DEFAULT_PATH})",
)
@click.option("--instance", type=click.IntRange(0, 63), default=None, help="address the r3090d@N instance (GPU N)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output, errors included")
@click.pass_context
def ctl(ctx: click.Context, config_path: str | None, instance: int | None, as_json: bool) -> None:
    """Inspect and control r3090d, the vLLM supervisor.

    --config, --instance and --json may come before the subcommand or after it.
    """
    values = {"--config": config_path, "--instance": instance, JSON_FLAG: as_json}
    given = {flag: value for flag, value in values.items() if value is not None and value is not False}
    if given:
        ctx.default_map = subcommand_defaults(ctx.command, given)
