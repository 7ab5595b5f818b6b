"""Command-line entry points: `r3090d` (the daemon) and `r3090ctl` (everything else).

Exit codes: usage errors 64, configuration errors 78, health-style commands
0/1/2/3 only (see r3090d.exitcodes). A user mistake prints one line, never a
traceback; under --json it is a JSON object on stdout.
"""

from __future__ import annotations

import sys

import click

from r3090d import __version__, exitcodes
from r3090d.cli import (
    alerts_cmd,  # noqa: F401
    bench_cmd,  # noqa: F401  (registers `bench`)
    config_cmd,  # noqa: F401  (registers `config`)
    control_cmd,  # noqa: F401  (registers `restart`, `maintenance`, `silence`, `reload`)
    history_cmd,  # noqa: F401  (registers `history`)
    plan_cmd,  # noqa: F401  (registers `plan`)
    preflight_cmd,  # noqa: F401  (registers `preflight`)
    setup_cmd,  # noqa: F401  (registers `setup` and `example`)
    status_cmd,  # noqa: F401  (registers `status`)
    suspend_cmd,  # noqa: F401  (registers `suspend` and `resume`)
    swap_cmd,  # noqa: F401  (registers `swap`)
)
from r3090d.cli.common import ctl, finish, guard_stdout, run_click
from r3090d.cli.daemon_cmd import daemon

# `r3090d --version`: the daemon is a plain command, so the option is added here.
click.version_option(__version__, prog_name="r3090d")(daemon)


def daemon_main() -> None:
    # prog_name: the name shell completion and messages use, whatever argv[0] is.
    sys.exit(finish(run_click(daemon, prog_name="r3090d")))


def ctl_main() -> None:
    guard_stdout()
    sys.exit(finish(run_click(ctl, prog_name="r3090ctl")))


__all__ = ["ctl", "daemon", "daemon_main", "ctl_main", "click", "exitcodes"]
