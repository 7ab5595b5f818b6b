"""The decision core: decide(snapshot, state, config, now) -> (actions, new_state).

Pure: no clock, no I/O, no live objects. Everything it knows arrives in the
frozen snapshot and the frozen PolicyState it returned last time; `now` is the
monotonic clock of the snapshot. Tests are tables of snapshots in and actions out.

The engine moves through phases:

    STOPPED --start--> STARTING --/health 200--> READY
    READY/STARTING --failure--> RESTARTING (old tree being stopped)
    RESTARTING --tree gone--> BACKOFF --delay over--> STARTING
    STARTING/young READY --too many start failures--> GIVEN_UP (engine stopped, daemon up)
    GIVEN_UP --r3090ctl restart--> STARTING (from zero failures)
    any --shutdown--> SHUTTING_DOWN --tree gone--> exit 0
    READY --r3090ctl suspend--> SUSPENDING --> SUSPENDED --r3090ctl resume--> RESUMING --> READY
          (r3090d.core.suspension: the stages, their failures and why no liveness rule runs there)

Restart semantics, as supervisord and Kubernetes' CrashLoopBackOff agree:
a *start failure* is an engine that never became ready, or failed within
`min_uptime` of becoming ready. Only consecutive start failures grow the
backoff and lead to a give-up (after `start_failures` of them, or after
`same_cause_failures` in a row with the same root-cause line). An engine that
was ready for `min_uptime` and then fails is restarted at once, for ever:
restarting is exactly what fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from r3090d import exitcodes
from r3090d.config import Config
from r3090d.core import alerting, rules, suspension
from r3090d.core.actions import (
    Action,
    Exit,
    RecordRestart,
    SendInferenceProbe,
    StartEngine,
    StopEngine,
    SuspendRecord,
)
from r3090d.core.snapshot import HealthStatus, Snapshot
from r3090d.core.suspension import Result, SuspendResult, Suspension
from r3090d.core.vocabulary import SUSPEND_PHASES, Phase, RestartKind, RestartReason, Severity

# How long to wait for NVML to stop listing processes of the old tree once
# psutil says they are gone, before starting the new engine anyway.
VRAM_RELEASE_WAIT_S = 30.0


@dataclass(frozen=True)
class PolicyState:
    phase: Phase = Phase.STOPPED
    phase_since: float = 0.0
    maintenance: bool = False
    generation: int = 0  # ChildSample.generation of the engine this state tracks
    ready_since: float | None = None
    next_start_at: float | None = None
    restart_reason: str | None = None  # why the current restart/backoff is happening
    start_failures: int = 0  # consecutive start failures: the backoff level and the give-up count
    same_cause_run: int = 0  # how many of those in a row had last_root_cause
    last_root_cause: str | None = None  # the root-cause line of the last failure, if the log had one
    backoff_level: int = 0  # the level the current (or last) restart waited at
    restart_times: tuple[float, ...] = ()  # unrequested restarts within restart_storm_window
    restarts_total: int = 0
    restarts_by_reason: tuple[tuple[str, int], ...] = ()
    last_restart_reason: str | None = None
    last_restart_at: float | None = None
    old_tree: tuple[int, ...] = ()  # pids of the engine being replaced
    stop_due_at: float | None = None  # DRAINING: the deferred drained StopEngine goes out then
    tree_gone_at: float | None = None
    give_up_reason: str | None = None  # set while GIVEN_UP; the gave_up alert fires until READY again
    gave_up_unresolved: bool = False  # a give-up whose alert has not yet resolved (engine not ready since)
    exit_code: int | None = None
    xid_seen: tuple[int, ...] = ()  # latched across restarts: only a reboot clears it
    watch: rules.WatchState = field(default_factory=rules.WatchState)
    blind: rules.Blindness = field(default_factory=rules.Blindness)
    alerts: alerting.AlertBook = field(default_factory=alerting.AlertBook)
    suspension: Suspension | None = None  # set while in SUSPEND_PHASES (and kept through a shutdown)
    suspend_last: SuspendResult | None = None  # how the operator's last suspend or resume ended


def initial_state(now: float) -> PolicyState:
    return PolicyState(phase=Phase.STOPPED, phase_since=now)


@dataclass(frozen=True)
class RestartHistory:
    """What one daemon hands on to the next through its state file, so that a crash, a kill or a restart
    of the daemon resets neither the restart_storm count nor the run of start failures toward a give-up."""

    restart_times: tuple[float, ...] = ()  # unrequested restarts, monotonic times of the new daemon's clock
    start_failures: int = 0
    same_cause_run: int = 0
    last_root_cause: str | None = None


def carry_on(st: PolicyState, history: RestartHistory, cfg: Config, now: float) -> PolicyState:
    """`st` going on from an earlier daemon's history: restarts outside restart_storm_window are dropped,
    and one stamped after `now` (the wall clock stepped back in between) counts as happening now."""
    window = cfg.watchdog.restart_storm_window
    failures = max(0, history.start_failures)
    return replace(
        st,
        restart_times=tuple(sorted(min(t, now) for t in history.restart_times if now - t < window)),
        start_failures=failures,
        same_cause_run=min(max(0, history.same_cause_run), failures),
        last_root_cause=history.last_root_cause,
    )


def suspended_state(record: SuspendRecord, now: float, since: float) -> PolicyState:
    """A daemon started with a suspension on record (state_dir/suspended.json): the engine stays down until resume."""
    return PolicyState(phase=Phase.SUSPENDED, phase_since=now, suspension=suspension.from_record(record, now, since))


def probes_engine(st: PolicyState) -> bool:
    """Whether this tick asks the engine's /health (the sampler's question)."""
    if st.phase in (Phase.STARTING, Phase.READY):
        return True
    return st.suspension is not None and st.suspension.stage in suspension.PROBED_STAGES


def lb_grace(cfg: Config) -> float:
    """How long a drained restart shows /healthz 503 before SIGTERM; nothing serves /healthz without the exporter."""
    return cfg.watchdog.lb_grace if cfg.daemon.exporter_enabled else 0.0


def backoff_delay(level: int, cfg: Config) -> float:
    """Delay before a restart after `level` consecutive start failures (level 0: at once)."""
    if level <= 0:
        return 0.0
    return min(cfg.watchdog.backoff_initial * 2 ** (level - 1), cfg.watchdog.backoff_max)


def decide(snap: Snapshot, st: PolicyState, cfg: Config, now: float) -> tuple[list[Action], PolicyState]:
    actions: list[Action] = []
    events: list[rules.Condition] = []
    if snap.maintenance is not None and snap.maintenance != st.maintenance:
        st = replace(st, maintenance=snap.maintenance)
    for key, seconds in snap.silences:
        st = replace(st, alerts=alerting.silence(st.alerts, key, now + seconds))
    if snap.gpu.xid_errors:
        st = replace(st, xid_seen=tuple(sorted(set(st.xid_seen) | set(snap.gpu.xid_errors))))
    window = cfg.watchdog.restart_storm_window
    st = replace(
        st,
        restart_times=tuple(t for t in st.restart_times if now - t < window),
        blind=rules.track_blindness(snap, st.blind, cfg, engine_ready=st.phase is Phase.READY),
    )
    st = _lifecycle(snap, st, cfg, now, actions, events)
    st = _unanswered(snap, st, now)
    watch = replace(st.watch, xid_seen=st.xid_seen)
    conds = rules.conditions(snap, watch, cfg, now, _lifecycle_facts(st, cfg, now), st.blind) + events
    conds += suspension.conditions(st.suspension, st.phase, snap, cfg, now)
    alert_actions, book = alerting.evaluate(conds, st.alerts, cfg, now)
    actions.extend(alert_actions)
    return actions, replace(st, alerts=book)


def _lifecycle_facts(st: PolicyState, cfg: Config, now: float) -> rules.LifecycleFacts:
    return rules.LifecycleFacts(
        phase=st.phase,
        backoff_remaining=(st.next_start_at - now) if st.phase is Phase.BACKOFF and st.next_start_at else None,
        restart_reason=st.restart_reason,
        give_up_reason=st.give_up_reason,
        gave_up_unresolved=st.gave_up_unresolved,
        recent_restarts=len(st.restart_times),
        root_cause=st.last_root_cause,
    )


def _to(st: PolicyState, phase: Phase, now: float, **changes) -> PolicyState:
    return replace(st, phase=phase, phase_since=now, **changes)


def _lifecycle(snap: Snapshot, st: PolicyState, cfg: Config, now: float, actions: list[Action], events: list) -> PolicyState:
    child = snap.child

    if snap.shutdown_requested and st.phase is not Phase.SHUTTING_DOWN:
        if child.alive or child.tree_pids:
            # A locked engine cannot drain: stop it at once. The suspension stays on
            # record (suspended.json): the next daemon keeps the engine down until resume.
            frozen = st.suspension is not None and st.suspension.stage in suspension.FROZEN_STAGES
            actions.append(StopEngine(drain=not frozen, reason="shutdown"))
        st = _to(st, Phase.SHUTTING_DOWN, now, exit_code=exitcodes.OK)

    if st.phase is Phase.SHUTTING_DOWN:
        if child.tree_gone:
            actions.append(Exit(code=st.exit_code if st.exit_code is not None else exitcodes.OK, reason="shutdown"))
        return st

    if st.phase is Phase.GIVEN_UP:
        return _given_up(snap, st, cfg, now, actions)

    if st.phase is Phase.STOPPED:
        actions.append(StartEngine(reason="initial start"))
        return _to(st, Phase.STARTING, now, generation=child.generation + 1, watch=rules.WatchState())

    if st.phase in (Phase.RESTARTING, Phase.DRAINING, Phase.BACKOFF):
        return _resume(snap, st, cfg, now, actions)

    if st.phase in SUSPEND_PHASES and st.suspension is not None:
        return _suspension(snap, st, cfg, now, actions, events)

    # STARTING or READY: the engine of st.generation should be running.
    if child.generation != st.generation:
        return st  # the spawn has not shown up in a sample yet
    if not child.alive:
        if child.spawn_error:
            return _fail(snap, st, cfg, now, actions, events, RestartReason.SPAWN_FAILED, child.spawn_error, drain=False)
        code = child.exit_code
        what = "exited during start" if st.phase is Phase.STARTING else "exited"
        # An exit we did not ask for is a failure whatever its code: vLLM can
        # exit 0 after its engine died.
        return _fail(snap, st, cfg, now, actions, events, RestartReason.EXITED, f"engine {what} with code {code}", drain=False)

    if st.phase is Phase.STARTING:
        if snap.health.status is HealthStatus.OK:
            return _to(st, Phase.READY, now, ready_since=now, gave_up_unresolved=False, watch=rules.WatchState(ready_at=now))
        if now - st.phase_since > cfg.engine.startup_timeout:
            return _fail(snap, st, cfg, now, actions, events, RestartReason.STARTUP_TIMEOUT, f"not ready after {cfg.engine.startup_timeout} s", drain=False)
        return st

    # READY
    if st.start_failures and _healthy_for(st, cfg, now):
        st = replace(st, start_failures=0, same_cause_run=0)
    watch, verdict = rules.assess(snap, st.watch, cfg, now)
    st = replace(st, watch=watch)
    if snap.restart_requested is not None:
        drain = snap.restart_requested != RestartKind.FAST
        return _restart(snap, st, cfg, now, actions, events, RestartReason.REQUESTED, "restart requested by operator", drain=drain, counts=False)
    if verdict is not None and not st.maintenance:
        return _fail(snap, st, cfg, now, actions, events, verdict.reason, verdict.detail, drain=verdict.drain)
    if snap.suspend_requested is not None:
        return _apply(snap, st, cfg, now, actions, events, suspension.begin(snap, cfg, now, snap.suspend_requested))
    if rules.probe_due(snap, st.watch, cfg, now) and not st.maintenance:
        actions.append(SendInferenceProbe())
    return st


def _healthy_for(st: PolicyState, cfg: Config, now: float) -> bool:
    """Ready for at least min_uptime: a failure now is not a start failure."""
    return st.phase is Phase.READY and st.ready_since is not None and now - st.ready_since >= cfg.watchdog.min_uptime


def _given_up(snap: Snapshot, st: PolicyState, cfg: Config, now: float, actions: list[Action]) -> PolicyState:
    """The engine stays stopped; the daemon keeps alerting, exporting and answering until asked to start again."""
    child = snap.child
    if cfg.daemon.exit_on_give_up:
        if child.tree_gone:
            actions.append(Exit(code=exitcodes.GAVE_UP, reason=st.give_up_reason or "gave up"))
        return st
    operator_restart = snap.restart_requested in (RestartKind.DRAIN, RestartKind.FAST)
    if operator_restart and child.tree_gone:
        # Nothing is serving, so there is nothing to drain: start again from zero failures.
        actions.append(StartEngine(reason="restart requested by operator after a give-up"))
        return _to(
            st,
            Phase.STARTING,
            now,
            generation=child.generation + 1,
            give_up_reason=None,
            start_failures=0,
            same_cause_run=0,
            backoff_level=0,
            old_tree=(),
            watch=rules.WatchState(),
        )
    return st


def _fail(snap, st, cfg, now, actions, events, reason, detail, *, drain) -> PolicyState:
    """A failure: restart, at once after a healthy period, else with backoff, or give up."""
    cause = snap.child.root_cause if not snap.child.alive else None
    if _healthy_for(st, cfg, now):
        st = replace(st, start_failures=0, same_cause_run=0, last_root_cause=cause)
        return _restart(snap, st, cfg, now, actions, events, reason, detail, drain=drain, counts=True, root_cause=cause)
    level = st.start_failures  # backoff before this restart: one step per earlier start failure in a row
    failures = st.start_failures + 1
    # Only a line that says why (an exception, an ERROR) can make two failures "the same cause".
    certain = cause is not None and snap.child.root_cause_certain
    same = st.same_cause_run + 1 if certain and cause == st.last_root_cause and st.start_failures else (1 if certain else 0)
    st = replace(st, start_failures=failures, same_cause_run=same, last_root_cause=cause)
    wd = cfg.watchdog
    if failures >= wd.start_failures or same >= wd.same_cause_failures:
        why = (
            f"{same} start failures in a row with the same cause"
            if same >= wd.same_cause_failures
            else f"{failures} start failures in a row"
        )
        why += f" (last: {reason}: {detail})"
        if cause:
            why += f"; root cause: {cause}"
        if snap.child.alive or snap.child.tree_pids:
            actions.append(StopEngine(drain=False, reason="gave up"))
        actions.append(RecordRestart(reason=reason, detail=detail, root_cause=cause))
        return _to(st, Phase.GIVEN_UP, now, give_up_reason=why, gave_up_unresolved=True, restart_reason=reason, ready_since=None)
    return _restart(snap, st, cfg, now, actions, events, reason, detail, drain=drain, counts=True, root_cause=cause, level=level)


def _restart(snap, st, cfg, now, actions, events, reason, detail, *, drain, counts, root_cause=None, level=0) -> PolicyState:
    delay = backoff_delay(level, cfg)
    by_reason = dict(st.restarts_by_reason)
    by_reason[reason] = by_reason.get(reason, 0) + 1
    actions.append(RecordRestart(reason=reason, detail=detail, root_cause=root_cause))
    # A drained restart first publishes DRAINING (/healthz 503) and holds the
    # SIGTERM for lb_grace, so the load balancer stops sending new requests.
    grace = lb_grace(cfg) if drain and snap.child.alive else 0.0
    if (snap.child.alive or snap.child.tree_pids) and grace <= 0:
        actions.append(StopEngine(drain=drain and snap.child.alive, reason=reason))
    wait = f", next start in {delay:.0f} s" if delay else ""
    cause = f"; root cause: {root_cause}" if root_cause else ""
    events.append(rules.Condition("engine_restarted", True, Severity.WARNING, f"engine restarting ({reason}): {detail}{cause}{wait}", event=True))
    phase = Phase.DRAINING if drain and snap.child.alive else Phase.RESTARTING
    st = _to(
        st,
        phase,
        now,
        restart_reason=reason,
        next_start_at=now + delay,
        backoff_level=level,
        restart_times=st.restart_times + ((now,) if counts else ()),
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


# ------------------------------------------------------------------ suspend/resume


def _suspension(snap, st, cfg, now, actions, events) -> PolicyState:
    """SUSPENDING, SUSPENDED, RESUMING: the stage machine of r3090d.core.suspension, and nothing else."""
    return _apply(snap, st, cfg, now, actions, events, suspension.advance(st.suspension, snap, cfg, now, lb_grace(cfg)))


def _apply(snap, st, cfg, now, actions, events, move: suspension.Move) -> PolicyState:
    actions.extend(move.actions)
    if move.event is not None:
        events.append(move.event)
    if move.result is not None:
        st = replace(st, suspend_last=move.result)
    if move.fail is not None:
        reason, detail = move.fail
        st = replace(st, suspension=None)
        return _restart(snap, st, cfg, now, actions, events, reason, detail, drain=False, counts=True)
    if move.start_cold:
        actions.append(StartEngine(reason="resume of a suspension without an engine"))
        return _to(st, Phase.STARTING, now, generation=snap.child.generation + 1, suspension=None, old_tree=(), watch=rules.WatchState())
    if move.phase is st.phase:
        return replace(st, suspension=move.suspension)
    if move.phase is Phase.READY:
        # Nothing that stood still during the suspension may read as a stall: the watch starts afresh.
        return _to(st, Phase.READY, now, suspension=None, ready_since=now, watch=rules.WatchState(ready_at=now))
    return _to(st, move.phase, now, suspension=move.suspension)


def _unanswered(snap: Snapshot, st: PolicyState, now: float) -> PolicyState:
    """A suspend or resume the phase could not take up (the reply was sent earlier in this loop turn) is refused."""
    for op, request in (("suspend", snap.suspend_requested), ("resume", snap.resume_requested)):
        taken = (st.suspension is not None and st.suspension.request == request) or (st.suspend_last is not None and st.suspend_last.request == request)
        if request is not None and not taken:
            why = f"the engine is {st.phase.value}"
            st = replace(st, suspend_last=SuspendResult(request, op, Result.REFUSED, why, now))
    return st
