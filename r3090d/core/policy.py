"""The decision core: decide(snapshot, state, config, now) -> (actions, new_state).

Pure: no clock, no I/O, no live objects. Everything it knows arrives in the
frozen snapshot and the frozen PolicyState it returned last time; `now` is the
monotonic clock of the snapshot. Tests are tables of snapshots in and actions out.

The engine moves through phases:

    STOPPED --start--> STARTING --/health 200--> READY
    READY/STARTING --failure--> RESTARTING (old tree being stopped)
    RESTARTING --tree gone--> BACKOFF --delay over--> STARTING
    STARTING/young READY --too many start failures--> GIVEN_UP (engine stopped, daemon up)
    GIVEN_UP --r3090ctl restart, or watchdog.give_up_retry later--> STARTING
    any start --the card needs a reset--> RESET_NEEDED --r3090ctl restart--> STARTING
    any automatic start (the first one too) --others hold the card--> WAITING_FOR_GPU --room--> STARTING
    any --shutdown--> SHUTTING_DOWN --tree gone--> exit 0
    READY --r3090ctl suspend--> SUSPENDING --> SUSPENDED --r3090ctl resume--> RESUMING --> READY
          (r3090d.core.suspension: the stages, their failures and why no liveness rule runs there)

Restart semantics: a start *succeeds* once the engine has served (vLLM counts a
request completed with finish reason stop, length or repetition, beyond the
daemon's own probes; a pooling request finishes as stop) or has been ready for
`min_uptime`, whichever comes first, judged before a death seen in the same tick.
A *start failure* is an engine that died before either. Only consecutive start
failures grow the backoff and lead to a give-up (after `start_failures` of them,
or after `same_cause_failures` in a row with the same root-cause line). An
engine whose start succeeded and then fails is restarted at once, for ever:
restarting is exactly what fixes it; only the same certain root cause again and
again backs off (capped), and never gives up; an engine healthy for `min_uptime`
ends that run. A give-up retries by itself every
`watchdog.give_up_retry` seconds.

Every start passes one gate (`start_gate`): no start while the card needs a
reset (an XID of the reset class, or the driver's recovery action), while the
GPU is lost or in maintenance, or (automatic starts) while processes outside the
engine hold the room it needs. A start after an engine's death first waits for
an NVML reading taken after the death, so an XID that arrives with it is seen.

The fast freeze detectors (gpu_idle, the passive stall) widen their own window
when they restart an engine that then trips them again before succeeding:
doubled each time, up to 8x, back to 1x once an engine has been healthy for
`min_uptime`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from r3090d import exitcodes
from r3090d.config.schema import Config
from r3090d.core import alerting, canary, rules, suspension
from r3090d.core.actions import (
    Action,
    Exit,
    RecordRestart,
    RequestGpuSample,
    SaveSuspension,
    SendInferenceProbe,
    StartEngine,
    StopEngine,
    SuspendRecord,
)
from r3090d.core.room import Room, engine_room
from r3090d.core.rootcause import nothing_says_why
from r3090d.core.snapshot import HealthStatus, Snapshot
from r3090d.core.suspension import Result, SuspendResult, Suspension
from r3090d.core.vocabulary import FAST_DETECTORS, SUSPEND_PHASES, Phase, RestartKind, RestartReason, Severity
from r3090d.core.xid import HOLDING_ACTIONS, RESET_PROCEDURE, ResetHold, XidClass, classify, describe

# How long to wait for NVML to stop listing processes of the old tree once
# psutil says they are gone, before starting the new engine anyway.
VRAM_RELEASE_WAIT_S = 30.0
# How long a start after a death waits for an NVML reading taken after it, at most.
FRESH_SAMPLE_WAIT_S = 10.0
# How far the fast freeze detectors' windows may widen, and the config key of each one's window.
MAX_DETECTOR_SCALE = 8
DETECTOR_WINDOW_KEYS = {RestartReason.GPU_IDLE: "gpu_idle_stall_seconds", RestartReason.STALLED: "stall_seconds"}


@dataclass(frozen=True)
class PolicyState:
    phase: Phase = Phase.STOPPED
    phase_since: float = 0.0
    maintenance: bool = False
    generation: int = 0  # ChildSample.generation of the engine this state tracks
    ready_since: float | None = None
    next_start_at: float | None = None
    restart_reason: str | None = None  # why the current restart/backoff is happening
    succeeded: bool = False  # this engine's start succeeded: it served, or was ready for min_uptime
    served_base: float | None = None  # completed requests (net of our probes) when this engine was first read READY
    death_at: float | None = None  # when the last engine's death was seen: a start waits for NVML after it
    recovered_same_cause: int = 0  # deaths after a successful start in a row with one certain root cause
    detector_scale: tuple[tuple[RestartReason, int], ...] = ()  # fast detectors' widened windows (absent: 1x)
    restarted_by: RestartReason | None = None  # the fast detector that restarted the engine now starting
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
    retry_at: float | None = None  # GIVEN_UP: when watchdog.give_up_retry tries a start by itself
    retry_attempts: int = 0  # automatic starts since the give-up
    retrying: bool = False  # the engine starting now is such an attempt: a failure returns to GIVEN_UP
    start_pending: str | None = None  # a start asked for (its reason), waiting for the old tree to go
    exit_code: int | None = None
    xid_seen: tuple[int, ...] = ()  # every XID seen since the daemon started, for status (it holds nothing)
    xid_counts: tuple[tuple[XidClass, int], ...] = ()  # XIDs seen, by class
    reset_hold: ResetHold | None = None  # the card needs a reset: no start until r3090ctl restart or a reboot
    gpu_wait: Room | None = None  # WAITING_FOR_GPU: the room the start waits for, and who holds it
    cold_after: bool = False  # DRAINING in swap mode: once the tree is gone the engine stays COLD (no restart)

    @property
    def given_up(self) -> bool:
        """The give-up stands (the gave_up alert, the exporter's gauge): through automatic attempts, until one succeeds."""
        return self.phase is Phase.GIVEN_UP or self.gave_up_unresolved
    watch: rules.WatchState = field(default_factory=rules.WatchState)
    blind: rules.Blindness = field(default_factory=rules.Blindness)
    alerts: alerting.AlertBook = field(default_factory=alerting.AlertBook)
    suspension: Suspension | None = None  # set while in SUSPEND_PHASES (and kept through a shutdown)
    suspend_last: SuspendResult | None = None  # how the operator's last suspend or resume ended
    canary: canary.CanaryState = field(default_factory=canary.CanaryState)


def initial_state(now: float, *, cold: bool = False) -> PolicyState:
    """STOPPED starts an engine at the first tick; COLD (swap mode) waits for the arbiter."""
    return PolicyState(phase=Phase.COLD if cold else Phase.STOPPED, phase_since=now)


@dataclass(frozen=True)
class RestartHistory:
    """What one daemon hands on to the next through its state file, so that a crash, a kill or a restart
    of the daemon resets neither the restart_storm count, nor the run of start failures toward a give-up,
    nor the count of the engine's restarts that `status` and the exporter show."""

    restart_times: tuple[float, ...] = ()  # unrequested restarts, monotonic times of the new daemon's clock
    start_failures: int = 0
    same_cause_run: int = 0
    last_root_cause: str | None = None
    restarts_total: int = 0
    restarts_by_reason: tuple[tuple[str, int], ...] = ()
    last_restart_reason: str | None = None
    last_restart_at: float | None = None  # monotonic, of the new daemon's clock


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
        restarts_total=max(0, history.restarts_total),
        restarts_by_reason=tuple(sorted((reason, n) for reason, n in history.restarts_by_reason if n > 0)),
        last_restart_reason=history.last_restart_reason,
        last_restart_at=None if history.last_restart_at is None else min(history.last_restart_at, now),
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


def decide(snap: Snapshot, st: PolicyState, cfg: Config, now: float, *, card: bool = True,
           arbitrated: bool = False) -> tuple[list[Action], PolicyState]:  # fmt: skip
    """One tick of one engine. `card`: also judge the GPU itself (XIDs, the reset hold, the GPU's alerts); swap mode
    runs several engines on one card and judges the card once, in core.card, handing the reset hold to each engine.

    `arbitrated` (swap mode): an engine that is not on the card starts only when the arbiter says so
    (`start_requested`). A give-up's retry, the operator's restart and a cleared reset hold leave it COLD, where it
    is demand for the arbiter like any other: a start straight through its own policy could find the card held by
    the resident engine and wait there for ever, with the arbiter waiting for it."""
    actions: list[Action] = []
    events: list[rules.Condition] = []
    if snap.maintenance is not None and snap.maintenance != st.maintenance:
        st = replace(st, maintenance=snap.maintenance)
    for key, seconds in snap.silences:
        st = replace(st, alerts=alerting.silence(st.alerts, key, now + seconds))
    if card:
        st = gpu_faults(snap, st, cfg, events)
    window = cfg.watchdog.restart_storm_window
    st = replace(
        st,
        restart_times=tuple(t for t in st.restart_times if now - t < window),
        blind=rules.track_blindness(snap, st.blind, cfg, engine_ready=st.phase is Phase.READY),
    )
    st = _lifecycle(snap, st, cfg, now, actions, events, arbitrated)
    st = _unanswered(snap, st, now)
    conds = rules.conditions(snap, st.watch, cfg, now, _lifecycle_facts(st, cfg, now), st.blind, card=card) + events
    conds += ([reset_condition(st.reset_hold)] if card else []) + _hold_conditions(st, cfg)
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
        given_up=st.given_up,
        recent_restarts=len(st.restart_times),
        root_cause=st.last_root_cause,
        retry_in=(st.retry_at - now) if st.retry_at is not None else None,
        exits_on_give_up=cfg.daemon.exit_on_give_up,
    )


