"""What `r3090ctl status` says, pure: a state document in, a verdict and a panel out.

Exit codes follow the monitoring-plugin scheme (r3090d.exitcodes):
  0 OK        the engine is ready and no warning fires
  1 WARNING   starting, draining, restarting, backoff, suspended (or on the way
              there or back), maintenance, a warning firing
  2 CRITICAL  the engine is down or given up, or in a phase this r3090ctl does
              not know; a critical alert firing
  3 UNKNOWN   the daemon is not running (the last persisted state is shown), or
              its state is in a format this r3090ctl cannot read
A silenced alert is shown but does not raise the exit code: silencing is how an
operator acknowledges it.

In swap mode (several models behind the router) the verdict is the card's:
CRITICAL when a model has failed or given up, or the router is down; WARNING
when a model restarts, backs off, waits for GPU memory or is suspended by the
operator, when the router has lost its link, or when the last swap failed. A
parked or cold model is the arbiter's choice, not an outage: it is OK, as are
the starting, parking and resuming of a swap.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field

from r3090d import exitcodes
from r3090d.core.arbiter import Residency
from r3090d.core.snapshot import GpuSample, GpuStatus, MetricsSample
from r3090d.core.suspension import Stage
from r3090d.core.vocabulary import SUSPEND_PHASES, Phase, Severity
from r3090d.service.statedoc import (
    CanaryInfo,
    ModelDoc,
    StateDocument,
    SuspendInfo,
    SwapInfo,
    SwapRecord,
    parse_section,
    view,
)
from r3090d.units import GIB, MIB

LABELS = {exitcodes.OK: "OK", exitcodes.WARNING: "WARNING", exitcodes.CRITICAL: "CRITICAL", exitcodes.UNKNOWN: "UNKNOWN"}
RESTART_PHASES = frozenset({Phase.DRAINING, Phase.RESTARTING, Phase.BACKOFF})  # the verdict names the restart's reason
# A suspension is asked for, like maintenance: not serving, but nothing is wrong.
WARNING_PHASES = RESTART_PHASES | {Phase.STARTING, Phase.SUSPENDING, Phase.SUSPENDED, Phase.RESUMING, Phase.WAITING_FOR_GPU}
CRITICAL_PHASES = frozenset({Phase.STOPPED, Phase.GIVEN_UP, Phase.SHUTTING_DOWN, Phase.RESET_NEEDED})


@dataclass(frozen=True)
class HealthVerdict:
    code: int
    reasons: tuple[str, ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        return LABELS.get(self.code, str(self.code))

    def line(self) -> str:
        return f"{self.label}: {'; '.join(self.reasons)}" if self.reasons else self.label


def verdict_of(doc: StateDocument | dict | None, *, running: bool, now: float) -> HealthVerdict:
    """The verdict on a document (a dict is parsed first, and may raise UnreadableFormat)."""
    if not running:
        return HealthVerdict(exitcodes.UNKNOWN, ("r3090d is not running",))
    d = view(doc)
    if d is None:
        return HealthVerdict(exitcodes.WARNING, ("r3090d is starting (no state yet)",))
    if d.waiting is not None and d.waiting.what:
        return HealthVerdict(exitcodes.WARNING, (f"r3090d is waiting for preflight before starting the engine: {d.waiting.what}",))
    if d.swap_mode:
        crit, warn = _router_findings(d.swap or SwapInfo())
        for m in d.models:
            _model_findings(m, crit, warn)
        return _verdict(d, crit, warn, now, "models: " + (", ".join(f"{m.name} {m.residency_name}" for m in d.models) or "none"))
    engine = d.engine
    crit: list[str] = []
    warn: list[str] = []
    heal = d.healing
    if engine.phase is Phase.GIVEN_UP:
        crit.append(f"gave up: {d.give_up_reason or 'too many restarts'}")
    elif engine.phase is Phase.RESET_NEEDED:
        crit.append(f"the GPU needs a reset: {heal.reset_hold or 'unknown reason'}; then r3090ctl restart")
    elif engine.phase is Phase.WAITING_FOR_GPU:
        who = ", ".join(h.text() for h in heal.gpu_wait_holders) or "others"
        warn.append(f"engine waiting for GPU memory held by {who}")
    elif engine.phase in CRITICAL_PHASES:
        crit.append(f"engine {engine.phase}")
    elif engine.phase in WARNING_PHASES:
        reason = d.restarts.last_reason
        warn.append(f"engine {engine.phase}" + (f" ({reason})" if reason and engine.phase in RESTART_PHASES else ""))
    elif engine.phase is not Phase.READY:
        crit.append(f"engine in an unknown phase {engine.phase_name!r}")
    return _verdict(d, crit, warn, now, "engine ready")


def model_verdict(doc: StateDocument, model: ModelDoc, now: float) -> HealthVerdict:
    """The verdict on one model of swap mode: its own engine, the router it is served through, the daemon's alerts."""
    crit, warn = _router_findings(doc.swap or SwapInfo())
    _model_findings(model, crit, warn)
    return _verdict(doc, crit, warn, now, f"model {model.name} {model.residency_name}")


