"""`r3090ctl status`: the daemon's view of the engine, GPU and alerts, with monitoring-plugin exit codes.

"Running" means the control socket answers. If it does not, the state file and
its pid decide: a live daemon with fresh state is still reported (with a note);
otherwise the last persisted state is shown and the exit code is 3 (UNKNOWN).
A document in a format this r3090ctl cannot read (a newer daemon's) is one line
saying so, and 3 (UNKNOWN) too.

In swap mode the panel has a row per model; `--model NAME` shows one model in
full (its engine's panel, as single mode shows its one engine) and judges that
model alone, with the router it is served through and the daemon's alerts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import psutil

from r3090d import exitcodes
from r3090d.cli.common import (
    CommandError,
    HealthCommand,
    config_option,
    ctl,
    emit_json,
    instance_option,
    load_config,
    reader_gone,
)
from r3090d.config import ConfigError
from r3090d.service import control_client, statusview
from r3090d.service.exporter import stale_after
from r3090d.service.state import STATE_FILE
from r3090d.service.statedoc import StateDocument, UnreadableFormat, view

STATUS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Located:
    running: bool
    doc: dict | None  # as the daemon wrote it: what --json prints
    source: str | None  # "socket" | "state-file" | None
    note: str | None = None  # why the socket was not used, or what is odd
    state_path: str = ""
    pid_note: str = ""
    state: StateDocument | None = None  # doc, parsed: what the verdict and the panel read
    unreadable: str | None = None  # why doc could not be parsed (a newer format)


def located(running: bool, doc, source: str | None, note: str | None, state_path: str, pid_note: str = "") -> Located:
    """A Located with its document parsed; a document this r3090ctl cannot read says why in `unreadable`."""
    raw = doc if isinstance(doc, dict) else None
    try:
        return Located(running, raw, source, note, state_path, pid_note, state=view(doc))
    except UnreadableFormat as exc:
        where = state_path if source == "state-file" else "the daemon's control socket"
        return Located(running, raw, source, note, state_path, pid_note, unreadable=f"{where}: {exc}")


def pid_is_daemon(pid, started_at) -> bool:
    """The pid is alive and is the process that wrote the state (not a reused pid)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started_at is None or proc.create_time() <= float(started_at) + 2.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def read_state(state_dir: str) -> tuple[dict | None, str | None]:
    path = Path(state_dir) / STATE_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except PermissionError:
        return None, f"cannot read {path}: permission denied"
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
    return (doc if isinstance(doc, dict) else None), None


def locate(cfg, timeout: float = STATUS_TIMEOUT_S) -> Located:
    dc = cfg.daemon
    state_path = str(Path(dc.state_dir) / STATE_FILE)
    try:
        reply = control_client.request(dc.runtime_dir, {"cmd": "status"}, timeout)
        if reply.get("ok"):
            return located(True, reply.get("state"), "socket", reply.get("message"), state_path)
        socket_note = f"the control socket answered: {reply.get('error')}"
    except control_client.ClientError as exc:
        socket_note = exc.detail
    doc, problem = read_state(dc.state_dir)
    if doc is None:
        return Located(False, None, None, problem or socket_note, state_path, "no state file" if problem is None else "state unreadable")
    found = located(False, doc, "state-file", socket_note, state_path)
    if found.state is None:
        return found
    daemon = found.state.daemon
    pid = daemon.pid
    if pid_is_daemon(pid, daemon.started_at):
        age = time.time() - (found.state.written_at or 0.0)
        if age <= stale_after(found.state):
            note = f"pid {pid} runs but its control socket does not answer: {socket_note}; showing {state_path}"
            return dataclasses.replace(found, running=True, note=note)
        return dataclasses.replace(found, note=f"pid {pid} is alive but its state is {age:.0f} s old: the daemon is stuck", pid_note=f"pid {pid} not answering")
    return dataclasses.replace(found, pid_note=f"pid {pid} is gone" if pid else "no pid recorded")


def start_hint(cfg) -> str:
    unit = f"r3090d@{cfg.instance}" if cfg.instance is not None else "r3090d"
    return f"systemctl start {unit}   (or in a terminal: r3090d --config {cfg.source})"