def _to(st: PolicyState, phase: Phase, now: float, **changes) -> PolicyState:
    return replace(st, phase=phase, phase_since=now, **changes)


# ------------------------------------------------------------------ GPU faults


def gpu_faults(snap: Snapshot, st, cfg: Config, events: list):
    """XIDs and the driver's recovery action: alerts by class; the reset class holds starts.

    `st` is the PolicyState, or swap mode's CardState: both carry xid_seen, xid_counts and reset_hold."""
    g = snap.gpu
    if not cfg.gpu.required:
        return st
    counts = dict(st.xid_counts)
    for xid in g.xid_errors:
        info = classify(xid)
        counts[info.cls] = counts.get(info.cls, 0) + 1
        if info.cls is XidClass.RESET:
            if st.reset_hold is None:
                st = replace(st, reset_hold=ResetHold(describe(xid), snap.wall))
        elif info.cls is XidClass.ROW_REMAP:
            events.append(rules.Condition("gpu_xid_row_remap", True, Severity.WARNING,
                                          f"{describe(xid)}: reset the GPU at a convenient time; the engine keeps serving", event=True))  # fmt: skip
        elif info.cls is XidClass.UNKNOWN:
            events.append(rules.Condition("gpu_xid_unknown", True, Severity.CRITICAL,
                                          f"unknown XID {xid}: not in r3090d's table; an engine that fails is restarted", event=True))  # fmt: skip
        else:
            events.append(rules.Condition("gpu_xid_application", True, Severity.WARNING,
                                          f"{describe(xid)}: an application-level fault; an engine that fails is restarted", event=True))  # fmt: skip
    if g.xid_errors:
        st = replace(st, xid_seen=tuple(sorted(set(st.xid_seen) | set(g.xid_errors))),
                     xid_counts=tuple(sorted(counts.items())))  # fmt: skip
    if g.recovery_action in HOLDING_ACTIONS and st.reset_hold is None:
        st = replace(st, reset_hold=ResetHold(f"the driver's recovery action is {g.recovery_action.text}", snap.wall))
    return st