def _verdict(d: StateDocument, crit: list[str], warn: list[str], now: float, ok: str) -> HealthVerdict:
    """The findings with maintenance and the alerts that fire (unless silenced) added, as a verdict."""
    if d.maintenance:
        warn.append("maintenance mode")
    muted = d.alerts.active_silences(now)
    for key, alert in sorted(d.alerts.firing.items()):
        if key in muted:
            continue
        (crit if alert.severity == Severity.CRITICAL else warn).append(f"{key} firing")
    if crit:
        return HealthVerdict(exitcodes.CRITICAL, tuple(crit + warn))
    if warn:
        return HealthVerdict(exitcodes.WARNING, tuple(warn))
    return HealthVerdict(exitcodes.OK, (ok,))


def _router_findings(swap: SwapInfo) -> tuple[list[str], list[str]]:
    """(critical, warning) findings on the router and the last swap."""
    crit: list[str] = []
    warn: list[str] = []
    router = swap.router
    if not router.up:
        crit.append("the router is down: nothing is served on the public port" + (f" ({router.restarts} restarts)" if router.restarts else ""))
    elif not router.linked:
        warn.append("the router has lost its link to the daemon: it routes by an old table")
    last = swap.last
    if last is not None and not last.ok:
        warn.append(f"the last swap failed ({swap_route(last)}): {last.error or 'no reason given'}")
    return crit, warn


def _model_findings(m: ModelDoc, crit: list[str], warn: list[str]) -> None:
    """One model's findings: what single mode says of its engine, but parked and cold are no outage."""
    phase, name = m.engine.phase, m.name
    if phase is Phase.GIVEN_UP:
        crit.append(f"model {name} gave up: {m.give_up_reason or 'too many restarts'}")
    elif phase is Phase.RESET_NEEDED:
        crit.append(f"the GPU needs a reset: {m.healing.reset_hold or 'unknown reason'}; then r3090ctl restart --model {name}")
    elif m.residency is Residency.FAILED:
        crit.append(f"model {name} failed" + (f": {m.give_up_reason}" if m.give_up_reason else ""))
    elif m.residency is None:
        crit.append(f"model {name} in an unknown state {m.residency_name!r}")
    elif phase is Phase.WAITING_FOR_GPU:
        who = ", ".join(h.text() for h in m.healing.gpu_wait_holders) or "others"
        warn.append(f"model {name} waiting for GPU memory held by {who}")
    elif phase in RESTART_PHASES and m.residency not in (Residency.PARKING, Residency.STOPPING):
        reason = m.restarts.last_reason
        warn.append(f"model {name} {phase}" + (f" ({reason})" if reason else ""))
    elif phase in SUSPEND_PHASES and m.suspended_by_operator:
        warn.append(f"model {name} {phase} by the operator")
    elif phase is Phase.SHUTTING_DOWN:
        crit.append(f"model {name} {phase}")
    elif phase is None:
        crit.append(f"model {name} in an unknown phase {m.engine.phase_name!r}")


