"""Watchdog rules, pure: what the latest snapshot means for a running engine.

`assess()` decides whether the engine must restart (dead, hung, stalled, KV leak)
and whether to send the active inference probe. `conditions()` says which alert
conditions hold right now; alerting.py turns those into fire/remind/resolve.
Both are pure and take `now` from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from r3090d.config.schema import Config
from r3090d.core import probetime
from r3090d.core.snapshot import GpuStatus, HealthStatus, Snapshot
from r3090d.core.vocabulary import SUSPEND_PHASES, Phase, RestartReason, Severity
from r3090d.units import MIB


@dataclass(frozen=True)
class WatchState:
    """Per-engine watch counters; reset whenever a new engine starts."""

    ready_at: float | None = None
    refused_polls: int = 0
    timeout_since: float | None = None
    kv_low_polls: int = 0
    kv_low_since: float | None = None  # when the current shortage began
    kv_load: bool = False  # the last KV shortage was classified as load
    progress: tuple[float | None, float | None, float | None] | None = None  # see progress_mark()
    progress_at: float | None = None  # when progress_mark() last moved
    preemptions: tuple[tuple[float, float], ...] = ()  # (time, total), a short window
    probe_seen_finished_at: float | None = None
    probe_due_at: float | None = None
    probe_failures: int = 0  # failed probes in a row with nothing moving after they were sent
    probe_excused: int = 0  # missed probes in a row retried as the host's fault (probetime.starved_miss)
    engine_cpu: tuple[float, float] | None = None  # (time, the engine's CPU seconds) at the last poll
    probe_cpu_sent: float | None = None  # the sent_at of the probe that probe_cpu_before belongs to
    probe_cpu_before: tuple[float, float] | None = None  # engine_cpu read just before that probe was sent
    memory_points: tuple[tuple[float, int], ...] = ()  # (time, used bytes), downsampled
    gpu_busy: bool = False  # the GPU's own view at the last poll: the engine is computing
    gpu_idle_since: float | None = None  # requests running and the GPU idle, since
    gpu_signal_off: str = ""  # why the GPU's view is not used (empty: it is)
    # The fast detectors' windows as multiples of their settings: widened by the policy after repeated trips.
    gpu_idle_scale: int = 1
    stall_scale: int = 1


@dataclass(frozen=True)
class RestartVerdict:
    reason: RestartReason  # DEAD | HUNG | STALLED | KV
    detail: str
    drain: bool


@dataclass(frozen=True)
class LifecycleFacts:
    phase: Phase
    backoff_remaining: float | None
    restart_reason: str | None
    give_up_reason: str | None
    given_up: bool = False  # the give-up stands: GIVEN_UP, or not yet served again since (PolicyState.given_up)
    recent_restarts: int = 0  # unrequested restarts within restart_storm_window
    root_cause: str | None = None
    retry_in: float | None = None  # GIVEN_UP: seconds to the next automatic attempt (watchdog.give_up_retry)
    exits_on_give_up: bool = False  # daemon.exit_on_give_up: the daemon exits 79 instead of staying up


@dataclass(frozen=True)
class Blindness:
    """Consecutive polls in which a source the watchdog relies on failed."""

    metrics_polls: int = 0
    metrics_detail: str = ""
    nvml_polls: int = 0
    nvml_detail: str = ""


# NVML answered, but with nothing usable: the GPU rules see nothing. (LOST and a
# hung call have their own conditions; DISABLED and PENDING are not failures.)
_NVML_BLIND = (GpuStatus.ERROR, GpuStatus.NO_DRIVER, GpuStatus.NO_LIBRARY, GpuStatus.NO_GPU)


def track_blindness(snap: Snapshot, b: Blindness, cfg: Config, engine_ready: bool) -> Blindness:
    eng, g = snap.metrics, snap.gpu
    if engine_ready and eng.error is not None:
        b = replace(b, metrics_polls=b.metrics_polls + 1, metrics_detail=eng.error)
    elif engine_ready or b.metrics_polls:
        b = replace(b, metrics_polls=0, metrics_detail="")
    if cfg.gpu.required and g.status in _NVML_BLIND and not g.hung:
        b = replace(b, nvml_polls=b.nvml_polls + 1, nvml_detail=f"{g.status.value}: {g.detail}".rstrip(": "))
    else:
        b = replace(b, nvml_polls=0, nvml_detail="")
    return b


@dataclass(frozen=True)
class Condition:
    key: str
    active: bool
    severity: Severity
    summary: str
    event: bool = False  # one-shot: sent as it happens, no hysteresis, no resolve
    immediate: bool = False  # a state, not a noisy reading: fire on the first active poll


@dataclass(frozen=True)
class GpuActivity:
    """The GPU's own view of whether the engine computes: busy is None when it cannot be trusted (see why_not)."""

    busy: bool | None
    why_not: str = ""