def reset_condition(hold: ResetHold | None) -> rules.Condition:
    return rules.Condition(
        "gpu_reset_needed", hold is not None, Severity.CRITICAL,
        f"the GPU needs a reset: {hold.reason}; no engine starts until then: {RESET_PROCEDURE}" if hold
        else "the GPU reset hold is cleared", immediate=True,
    )  # fmt: skip


def _hold_conditions(st: PolicyState, cfg: Config) -> list[rules.Condition]:
    out = [_widened_condition(st, cfg)]
    wait = st.gpu_wait if st.phase is Phase.WAITING_FOR_GPU else None
    out.append(rules.Condition(
        "gpu_room", wait is not None, Severity.WARNING,
        f"the engine waits for GPU memory: {wait.text()}; it starts once they let go" if wait
        else "the GPU has room for the engine again", immediate=True,
    ))  # fmt: skip
    return out


# ------------------------------------------------------------------ the start gate


@dataclass(frozen=True)
class Gate:
    """Why a start must wait: the phase to wait in, and (WAITING_FOR_GPU) the room it waits for."""

    phase: Phase
    room: Room | None = None


def start_gate(snap: Snapshot, st: PolicyState, cfg: Config, now: float, *, automatic: bool) -> Gate | None:
    """None when an engine may start now; else where to wait.

    Every start passes here: the first, a restart, the start after a give-up (by the
    operator or by give_up_retry), and the cold start of a resumed suspension.
    """
    g = snap.gpu
    if st.reset_hold is not None:
        return Gate(Phase.RESET_NEEDED)
    if st.maintenance or g.lost:
        # Maintenance pauses remediation; a lost GPU would only crash the new engine.
        return Gate(Phase.BACKOFF)
    if not cfg.gpu.required or not automatic:
        return None
    if _reading_predates_death(st, snap) and now - st.death_at < FRESH_SAMPLE_WAIT_S:
        return Gate(st.phase)  # an NVML reading after the death first (asked for by _start)
    room = engine_room(g, cfg, snap.child.tree_pids, snap.process_names)
    if room is not None and not room.fits and room.holders:
        return Gate(Phase.WAITING_FOR_GPU, room)
    return None


