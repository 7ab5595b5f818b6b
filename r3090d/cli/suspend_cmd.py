"""`r3090ctl suspend | resume`: lend the GPU by checkpointing the engine, and take it back.

The daemon answers at once: accepted (with a request number) or refused in one
line. The work then runs over many ticks (drain, checkpoint; or room check,
restore, one /health and one inference probe); `--wait` follows it through the
state document until the request of that number has its result, as
`restart --wait` follows a restart.

Exit codes: 0 accepted (with --wait: done); 1 refused, failed, or the daemon
cannot be reached; 69 (EX_UNAVAILABLE) when suspend can never work here: no GPU
(gpu.required = false, the CPU demo), an engine on several GPUs, or a driver
without process checkpointing. Nothing is done to the engine in any refusal.

`suspend --test` suspends, resumes and sends one completion, then prints each
step's time and the GPU memory the suspension freed.

In swap mode `suspend --model NAME` and `resume --model NAME` act on that model's
engine: suspended by the operator, it stays off the GPU (and out of the router's
table) until resumed, unlike a parked one, which the daemon brings back itself.
"""

from __future__ import annotations

import time

import click

from r3090d import exitcodes
from r3090d.cli.common import UsageExit, config_option, ctl, emit_json, instance_option, load_config
from r3090d.cli.control_cmd import (
    ask,
    checked_model,
    engine_of,
    follow_state,
    model_option,
    read_state,
    wait_ready,
    with_model,
)
from r3090d.core.suspension import Result
from r3090d.core.vocabulary import Phase
from r3090d.service.statedoc import StateDocument, SuspendInfo, UnreadableFormat
from r3090d.units import MIB

EXIT_UNAVAILABLE = exitcodes.PREFLIGHT_PERMANENT  # 69, EX_UNAVAILABLE: this host or config cannot suspend
POLL_S = 0.1
CODES = {Result.SUSPENDED: exitcodes.OK, Result.RESUMED: exitcodes.OK, Result.STARTED_COLD: exitcodes.OK,
         Result.UNAVAILABLE: EXIT_UNAVAILABLE}  # fmt: skip


def _before(cfg, model: str | None = None) -> StateDocument | None:
    """The state a request starts from (in swap mode the model's engine's), for --wait; None when unknown
    (then --wait says why it cannot follow). The daemon's pid is the whole document's either way."""
    try:
        doc = read_state(cfg)
    except UnreadableFormat:
        return None
    return engine_of(doc, model) if doc is not None else None


def reply_code(reply: dict) -> int:
    """0 accepted; 69 a refusal no retry changes ("unavailable"); 1 any other refusal."""
    if reply.get("ok"):
        return exitcodes.OK
    return EXIT_UNAVAILABLE if reply.get("unavailable") else exitcodes.WARNING


def show_reply(reply: dict, as_json: bool) -> int:
    code = reply_code(reply)
    if as_json:
        emit_json({**reply, "exit_code": code})
    elif reply.get("ok"):
        click.echo(reply.get("message") or "ok")
    else:
        click.echo(f"r3090ctl: refused: {reply.get('error') or 'no reason given'}", err=True)
    return code


def follow(cfg, request: int, daemon_pid, timeout: float, *, quiet: bool, model: str | None = None) -> dict:
    """Print each phase (and stage) until the request's result is in the state document; return that result."""
    shown = None

    def judge(doc: StateDocument, elapsed: float) -> dict | None:
        nonlocal shown
        if daemon_pid is not None and doc.daemon.pid != daemon_pid:
            return {"ok": False, "error": "r3090d restarted during the wait (r3090ctl status)"}
        sus = doc.suspend or SuspendInfo()
        where = doc.engine.phase_name, sus.stage.value if sus.stage is not None else None
        if where != shown and not quiet:
            click.echo(f"  +{elapsed:5.1f} s  {where[0]}" + (f" ({where[1]})" if where[1] and where[1] != where[0] else ""))
        shown = where
        last = sus.last
        if last is None or last.request != request:
            return None
        if last.result is None:
            return {"ok": False, "error": f"request {request} ended in a way this r3090ctl does not know (r3090ctl status)"}
        return {"ok": CODES.get(last.result) == exitcodes.OK, "result": last.result.value, "detail": last.detail,
                "after_s": round(elapsed, 2), "doc": doc}  # fmt: skip

    return follow_state(cfg, timeout, judge, during="the wait", interval=POLL_S, model=model,
                        timed_out=lambda: f"no result after {timeout:.0f} s; the operation goes on (r3090ctl status)")  # fmt: skip