def gpu_activity(snap: Snapshot, cfg: Config) -> GpuActivity:
    """NVML utilization is the share of the last sample period (1/6 s to 1 s) in which
    any kernel ran, from any process. It says something about the engine only when
    the engine's process tree is the GPU's sole user and the sample is fresh."""
    g = snap.gpu
    if not cfg.gpu.required:
        return GpuActivity(None, "gpu.required is false")
    if not g.usable or g.utilization_gpu is None:
        return GpuActivity(None, "NVML gives no utilization reading")
    if g.age_s is None or g.age_s > 2 * cfg.watchdog.poll_interval:
        return GpuActivity(None, f"the NVML sample is {g.age_s or 0:.1f} s old")
    if g.processes is None or g.graphics_processes is None or g.memory_used is None:
        return GpuActivity(None, "NVML does not list the GPU's processes")
    engine = set(snap.child.tree_pids)
    foreign = sorted({p.pid for p in g.processes + g.graphics_processes} - engine)
    if foreign:
        return GpuActivity(None, f"another process uses the GPU (pid {', '.join(map(str, foreign[:3]))})")
    share = sum(p.used_bytes or 0 for p in g.processes if p.pid in engine)
    other = g.memory_used - share
    if other > cfg.watchdog.gpu_foreign_margin_mib * MIB:
        return GpuActivity(None, f"{other / MIB:.0f} MiB of GPU memory is used beyond the engine's processes (another container?)")
    return GpuActivity(g.utilization_gpu > 0)


def progress_mark(snap: Snapshot) -> tuple[float | None, float | None, float | None] | None:
    """What moves while the engine works. vLLM counts prompt tokens only when a
    prefill finishes, so a long chunked prefill moves neither token counter; it
    does allocate KV blocks chunk by chunk, so KV usage moves. Any of the three
    moving is progress. None: /metrics said nothing this poll (not "no progress")."""
    eng = snap.metrics
    if eng.error is not None or eng.generation_tokens_total is None:
        return None
    return (eng.generation_tokens_total, eng.prompt_tokens_total, eng.kv_usage)


def _held_since(since: float | None, holds: bool, now: float) -> float | None:
    """When a condition that holds now began; None while it does not hold."""
    return (now if since is None else since) if holds else None


def _advance_progress(snap: Snapshot, w: WatchState, now: float) -> WatchState:
    mark = progress_mark(snap)
    if mark is None:
        return w
    if w.progress is None or mark != w.progress:
        return replace(w, progress=mark, progress_at=now)
    return w