def _reading_predates_death(st: PolicyState, snap: Snapshot) -> bool:
    g = snap.gpu
    return st.death_at is not None and g.usable and g.taken_at is not None and g.taken_at < st.death_at


def _start(snap, st, cfg, now, actions, reason: str, *, automatic: bool, **changes) -> PolicyState:
    """Start an engine through the gate, or wait where the gate says."""
    st = replace(st, **changes) if changes else st
    gate = start_gate(snap, st, cfg, now, automatic=automatic)
    if gate is not None:
        if _reading_predates_death(st, snap):
            actions.append(RequestGpuSample())
        st = replace(st, gpu_wait=gate.room, start_pending=reason)
        return st if st.phase is gate.phase else _to(st, gate.phase, now)
    actions.append(StartEngine(reason=reason))
    return _to(
        st, Phase.STARTING, now,
        generation=snap.child.generation + 1, old_tree=(), start_pending=None, gpu_wait=None, death_at=None,
        succeeded=False, served_base=None, watch=_fresh_watch(st), canary=st.canary.fresh(),
    )  # fmt: skip


def _fresh_watch(st: PolicyState, ready_at: float | None = None) -> rules.WatchState:
    return _scaled(rules.WatchState(ready_at=ready_at), st.detector_scale)


def _scaled(watch: rules.WatchState, detector_scale: tuple[tuple[RestartReason, int], ...]) -> rules.WatchState:
    """The watch with the fast detectors' windows as the policy has widened them (absent: 1x)."""
    scale = dict(detector_scale)
    return replace(watch, gpu_idle_scale=scale.get(RestartReason.GPU_IDLE, 1), stall_scale=scale.get(RestartReason.STALLED, 1))


# ------------------------------------------------------------------ the lifecycle