def _finish(reply: dict, result: dict, as_json: bool) -> int:
    code = CODES.get(Result(result["result"]), exitcodes.WARNING) if "result" in result else exitcodes.WARNING
    text = result.get("detail") or result.get("error") or ""
    if as_json:
        emit_json({**reply, **{k: v for k, v in result.items() if k != "doc"}, "exit_code": code})
    elif code == exitcodes.OK:
        click.echo(f"{result['result']} after {result['after_s']:.1f} s: {text}")
    else:
        click.echo(f"r3090ctl: {result.get('result', 'failed')}: {text}", err=True)
    return code


def _send(cfg, cmd: str, *, wait: bool, as_json: bool, limit: float, model: str | None = None) -> tuple[dict, dict | None, StateDocument | None]:
    """Send `cmd` (for `model`'s engine in swap mode); with --wait and once accepted, follow it to its result
    (None: nothing to follow). Also returns the state before the request."""
    before = _before(cfg, model)
    reply = ask(cfg, with_model({"cmd": cmd}, model))
    if not reply.get("ok") or not wait:
        return reply, None, before
    if not as_json:
        click.echo(reply.get("message") or "accepted")
    return reply, follow(cfg, reply["request"], before.daemon.pid if before else None, limit, quiet=as_json, model=model), before


def _suspend_timeout(cfg) -> float:
    return cfg.watchdog.lb_grace + cfg.suspend.drain_timeout + cfg.suspend.operation_timeout + 30


def _resume_timeout(cfg) -> float:
    return cfg.watchdog.nvml_hung_after + cfg.suspend.operation_timeout + cfg.suspend.verify_timeout + 30


@ctl.command("suspend")
@click.option("--wait", is_flag=True, help="show progress until the engine is suspended")
@click.option("--test", "test", is_flag=True, help="suspend, resume and send one completion; print step times and the VRAM freed")
@click.option("--timeout", type=click.FloatRange(min=1), metavar="SECONDS", help="with --wait: give up waiting after this long")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@model_option
@config_option
@instance_option
def suspend_command(wait, test, timeout, as_json, model, config_path, instance) -> int:
    """Lend the GPU: drain the engine, then checkpoint it (its GPU memory moves into its host memory)."""
    if test:
        if model is not None:
            raise UsageExit("--test suspends the one engine of single mode: drop --model")
        return _self_test(load_config(config_path, instance), timeout, as_json)
    cfg = load_config(config_path, instance, check_files=False)
    model = checked_model(cfg, model, "suspend")
    reply, result, _ = _send(cfg, "suspend", wait=wait, as_json=as_json, limit=timeout or _suspend_timeout(cfg), model=model)
    return show_reply(reply, as_json) if result is None else _finish(reply, result, as_json)


@ctl.command("resume")
@click.option("--wait", is_flag=True, help="show progress until the engine serves again")
@click.option("--timeout", type=click.FloatRange(min=1), metavar="SECONDS", help="with --wait: give up waiting after this long")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@model_option
@config_option
@instance_option
def resume_command(wait, timeout, as_json, model, config_path, instance) -> int:
    """Take the GPU back: check it has room, restore the engine, and serve once /health and a probe pass."""
    cfg = load_config(config_path, instance, check_files=False)
    model = checked_model(cfg, model, "resume")
    limit = timeout or _resume_timeout(cfg)
    started = time.monotonic()
    reply, result, before = _send(cfg, "resume", wait=wait, as_json=as_json, limit=limit, model=model)
    if result is None:
        return show_reply(reply, as_json)
    if result.get("result") == Result.STARTED_COLD.value:
        # No engine was left to restore: a new one loads, as after a restart.
        left = max(1.0, limit + cfg.engine.startup_timeout - (time.monotonic() - started))
        ready = wait_ready(cfg, before.engine.generation if before else None, before.engine.pid if before else None, left, quiet=as_json,
                           model=model)  # fmt: skip
        result = {**result, "ok": ready["ok"], "detail": ready.get("message") or ready.get("error", "")}
        if not ready["ok"]:
            result["result"] = Result.FAILED.value
    return _finish(reply, result, as_json)


# ------------------------------------------------------------------ --test


def _completion(cfg) -> tuple[bool, float, str]:
    from r3090d.probes.http import engine_client

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    body = {"model": cfg.model_name, "prompt": "ping", "max_tokens": 1, "temperature": 0}
    t0 = time.monotonic()
    try:
        with engine_client(cfg.watchdog.probe_timeout + 30, cfg.engine.uds) as client:
            r = client.post(cfg.engine_url + "/v1/completions", json=body, headers=headers)
        return r.status_code == 200, time.monotonic() - t0, "" if r.status_code == 200 else f"HTTP {r.status_code}"
    except Exception as exc:  # noqa: BLE001 - reported, as a failed step
        return False, time.monotonic() - t0, type(exc).__name__