def assess(snap: Snapshot, w: WatchState, cfg: Config, now: float) -> tuple[WatchState, RestartVerdict | None]:
    """Only called while the engine is READY. Returns the new counters and a restart verdict."""
    wd = cfg.watchdog
    if w.ready_at is None:
        w = replace(w, ready_at=now)
    if w.progress_at is None:
        w = replace(w, progress_at=now)
    w = _advance_progress(snap, w, now)
    w = _track_preemptions(snap, w, now)
    w = _track_memory(snap, w, cfg, now)
    w = _track_engine_cpu(snap, w, now)
    health = snap.health

    # Dead: refused for K polls, or a 503 (vLLM's answer after EngineDeadError).
    if health.status is HealthStatus.HTTP and health.http_status == 503:
        return w, RestartVerdict(RestartReason.DEAD, "/health answered 503", drain=False)
    w = replace(w, refused_polls=w.refused_polls + 1 if health.status is HealthStatus.REFUSED else 0)
    if w.refused_polls >= wd.dead_refused_polls:
        return w, RestartVerdict(RestartReason.DEAD, f"/health refused for {w.refused_polls} polls", drain=False)

    # Hung: /health timing out for T seconds.
    w = replace(w, timeout_since=_held_since(w.timeout_since, health.status is HealthStatus.TIMEOUT, now))
    if w.timeout_since is not None and now - w.timeout_since >= wd.hang_timeout:
        return w, RestartVerdict(RestartReason.HUNG, f"/health timed out for {now - w.timeout_since:.0f} s", drain=False)

    eng = snap.metrics
    running = eng.error is None and (eng.running or 0) > 0
    # Frozen engine, seen by the GPU: requests running while the GPU computes nothing.
    act = gpu_activity(snap, cfg)
    w = replace(w, gpu_busy=bool(act.busy), gpu_signal_off=act.why_not)
    w = replace(w, gpu_idle_since=_held_since(w.gpu_idle_since, running and act.busy is False, now))
    if w.gpu_idle_since is not None and now - w.gpu_idle_since >= wd.gpu_idle_stall_seconds * w.gpu_idle_scale:
        idle_s = now - w.gpu_idle_since
        return w, RestartVerdict(RestartReason.GPU_IDLE, f"{eng.running:.0f} running and the GPU idle (0% busy) for {idle_s:.1f} s", drain=False)

    # Frozen engine, passive: requests running and nothing moving for S seconds. A busy
    # GPU is progress too (a long prefill moves no counter) but only up to the busy cap.
    quiet = now - w.progress_at
    if running and quiet >= wd.stall_seconds * w.stall_scale and not _gpu_working(w, wd, quiet):
        busy = " while the GPU read busy (over the busy cap)" if w.gpu_busy else ""
        return w, RestartVerdict(RestartReason.STALLED, f"{eng.running:.0f} running, no progress (tokens or KV blocks) for {quiet:.0f} s{busy}", drain=False)

    # Frozen engine, active: the probe's consecutive failures.
    inf = snap.inference
    if inf.finished_at is not None and inf.finished_at != w.probe_seen_finished_at:
        w = replace(w, probe_seen_finished_at=inf.finished_at)
        moved = inf.sent_at is not None and w.progress_at > inf.sent_at
        if inf.ok or moved:
            # A probe that queued behind a long prefill times out while the engine works:
            # progress after it was sent says the engine is not frozen, so it does not count.
            w = replace(w, probe_failures=0, probe_excused=0, probe_due_at=max(inf.finished_at, w.progress_at) + wd.probe_idle_seconds)
        elif w.probe_excused < probetime.EXCUSED_MISSES_MAX and probetime.starved_miss(inf, snap.host_load, w.probe_cpu_before, snap.child.cpu_seconds, now):
            # The engine computes on a host with no CPU to spare: its turn came late, it is not frozen. Retried, not counted.
            w = replace(w, probe_excused=w.probe_excused + 1, probe_due_at=inf.finished_at)
        else:
            w = replace(w, probe_failures=w.probe_failures + 1, probe_due_at=inf.finished_at)  # retry at once
            if w.probe_failures >= wd.probe_failures:
                excused = f"; {w.probe_excused} missed while the engine computed on a saturated host, retried" if w.probe_excused else ""
                facts = probetime.miss_facts(snap.host_load, w.probe_cpu_before, snap.child.cpu_seconds, now) if inf.timed_out else ""
                facts = f" ({facts})" if facts else ""
                return w, RestartVerdict(RestartReason.PROBE_FAILED, f"{w.probe_failures} inference probes failed with nothing moving ({inf.detail}){excused}{facts}", drain=False)

    # KV cache: low free blocks for K consecutive polls.
    if eng.free_blocks is not None and eng.free_blocks < wd.min_free_blocks:
        if w.kv_low_polls == 0:
            w = replace(w, kv_low_since=now)
        w = replace(w, kv_low_polls=w.kv_low_polls + 1)
        if w.kv_low_polls >= wd.kv_low_polls:
            leak = _kv_leak(snap, w)
            cooling = now - w.ready_at < wd.kv_cooldown
            if (leak or wd.kv_restart_under_load) and not cooling:
                kind = "leak" if leak else "threshold"
                return w, RestartVerdict(RestartReason.KV, f"{eng.free_blocks:.0f} free blocks < {wd.min_free_blocks} for {w.kv_low_polls} polls ({kind})", drain=True)
            w = replace(w, kv_load=not leak)
    elif eng.free_blocks is not None:
        w = replace(w, kv_low_polls=0, kv_low_since=None, kv_load=False)
    return w, None