def _lifecycle(snap: Snapshot, st: PolicyState, cfg: Config, now: float, actions: list[Action], events: list,
               arbitrated: bool = False) -> PolicyState:  # fmt: skip
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
        return _given_up(snap, st, cfg, now, actions, arbitrated)

    if st.phase is Phase.STOPPED:
        # The first start passes the gate as an automatic start: a card held by others at boot waits in
        # WAITING_FOR_GPU (the daemon up, the holders named), not in preflight until it exits 75.
        return _start(snap, st, cfg, now, actions, "initial start", automatic=True)

    if st.phase is Phase.COLD:
        # Swap mode: the arbiter brings the engine in when its model is asked for (or the operator restarts it).
        if snap.start_requested or (snap.restart_requested is not None and not arbitrated):
            # The card has just changed (another engine parked or stopped for this one): its room is judged on an
            # NVML reading taken after the ask, as after a death, not on one that still shows the engine that left.
            reason = "brought in for its model" if snap.start_requested else "started by operator"
            return _start(snap, st, cfg, now, actions, reason, automatic=True, death_at=st.death_at if st.death_at is not None else now)
        return st

    if st.phase is Phase.RESET_NEEDED:
        if snap.restart_requested is not None:
            # The operator has reset the card (or decided to try): the hold is cleared.
            st = replace(st, reset_hold=None, start_failures=0, same_cause_run=0, next_start_at=None)
            if arbitrated:
                return _to(st, Phase.COLD, now, start_pending=None)
            return _start(snap, st, cfg, now, actions, "restart requested by operator after a GPU reset", automatic=False)
        if arbitrated:
            return st if st.reset_hold is not None else _to(st, Phase.COLD, now, start_pending=None)
        return _start(snap, st, cfg, now, actions, st.start_pending or "restart", automatic=True)

    if st.phase is Phase.WAITING_FOR_GPU and arbitrated and snap.stop_cold_requested is not None:
        # The arbiter gives its place to another model: nothing runs yet, nothing to stop.
        return _to(st, Phase.COLD, now, start_pending=None, gpu_wait=None)

    if st.phase is Phase.WAITING_FOR_GPU:
        operator = snap.restart_requested is not None and not arbitrated  # the operator's word: start now, room or not
        reason = "restart requested by operator while waiting for the GPU" if operator else st.start_pending or "restart"
        return _start(snap, st, cfg, now, actions, reason, automatic=not operator)

    if st.phase in (Phase.RESTARTING, Phase.DRAINING, Phase.BACKOFF):
        return _resume(snap, st, cfg, now, actions)

    if st.phase in SUSPEND_PHASES and st.suspension is not None:
        return _suspension(snap, st, cfg, now, actions, events)

    # STARTING or READY: the engine of st.generation should be running.
    if child.generation != st.generation:
        return st  # the spawn has not shown up in a sample yet
    if st.phase is Phase.READY:
        # Before the death, if any: an engine that served its first request and died in one poll had succeeded.
        st = _track_success(snap, st, cfg, now)
    if not child.alive:
        if child.spawn_error:
            return _fail(snap, st, cfg, now, actions, events, RestartReason.SPAWN_FAILED, child.spawn_error, drain=False)
        code = child.exit_code
        what = "exited during start" if st.phase is Phase.STARTING else "exited"
        # An exit we did not ask for is a failure whatever its code: vLLM can
        # exit 0 after its engine died.
        return _fail(snap, st, cfg, now, actions, events, RestartReason.EXITED, f"engine {what} with code {code}{nothing_says_why(child.root_cause, child.last_log_line)}", drain=False)

    if st.phase is Phase.STARTING:
        if snap.health.status is HealthStatus.OK:
            cleared = {} if st.retrying else {"gave_up_unresolved": False}
            base, _ = served_since_ready(snap, replace(st, served_base=None))  # this tick's /metrics, read with /health's 200
            return _to(st, Phase.READY, now, ready_since=now, served_base=base, watch=_fresh_watch(st, ready_at=now), **cleared)
        if now - st.phase_since > cfg.engine.startup_timeout:
            return _fail(snap, st, cfg, now, actions, events, RestartReason.STARTUP_TIMEOUT, f"not ready after {cfg.engine.startup_timeout} s", drain=False)
        return st

    # READY
    watch, verdict = rules.assess(snap, st.watch, cfg, now)
    st = replace(st, watch=watch)
    if snap.restart_requested is not None:
        drain = snap.restart_requested != RestartKind.FAST
        return _restart(snap, st, cfg, now, actions, events, RestartReason.REQUESTED, "restart requested by operator", drain=drain, counts=False)
    if verdict is not None and not st.maintenance:
        return _fail(snap, st, cfg, now, actions, events, verdict.reason, verdict.detail, drain=verdict.drain)
    if snap.stop_cold_requested is not None:
        # Swap mode: stopped drained to make room for another model, and left cold (not restarted).
        # Drained while its /metrics shows requests (or says nothing); idle, a fast stop: vLLM's own drained
        # shutdown of an idle engine still takes seconds, and every one of them is the next model's wait.
        idle = snap.metrics.error is None and snap.metrics.in_engine == 0
        actions.append(StopEngine(drain=not idle, reason=snap.stop_cold_requested))
        return _to(st, Phase.DRAINING, now, restart_reason=snap.stop_cold_requested, cold_after=True, tree_gone_at=None, ready_since=None,
                   old_tree=tuple(sorted(set(snap.child.tree_pids) | ({snap.child.pid} if snap.child.pid else set()))))  # fmt: skip
    if snap.suspend_requested is not None:
        move = suspension.begin(snap, cfg, now, snap.suspend_requested, st.canary.baseline, baseline_for=st.canary.baseline_for, parked=snap.park,
                                by_sleep=snap.park and snap.park_by_sleep)  # fmt: skip
        return _apply(snap, st, cfg, now, actions, events, move)
    check = canary.step(st.canary, snap, cfg, now, maintenance=st.maintenance)
    st = replace(st, canary=check.state)
    actions.extend(check.actions)
    events.extend(check.events)
    if check.restart is not None:
        # Wrong answers are worse than none: stop at once, no drain.
        return _fail(snap, st, cfg, now, actions, events, RestartReason.WRONG_OUTPUT, check.restart, drain=False)
    if rules.probe_due(snap, st.watch, cfg, now) and not st.maintenance:
        actions.append(SendInferenceProbe())
    return st


