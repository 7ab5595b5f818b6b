"""The state document, built by pure functions: `report()` each tick, `preflight_report()` before the loop.

`report()` turns the policy's state and the tick's snapshot into a StateDocument
(service/statedoc.py); the policy's monotonic times are shifted to wall-clock
ones by `offset`.
"""

from __future__ import annotations

import dataclasses

from r3090d.config import MIB, Config
from r3090d.core import canary
from r3090d.core.alerting import AlertBook
from r3090d.core.policy import PolicyState
from r3090d.core.snapshot import Snapshot
from r3090d.core.suspension import HOW_TO_RESUME, Stage
from r3090d.core.vocabulary import SUSPEND_PHASES, Phase
from r3090d.preflight.checks import Status
from r3090d.service.state import BOOK_TIME_FIELDS
from r3090d.service.statedoc import (
    AlertBookInfo,
    AlertsInfo,
    CanaryInfo,
    DaemonIdentity,
    DaemonInfo,
    EngineInfo,
    FiringAlert,
    HealingInfo,
    ModelDoc,
    ModelFleetState,
    PreflightSummary,
    ProbeInfo,
    RestartsInfo,
    StateDocument,
    SuspendInfo,
    SwapInfo,
    Telemetry,
    Thresholds,
    WaitingInfo,
    WatchInfo,
    parse_section,
)


def report(
    st: PolicyState,
    snap: Snapshot,
    cfg: Config,
    *,
    identity: DaemonIdentity,
    offset: float,
    written_at: float,
    tick_s: float,
    preflight: PreflightSummary | None,
    telemetry: dict,
    suspend: SuspendInfo | None = None,
) -> StateDocument:
    """`suspend` is the suspend section, with what only the daemon can measure (SuspendService.publish)."""

    def wall(t: float | None) -> float | None:
        return None if t is None else t + offset

    firing = {k: FiringAlert(e.severity, e.summary, wall(e.since)) for k, e in st.alerts.firing().items()}
    return StateDocument(
        written_at=written_at,
        daemon=daemon_info(identity, cfg, poll_interval=cfg.watchdog.poll_interval, tick_seconds=round(tick_s, 4)),
        engine=EngineInfo(
            state="maintenance" if st.maintenance and st.phase is Phase.READY else st.phase.value,
            phase=st.phase,
            maintenance=st.maintenance,
            since=st.phase_since + offset,
            pid=snap.child.pid if snap.child.alive else None,
            tree_pids=list(snap.child.tree_pids),
            model=cfg.model_name,
            url=cfg.engine_address,
            ready_since=wall(st.ready_since),
            generation=st.generation,
        ),
        restarts=restarts_info(st, offset),
        next_action=next_action(st, snap, cfg),
        watch=WatchInfo(st.watch.gpu_signal_off if cfg.gpu.required else None),
        give_up_reason=st.give_up_reason,
        xid_seen=list(st.xid_seen),
        health=snap.health,
        inference=probe_info(snap, offset),
        thresholds=Thresholds(
            gpu_memory_alert_bytes=cfg.watchdog.gpu_memory_alert_mib * MIB,
            kv_min_free_blocks=cfg.watchdog.min_free_blocks,
            restart_storm_restarts=cfg.watchdog.restart_storm_restarts,
            restart_storm_window_s=cfg.watchdog.restart_storm_window,
        ),
        metrics=snap.metrics,
        gpu=snap.gpu,
        alerts=AlertsInfo(firing, {k: u + offset for k, u in st.alerts.silenced}),
        alert_book=book_info(st.alerts, offset),
        preflight=preflight,
        telemetry=parse_section(Telemetry, telemetry) or Telemetry(),
        suspend=suspend,
        healing=healing_info(st, cfg, offset),
        canary=canary_info(st, cfg),
    )


def restarts_info(st: PolicyState, offset: float) -> RestartsInfo:
    return RestartsInfo(
        total=st.restarts_total,
        by_reason=dict(st.restarts_by_reason),
        last_reason=st.last_restart_reason,
        last_at=None if st.last_restart_at is None else st.last_restart_at + offset,
        last_root_cause=st.last_root_cause,
        backoff_level=st.backoff_level,
        start_failures=st.start_failures,
        same_cause_run=st.same_cause_run,
        recent=len(st.restart_times),
        recent_at=[t + offset for t in st.restart_times],
    )


