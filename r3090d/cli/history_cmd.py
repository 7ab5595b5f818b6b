"""`r3090ctl history [N]`: the engine restarts recorded in the state directory (newest first).

Reads the records directly, so it works with the daemon stopped too (after a
give-up, say). Without N: a table; with N: record N in full.
"""

from __future__ import annotations

import json

import click

from r3090d import exitcodes
from r3090d.cli.common import UsageExit, config_option, ctl, emit_json, instance_option, load_config
from r3090d.service import forensics, statusview

LOG_TAIL_LINES = 25


def load_records(state_dir: str) -> list[tuple[str, dict | None, str | None]]:
    """(file name, record or None, why unreadable) for each record, newest first."""
    out = []
    for path in forensics.list_records(state_dir):
        try:
            data = json.loads(path.read_text())
            out.append((path.name, data if isinstance(data, dict) else None, None if isinstance(data, dict) else "not a JSON object"))
        except PermissionError:
            out.append((path.name, None, "permission denied"))
        except (OSError, ValueError) as exc:
            out.append((path.name, None, getattr(exc, "strerror", None) or str(exc)))
    return out


def summary(name: str, rec: dict | None, why: str | None) -> dict:
    if rec is None:
        return {"file": name, "error": why}
    return {"file": name, "time": rec.get("time"), "reason": rec.get("reason"), "detail": rec.get("detail"), "root_cause": rec.get("root_cause"), "ready_after_s": rec.get("ready_after_s")}


@ctl.command("history")
@click.argument("number", type=click.IntRange(min=1), required=False)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@config_option
@instance_option
def history_command(number, as_json, config_path, instance) -> int:
    """List engine restarts (time, reason, time to ready), or show restart NUMBER (1 = newest) in full."""
    cfg = load_config(config_path, instance, check_files=False)
    folder = forensics.records_dir(cfg.daemon.state_dir)
    try:
        records = load_records(cfg.daemon.state_dir)
    except PermissionError:
        click.echo(f"r3090ctl history: cannot read {folder}: permission denied (run as root or as a member of the daemon's group)", err=True)
        return exitcodes.WARNING
    if number is not None:
        if number > len(records):
            raise UsageExit(f"there are {len(records)} restart records in {folder}; ask for 1 to {len(records)}" if records else f"no restart records in {folder}")
        name, rec, why = records[number - 1]
        if rec is None:
            click.echo(f"r3090ctl history: {folder / name}: {why}", err=True)
            return exitcodes.WARNING
        if as_json:
            emit_json({"file": str(folder / name), **rec})
        else:
            show(number, folder / name, rec)
        return exitcodes.OK
    if as_json:
        emit_json([summary(*r) for r in records])
        return exitcodes.OK
    if not records:
        click.echo(f"no restarts recorded in {folder}")
        return exitcodes.OK
    rows = [("#", "time", "reason", "ready after", "root cause or detail")]
    for i, (name, rec, why) in enumerate(records, 1):
        if rec is None:
            rows.append((str(i), "-", "?", "-", f"unreadable {name}: {why}"))
            continue
        ready = rec.get("ready_after_s")
        rows.append((str(i), statusview.clock(rec.get("time")), str(rec.get("reason")), f"{ready:.1f} s" if isinstance(ready, int | float) else "not ready", str(rec.get("root_cause") or rec.get("detail") or "")[:90]))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    return exitcodes.OK


def show(number: int, path, rec: dict) -> None:
    echo = click.echo
    ready = rec.get("ready_after_s")
    echo(f"Restart #{number}  {path}")
    echo(f"Time       {statusview.clock(rec.get('time'))}")
    echo(f"Reason     {rec.get('reason')}: {rec.get('detail')}")
    if rec.get("root_cause"):
        echo(f"Root cause {rec['root_cause']}")
    echo(f"Ready      {'after ' + format(ready, '.1f') + ' s' if isinstance(ready, int | float) else 'not (yet) ready after this restart'}")
    snap = rec.get("snapshot") or {}
    child = snap.get("child") or {}
    health = snap.get("health") or {}
    eng = snap.get("metrics") or snap.get("engine") or {}  # "engine": a record written before the field was renamed
    echo(f"Engine     pid {child.get('pid')}, alive {child.get('alive')}, exit code {child.get('exit_code')}, tree {child.get('tree_pids')}")
    echo(f"/health    {health.get('status')}" + (f" {health.get('http_status')}" if health.get("http_status") else "") + (f" ({health.get('detail')})" if health.get("detail") else ""))
    if eng.get("kv_usage") is not None:
        echo(f"KV cache   {eng['kv_usage'] * 100:.0f}% used, {eng.get('free_blocks') or 0:.0f} free blocks; running {eng.get('running')}, waiting {eng.get('waiting')}")
    echo(f"GPU        {statusview.gpu_line(rec.get('gpu') or {})}")
    metrics = rec.get("metrics_text")
    echo(f"Metrics    {len(metrics.splitlines())} lines of vLLM /metrics kept" if metrics else "Metrics    none captured")
    tail = rec.get("engine_log_tail") or []
    echo(f"Engine log (last {min(len(tail), LOG_TAIL_LINES)} of {len(tail)} lines kept):")
    for line in tail[-LOG_TAIL_LINES:]:
        echo(f"  {line}")