def _healthy_for(st: PolicyState, cfg: Config, now: float) -> bool:
    """Ready for at least min_uptime."""
    return st.phase is Phase.READY and st.ready_since is not None and now - st.ready_since >= cfg.watchdog.min_uptime


def served_since_ready(snap: Snapshot, st: PolicyState) -> tuple[float | None, bool]:
    """(the baseline, whether the engine completed a request of its own clients since it was first read READY).

    vLLM's completed requests (stop, length, repetition; a pooling request finishes as stop) less the daemon's
    own: every probe sent, but those that ended without an answer (vLLM never completes them), so that the
    daemon's own requests never count as the engine having served, and a probe lost for good hides no client's.
    """
    served = snap.metrics.served_total
    if served is None or snap.metrics.error is not None:
        return st.served_base, False
    own = snap.inference.sent_total - snap.inference.unanswered_total + snap.canary.sent_total - snap.canary.unanswered_total
    net = served - own
    if st.served_base is None:
        return net, False
    return st.served_base, net > st.served_base


def _track_success(snap: Snapshot, st: PolicyState, cfg: Config, now: float) -> PolicyState:
    """READY: a start succeeds once the engine served or was ready for min_uptime; after min_uptime, widened
    detectors narrow and the same-cause backoff starts afresh (the same cause weeks apart is not a run)."""
    if not st.succeeded:
        base, served = served_since_ready(snap, st)
        st = replace(st, served_base=base)
        if served or _healthy_for(st, cfg, now):
            st = replace(st, succeeded=True, start_failures=0, same_cause_run=0, backoff_level=0, retrying=False,
                         retry_at=None, retry_attempts=0, gave_up_unresolved=False, give_up_reason=None)  # fmt: skip
    if st.detector_scale and _healthy_for(st, cfg, now):
        st = replace(st, detector_scale=(), watch=_scaled(st.watch, ()))
    if st.recovered_same_cause and _healthy_for(st, cfg, now):
        st = replace(st, recovered_same_cause=0)
    return st


def _given_up(snap: Snapshot, st: PolicyState, cfg: Config, now: float, actions: list[Action], arbitrated: bool = False) -> PolicyState:
    """The engine stays stopped; the daemon keeps alerting, exporting and answering until asked to start again."""
    child = snap.child
    if cfg.daemon.exit_on_give_up:
        if child.tree_gone:
            actions.append(Exit(code=exitcodes.GAVE_UP, reason=st.give_up_reason or "gave up"))
        return st
    operator_restart = snap.restart_requested in (RestartKind.DRAIN, RestartKind.FAST)
    if operator_restart:
        # Nothing is serving, so there is nothing to drain: start again from zero failures.
        # The operator's word also clears a reset hold: they have looked at the card.
        st = replace(st, start_pending="restart requested by operator after a give-up", reset_hold=None, retrying=False)
    elif st.start_pending is None and st.retry_at is not None and now >= st.retry_at:
        st = replace(st, start_pending=f"automatic retry {st.retry_attempts + 1} after a give-up", retrying=True,
                     retry_attempts=st.retry_attempts + 1, retry_at=None)  # fmt: skip
    if st.start_pending is None:
        return st
    if not child.tree_gone:
        # What is left of the old tree goes first, as in a fast stop; the start follows.
        if (child.alive or child.tree_pids) and not child.stopping:
            actions.append(StopEngine(drain=False, reason="start after a give-up"))
        return st
    changes = dict(start_failures=0, same_cause_run=0, backoff_level=0)
    if not st.retrying:
        changes.update(give_up_reason=None, retry_at=None, retry_attempts=0)
    if arbitrated:
        # Cold, and no longer failed: the arbiter brings it in when its model is asked for (a retry's failure
        # gives up again).
        return _to(st, Phase.COLD, now, start_pending=None, **changes)
    # The gate may hold it (a reset, a held card): it then waits in that phase, the give-up's alert still standing.
    return _start(snap, st, cfg, now, actions, st.start_pending, automatic=st.retrying, **changes)


