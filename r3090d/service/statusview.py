"""What `r3090ctl status` says, pure: a state document in, a verdict and a panel out.

Exit codes follow the monitoring-plugin scheme (r3090d.exitcodes):
  0 OK        the engine is ready and no warning fires
  1 WARNING   starting, draining, restarting, backoff, maintenance, a warning firing
  2 CRITICAL  the engine is down or given up, a critical alert firing
  3 UNKNOWN   the daemon is not running (the last persisted state is shown)
A silenced alert is shown but does not raise the exit code: silencing is how an
operator acknowledges it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from r3090d import exitcodes

LABELS = {exitcodes.OK: "OK", exitcodes.WARNING: "WARNING", exitcodes.CRITICAL: "CRITICAL", exitcodes.UNKNOWN: "UNKNOWN"}
WARNING_PHASES = {"starting", "draining", "restarting", "backoff"}
CRITICAL_PHASES = {"stopped", "given-up", "shutting-down"}
GIB = 1024**3


@dataclass(frozen=True)
class Verdict:
    code: int
    reasons: tuple[str, ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        return LABELS.get(self.code, str(self.code))

    def line(self) -> str:
        return f"{self.label}: {'; '.join(self.reasons)}" if self.reasons else self.label


def active_silences(doc: dict, now: float) -> dict[str, float]:
    return {k: u for k, u in ((doc.get("alerts") or {}).get("silenced") or {}).items() if u and u > now}


def evaluate(doc: dict | None, *, running: bool, now: float) -> Verdict:
    if not running:
        return Verdict(exitcodes.UNKNOWN, ("r3090d is not running",))
    if doc is None:
        return Verdict(exitcodes.WARNING, ("r3090d is starting (no state yet)",))
    engine = doc.get("engine") or {}
    phase = engine.get("phase") or "unknown"
    crit: list[str] = []
    warn: list[str] = []
    waiting = (doc.get("waiting") or {}).get("for")
    if waiting:
        return Verdict(exitcodes.WARNING, (f"r3090d is waiting for preflight before starting the engine: {waiting}",))
    if phase == "given-up":
        crit.append(f"gave up: {doc.get('give_up_reason') or 'too many restarts'}")
    elif phase in ("stopped", "shutting-down"):
        crit.append(f"engine {phase}")
    elif phase in WARNING_PHASES:
        reason = (doc.get("restarts") or {}).get("last_reason")
        warn.append(f"engine {phase}" + (f" ({reason})" if reason and phase != "starting" else ""))
    elif phase != "ready":
        crit.append(f"engine in an unknown phase {phase!r}")
    if engine.get("maintenance"):
        warn.append("maintenance mode")
    muted = active_silences(doc, now)
    for key, alert in sorted(((doc.get("alerts") or {}).get("firing") or {}).items()):
        if key in muted:
            continue
        (crit if alert.get("severity") == "critical" else warn).append(f"{key} firing")
    if crit:
        return Verdict(exitcodes.CRITICAL, tuple(crit + warn))
    if warn:
        return Verdict(exitcodes.WARNING, tuple(warn))
    return Verdict(exitcodes.OK, ("engine ready",))


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


def _num(v, fmt="{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def panel(doc: dict, verdict: Verdict, now: float, *, note: str | None = None) -> list[str]:
    """The status panel as lines."""
    daemon = doc.get("daemon") or {}
    engine = doc.get("engine") or {}
    metrics = doc.get("metrics") or {}
    gpu = doc.get("gpu") or {}
    restarts = doc.get("restarts") or {}
    alerts = doc.get("alerts") or {}
    lines = []
    inst = daemon.get("instance")
    name = "r3090d" + (f"@{inst}" if inst is not None else "")
    lines.append(
        f"{name} {daemon.get('version', '?')} on {daemon.get('host', '?')}: pid {daemon.get('pid', '?')}, "
        f"up {ago(now - daemon['started_at']) if daemon.get('started_at') else '-'}, config {daemon.get('config') or '-'}"
    )
    if note:
        lines.append(f"  ({note})")
    phase = engine.get("phase") or "?"
    state = phase + (" (maintenance)" if engine.get("maintenance") else "")
    since = engine.get("since")
    where = f"pid {engine['pid']}" if engine.get("pid") else "no process"
    lines.append(f"Engine     {state} for {ago(now - since) if since else '-'}, {where}")
    lines.append(f"Model      {engine.get('model') or '-'} at {engine.get('url') or '-'}")
    if doc.get("next_action"):
        lines.append(f"Next       {doc['next_action']}")
    off = (doc.get("watch") or {}).get("gpu_signal_off")
    if off and phase == "ready":
        lines.append(f"GPU view   not used: {off}; freezes are found by the counters and the probe")
    if doc.get("give_up_reason"):
        lines.append(f"Gave up    {doc['give_up_reason']}")
    elif (doc.get("restarts") or {}).get("last_root_cause"):
        lines.append(f"Last cause {doc['restarts']['last_root_cause']}")
    usage = metrics.get("kv_usage")
    if usage is not None or metrics.get("free_blocks") is not None:
        total = metrics.get("num_gpu_blocks")
        lines.append(
            f"KV cache   {_num(usage * 100 if usage is not None else None)}% used, "
            f"{_num(metrics.get('free_blocks'))} free blocks" + (f" of {total}" if total else "")
            + f"; running {_num(metrics.get('running'))}, waiting {_num(metrics.get('waiting'))}"
        )
    elif metrics.get("error"):
        lines.append(f"KV cache   - ({metrics['error']})")
    else:
        lines.append("KV cache   -")
    lines.append("GPU        " + gpu_line(gpu))
    total = restarts.get("total") or 0
    if total:
        by = ", ".join(f"{k} {v}" for k, v in sorted((restarts.get("by_reason") or {}).items()))
        last_at = restarts.get("last_at")
        lines.append(f"Restarts   {total} ({by}); last: {restarts.get('last_reason')}, {ago(now - last_at) + ' ago' if last_at else '-'}")
    else:
        lines.append("Restarts   none since the daemon started")
    firing = alerts.get("firing") or {}
    muted = active_silences(doc, now)
    if firing:
        for key, a in sorted(firing.items()):
            quiet = " [silenced]" if key in muted else ""
            lines.append(f"Alert      {key} ({a.get('severity')}, {ago(now - a['since']) if a.get('since') else '-'}){quiet}: {a.get('summary')}")
    else:
        lines.append("Alerts     none firing")
    for key, until in sorted(muted.items()):
        lines.append(f"Silenced   {key} until {clock(until)} ({ago(until - now)} left)")
    lines.append(f"Status     {verdict.line()}")
    return lines


def gpu_line(gpu: dict) -> str:
    status = gpu.get("status")
    if status == "disabled":
        return "not monitored (gpu.required = false)"
    if status != "ok":
        return f"{status or '-'}" + (f": {gpu['detail']}" if gpu.get("detail") else "")
    parts = []
    idx = gpu.get("index")
    head = (f"{idx}: " if idx is not None else "") + (gpu.get("name") or "GPU")
    parts.append(head)
    used, total = gpu.get("memory_used"), gpu.get("memory_total")
    if used is not None and total:
        parts.append(f"memory {used / GIB:.1f}/{total / GIB:.1f} GiB")
    if gpu.get("utilization_gpu") is not None:
        parts.append(f"util {gpu['utilization_gpu']}%")
    if gpu.get("temperature_c") is not None:
        parts.append(f"{gpu['temperature_c']} C")
    if gpu.get("power_w") is not None:
        parts.append(f"{gpu['power_w']:.0f}" + (f"/{gpu['power_limit_w']:.0f}" if gpu.get("power_limit_w") else "") + " W")
    if gpu.get("pcie_width") is not None:
        link = f"PCIe Gen{gpu.get('pcie_gen') or '?'} x{gpu['pcie_width']}"
        if gpu.get("pcie_width_max"):
            link += f" (max Gen{gpu.get('pcie_gen_max') or '?'} x{gpu['pcie_width_max']})"
        parts.append(link)
    return ", ".join(parts)


def not_running_lines(doc: dict | None, pid_note: str, state_path: str, start_hint: str, now: float) -> list[str]:
    """What `status` prints when the daemon is not running: its last word and how to start it."""
    lines = [f"r3090d is not running ({pid_note})."]
    if doc is None:
        lines.append(f"No persisted state at {state_path}.")
    else:
        engine = doc.get("engine") or {}
        phase = engine.get("phase")
        written = doc.get("written_at")
        lines.append(f"Last state written {clock(written)} ({ago(now - written) if written else '-'} ago) to {state_path}:")
        if phase == "given-up":
            lines.append(f"  gave up at {clock(engine.get('since'))} because {doc.get('give_up_reason') or 'of too many restarts'}")
        elif phase == "shutting-down":
            lines.append(f"  stopped on request at {clock(engine.get('since'))} (the engine was drained and stopped)")
        else:
            lines.append(f"  engine {phase or '?'} since {clock(engine.get('since'))}")
        restarts = doc.get("restarts") or {}
        if restarts.get("total"):
            lines.append(f"  restarts: {restarts['total']}, last: {restarts.get('last_reason')} at {clock(restarts.get('last_at'))}")
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
