"""The decision core: decide(snapshot, state, config, now) -> (actions, new_state).

Pure: no clock, no I/O, no live objects. Everything it knows arrives in the
frozen snapshot and the frozen PolicyState it returned last time; `now` is the
monotonic clock of the snapshot. Tests are tables of snapshots in and actions out.

The engine moves through phases:

    STOPPED --start--> STARTING --/health 200--> READY
    READY/STARTING --failure--> RESTARTING (old tree being stopped)
    RESTARTING --tree gone--> BACKOFF --delay over--> STARTING
    any --too many failures in the window--> GIVEN_UP --tree gone--> exit
    any --shutdown--> SHUTTING_DOWN --tree gone--> exit 0
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from r3090d import alerting, exitcodes, rules
from r3090d.config import Config
from r3090d.model import (
    Action,
    Exit,
    HealthStatus,
    RecordRestart,
    SendInferenceProbe,
    Snapshot,
    StartEngine,
    StopEngine,
)

# How long to wait for NVML to stop listing processes of the old tree once
# psutil says they are gone, before starting the new engine anyway.
VRAM_RELEASE_WAIT_S = 30.0


class Phase(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # a drained restart in progress: the engine still finishes its streams
    RESTARTING = "restarting"  # the old tree is being stopped
    BACKOFF = "backoff"
    GIVEN_UP = "given-up"
    SHUTTING_DOWN = "shutting-down"


@dataclass(frozen=True)
class PolicyState:
    phase: Phase = Phase.STOPPED
    phase_since: float = 0.0
    maintenance: bool = False
    generation: int = 0  # ChildSample.generation of the engine this state tracks
    ready_since: float | None = None
    next_start_at: float | None = None
    restart_reason: str | None = None  # why the current restart/backoff is happening
    failure_times: tuple[float, ...] = ()  # within the give-up window
    backoff_level: int = 0  # consecutive restarts without a stable period
    restarts_total: int = 0
    restarts_by_reason: tuple[tuple[str, int], ...] = ()
    last_restart_reason: str | None = None
    last_restart_at: float | None = None
    old_tree: tuple[int, ...] = ()  # pids of the engine being replaced
    stop_due_at: float | None = None  # DRAINING: the deferred drained StopEngine goes out then
    tree_gone_at: float | None = None
    give_up_reason: str | None = None
    exit_code: int | None = None
    xid_seen: tuple[int, ...] = ()  # latched across restarts: only a reboot clears it
    watch: rules.WatchState = field(default_factory=rules.WatchState)
    alerts: alerting.AlertBook = field(default_factory=alerting.AlertBook)


def initial_state(now: float) -> PolicyState:
    return PolicyState(phase=Phase.STOPPED, phase_since=now)


def lb_grace(cfg: Config) -> float:
    """How long a drained restart shows /healthz 503 before SIGTERM; nothing serves /healthz without the exporter."""
    return cfg.watchdog.lb_grace if cfg.daemon.exporter_enabled else 0.0


def backoff_delay(level: int, cfg: Config) -> float:
    """Delay before the restart number `level` (0-based) since the last stable period."""
    if level <= 0:
        return 0.0
    return min(cfg.watchdog.backoff_initial * 2 ** (level - 1), cfg.watchdog.backoff_max)


def decide(snap: Snapshot, st: PolicyState, cfg: Config, now: float) -> tuple[list[Action], PolicyState]:
    actions: list[Action] = []
    events: list[rules.Condition] = []
    if snap.maintenance is not None and snap.maintenance != st.maintenance:
        st = replace(st, maintenance=snap.maintenance)
    if snap.gpu.xid_errors:
        st = replace(st, xid_seen=tuple(sorted(set(st.xid_seen) | set(snap.gpu.xid_errors))))
    st = _lifecycle(snap, st, cfg, now, actions, events)
    watch = replace(st.watch, xid_seen=st.xid_seen)
    conds = rules.conditions(snap, watch, cfg, now, _lifecycle_facts(st, now)) + events
    alert_actions, book = alerting.evaluate(conds, st.alerts, cfg, now)
    actions.extend(alert_actions)
    return actions, replace(st, alerts=book)


def _lifecycle_facts(st: PolicyState, now: float) -> rules.LifecycleFacts:
    return rules.LifecycleFacts(
        phase=st.phase.value,
        backoff_remaining=(st.next_start_at - now) if st.phase is Phase.BACKOFF and st.next_start_at else None,
        restart_reason=st.restart_reason,
        give_up_reason=st.give_up_reason,
    )


def _to(st: PolicyState, phase: Phase, now: float, **changes) -> PolicyState:
    return replace(st, phase=phase, phase_since=now, **changes)


def _lifecycle(snap: Snapshot, st: PolicyState, cfg: Config, now: float, actions: list[Action], events: list) -> PolicyState:
    child = snap.child

    if snap.shutdown_requested and st.phase not in (Phase.SHUTTING_DOWN, Phase.GIVEN_UP):
        if child.alive or child.tree_pids:
            actions.append(StopEngine(drain=True, reason="shutdown"))
        st = _to(st, Phase.SHUTTING_DOWN, now, exit_code=exitcodes.OK)

    if st.phase in (Phase.SHUTTING_DOWN, Phase.GIVEN_UP):
        if child.tree_gone:
            actions.append(Exit(code=st.exit_code if st.exit_code is not None else exitcodes.OK, reason=st.give_up_reason or "shutdown"))
        return st

    if st.phase is Phase.STOPPED:
        actions.append(StartEngine(reason="initial start"))
        return _to(st, Phase.STARTING, now, generation=child.generation + 1, watch=rules.WatchState())

    if st.phase in (Phase.RESTARTING, Phase.DRAINING, Phase.BACKOFF):
        return _resume(snap, st, cfg, now, actions)

    # STARTING or READY: the engine of st.generation should be running.
    if child.generation != st.generation:
        return st  # the spawn has not shown up in a sample yet
    if not child.alive:
        if child.spawn_error:
            return _fail(snap, st, cfg, now, actions, events, "spawn_failed", child.spawn_error, drain=False)
        code = child.exit_code
        what = "exited during start" if st.phase is Phase.STARTING else "exited"
        # An exit we did not ask for is a failure whatever its code: vLLM can
        # exit 0 after its engine died.
        return _fail(snap, st, cfg, now, actions, events, "exited", f"engine {what} with code {code}", drain=False)

    if st.phase is Phase.STARTING:
        if snap.health.status is HealthStatus.OK:
            return _to(st, Phase.READY, now, ready_since=now, watch=rules.WatchState(ready_at=now))
        if now - st.phase_since > cfg.engine.startup_timeout:
            return _fail(snap, st, cfg, now, actions, events, "startup_timeout", f"not ready after {cfg.engine.startup_timeout} s", drain=False)
        return st

    # READY
    if st.backoff_level and st.ready_since is not None and now - st.ready_since >= cfg.watchdog.stable_after:
        st = replace(st, backoff_level=0)
    watch, verdict = rules.assess(snap, st.watch, cfg, now)
    st = replace(st, watch=watch)
    if snap.restart_requested:
        drain = snap.restart_requested == "drain"
        return _restart(snap, st, cfg, now, actions, events, "requested", "restart requested by operator", drain=drain, counts=False)
    if verdict is not None and not st.maintenance:
        return _fail(snap, st, cfg, now, actions, events, verdict.reason, verdict.detail, drain=verdict.drain)
    if rules.probe_due(snap, st.watch, cfg, now) and not st.maintenance:
        actions.append(SendInferenceProbe())
    return st


def _fail(snap, st, cfg, now, actions, events, reason, detail, *, drain) -> PolicyState:
    """A failure counts toward give-up; then the engine restarts (after backoff)."""
    window = cfg.watchdog.give_up_window
    failures = tuple(t for t in st.failure_times if now - t < window) + (now,)
    st = replace(st, failure_times=failures)
    if len(failures) > cfg.watchdog.give_up_restarts:
        why = f"{len(failures)} failures in {window:.0f} s (last: {reason}: {detail})"
        if snap.child.alive or snap.child.tree_pids:
            actions.append(StopEngine(drain=False, reason="gave up"))
        actions.append(RecordRestart(reason=reason, detail=detail))
        events.append(rules.Condition("gave_up", True, "critical", f"gave up: {why}; the engine stays down until someone restarts r3090d", event=True))
        return _to(st, Phase.GIVEN_UP, now, give_up_reason=why, exit_code=exitcodes.GAVE_UP, restart_reason=reason)
    return _restart(snap, st, cfg, now, actions, events, reason, detail, drain=drain, counts=True)


def _restart(snap, st, cfg, now, actions, events, reason, detail, *, drain, counts) -> PolicyState:
    delay = backoff_delay(st.backoff_level, cfg) if counts else 0.0
    by_reason = dict(st.restarts_by_reason)
    by_reason[reason] = by_reason.get(reason, 0) + 1
    actions.append(RecordRestart(reason=reason, detail=detail))
    # A drained restart first publishes DRAINING (/healthz 503) and holds the
    # SIGTERM for lb_grace, so the load balancer stops sending new requests.
    grace = lb_grace(cfg) if drain and snap.child.alive else 0.0
    if (snap.child.alive or snap.child.tree_pids) and grace <= 0:
        actions.append(StopEngine(drain=drain and snap.child.alive, reason=reason))
    wait = f", next start in {delay:.0f} s" if delay else ""
    events.append(rules.Condition("engine_restarted", True, "warning", f"engine restarting ({reason}): {detail}{wait}", event=True))
    phase = Phase.DRAINING if drain and snap.child.alive else Phase.RESTARTING
    st = _to(
        st,
        phase,
        now,
        restart_reason=reason,
        next_start_at=now + delay,
        backoff_level=st.backoff_level + 1 if counts else st.backoff_level,
        restarts_total=st.restarts_total + 1,
        restarts_by_reason=tuple(sorted(by_reason.items())),
        last_restart_reason=reason,
        last_restart_at=now,
        old_tree=tuple(sorted(set(snap.child.tree_pids) | ({snap.child.pid} if snap.child.pid else set()))),
        tree_gone_at=None,
        ready_since=None,
        stop_due_at=now + grace if grace > 0 else None,
    )
    # Nothing left to stop: go straight on, so a crash is answered in this tick.
    return _resume(snap, st, cfg, now, actions) if snap.child.tree_gone else st


def _resume(snap, st, cfg, now, actions) -> PolicyState:
    """RESTARTING/DRAINING/BACKOFF: start the new engine once the old tree is gone and the delay is over."""
    child = snap.child
    if st.stop_due_at is not None:
        if child.alive and now < st.stop_due_at:
            return st
        if child.alive or child.tree_pids:
            actions.append(StopEngine(drain=child.alive, reason=st.restart_reason or "restart"))
        st = replace(st, stop_due_at=None)
    if not child.tree_gone:
        return st
    if st.tree_gone_at is None:
        st = replace(st, tree_gone_at=now)
    if snap.gpu.usable and snap.gpu.processes is not None and now - st.tree_gone_at < VRAM_RELEASE_WAIT_S:
        if {p.pid for p in snap.gpu.processes} & set(st.old_tree):
            return st  # the driver still lists the old tree as holding VRAM
    if st.maintenance or snap.gpu.lost or st.xid_seen:
        # Maintenance pauses remediation; a lost GPU or an XID error needs a reboot,
        # and starting vLLM again would only crash again.
        return st if st.phase is Phase.BACKOFF else _to(st, Phase.BACKOFF, now)
    if st.next_start_at is not None and now < st.next_start_at:
        return st if st.phase is Phase.BACKOFF else _to(st, Phase.BACKOFF, now)
    actions.append(StartEngine(reason=f"restart after {st.restart_reason}"))
    return _to(st, Phase.STARTING, now, generation=child.generation + 1, old_tree=(), watch=rules.WatchState())