def _fail(snap, st, cfg, now, actions, events, reason, detail, *, drain) -> PolicyState:
    """A failure: restart, at once after a successful start, else with backoff, or give up."""
    cause = snap.child.root_cause if not snap.child.alive else None
    certain = cause is not None and snap.child.root_cause_certain
    if not snap.child.alive:
        st = replace(st, death_at=snap.child.exited_at if snap.child.exited_at is not None else now)
    st = _widen_detector(st, reason)
    if st.succeeded or _healthy_for(st, cfg, now):
        # A recoverable failure: restart at once, for ever; the same certain cause again and again backs off, capped.
        run = _same_cause(st.recovered_same_cause, st, cause, certain)
        st = replace(st, start_failures=0, same_cause_run=0, last_root_cause=cause, recovered_same_cause=run)
        return _restart(snap, st, cfg, now, actions, events, reason, detail, drain=drain, counts=True, root_cause=cause, level=max(0, run - 1))
    cause_text = f"; root cause: {cause}" if cause else ""
    if st.retrying:
        why = f"automatic retry {st.retry_attempts} failed ({reason}: {detail}){cause_text}"
        return _give_up(snap, st, cfg, now, actions, reason, detail, cause, why, retrying=False, last_root_cause=cause)
    level = st.start_failures  # backoff before this restart: one step per earlier start failure in a row
    failures = st.start_failures + 1
    same = _same_cause(st.same_cause_run if st.start_failures else 0, st, cause, certain)
    st = replace(st, start_failures=failures, same_cause_run=same, last_root_cause=cause, recovered_same_cause=0)
    wd = cfg.watchdog
    if failures >= wd.start_failures or same >= wd.same_cause_failures:
        count = f"{same} start failures in a row with the same cause" if same >= wd.same_cause_failures else f"{failures} start failures in a row"
        return _give_up(snap, st, cfg, now, actions, reason, detail, cause, f"{count} (last: {reason}: {detail}){cause_text}", retry_attempts=0)
    return _restart(snap, st, cfg, now, actions, events, reason, detail, drain=drain, counts=True, root_cause=cause, level=level)


def _same_cause(run: int, st: PolicyState, cause: str | None, certain: bool) -> int:
    """A run of failures with one root cause, `run` long before this one. Only a line that says why
    (an exception, an ERROR, a signal) can make two failures "the same cause"."""
    if not certain:
        return 0
    return run + 1 if run and cause == st.last_root_cause else 1


def _give_up(snap, st, cfg, now, actions, reason, detail, cause, why: str, **changes) -> PolicyState:
    """GIVEN_UP: stop what is left of the engine, record the failure; the next automatic attempt in give_up_retry."""
    if snap.child.alive or snap.child.tree_pids:
        actions.append(StopEngine(drain=False, reason="gave up"))
    actions.append(RecordRestart(reason=reason, detail=detail, root_cause=cause))
    wd = cfg.watchdog
    retry_at = now + wd.give_up_retry if wd.give_up_retry > 0 and not cfg.daemon.exit_on_give_up else None
    return _to(st, Phase.GIVEN_UP, now, give_up_reason=why, gave_up_unresolved=True, restart_reason=reason, ready_since=None,
               retry_at=retry_at, start_pending=None, **changes)  # fmt: skip


def _widen_detector(st: PolicyState, reason: str) -> PolicyState:
    """A fast detector that trips again on the engine it restarted, before that engine succeeded, doubles its window."""
    detector = RestartReason(reason) if reason in FAST_DETECTORS else None
    if detector is not None and st.restarted_by is detector and not st.succeeded:
        scales = dict(st.detector_scale)
        scales[detector] = min(scales.get(detector, 1) * 2, MAX_DETECTOR_SCALE)
        st = replace(st, detector_scale=tuple(sorted(scales.items())))
    return replace(st, restarted_by=detector)


def _widened_condition(st: PolicyState, cfg: Config) -> rules.Condition:
    """Held while a fast detector runs widened: one alert, whose reminders carry the current windows."""
    parts = []
    for detector, scale in st.detector_scale:
        key = DETECTOR_WINDOW_KEYS[detector]
        seconds = getattr(cfg.watchdog, key)
        parts.append(f"{detector.value} fired again on engines it had restarted before they served: its window is "
                     f"{seconds * scale:g} s, {scale}x watchdog.{key} = {seconds:g} s")  # fmt: skip
    if parts:
        keys = " or ".join(f"watchdog.{DETECTOR_WINDOW_KEYS[d]}" for d, _ in st.detector_scale)
        text = "; ".join(parts) + f"; if the workload legitimately idles that long, raise {keys}"
    else:
        text = "the fast freeze detectors are back to their configured windows"
    return rules.Condition("detector_widened", bool(parts), Severity.WARNING, text, immediate=True)


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
    if st.cold_after:
        return _to(st, Phase.COLD, now, cold_after=False, restart_reason=None, tree_gone_at=None, old_tree=())
    if st.tree_gone_at is None:
        st = replace(st, tree_gone_at=now, death_at=st.death_at if st.death_at is not None else now)
    if snap.gpu.usable and snap.gpu.processes is not None and now - st.tree_gone_at < VRAM_RELEASE_WAIT_S:
        if {p.pid for p in snap.gpu.processes} & set(st.old_tree):
            return st  # the driver still lists the old tree as holding VRAM
    if st.next_start_at is not None and now < st.next_start_at:
        return st if st.phase is Phase.BACKOFF else _to(st, Phase.BACKOFF, now)
    return _start(snap, st, cfg, now, actions, f"restart after {st.restart_reason}", automatic=True)