def missing_model(found: Located, model: str) -> str | None:
    """Why --model NAME cannot be shown from this document, or None."""
    d = found.state
    if d is None:
        return None  # not running, starting or unreadable: said as without --model
    if not d.swap_mode:
        return f"--model {model!r}: r3090d serves one engine (no [[models]]); r3090ctl status without --model"
    if d.model(model) is None:
        return f"r3090d serves no model {model!r}; its models: {', '.join(m.name for m in d.models) or 'none'}"
    return None


def judge(found: Located, now: float, model: str | None = None) -> statusview.HealthVerdict:
    if found.unreadable:
        return statusview.HealthVerdict(exitcodes.UNKNOWN, (found.unreadable,))
    if model is not None and found.running and found.state is not None:
        missing = missing_model(found, model)
        if missing:
            return statusview.HealthVerdict(exitcodes.UNKNOWN, (missing,))
        return statusview.model_verdict(found.state, found.state.model(model), now)
    return statusview.verdict_of(found.state, running=found.running, now=now)


def _json(found: Located, verdict: statusview.HealthVerdict, model: str | None) -> dict:
    out = {
        "running": found.running,
        "source": found.source,
        "note": found.note,
        "exit_code": verdict.code,
        "verdict": verdict.label,
        "reasons": list(verdict.reasons),
        "state": found.doc,
    }
    if model is not None:
        models = (found.doc or {}).get("models")
        out["model"] = next((m for m in models if isinstance(m, dict) and m.get("name") == model), None) if isinstance(models, list) else None
    return out


def render(cfg, found: Located, now: float, as_json: bool, model: str | None = None) -> int:
    verdict = judge(found, now, model)
    if as_json:
        emit_json(_json(found, verdict, model))
        return verdict.code
    if found.unreadable:
        click.echo(verdict.line())  # one line: the state cannot be shown
        return verdict.code
    if not found.running:
        for line in statusview.not_running_lines(found.state, found.pid_note or "no answer", found.state_path, start_hint(cfg), now):
            click.echo(line)
        if found.note and found.source is None:
            click.echo(f"({found.note})")
        return verdict.code
    if found.state is None:
        click.echo(f"r3090d is starting: {found.note or 'no state yet'}")
        click.echo(f"Status     {verdict.line()}")
        return verdict.code
    note = found.note if found.source == "state-file" else None
    if model is not None:
        missing = missing_model(found, model)
        if missing:
            click.echo(verdict.line())  # one line: there is no such panel
            return verdict.code
        lines = statusview.model_panel(found.state, found.state.model(model), verdict, now, note=note)
    else:
        lines = statusview.panel(found.state, verdict, now, note=note)
    for line in lines:
        click.echo(line)
    return verdict.code


@ctl.command("status", cls=HealthCommand)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (with --watch: one JSON document per line)")
@click.option("--watch", type=click.FloatRange(min=0.2), metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
@click.option("--model", "model", metavar="NAME", help="swap mode: one model in full, and the verdict on it alone")
@config_option
@instance_option
def status_command(as_json, watch, model, config_path, instance) -> int:
    """The engine's state, KV cache, GPU, restarts and alerts. Exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN."""
    try:
        cfg = load_config(config_path, instance, check_files=False)
    except ConfigError as exc:
        raise CommandError(f"cannot find the daemon: config error: {exc.one_line()}", exitcodes.UNKNOWN, "r3090ctl status") from None
    if not watch:
        return render(cfg, locate(cfg), time.time(), as_json, model)
    code = exitcodes.UNKNOWN
    try:
        while True:
            found = locate(cfg)
            if not as_json and sys.stdout.isatty():
                click.echo("\x1b[H\x1b[2J", nl=False)
            if as_json:
                verdict = judge(found, time.time(), model)
                code = verdict.code
                line = {k: v for k, v in _json(found, verdict, model).items() if k != "note"}
                click.echo(json.dumps(line, sort_keys=True, default=str))
            else:
                code = render(cfg, found, time.time(), False, model)
                click.echo(f"(every {watch:g} s, Ctrl-C to stop; {time.strftime('%H:%M:%S')})")
            sys.stdout.flush()
            if reader_gone():  # `status --watch | head`: nobody reads any more
                return code
            time.sleep(watch)
    except KeyboardInterrupt:
        return code