def _track_engine_cpu(snap: Snapshot, w: WatchState, now: float) -> WatchState:
    """Keep the engine's CPU time as read just before the latest probe was sent: the poll that sent it
    read it first. A probe first seen with no such reading has none (its miss is counted)."""
    sent = snap.inference.sent_at
    if sent is not None and sent != w.probe_cpu_sent:
        before = w.engine_cpu if w.engine_cpu is not None and w.engine_cpu[0] <= sent else None
        w = replace(w, probe_cpu_sent=sent, probe_cpu_before=before)
    cpu = snap.child.cpu_seconds
    return replace(w, engine_cpu=(now, cpu) if cpu is not None else None)


def _gpu_working(w: WatchState, wd, quiet: float) -> bool:
    return w.gpu_busy and quiet < wd.gpu_busy_cap_seconds


def _kv_leak(snap: Snapshot, w: WatchState) -> bool:
    """Leak: blocks held with nothing running, or no progress since the shortage began."""
    eng = snap.metrics
    idle = (eng.kv_usage or 0) > 0 and (eng.running or 0) == 0 and (eng.waiting or 0) == 0
    no_progress = w.kv_low_since is not None and w.progress_at is not None and w.progress_at <= w.kv_low_since
    return idle or no_progress


def probe_due(snap: Snapshot, w: WatchState, cfg: Config, now: float) -> bool:
    """Send the active completion probe when nothing progressed for P seconds and none is in flight."""
    inf = snap.inference
    in_flight = inf.sent_at is not None and (inf.finished_at is None or inf.finished_at < inf.sent_at)
    if in_flight or w.progress_at is None:
        return False
    if _gpu_working(w, cfg.watchdog, now - w.progress_at):
        return False  # the GPU says the engine computes: a probe would only queue behind it
    due = w.probe_due_at if w.probe_due_at is not None else w.progress_at + cfg.watchdog.probe_idle_seconds
    due = max(due, w.progress_at + cfg.watchdog.probe_idle_seconds) if inf.ok is not False else due
    return now >= due


def _track_preemptions(snap: Snapshot, w: WatchState, now: float) -> WatchState:
    total = snap.metrics.preemptions_total
    if total is None:
        return w
    points = tuple(p for p in w.preemptions if now - p[0] <= 300.0) + ((now, total),)
    return replace(w, preemptions=points)


def preemption_rate(w: WatchState) -> float | None:
    """Preemptions per minute over the recent window."""
    if len(w.preemptions) < 2:
        return None
    (t0, v0), (t1, v1) = w.preemptions[0], w.preemptions[-1]
    return (v1 - v0) / (t1 - t0) * 60.0 if t1 > t0 else None


MEMORY_POINTS = 60  # the growth window is kept as about this many points


