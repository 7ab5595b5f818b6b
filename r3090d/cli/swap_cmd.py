"""`r3090ctl swap NAME`: bring a model onto the GPU by hand (swap mode).

The daemon answers at once: accepted, or refused in one line (a model it does
not serve, one that has failed). The swap then runs over many ticks, as the
arbiter's own do: the resident engine is drained (requests still running at
swap.drain_timeout are frozen with it) and parked in host memory, or stopped
where it cannot be parked; the model is resumed, or cold-started, passes its
canary, and the router routes to it. `--wait` follows it through the state
document until the model serves or the swap fails.

Exit codes: 0 accepted (with --wait: the model serves); 1 refused, failed, or
the daemon cannot be reached; 64 usage (a config without [[models]], a name
that cannot be one).
"""

from __future__ import annotations

import dataclasses

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
from r3090d.cli.control_cmd import ask, follow_state, read_state
from r3090d.cli.suspend_cmd import POLL_S, show_reply
from r3090d.core.arbiter import Residency
from r3090d.service import control_protocol
from r3090d.service.statedoc import StateDocument, SwapInfo, UnreadableFormat
from r3090d.service.statusview import swap_route, swap_steps


def swap_timeout(cfg) -> float:
    """Long enough for a drain, a park, and the slower of a resume and a cold start with its canary."""
    return cfg.swap.drain_timeout + 2 * cfg.suspend.operation_timeout + cfg.suspend.verify_timeout + cfg.engine.startup_timeout + 30


def follow_swap(cfg, model: str, before: StateDocument | None, timeout: float, *, quiet: bool) -> dict:
    """Print where the model is (and the swap's stage) at each change, until it serves or the swap to it fails."""
    daemon_pid = before.daemon.pid if before is not None else None
    swaps_before = before.swap.total if before is not None and before.swap is not None else None
    shown = None

    def judge(doc: StateDocument, elapsed: float) -> dict | None:
        nonlocal shown
        if daemon_pid is not None and doc.daemon.pid != daemon_pid:
            return {"ok": False, "error": "r3090d restarted during the wait (r3090ctl status)"}
        m = doc.model(model)
        if m is None:
            return {"ok": False, "error": f"r3090d's state has no model {model!r} (r3090ctl status)"}
        swap = doc.swap or SwapInfo()
        going = swap.in_progress
        where = m.residency_name, going.stage if going is not None and going.stage else None
        if where != shown and not quiet:
            click.echo(f"  +{elapsed:5.1f} s  {where[0]}" + (f" ({where[1]})" if where[1] else ""))
        shown = where
        last = swap.last
        # The swap that brought this model in ended after the request (a swap count that grew says so).
        ended = last if last is not None and last.to_model == model and (swaps_before is None or swap.total > swaps_before) else None
        record = {"swap": dataclasses.asdict(ended)} if ended is not None else {}
        if ended is not None and not ended.ok:
            return {"ok": False, "error": f"the swap {swap_route(ended)} failed: {ended.error or 'no reason given'}", **record}
        if m.failed:
            return {"ok": False, "error": f"{model} is {m.residency_name}: {m.give_up_reason or m.engine.phase_name}"}
        if m.residency is Residency.READY and (going is None or going.to_model != model):
            took = f" (swap {swap_route(ended)} in {ended.seconds:.1f} s: {swap_steps(ended)})" if ended is not None and ended.seconds is not None else ""
            return {"ok": True, "message": f"{model} serves after {elapsed:.1f} s{took}", "after_s": round(elapsed, 2), **record}
        return None

    return follow_state(cfg, timeout, judge, during="the swap", interval=POLL_S,
                        timed_out=lambda: f"{model} is still {shown[0] if shown else 'not ready'} after {timeout:.0f} s; the swap goes on (r3090ctl status)")  # fmt: skip


@ctl.command("swap")
@click.argument("model", metavar="NAME")
@click.option("--wait", is_flag=True, help="show progress until the model serves")
@click.option("--timeout", type=click.FloatRange(min=1), metavar="SECONDS", help="with --wait: give up waiting after this long (default: from the config)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@config_option
@instance_option
def swap_command(model, wait, timeout, as_json, config_path, instance) -> int:
    """Swap mode: bring model NAME onto the GPU now, parking (or stopping) what must make room."""
    cfg = load_config(config_path, instance, check_files=False)
    if not cfg.swap_mode:
        raise CommandError(f"swap needs swap mode: {cfg.source} has no [[models]], so r3090d serves one engine", exitcodes.USAGE, "r3090ctl swap")
    if not control_protocol.is_model_name(model):
        raise UsageExit(f"{model[:40]!r} is not a served model name (1 to {control_protocol.MAX_MODEL_NAME} printable characters)")
    try:
        before = read_state(cfg)
    except UnreadableFormat:
        before = None  # asked all the same; --wait says why it cannot follow
    reply = ask(cfg, {"cmd": "swap", "model": model})
    if not reply.get("ok") or not wait:
        return show_reply(reply, as_json)
    if not as_json:
        click.echo(reply.get("message") or "accepted")
    result = follow_swap(cfg, model, before, timeout or swap_timeout(cfg), quiet=as_json)
    code = exitcodes.OK if result["ok"] else exitcodes.WARNING
    if as_json:
        emit_json({**reply, **result, "exit_code": code})
    elif result["ok"]:
        click.echo(result["message"])
    else:
        click.echo(f"r3090ctl: {result['error']}", err=True)
    return code
