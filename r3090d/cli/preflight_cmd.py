"""`r3090ctl preflight`: check the host, GPU, model and engine before (or while) running.

Exit codes: 0 all checks ok or skipped, 1 warnings only, 2 any failure, 3 the
checks could not run (a config or usage error).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import psutil

from r3090d.cli.common import HealthCommand, config_option, ctl, emit_json, instance_option, load_config
from r3090d.config import Config
from r3090d.preflight import checks as preflightmod
from r3090d.service.state import STATE_FILE, read_json
from r3090d.service.statedoc import UnreadableFormat, view

COLUMNS = ("name", "status", "measured", "expected", "hint")


def own_engine_pids(cfg: Config) -> tuple[int, ...]:
    """Pids of the engine tree the running daemon owns, from its state file.

    Those processes may hold the engine port and VRAM without failing
    preflight. A state file whose daemon is gone vouches for nothing.
    """
    try:
        doc = view(read_json(Path(cfg.daemon.state_dir) / STATE_FILE))
    except UnreadableFormat:
        return ()  # a newer daemon's document: what it says cannot be read, so it vouches for nothing
    if doc is None or doc.daemon.pid is None or doc.daemon.pid <= 0 or not psutil.pid_exists(doc.daemon.pid):
        return ()
    pids = {p for p in (doc.engine.pid, *doc.engine.tree_pids) if p is not None}
    return tuple(sorted(pids))


def render_table(results: list[preflightmod.CheckResult]) -> str:
    rows = [COLUMNS] + [(r.name, r.status.value.upper(), r.measured, r.expected, r.hint) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return "\n".join(lines)


@ctl.command("preflight", cls=HealthCommand)
@config_option
@instance_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--own-pid", "own_pids", type=int, multiple=True, hidden=True, help="a pid of r3090d's own engine")
def preflight(config_path, instance, as_json, own_pids) -> int:
    """Check the GPU, host, model and vLLM install; exit 0 ok, 1 warnings, 2 failures, 3 unknown."""
    # Missing model or python are reported as failed checks, not as config errors.
    cfg = load_config(config_path, instance, check_files=False)
    from r3090d.preflight import gather as preflight_facts

    pids = tuple(own_pids) + own_engine_pids(cfg)
    results = preflight_facts.run(cfg, pids)
    code = preflightmod.exit_code(results)
    if as_json:
        emit_json(
            {
                "exit_code": code,
                "checks": [dict(dataclasses.asdict(r), status=r.status.value) for r in results],
            }
        )
    else:
        click.echo(render_table(results))
    return code