def _steps(doc: StateDocument | None) -> dict[str, float]:
    worker = doc.suspend.worker if doc is not None and doc.suspend is not None else None
    return {s.step: s.took_s for s in worker.steps if s.ok} if worker is not None else {}


def _used_while_suspended(cfg, pid, daemon_pid) -> int | None:
    """GPU memory used once NVML no longer lists the checkpointed pid (a reading taken after the checkpoint)."""
    deadline = time.monotonic() + max(10.0, 5 * cfg.watchdog.poll_interval)
    while time.monotonic() < deadline:
        try:
            doc = read_state(cfg)
        except UnreadableFormat:
            return None
        gpu = doc.gpu if doc is not None else None
        if gpu is not None and gpu.processes is not None and pid not in [p.pid for p in gpu.processes]:
            return gpu.memory_used
        time.sleep(POLL_S)
    return None


def _self_test(cfg, timeout: float | None, as_json: bool) -> int:
    try:
        before = read_state(cfg)
    except UnreadableFormat as exc:
        return show_reply({"ok": False, "error": str(exc)}, as_json)
    if before is None or before.engine.phase is not Phase.READY:
        phase = before.engine.phase_name if before is not None else "unreachable"
        return show_reply({"ok": False, "error": f"the engine is {phase}: --test needs a ready engine"}, as_json)
    daemon_pid = before.daemon.pid
    used_before = before.gpu.memory_used if before.gpu is not None else None
    report: dict = {"ok": False}
    reply = ask(cfg, {"cmd": "suspend"})
    if not reply.get("ok"):
        return show_reply(reply, as_json)
    sus = follow(cfg, reply["request"], daemon_pid, timeout or _suspend_timeout(cfg), quiet=True)
    if sus.get("result") != Result.SUSPENDED.value:
        return _finish(reply, sus, as_json)
    doc = sus["doc"]
    section = doc.suspend or SuspendInfo()
    pid, gpu_bytes = section.pid, section.gpu_bytes
    used_during = _used_while_suspended(cfg, pid, daemon_pid)
    report.update(suspend_s=sus["after_s"], suspend_steps=_steps(doc), gpu_bytes=gpu_bytes,
                  vram_freed_bytes=used_before - used_during if used_before is not None and used_during is not None else None)  # fmt: skip
    reply = ask(cfg, {"cmd": "resume"})
    if not reply.get("ok"):
        return show_reply(reply, as_json)
    res = follow(cfg, reply["request"], daemon_pid, timeout or _resume_timeout(cfg), quiet=True)
    report.update(resume_s=res.get("after_s"), resume_steps=_steps(res.get("doc")), resume_result=res.get("result"))
    if res.get("result") != Result.RESUMED.value:
        report["error"] = res.get("detail") or res.get("error")
    else:
        ok, took, why = _completion(cfg)
        report.update(ok=ok, completion_s=round(took, 3), error=why)
    code = exitcodes.OK if report["ok"] else exitcodes.WARNING
    if as_json:
        emit_json({**report, "exit_code": code})
        return code
    steps = {**report.get("suspend_steps", {}), **report.get("resume_steps", {})}
    click.echo(f"suspend   {report['suspend_s']:6.2f} s  (" + ", ".join(f"{k} {steps[k]:.2f} s" for k in ("lock", "checkpoint") if k in steps) + ")")
    if report.get("resume_s") is not None:
        click.echo(f"resume    {report['resume_s']:6.2f} s  (" + ", ".join(f"{k} {steps[k]:.2f} s" for k in ("restore", "unlock") if k in steps) + ", then /health and a probe)")
    if "completion_s" in report:
        click.echo(f"complete  {report['completion_s']:6.2f} s  ({'ok' if report['ok'] else report['error']})")
    freed = report.get("vram_freed_bytes")
    click.echo(f"VRAM freed: {freed / MIB:.0f} MiB" if freed is not None else "VRAM freed: not measured (NVML gave no reading)",
               nl=False)  # fmt: skip
    click.echo(f" (the engine's process held {gpu_bytes / MIB:.0f} MiB)" if gpu_bytes else "")
    if not report["ok"]:
        click.echo(f"r3090ctl: suspend test failed: {report.get('error')}", err=True)
    return code
