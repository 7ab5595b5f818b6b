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
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from r3090d import exitcodes
from r3090d.core.snapshot import GpuSample, GpuStatus
from r3090d.core.suspension import Stage
from r3090d.core.vocabulary import Phase, Severity
from r3090d.service.statedoc import CanaryInfo, StateDocument, SuspendInfo, parse_section, view
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
    if engine.maintenance:
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
    return HealthVerdict(exitcodes.OK, ("engine ready",))


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
    """The status panel as lines."""
    d = view(doc) or StateDocument()
    daemon, engine, metrics, restarts, alerts = d.daemon, d.engine, d.metrics, d.restarts, d.alerts
    lines = []
    name = "r3090d" + (f"@{daemon.instance}" if daemon.instance is not None else "")
    lines.append(
        f"{name} {daemon.version or '?'} on {daemon.host or '?'}: pid {'?' if daemon.pid is None else daemon.pid}, "
        f"up {ago(now - daemon.started_at) if daemon.started_at else '-'}, config {daemon.config or '-'}"
    )
    if note:
        lines.append(f"  ({note})")
    state = engine.phase_name + (" (maintenance)" if engine.maintenance else "")
    where = f"pid {engine.pid}" if engine.pid else "no process"
    lines.append(f"Engine     {state} for {ago(now - engine.since) if engine.since else '-'}, {where}")
    lines.append(f"Model      {engine.model or '-'} at {engine.url or '-'}")
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
        lines.append("Restarts   none since the daemon started")
    if restarts.recent:
        # restart_storm's count, which a restart of the daemon does not reset: it can hold restarts the line above does not.
        window = d.thresholds.restart_storm_window_s
        lines.append(f"Recent     {restarts.recent} unrequested restarts within {ago(window) if window else 'the storm window'}, earlier daemons' included")
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


def canary_lines(c: CanaryInfo, now: float) -> list[str]:
    """The known-answer canary: when it last matched, its counts, and the last mismatch."""
    if not c.enabled:
        return ["Canary     off (canary.enabled = false)"]
    if c.baseline_tokens is None:
        return ["Canary     no baseline yet (taken once nothing else runs)"]
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
        lines.append(f"Suspended  {since}; {held}")
        if s.frozen_requests:
            frozen = f"{s.frozen_requests} request(s) frozen with the engine, to finish after resume"
            lines.append(f"Frozen     {frozen}")
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
    if s.how_to_resume:
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
        if engine.phase is Phase.GIVEN_UP:
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