def _track_memory(snap: Snapshot, w: WatchState, cfg: Config, now: float) -> WatchState:
    used = snap.gpu.memory_used if snap.gpu.usable else None
    if used is None:
        return w
    step = cfg.watchdog.growth_window / MEMORY_POINTS
    if w.memory_points and now - w.memory_points[-1][0] < step:
        return w
    points = tuple(p for p in w.memory_points if now - p[0] <= cfg.watchdog.growth_window) + ((now, used),)
    return replace(w, memory_points=points)


def memory_slope(points: tuple[tuple[float, int], ...]) -> float | None:
    """Least-squares slope in bytes per second."""
    n = len(points)
    if n < 3:
        return None
    mt = sum(p[0] for p in points) / n
    mv = sum(p[1] for p in points) / n
    den = sum((p[0] - mt) ** 2 for p in points)
    if den == 0:
        return None
    return sum((p[0] - mt) * (p[1] - mv) for p in points) / den


def _after_give_up(life: LifecycleFacts) -> str:
    """What follows a give-up, as the gave_up alert says it."""
    if life.exits_on_give_up:
        return "the daemon exits with code 79 (daemon.exit_on_give_up); systemd's Restart= decides what follows"
    if life.retry_in is not None:
        return f"the engine stays stopped; next automatic attempt in {max(0.0, life.retry_in) / 60:.0f} min (r3090ctl restart starts it now)"
    if life.phase is Phase.GIVEN_UP:
        return "the engine stays stopped until r3090ctl restart"
    return "an attempt to start the engine is under way"


def conditions(snap: Snapshot, w: WatchState, cfg: Config, now: float, life: LifecycleFacts, blind: Blindness = Blindness(), *,
               card: bool = True) -> list[Condition]:  # fmt: skip
    """The alert conditions of one engine; with `card`, also the GPU's (swap mode judges the card once, in core.card)."""
    wd = cfg.watchdog
    out: list[Condition] = []
    cause = f"; root cause: {life.root_cause}" if life.root_cause else ""
    out.append(Condition(
        "gave_up",
        life.given_up,
        Severity.CRITICAL,
        # The give-up's reason (with its root cause) ends the line: Alertmanager's annotation cuts the cause from the end.
        f"gave up ({_after_give_up(life)}): {life.give_up_reason}" if life.give_up_reason
        else "the engine serves again after a give-up",
        immediate=True,
    ))  # fmt: skip
    storm = life.recent_restarts >= wd.restart_storm_restarts
    out.append(Condition(
        "restart_storm",
        storm,
        Severity.WARNING,
        f"{life.recent_restarts} engine restarts in {wd.restart_storm_window:.0f} s (last: {life.restart_reason}{cause})" if storm
        else f"restarts back under {wd.restart_storm_restarts} in {wd.restart_storm_window:.0f} s",
        immediate=True,
    ))  # fmt: skip
    out.append(blindness_condition(blind, cfg, nvml=card))
    if card:
        out += card_conditions(snap, w, cfg, life.phase)
    if life.phase is Phase.READY:
        rate = preemption_rate(w)
        rate_text = f", {rate:.1f} preemptions/min" if rate is not None else ""
        eng = snap.metrics
        counts = f"{eng.free_blocks or 0:.0f} free blocks, {eng.running or 0:.0f} running, {eng.waiting or 0:.0f} waiting"
        out.append(Condition("kv_pressure", w.kv_load, Severity.WARNING, f"KV cache full under load: {counts}{rate_text}" if w.kv_load else f"KV cache has room again: {counts}"))
    backoff = life.phase is Phase.BACKOFF and (life.backoff_remaining or 0) > 0
    out.append(Condition("engine_backoff", backoff, Severity.WARNING, f"engine restart backoff after {life.restart_reason}: {life.backoff_remaining or 0:.0f} s left" if backoff else f"engine restart backoff over (after {life.restart_reason})"))
    return out