HANDED_ON = ("format", "restarts", "alert_book")  # the sections of a state document that state.carried_over reads


def hand_on(st: PolicyState, offset: float) -> dict:
    """What one engine hands on to the next daemon (swap mode: each model's, in its own state directory): its
    restart history and alert book, as the state document holds them, so that state.carried_over reads them."""
    doc = StateDocument(restarts=restart_history(restarts_info(st, offset)), alert_book=book_info(st.alerts, offset)).to_json()
    return {key: doc[key] for key in HANDED_ON}


def canary_info(st: PolicyState, cfg: Config) -> CanaryInfo:
    cs, cc = st.canary, cfg.canary
    return CanaryInfo(
        enabled=cc.enabled,
        interval_s=cc.interval,
        baseline_tokens=canary.confident_prefix(cs.baseline, cc.margin_threshold) if cs.baseline else None,
        checks=cs.checks,
        mismatches=cs.mismatches,
        inconclusive=cs.inconclusive,
        errors=cs.errors,
        last_verdict=cs.last.verdict.value if cs.last else None,
        last_match_at=cs.last_match_wall,
        last_ok_at=cs.last_ok_wall,
        last_margin=cs.last_margin,
        last_mismatch=cs.last_mismatch.text(cc.prompt) if cs.last_mismatch else None,
        last_mismatch_at=cs.last_mismatch_wall,
    )


def healing_info(st: PolicyState, cfg: Config, offset: float) -> HealingInfo:
    hold, wait = st.reset_hold, st.gpu_wait if st.phase is Phase.WAITING_FOR_GPU else None
    return HealingInfo(
        reset_hold=hold.reason if hold else None,
        reset_hold_since=hold.since_wall if hold else None,
        gpu_wait_holders=list(wait.holders) if wait else [],
        gpu_wait_need_bytes=wait.need if wait else None,
        gpu_wait_free_bytes=wait.free if wait else None,
        give_up_retry_s=0.0 if cfg.daemon.exit_on_give_up else cfg.watchdog.give_up_retry,
        retry_attempts=st.retry_attempts,
        next_retry_at=st.retry_at + offset if st.retry_at is not None else None,
        given_up=st.given_up,
        start_succeeded=st.succeeded,
        xid_by_class={cls.value: n for cls, n in st.xid_counts},
        detector_scale={reason.value: scale for reason, scale in st.detector_scale},
    )


def daemon_info(identity: DaemonIdentity, cfg: Config, *, poll_interval: float, tick_seconds: float | None = None) -> DaemonInfo:
    """Who writes the document, and how often it is re-written (readers judge its freshness by it)."""
    return DaemonInfo(
        pid=identity.pid,
        started_at=identity.started_at,
        version=identity.version,
        instance=cfg.instance,
        config=cfg.source,
        host=identity.host,
        tick_seconds=tick_seconds,
        poll_interval=poll_interval,
    )


def preflight_report(
    previous: StateDocument | None,
    cfg: Config,
    *,
    identity: DaemonIdentity,
    summary: PreflightSummary,
    waiting: str | None,
    written_at: float,
) -> StateDocument:
    """The document preflight leaves before the loop's first tick: what it waits for, or why it failed.

    No engine runs yet, so nothing an earlier daemon measured is repeated as current; only
    its alert book and restart history are carried over, for the loop to go on from
    (Daemon.run reads them back). `waiting` keeps its first `since` across re-checks.
    """
    earlier_wait = previous.waiting if previous is not None else None
    failed = [c.name for c in summary.checks if c.status is Status.FAIL]
    return StateDocument(
        written_at=written_at,
        # re-written at each re-check: that is its freshness
        daemon=daemon_info(identity, cfg, poll_interval=cfg.preflight.transient_retry_s),
        engine=EngineInfo(state=Phase.STOPPED.value, phase=Phase.STOPPED, model=cfg.model_name, url=cfg.engine_address),
        alert_book=previous.alert_book if previous is not None else AlertBookInfo(),
        restarts=restart_history(previous.restarts) if previous is not None else RestartsInfo(),
        preflight=summary,
        waiting=None if waiting is None else WaitingInfo(waiting, earlier_wait.since if earlier_wait and earlier_wait.since else written_at),
        give_up_reason=None if waiting else "preflight failed: " + "; ".join(failed),
    )