# ------------------------------------------------------------------ suspend/resume


def _suspension(snap, st, cfg, now, actions, events) -> PolicyState:
    """SUSPENDING, SUSPENDED, RESUMING: the stage machine of r3090d.core.suspension, and nothing else
    (but swap mode's eviction of a parked engine to make room in host memory)."""
    if snap.stop_cold_requested is not None and st.suspension.stage is suspension.Stage.SUSPENDED:
        # Its GPU memory is in its host RAM and its process frozen: nothing to drain, stop it at once.
        if snap.child.alive or snap.child.tree_pids:
            actions.append(StopEngine(drain=False, reason=snap.stop_cold_requested))
        actions.append(SaveSuspension(None))
        return _to(st, Phase.DRAINING, now, suspension=None, restart_reason=snap.stop_cold_requested, cold_after=True,
                   tree_gone_at=None, old_tree=tuple(snap.child.tree_pids))  # fmt: skip
    if st.reset_hold is not None and snap.resume_requested is not None:
        snap = replace(snap, resume_requested=None)  # refused below (_unanswered): the card needs a reset first
    return _apply(snap, st, cfg, now, actions, events, suspension.advance(st.suspension, snap, cfg, now, lb_grace(cfg)))


def _apply(snap, st, cfg, now, actions, events, move: suspension.Move) -> PolicyState:
    actions.extend(move.actions)
    if move.event is not None:
        events.append(move.event)
    if move.result is not None:
        st = replace(st, suspend_last=move.result)
    if move.compared is not None:
        st = replace(st, canary=st.canary.counted(move.compared, snap.wall))
    if move.fail is not None:
        reason, detail = move.fail
        st = replace(st, suspension=None)
        return _restart(snap, st, cfg, now, actions, events, reason, detail, drain=False, counts=True)
    if move.stop_cold is not None:
        # A failed park by sleep: the engine has its scheduler back; stopped drained, as a park that cannot be.
        actions.append(StopEngine(drain=True, reason=move.stop_cold))
        return _to(st, Phase.DRAINING, now, suspension=None, restart_reason=move.stop_cold, cold_after=True, tree_gone_at=None, ready_since=None,
                   old_tree=tuple(sorted(set(snap.child.tree_pids) | ({snap.child.pid} if snap.child.pid else set()))))  # fmt: skip
    if move.start_cold:
        return _start(snap, replace(st, suspension=None), cfg, now, actions, "resume of a suspension without an engine", automatic=False)
    if move.phase is st.phase:
        return replace(st, suspension=move.suspension)
    if move.phase is Phase.READY:
        # Nothing that stood still during the suspension may read as a stall: the watch starts afresh.
        # The baseline the suspension carried (taken before the lock) is the engine's from now on, if it answered
        # the current question; else none, and the READY path takes a new one.
        key = canary.request_key(cfg.canary)
        if st.suspension is not None:
            held = suspension.held_baseline(st.suspension, cfg)
        else:
            held = st.canary.baseline if st.canary.baseline_for == key else None
        return _to(st, Phase.READY, now, suspension=None, ready_since=now, watch=_fresh_watch(st, ready_at=now),
                   canary=st.canary.fresh(held, key))  # fmt: skip
    return _to(st, move.phase, now, suspension=move.suspension)


def _unanswered(snap: Snapshot, st: PolicyState, now: float) -> PolicyState:
    """A suspend or resume the phase could not take up (the reply was sent earlier in this loop turn) is refused."""
    for op, request in (("suspend", snap.suspend_requested), ("resume", snap.resume_requested)):
        taken = (st.suspension is not None and st.suspension.request == request) or (st.suspend_last is not None and st.suspend_last.request == request)
        if request is not None and not taken:
            why = f"the GPU needs a reset ({st.reset_hold.reason})" if st.reset_hold and op == "resume" else f"the engine is {st.phase.value}"
            st = replace(st, suspend_last=SuspendResult(request, op, Result.REFUSED, why, now))
    return st