# ------------------------------------------------------------------ formatting


def ago(seconds: float | None) -> str:
    """A duration for people: 45 s, 12 min, 3 h 05 min, 2 d 04 h."""
    if seconds is None:
        return "-"
    s = max(0, int(round(seconds)))
    if s < 90:
        return f"{s} s"
    m = s // 60
    if m < 90:
        return f"{m} min"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{d} d {h:02d} h"


def clock(wall: float | None) -> str:
    if wall is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))


def _mib(n: int | None) -> str:
    return "? MiB" if n is None else f"{n / MIB:.0f} MiB"


def _num(v, fmt="{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def panel(doc: StateDocument | dict, verdict: HealthVerdict, now: float, *, note: str | None = None) -> list[str]:
    """The status panel as lines: one engine's, or in swap mode a row per model."""
    d = view(doc) or StateDocument()
    if d.swap_mode:
        return swap_panel(d, verdict, now, note=note)
    return _engine_panel(d, verdict, now, note=note)


def model_panel(doc: StateDocument, model: ModelDoc, verdict: HealthVerdict, now: float, *, note: str | None = None) -> list[str]:
    """One model of swap mode in full: the panel of one engine, with where the model is and how it is used."""
    engine = doc.for_model(model)
    if not model.resident:
        # What its /metrics said before it left the GPU is no reading of now.
        engine = dataclasses.replace(engine, metrics=MetricsSample(error=f"{model.residency_name}: not on the GPU"))
    return _engine_panel(engine, verdict, now, note=note, served=_served_lines(doc, model, now))


def _header(d: StateDocument, now: float, note: str | None) -> list[str]:
    daemon = d.daemon
    name = "r3090d" + (f"@{daemon.instance}" if daemon.instance is not None else "")
    lines = [
        f"{name} {daemon.version or '?'} on {daemon.host or '?'}: pid {'?' if daemon.pid is None else daemon.pid}, "
        f"up {ago(now - daemon.started_at) if daemon.started_at else '-'}, config {daemon.config or '-'}"
    ]
    if note:
        lines.append(f"  ({note})")
    return lines


def _engine_panel(d: StateDocument, verdict: HealthVerdict, now: float, *, note: str | None, served: list[str] | None = None) -> list[str]:
    engine, metrics, restarts = d.engine, d.metrics, d.restarts
    lines = _header(d, now, note)
    state = engine.phase_name + (" (maintenance)" if engine.maintenance else "")
    where = f"pid {engine.pid}" if engine.pid else "no process"
    lines.append(f"Engine     {state} for {ago(now - engine.since) if engine.since else '-'}, {where}")
    lines.append(f"Model      {engine.model or '-'} at {engine.url or '-'}")
    lines.extend(served or [])
    if d.next_action:
        lines.append(f"Next       {d.next_action}")
    lines.extend(suspend_lines(d.suspend, now))
    off = d.watch.gpu_signal_off
    if off and engine.phase is Phase.READY:
        lines.append(f"GPU view   not used: {off}; freezes are found by the counters and the probe")
    heal = d.healing
    if heal.reset_hold:
        lines.append(f"GPU reset  needed since {clock(heal.reset_hold_since)}: {heal.reset_hold}")
    if heal.gpu_wait_holders:
        who = ", ".join(h.text() for h in heal.gpu_wait_holders)
        lines.append(f"GPU held   by {who}: {_mib(heal.gpu_wait_free_bytes)} free, {_mib(heal.gpu_wait_need_bytes)} needed")
    if d.give_up_reason:
        lines.append(f"Gave up    {d.give_up_reason}")
        if heal.next_retry_at is not None:
            lines.append(f"Retry      attempt {heal.retry_attempts + 1} at {clock(heal.next_retry_at)} (every {ago(heal.give_up_retry_s)}, watchdog.give_up_retry)")
    elif restarts.last_root_cause:
        lines.append(f"Last cause {restarts.last_root_cause}")
    usage = metrics.kv_usage
    if usage is not None or metrics.free_blocks is not None:
        total = metrics.num_gpu_blocks
        lines.append(
            f"KV cache   {_num(usage * 100 if usage is not None else None)}% used, "
            f"{_num(metrics.free_blocks)} free blocks" + (f" of {total}" if total else "")
            + f"; running {_num(metrics.running)}, waiting {_num(metrics.waiting)}"
        )
    elif metrics.error:
        lines.append(f"KV cache   - ({metrics.error})")
    else:
        lines.append("KV cache   -")
    lines.append("GPU        " + gpu_line(d.gpu))
    lines.extend(canary_lines(d.canary, now))
    if restarts.total:
        by = ", ".join(f"{k} {v}" for k, v in sorted(restarts.by_reason.items()))
        last_at = restarts.last_at
        lines.append(f"Restarts   {restarts.total} ({by}); last: {restarts.last_reason}, {ago(now - last_at) + ' ago' if last_at else '-'}")
    else:
        lines.append("Restarts   none")
    if restarts.recent:
        # restart_storm's count, which a restart of the daemon does not reset either.
        window = d.thresholds.restart_storm_window_s
        lines.append(f"Recent     {restarts.recent} unrequested restarts within {ago(window) if window else 'the storm window'}, earlier daemons' included")
    return lines + _alert_lines(d, verdict, now)


def _alert_lines(d: StateDocument, verdict: HealthVerdict, now: float) -> list[str]:
    """The panel's foot: alerts, silences, the verdict."""
    alerts, lines = d.alerts, []
    muted = alerts.active_silences(now)
    if alerts.firing:
        for key, a in sorted(alerts.firing.items()):
            quiet = " [silenced]" if key in muted else ""
            lines.append(f"Alert      {key} ({a.severity}, {ago(now - a.since) if a.since else '-'}){quiet}: {a.summary}")
    else:
        lines.append("Alerts     none firing")
    for key, until in sorted(muted.items()):
        lines.append(f"Silenced   {key} until {clock(until)} ({ago(until - now)} left)")
    lines.append(f"Status     {verdict.line()}")
    return lines


# ------------------------------------------------------------------ swap mode

MODEL_COLUMNS = ("MODEL", "KIND", "STATE", "PHASE", "LAST USED", "HOST RAM", "SWAPS IN", "RESTARTS", "CANARY")


def swap_panel(d: StateDocument, verdict: HealthVerdict, now: float, *, note: str | None = None) -> list[str]:
    """Swap mode's panel: a row per model, the swaps, the router, host memory for parked engines, the card."""
    swap = d.swap or SwapInfo()
    lines = _header(d, now, note)
    resident = sum(1 for m in d.models if m.resident)
    where = "running" if _no_gpu(d) else "on the GPU"
    lines.append(f"Models     {len(d.models)}, {resident} {where} (at most {swap.max_resident}); r3090ctl status --model NAME shows one in full")
    rows = [MODEL_COLUMNS] + [model_row(m, now) for m in d.models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(MODEL_COLUMNS))]
    lines.extend(("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))).rstrip() for row in rows)
    lines.extend(swap_lines(swap, now))
    lines.append(router_line(swap))
    lines.append(host_memory_line(swap, no_gpu=_no_gpu(d)))
    if d.maintenance:
        lines.append("Maintenance on: automatic restarts are paused, and /healthz answers 503")
    heal = d.healing
    if heal.reset_hold:
        lines.append(f"GPU reset  needed since {clock(heal.reset_hold_since)}: {heal.reset_hold}")
    for m in d.models:
        if m.give_up_reason:
            lines.append(f"Gave up    {m.name}: {m.give_up_reason}")
        elif m.engine.phase is Phase.WAITING_FOR_GPU and m.healing.gpu_wait_holders:
            who = ", ".join(h.text() for h in m.healing.gpu_wait_holders)
            lines.append(f"GPU held   {m.name} waits for {_mib(m.healing.gpu_wait_need_bytes)}, held by {who}")
    lines.append("GPU        " + gpu_line(d.gpu))
    return lines + _alert_lines(d, verdict, now)


def model_row(m: ModelDoc, now: float) -> tuple[str, ...]:
    """A model's row: name, kind, state, phase, last used, host RAM held, swaps in, restarts, the canary's last verdict."""
    c = m.canary
    canary = (c.last_verdict or "-") if c.enabled else "off"
    return (
        m.name,
        m.kind.value if m.kind is not None else "?",
        m.residency_name + (" (suspended)" if m.suspended_by_operator else ""),
        m.engine.phase_name,
        f"{ago(now - m.last_used)} ago" if m.last_used is not None else "never",
        _gib(m.host_bytes) if m.host_bytes else "-",
        str(m.swaps_in),
        str(m.restarts.total),
        canary,
    )


def swap_route(r: SwapRecord) -> str:
    return f"{r.from_model or '(none)'} -> {r.to_model or '?'}"


def swap_lines(swap: SwapInfo, now: float) -> list[str]:
    """The swap under way, and the last one with where its time went."""
    lines = []
    p = swap.in_progress
    if p is not None:
        since = f" for {ago(now - p.since)}" if p.since is not None else ""
        lines.append(f"Swapping   {p.from_model or '(none)'} -> {p.to_model or '?'}: {p.stage or 'under way'}{since}")
    last = swap.last
    counts = f"{swap.total} swap(s), {swap.failed} failed"
    if last is None:
        lines.append(f"Last swap  none yet ({counts})")
        return lines
    how = "cold start" if last.cold else "resumed"
    took = f" in {last.seconds:.1f} s" if last.seconds is not None else ""
    steps = swap_steps(last)
    when = f", {ago(now - last.at)} ago" if last.at is not None else ""
    outcome = "" if last.ok else f" FAILED: {last.error or 'no reason given'}"
    lines.append(f"Last swap  {swap_route(last)} ({how}){took}{when}{outcome}")
    detail = [s for s in (steps, f"{last.frozen_requests} request(s) frozen with the outgoing engine" if last.frozen_requests else "") if s]
    if detail:
        lines.append("           " + "; ".join(detail))
    lines.append(f"Swaps      {counts}")
    return lines


def swap_steps(r: SwapRecord) -> str:
    """Where a swap's time went: "drain 0.1 s, checkpoint 6.3 s, restore 2.5 s, canary 0.4 s, routing 0.0 s"."""
    return ", ".join(
        f"{label} {value:.1f} s"
        for label, value in (
            ("drain", r.drain_s), ("checkpoint", r.checkpoint_s), ("stop", r.stop_s), ("restore", r.restore_s),
            ("start", r.start_s), ("canary", r.canary_s), ("routing", r.routing_s),
        )
        if value is not None
    )  # fmt: skip


def router_line(swap: SwapInfo) -> str:
    r = swap.router
    where = f" on {r.address}" if r.address else ""
    pid = f" (pid {r.pid})" if r.pid else ""
    state = ("up" + pid + where + (", linked" if r.linked else ", NOT linked to the daemon")) if r.up else "DOWN"
    last = f", last {clock(r.last_restart_at)}" if r.restarts and r.last_restart_at is not None else ""
    return f"Router     {state}; {r.restarts} restart(s){last}; a request waits up to {swap.queue_timeout:g} s for its model"


def _no_gpu(d: StateDocument) -> bool:
    """gpu.required = false: nothing is parked; a swap is a stop and a cold start."""
    return d.gpu is None or d.gpu.status is GpuStatus.DISABLED


def host_memory_line(swap: SwapInfo, *, no_gpu: bool = False) -> str:
    if no_gpu:
        return "Host RAM   nothing is parked without a GPU: a swap is a drained stop and a cold start"
    budget = _gib(swap.host_budget_bytes) if swap.host_budget_bytes is not None else "? GiB"
    return f"Host RAM   {_gib(swap.host_parked_bytes)} of {budget} held by parked engines"


def _engine_listener(m: ModelDoc) -> str:
    """Where a model's engine serves: its port, or its unix socket (named on the Model line)."""
    if m.port is not None:
        return f"port {m.port}"
    return "its unix socket" if m.engine.url.startswith("unix:") else "port ?"


def _served_lines(d: StateDocument, m: ModelDoc, now: float) -> list[str]:
    """The lines a model's own panel adds to its engine's: where it is, how it is used, and the router it is served through."""
    kind = m.kind.value if m.kind is not None else "?"
    used = f"last used {ago(now - m.last_used)} ago" if m.last_used is not None else "never used"
    held = f"; holds {_gib(m.host_bytes)} of host memory parked" if m.host_bytes else ""
    lines = [
        f"Served as  {m.name} ({kind}) on {_engine_listener(m)}: {m.residency_name}; {used}; "
        f"swapped in {m.swaps_in}, out {m.swaps_out}{held}",
    ]
    if m.waiting or m.inflight or m.frozen:
        lines.append(f"Requests   {m.waiting} waiting at the router, {m.inflight} in flight, {m.frozen} frozen with the engine")
    moving = m.fleet.words()
    if moving:
        lines.append(f"Swap       {'; '.join(moving)}")
    swap = d.swap or SwapInfo()
    lines.append(router_line(swap))
    return lines


def canary_lines(c: CanaryInfo, now: float) -> list[str]:
    """The known-answer canary: when it last matched, its counts, and the last mismatch."""
    if not c.enabled:
        return ["Canary     off (canary.enabled = false)"]
    if c.baseline_tokens is None:
        return ["Canary     no baseline yet (taken once nothing else runs, or under load after canary.interval)"]
    matched = f"last match {clock(c.last_match_at)} ({ago(now - c.last_match_at)} ago)" if c.last_match_at else "no match yet"
    counts = f"{c.checks} checks, {c.mismatches} mismatches, {c.inconclusive} inconclusive, {c.errors} without answer"
    last = f"last check {c.last_verdict}; " if c.last_verdict else ""
    lines = [f"Canary     {last}{matched}; {counts}; baseline compared over {c.baseline_tokens} token(s)"]
    if c.last_mismatch:
        lines.append(f"Mismatch   {clock(c.last_mismatch_at)}: {c.last_mismatch}")
    return lines


def suspend_lines(s: SuspendInfo | None, now: float) -> list[str]:
    """The panel's lines on a suspension that stands or is under way, and on a last request that failed."""
    if s is None:
        return []
    lines = []
    if s.standing:
        since = f"since {clock(s.since)} ({ago(now - s.since)} ago)" if s.since is not None else "since -"
        gpu = _gib(s.gpu_bytes)
        if s.cold:
            held = f"no engine process is left: resuming starts a new one, which needs {gpu} of GPU memory free"  # fmt: skip
        else:
            rss = s.host_rss_bytes
            host = "host memory (not measured)" if rss is None else f"{_gib(rss)} of host memory"
            held = f"the engine holds {host}, {gpu} of GPU memory checkpointed"
        # Parked: swapped out for another model, and brought back when its own is asked for.
        lines.append(f"{'Parked   ' if s.parked else 'Suspended'}  {since}; {held}")
        if s.frozen_requests:
            back = "when its model's turn comes" if s.parked else "after resume"
            lines.append(f"Frozen     {s.frozen_requests} request(s) frozen with the engine, to finish {back}")
    if s.stage is not None and s.stage is not Stage.SUSPENDED:
        w = s.worker
        busy = w is not None and w.in_flight and w.step
        driver = f" (the GPU driver's {w.op} of pid {w.pid}: {w.step})" if w is not None and busy else ""
        lines.append(f"Stage      {s.stage.value}{driver}")
    failed = s.last if s.last is not None and s.last.failed else None
    # A refusal or failure is both the suspension's error and the request's detail: said once.
    detail = failed.detail if failed is not None else ""
    if s.error and not (detail and (detail in s.error or s.error in detail)):
        lines.append(f"Error      {s.error}")
    if failed is not None:
        # None: a result this r3090ctl does not know
        result = failed.result.value if failed.result is not None else "ended"
        at = f" {ago(now - failed.at)} ago" if failed.at is not None else ""
        lines.append(f"Last op    {failed.op} (request {failed.request}) {result}{at}: {detail}")
    if s.how_to_resume and not s.parked:
        lines.append(f"Resume     {s.how_to_resume}")
    return lines


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def gpu_line(gpu: GpuSample | dict | None) -> str:
    """One line on the GPU: from the state document, or the dict a restart record keeps."""
    g = parse_section(GpuSample, gpu) if isinstance(gpu, dict) else gpu
    if g is None:
        return "-"
    if g.status is GpuStatus.DISABLED:
        return "not monitored (gpu.required = false)"
    if g.status is not GpuStatus.OK:
        return g.status.value + (f": {g.detail}" if g.detail else "")
    parts = [(f"{g.index}: " if g.index is not None else "") + (g.name or "GPU")]
    if g.memory_used is not None and g.memory_total:
        parts.append(f"memory {g.memory_used / GIB:.1f}/{g.memory_total / GIB:.1f} GiB")
    if g.utilization_gpu is not None:
        parts.append(f"util {g.utilization_gpu}%")
    if g.temperature_c is not None:
        parts.append(f"{g.temperature_c} C")
    if g.power_w is not None:
        parts.append(f"{g.power_w:.0f}" + (f"/{g.power_limit_w:.0f}" if g.power_limit_w else "") + " W")
    if g.pcie_width is not None:
        link = f"PCIe Gen{g.pcie_gen or '?'} x{g.pcie_width}"
        if g.pcie_width_max:
            link += f" (max Gen{g.pcie_gen_max or '?'} x{g.pcie_width_max})"
        parts.append(link)
    return ", ".join(parts)


def not_running_lines(doc: StateDocument | dict | None, pid_note: str, state_path: str, start_hint: str, now: float) -> list[str]:
    """What `status` prints when the daemon is not running: its last word and how to start it."""
    lines = [f"r3090d is not running ({pid_note})."]
    d = view(doc)
    if d is None:
        lines.append(f"No persisted state at {state_path}.")
    else:
        engine, written = d.engine, d.written_at
        lines.append(f"Last state written {clock(written)} ({ago(now - written) if written else '-'} ago) to {state_path}:")
        if d.swap_mode:
            lines.append("  models: " + (", ".join(f"{m.name} {m.residency_name}" for m in d.models) or "none"))
        elif engine.phase is Phase.GIVEN_UP:
            lines.append(f"  gave up at {clock(engine.since)} because {d.give_up_reason or 'of too many restarts'}")
        elif engine.phase is Phase.SHUTTING_DOWN:
            lines.append(f"  stopped on request at {clock(engine.since)} (the engine was drained and stopped)")
        else:
            lines.append(f"  engine {engine.phase_name} since {clock(engine.since)}")
        if d.restarts.total:
            lines.append(f"  restarts: {d.restarts.total}, last: {d.restarts.last_reason} at {clock(d.restarts.last_at)}")
    lines.append(f"Start it with: {start_hint}")
    return lines


# ------------------------------------------------------------------ durations

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|sec|secs|m|min|mins|h|hr|hrs|d|day|days)")
_UNIT_S = {"s": 1, "sec": 1, "secs": 1, "m": 60, "min": 60, "mins": 60, "h": 3600, "hr": 3600, "hrs": 3600, "d": 86400, "day": 86400, "days": 86400}


def parse_duration(text: str) -> float:
    """'30m', '2h', '1h30m', '90s', '1d' -> seconds. Raises ValueError with a hint."""
    raw = text.strip().lower()
    if not raw:
        raise ValueError("empty duration: write e.g. 30m, 2h or 1h30m")
    pos, total = 0, 0.0
    for m in _DURATION.finditer(raw):
        if raw[pos : m.start()].strip():
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if pos != len(raw) or pos == 0:
        if re.fullmatch(r"\d+(\.\d+)?", raw):
            raise ValueError(f"{text!r} has no unit: write {raw}s, {raw}m or {raw}h")
        raise ValueError(f"{text!r} is not a duration: write e.g. 30m, 2h or 1h30m (units s, m, h, d)")
    if total <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return total