def restart_history(restarts: RestartsInfo) -> RestartsInfo:
    """What a daemon's successor counts on from (state.carried_over), without what was this daemon's alone."""
    return RestartsInfo(
        total=restarts.total,
        by_reason=restarts.by_reason,
        last_reason=restarts.last_reason,
        last_at=restarts.last_at,
        last_root_cause=restarts.last_root_cause,
        start_failures=restarts.start_failures,
        same_cause_run=restarts.same_cause_run,
        recent=len(restarts.recent_at),
        recent_at=restarts.recent_at,
    )


def book_info(book: AlertBook, offset: float) -> AlertBookInfo:
    """The alert book with its monotonic times shifted to wall-clock ones, as the document carries it."""

    def wall(t: float | None) -> float | None:
        return None if t is None else t + offset

    entries = {key: dataclasses.replace(e, **{name: wall(getattr(e, name)) for name in BOOK_TIME_FIELDS}) for key, e in book.entries}
    return AlertBookInfo(entries, {key: until + offset for key, until in book.silenced})


def probe_info(snap: Snapshot, offset: float) -> ProbeInfo:
    """The last finished inference probe, in wall time: for the exporter's latency gauge and status."""
    inf = snap.inference
    finished = inf.finished_at is not None and inf.sent_at is not None and inf.finished_at >= inf.sent_at
    return ProbeInfo(
        ok=inf.ok,
        latency_s=round(inf.finished_at - inf.sent_at, 4) if finished else None,
        finished_at=inf.finished_at + offset if finished else None,
        detail=inf.detail,
        consecutive_failures=inf.consecutive_failures,
    )


def status_line(st: PolicyState, snap: Snapshot) -> str:
    """One line for sd_notify's STATUS= (what `systemctl status` shows) and the log."""
    now = snap.now
    if st.phase is Phase.STARTING:
        return f"loading model ({now - st.phase_since:.0f} s)"
    if st.phase is Phase.GIVEN_UP:
        return f"gave up, engine stopped: {st.give_up_reason}"
    if st.phase is Phase.RESET_NEEDED and st.reset_hold is not None:
        return f"engine stopped: the GPU needs a reset ({st.reset_hold.reason})"
    if st.phase is Phase.WAITING_FOR_GPU and st.gpu_wait is not None:
        return f"waiting for GPU memory: {st.gpu_wait.text()}"
    parts = [("maintenance " if st.maintenance else "") + st.phase.value]
    e = snap.metrics
    if e.kv_usage is not None:
        parts.append(f"kv {e.kv_usage * 100:.0f}% ({e.free_blocks or 0:.0f} free blocks)")
    g = snap.gpu
    if g.memory_used is not None and g.memory_total:
        parts.append(f"gpu {g.memory_used / MIB:.0f}/{g.memory_total / MIB:.0f} MiB")
    if st.restarts_total:
        parts.append(f"restarts {st.restarts_total} (last: {st.last_restart_reason})")
    return ", ".join(parts)