def blindness_condition(blind: Blindness, cfg: Config, *, nvml: bool = True) -> Condition:
    """watchdog_blind: /metrics failing (the engine's), and with `nvml`, NVML failing (the card's: swap mode
    judges it once for the card, in core.card, not once per engine)."""
    wd = cfg.watchdog
    blind_what = []
    if blind.metrics_polls >= wd.blind_polls:
        blind_what.append(f"/metrics failing for {blind.metrics_polls} polls ({blind.metrics_detail}): the KV and stall rules see nothing")
    if nvml and blind.nvml_polls >= wd.blind_polls:
        blind_what.append(f"NVML failing for {blind.nvml_polls} polls ({blind.nvml_detail}): the GPU rules see nothing")
    return Condition("watchdog_blind", bool(blind_what), Severity.WARNING, "watchdog blind: " + "; ".join(blind_what) if blind_what else "the watchdog sees again")


def card_conditions(snap: Snapshot, w: WatchState, cfg: Config, phase: Phase) -> list[Condition]:
    """The GPU's own alerts (lost, NVML hung, memory, temperature, power, throttling, memory growth)."""
    if not cfg.gpu.required:
        return []
    wd = cfg.watchdog
    g = snap.gpu
    out: list[Condition] = []
    lost = g.lost or g.status is GpuStatus.LOST
    out.append(Condition("gpu_lost", lost, Severity.CRITICAL, f"GPU {cfg.gpu.index} is lost ({g.detail or 'GpuIsLost'}): reboot needed" if lost else f"GPU {cfg.gpu.index} answers NVML again"))
    out.append(Condition("nvml_hung", g.hung, Severity.WARNING, f"an NVML call has been stuck for {g.age_s or 0:.0f} s" if g.hung else "NVML answers again"))
    limit = wd.gpu_memory_alert_mib * MIB
    if phase in SUSPEND_PHASES:
        # The card is lent: what the borrower uses is none of this alert's business.
        out.append(Condition("gpu_memory", False, Severity.WARNING, "GPU memory alert paused: the engine is suspended, the GPU lent"))
    elif g.usable and g.memory_used is not None:
        over = g.memory_used > limit
        out.append(Condition("gpu_memory", over, Severity.WARNING, f"GPU memory used {g.memory_used / MIB:.0f} MiB (alert above {wd.gpu_memory_alert_mib} MiB)" if over else f"GPU memory used {g.memory_used / MIB:.0f} MiB, back under {wd.gpu_memory_alert_mib} MiB"))
    if g.usable and g.temperature_c is not None:
        hot = g.temperature_c >= wd.temperature_warn_c
        out.append(Condition("gpu_temperature", hot, Severity.WARNING, f"GPU at {g.temperature_c} C (warning at {wd.temperature_warn_c} C)" if hot else f"GPU cooled to {g.temperature_c} C (warning at {wd.temperature_warn_c} C)"))
    if g.usable and g.power_w is not None and g.power_limit_w:
        high = g.power_w >= wd.power_warn_ratio * g.power_limit_w
        out.append(Condition("gpu_power", high, Severity.WARNING, f"GPU power {g.power_w:.0f} W of a {g.power_limit_w:.0f} W limit (warning at {wd.power_warn_ratio:.0%})" if high else f"GPU power back to {g.power_w:.0f} W of a {g.power_limit_w:.0f} W limit"))
    if g.usable and g.clock_event_reasons is not None:
        hit = sorted(set(g.clock_event_reasons) & set(wd.throttle_warn_reasons))
        out.append(Condition("gpu_throttle", bool(hit), Severity.WARNING, f"GPU clocks held back: {', '.join(hit)}" if hit else "GPU clocks no longer held back"))
    slope = memory_slope(w.memory_points)
    if g.usable and g.memory_used is not None and phase is Phase.READY:
        growing = False
        text = "GPU memory is not growing"
        if slope is not None and slope > 0:
            eta = (limit - g.memory_used) / slope
            growing = 0 < eta <= wd.growth_horizon
            text = f"GPU memory grows {slope * 3600 / MIB:.0f} MiB/h; crosses {wd.gpu_memory_alert_mib} MiB in {eta / 3600:.1f} h"
        out.append(Condition("gpu_memory_growth", growing, Severity.WARNING, text))
    return out
