"""Command-line entry points: `r3090d` (the daemon) and `r3090ctl` (everything else).

Exit codes: usage errors 64, configuration errors 78, health-style commands
0/1/2/3 (see r3090d.exitcodes). A user mistake prints one line, never a traceback.
"""

from __future__ import annotations

import sys

import click

from r3090d import exitcodes
from r3090d.cli import (
    alerts_cmd,  # noqa: F401
    bench_cmd,  # noqa: F401  (registers `bench`)
    config_cmd,  # noqa: F401  (registers `config`)
    control_cmd,  # noqa: F401  (registers `restart`, `maintenance`, `silence`, `reload`)
    history_cmd,  # noqa: F401  (registers `history`)
    plan_cmd,  # noqa: F401  (registers `plan`)
    preflight_cmd,  # noqa: F401  (registers `preflight`)
    status_cmd,  # noqa: F401  (registers `status`)
)
from r3090d.cli.common import ctl, run_click
from r3090d.cli.daemon_cmd import daemon


def daemon_main() -> None:
    sys.exit(run_click(daemon))


def ctl_main() -> None:
    sys.exit(run_click(ctl))


__all__ = ["ctl", "daemon", "daemon_main", "ctl_main", "click", "exitcodes"]
