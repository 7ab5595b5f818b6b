"""`r3090ctl restart | maintenance | silence | reload`: ask the running daemon over its control socket.

These talk to r3090d, not to systemd: a restart is the daemon's own (drained by
default, with the load-balancer grace), so its history, alerts and backoff stay
right. Exit 0 when the daemon accepted, 1 when it refused or cannot be reached.

In swap mode (several models, one engine each) `restart --model NAME` restarts
that model's engine, and --wait follows that engine.
"""

from __future__ import annotations

import time

import click

from r3090d import exitcodes
from r3090d.cli.common import (
    CommandError,
    UsageExit,
    config_option,
    ctl,
    emit_json,
    instance_option,
    load_config,
)
from r3090d.config import ConfigError
from r3090d.core.vocabulary import Phase
from r3090d.service import control_client, control_protocol, statusview
from r3090d.service.statedoc import StateDocument, UnreadableFormat, view

REQUEST_TIMEOUT_S = 15.0
RELOAD_TIMEOUT_S = control_protocol.RELOAD_TIMEOUT_S + 5.0
LOST_AFTER_S = 15.0  # --wait: the daemon stopped answering for this long


def ask(cfg, payload: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """The daemon's reply, or a click exception with one line and exit 1."""
    try:
        return control_client.request(cfg.daemon.runtime_dir, payload, timeout)
    except control_client.ClientError as exc:
        raise _Failed(str(exc)) from None


class _Failed(click.ClickException):
    exit_code = exitcodes.WARNING  # 1: the command did not do what was asked

    def show(self, file=None) -> None:
        click.echo(f"r3090ctl: {self.message}", err=True)


# swap mode: which model's engine a command acts on
model_option = click.option("--model", "model", metavar="NAME", help="swap mode: the model (its served name) whose engine this acts on")


def checked_model(cfg, model: str | None, command: str) -> str | None:
    """The --model given, once it can be sent: a well-formed name, and a config with [[models]]; else exit 64."""
    if model is None:
        return None
    if not control_protocol.is_model_name(model):
        raise UsageExit(f"--model {model[:40]!r} is not a served model name (1 to {control_protocol.MAX_MODEL_NAME} printable characters)")
    if not cfg.swap_mode:
        raise CommandError(f"--model needs swap mode: {cfg.source} has no [[models]], so r3090d serves one engine; drop --model",
                           exitcodes.USAGE, f"r3090ctl {command}")  # fmt: skip
    return model


def with_model(payload: dict, model: str | None) -> dict:
    return {**payload, "model": model} if model is not None else payload


def engine_of(doc: StateDocument, model: str | None) -> StateDocument | None:
    """The document as one engine's: the whole one, or in swap mode the named model's (None: no such model in it)."""
    if model is None:
        return doc
    found = doc.model(model)
    return doc.for_model(found) if found is not None else None


def report(reply: dict, as_json: bool) -> int:
    if as_json:
        emit_json(reply)
    elif reply.get("ok"):
        click.echo(reply.get("message") or "ok")
    else:
        click.echo(f"r3090ctl: refused: {reply.get('error') or 'no reason given'}", err=True)
    return exitcodes.OK if reply.get("ok") else exitcodes.WARNING


# ------------------------------------------------------------------ restart


@ctl.command("restart")
@click.option("--drain/--no-drain", default=True, show_default=True, help="let running requests finish (and the load balancer leave) first")
@click.option("--wait", is_flag=True, help="show progress until the new engine is ready")
@click.option("--timeout", type=click.FloatRange(min=1), metavar="SECONDS", help="with --wait: give up waiting after this long (default: from the config)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@model_option
@config_option
@instance_option
def restart_command(drain, wait, timeout, as_json, model, config_path, instance) -> int:
    """Restart the engine through the daemon (drained by default); in swap mode, --model NAME's engine."""
    cfg = load_config(config_path, instance, check_files=False)
    model = checked_model(cfg, model, "restart")
    try:
        before = read_state(cfg)
        before = engine_of(before, model) if before is not None else None
    except UnreadableFormat:
        before = None  # asked all the same; --wait says why it cannot follow
    reply = ask(cfg, with_model({"cmd": "restart", "drain": drain}, model))
    if not reply.get("ok") or not wait:
        return report(reply, as_json)
    if not as_json:
        click.echo(reply.get("message") or "restart requested")
    if timeout is None:
        e = cfg.engine
        timeout = cfg.watchdog.lb_grace + e.shutdown_timeout + 10 + cfg.watchdog.backoff_max + e.startup_timeout + 30
    result = wait_ready(cfg, reply.get("generation"), before.engine.pid if before else None, timeout, quiet=as_json, model=model)
    if as_json:
        emit_json({**reply, **result})
    elif result["ok"]:
        click.echo(result["message"])
    else:
        click.echo(f"r3090ctl: {result['error']}", err=True)
    return exitcodes.OK if result["ok"] else exitcodes.WARNING


def _status(cfg) -> dict | None:
    try:
        reply = control_client.request(cfg.daemon.runtime_dir, {"cmd": "status"}, 5.0)
    except control_client.ClientError:
        return None
    return reply.get("state") if reply.get("ok") else None


def read_state(cfg) -> StateDocument | None:
    """The daemon's state document, parsed; None while it does not answer or has none. Raises UnreadableFormat."""
    return view(_status(cfg))


def follow_state(cfg, timeout: float, judge, *, during: str, timed_out, interval: float = 0.25, model: str | None = None) -> dict:
    """Read the state document every `interval` s until `judge(doc, elapsed)` answers (a result dict).

    The one loop behind every --wait: an unreadable format, a daemon silent for
    LOST_AFTER_S (`during` names what it was in) and the timeout (`timed_out()`
    says what is still going on) end it with {"ok": False, "error": ...}. With
    `model` (swap mode), judge gets that model's engine as the document's (engine_of).
    """
    start = last_seen = time.monotonic()
    while True:
        now = time.monotonic()
        try:
            doc = read_state(cfg)
        except UnreadableFormat as exc:
            return {"ok": False, "error": str(exc)}
        if doc is None:
            if now - last_seen > LOST_AFTER_S:
                return {"ok": False, "error": f"r3090d stopped answering {now - start:.0f} s into {during}"}
        else:
            last_seen = now
            engine = engine_of(doc, model)
            if engine is None:
                served = ", ".join(m.name for m in doc.models) or "none: it runs one engine"
                return {"ok": False, "error": f"r3090d serves no model {model!r} (its models: {served})"}
            answer = judge(engine, now - start)
            if answer is not None:
                return answer
        if now - start > timeout:
            return {"ok": False, "error": timed_out()}
        time.sleep(interval)


def wait_ready(cfg, old_generation, old_pid, timeout: float, *, quiet: bool, model: str | None = None) -> dict:
    """Follow the phases until a new engine is ready; print each change."""
    last_phase = Phase.READY.value  # what the engine was when the restart was accepted (a given-up start prints its phase)

    def judge(doc: StateDocument, elapsed: float) -> dict | None:
        nonlocal last_phase
        engine = doc.engine
        if engine.phase_name != last_phase:
            last_phase = engine.phase_name
            if not quiet:
                extra = doc.next_action
                click.echo(f"  +{elapsed:5.1f} s  {last_phase}" + (f"  ({extra})" if extra else ""))
        new_engine = (
            engine.generation > old_generation
            if isinstance(old_generation, int) and engine.generation is not None
            else engine.pid not in (None, old_pid)
        )
        if engine.phase is Phase.READY and new_engine:
            return {"ok": True, "message": f"ready after {elapsed:.1f} s (engine pid {engine.pid})", "ready_after_s": round(elapsed, 2), "pid": engine.pid}
        # The given-up state a restart starts from is not its answer; one the new engine reaches is.
        if engine.phase is Phase.GIVEN_UP and new_engine:
            return {"ok": False, "error": f"r3090d gave up: {doc.give_up_reason}"}
        if engine.phase is Phase.SHUTTING_DOWN:
            return {"ok": False, "error": "r3090d is shutting down"}
        return None

    return follow_state(cfg, timeout, judge, during="the restart", model=model,
                        timed_out=lambda: f"still {last_phase} after {timeout:.0f} s; the restart goes on (r3090ctl status)")  # fmt: skip


# ------------------------------------------------------------------ maintenance, silence, reload


@ctl.command("maintenance")
@click.argument("mode", type=click.Choice(["on", "off"]))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@config_option
@instance_option
def maintenance_command(mode, as_json, config_path, instance) -> int:
    """Pause (on) or resume (off) automatic restarts; /healthz answers 503 while on."""
    cfg = load_config(config_path, instance, check_files=False)
    return report(ask(cfg, {"cmd": "maintenance", "on": mode == "on"}), as_json)


@ctl.command("silence")
@click.argument("alert")
@click.argument("duration")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@config_option
@instance_option
def silence_command(alert, duration, as_json, config_path, instance) -> int:
    """Stop notifications for ALERT for DURATION (30m, 2h, 1h30m, 1d); it is still tracked and shown."""
    if not control_protocol.ALERT_KEY.fullmatch(alert):
        raise UsageExit(f"{alert!r} is not an alert name (letters, digits, _ . : -); see r3090ctl status")
    try:
        seconds = statusview.parse_duration(duration)
    except ValueError as exc:
        raise UsageExit(str(exc)) from None
    if seconds > control_protocol.MAX_SILENCE_S:
        raise UsageExit(f"{duration} is longer than the 30 days a silence may last")
    cfg = load_config(config_path, instance, check_files=False)
    reply = ask(cfg, {"cmd": "silence", "alert": alert, "seconds": seconds})
    if reply.get("ok") and not as_json:
        reply = {**reply, "message": f"{alert} silenced until {statusview.clock(time.time() + seconds)} ({statusview.ago(seconds)})"}
    return report(reply, as_json)


@ctl.command("reload")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@config_option
@instance_option
def reload_command(as_json, config_path, instance) -> int:
    """Re-read the config file; an invalid file is refused and the running config stays."""
    try:
        cfg = load_config(config_path, instance, check_files=False)
    except ConfigError as exc:
        # The daemon would refuse it too; and a broken file cannot say where the daemon listens.
        click.echo(f"r3090ctl reload: not sent, the config is invalid: {exc.one_line()}", err=True)
        click.echo("r3090ctl reload: a running r3090d keeps its current config", err=True)
        return exitcodes.CONFIG
    return report(ask(cfg, {"cmd": "reload"}, RELOAD_TIMEOUT_S), as_json)