def next_action(st: PolicyState, snap: Snapshot, cfg: Config) -> str | None:
    s = st.suspension
    if s is not None and st.phase in SUSPEND_PHASES:
        if s.stage is Stage.DRAINING:
            left = s.stage_since + cfg.suspend.drain_timeout - snap.now
            how = "put the engine to sleep" if s.by_sleep else "checkpoint the engine"
            return f"{how} once nothing runs (at the latest in {max(0.0, left):.0f} s after the load balancer's grace)"
        if s.stage is Stage.SUSPENDED:
            return f"none until {HOW_TO_RESUME}" + (" (which starts a new engine)" if s.cold else "")
        if s.stage is Stage.VERIFYING:
            return "ready once /health answers 200 and one inference probe passes"
        if s.stage in (Stage.SLEEPING, Stage.WAKING, Stage.UNPAUSING):
            return f"wait for vLLM's {s.stage.value} (at most swap.sleep_timeout, {cfg.swap.sleep_timeout:.0f} s)"
        return f"wait for the GPU driver ({s.stage.value})"
    if st.phase is Phase.BACKOFF and st.next_start_at is not None:
        return f"start engine in {max(0.0, st.next_start_at - snap.now):.0f} s"
    if st.phase is Phase.DRAINING and st.stop_due_at is not None:
        return f"drained stop of the engine in {max(0.0, st.stop_due_at - snap.now):.0f} s (load balancer grace)"
    if st.phase in (Phase.RESTARTING, Phase.DRAINING):
        return "start engine once the old process tree is gone"
    if st.phase is Phase.STARTING:
        return f"give up waiting for /health in {max(0.0, st.phase_since + cfg.engine.startup_timeout - snap.now):.0f} s"
    if st.phase is Phase.GIVEN_UP:
        if st.retry_at is not None:
            return f"automatic start attempt in {max(0.0, st.retry_at - snap.now):.0f} s (r3090ctl restart starts it now)"
        return "none until r3090ctl restart (after fixing the cause; r3090ctl reload applies a fixed config)"
    if st.phase is Phase.RESET_NEEDED:
        return "none until the GPU is reset and r3090ctl restart (or a reboot)"
    if st.phase is Phase.WAITING_FOR_GPU:
        return "start the engine as soon as the other processes free the GPU memory"
    return None


# ------------------------------------------------------------------ swap mode


def model_doc(name: str, engine_doc: StateDocument, *, kind, residency, port: int, last_used: float | None, host_bytes: int,
              gpu_bytes: int, swaps_in: int, swaps_out: int, inflight: int, waiting: int, frozen: int,
              fleet: ModelFleetState | None = None) -> ModelDoc:  # fmt: skip
    """One model of swap mode: where its engine is and how it is used, with its engine's own sections
    (what report() gives for that engine alone)."""
    d = engine_doc
    return ModelDoc(
        name=name, kind=kind, residency=residency, port=port, last_used=last_used, host_bytes=host_bytes, gpu_bytes=gpu_bytes,
        swaps_in=swaps_in, swaps_out=swaps_out, inflight=inflight, waiting=waiting, frozen=frozen,
        engine=d.engine, restarts=d.restarts, health=d.health, inference=d.inference, canary=d.canary, suspend=d.suspend,
        metrics=d.metrics, watch=d.watch, give_up_reason=d.give_up_reason, next_action=d.next_action, healing=d.healing,
        fleet=fleet or ModelFleetState(),
    )  # fmt: skip


def swap_document(models: list[ModelDoc], swap: SwapInfo, gpu, cfg: Config, *, identity: DaemonIdentity, firing: dict,
                  xid_seen: list[int], healing: HealingInfo, written_at: float, tick_s: float,
                  preflight: PreflightSummary | None, telemetry: dict, alert_book: AlertBookInfo | None = None) -> StateDocument:  # fmt: skip
    """The node's document in swap mode: the daemon, the card and every model; the top-level engine is "swap".
    `alert_book`: the card's, which the next daemon goes on from (each model's is in its own state directory)."""
    return StateDocument(
        written_at=written_at,
        daemon=daemon_info(identity, cfg, poll_interval=cfg.watchdog.poll_interval, tick_seconds=round(tick_s, 4)),
        engine=EngineInfo(state=SWAP_ENGINE_STATE, model=", ".join(m.name for m in models), url=f"http://{cfg.engine.host}:{cfg.engine.port}"),
        xid_seen=xid_seen,
        gpu=gpu,
        alerts=AlertsInfo(firing, {}),
        alert_book=alert_book or AlertBookInfo(),
        preflight=preflight,
        telemetry=parse_section(Telemetry, telemetry) or Telemetry(),
        healing=healing,
        models=models,
        swap=swap,
    )


SWAP_ENGINE_STATE = "swap"  # the top-level engine's state in swap mode: the models say where each engine is
