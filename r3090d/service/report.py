"""The state document: what the daemon publishes each tick, built by one pure function.

`report()` turns the policy's state and the tick's snapshot into a StateDocument;
the daemon writes it to state.json and answers `r3090ctl status` with it, and
the exporter and /healthz read it. Times in it are wall-clock (Unix) seconds:
the policy's monotonic times are shifted by `offset`.

FORMAT_VERSION grows when a field changes meaning or goes away. A reader accepts
every version in READABLE_FORMATS; after an upgrade, a daemon started before it
keeps writing its own (older) format until it is restarted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from r3090d.config import MIB, Config
from r3090d.core.policy import PolicyState
from r3090d.core.snapshot import Snapshot
from r3090d.core.vocabulary import Phase
from r3090d.service.state import book_to_json, plain

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # 1: before give-up kept the daemon up (no restarts.start_failures, no thresholds)


class UnreadableFormat(ValueError):
    """A state document this r3090ctl cannot read: written by a newer daemon."""


def check_format(doc: dict) -> dict:
    """The document itself if this version of r3090d can read it."""
    version = doc.get("format", 1)
    if version not in READABLE_FORMATS:
        raise UnreadableFormat(
            f"the state was written in format {version}, this r3090ctl reads {', '.join(map(str, READABLE_FORMATS))}: "
            "restart the daemon (systemctl restart r3090d) or upgrade r3090ctl"
        )
    return doc


@dataclass(frozen=True)
class DaemonIdentity:
    """What does not change between ticks."""

    pid: int
    started_at: float
    version: str
    host: str


@dataclass(frozen=True)
class DaemonInfo:
    pid: int
    started_at: float
    version: str
    instance: int | None
    config: str
    host: str
    tick_seconds: float
    poll_interval: float


@dataclass(frozen=True)
class EngineInfo:
    state: str  # the phase, or "maintenance" while maintenance holds a ready engine
    phase: Phase
    maintenance: bool
    since: float
    pid: int | None
    tree_pids: list[int]
    model: str
    url: str
    ready_since: float | None
    generation: int


@dataclass(frozen=True)
class RestartsInfo:
    total: int
    by_reason: dict[str, int]
    last_reason: str | None
    last_at: float | None
    last_root_cause: str | None
    backoff_level: int
    start_failures: int
    recent: int  # unrequested restarts within watchdog.restart_storm_window


@dataclass(frozen=True)
class ProbeInfo:
    ok: bool | None
    latency_s: float | None
    finished_at: float | None
    detail: str
    consecutive_failures: int


@dataclass(frozen=True)
class Thresholds:
    gpu_memory_alert_bytes: int
    kv_min_free_blocks: int


@dataclass(frozen=True)
class FiringAlert:
    severity: str
    summary: str
    since: float | None


@dataclass(frozen=True)
class StateDocument:
    written_at: float
    daemon: DaemonInfo
    engine: EngineInfo
    restarts: RestartsInfo
    next_action: str | None
    watch: dict
    give_up_reason: str | None
    xid_seen: list[int]
    health: dict
    inference: ProbeInfo
    thresholds: Thresholds
    metrics: dict
    gpu: dict
    alerts: dict
    alert_book: dict
    preflight: dict | None
    telemetry: dict
    format: int = FORMAT_VERSION
    waiting: dict | None = field(default=None)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def report(
    st: PolicyState,
    snap: Snapshot,
    cfg: Config,
    *,
    identity: DaemonIdentity,
    offset: float,
    written_at: float,
    tick_s: float,
    preflight: dict | None,
    telemetry: dict,
) -> StateDocument:
    def wall(t: float | None) -> float | None:
        return None if t is None else t + offset

    firing = {k: FiringAlert(e.severity, e.summary, wall(e.since)) for k, e in st.alerts.firing().items()}
    return StateDocument(
        written_at=written_at,
        daemon=DaemonInfo(
            pid=identity.pid,
            started_at=identity.started_at,
            version=identity.version,
            instance=cfg.instance,
            config=cfg.source,
            host=identity.host,
            tick_seconds=round(tick_s, 4),
            poll_interval=cfg.watchdog.poll_interval,
        ),
        engine=EngineInfo(
            state="maintenance" if st.maintenance and st.phase is Phase.READY else st.phase.value,
            phase=st.phase,
            maintenance=st.maintenance,
            since=st.phase_since + offset,
            pid=snap.child.pid if snap.child.alive else None,
            tree_pids=list(snap.child.tree_pids),
            model=cfg.model_name,
            url=cfg.engine_url,
            ready_since=wall(st.ready_since),
            generation=st.generation,
        ),
        restarts=RestartsInfo(
            total=st.restarts_total,
            by_reason=dict(st.restarts_by_reason),
            last_reason=st.last_restart_reason,
            last_at=wall(st.last_restart_at),
            last_root_cause=st.last_root_cause,
            backoff_level=st.backoff_level,
            start_failures=st.start_failures,
            recent=len(st.restart_times),
        ),
        next_action=next_action(st, snap, cfg),
        watch={"gpu_signal_off": st.watch.gpu_signal_off if cfg.gpu.required else None},
        give_up_reason=st.give_up_reason,
        xid_seen=list(st.xid_seen),
        health=plain(snap.health),
        inference=probe_info(snap, offset),
        thresholds=Thresholds(cfg.watchdog.gpu_memory_alert_mib * MIB, cfg.watchdog.min_free_blocks),
        metrics=plain(snap.engine),
        gpu=plain(snap.gpu),
        alerts={"firing": firing, "silenced": {k: u + offset for k, u in st.alerts.silenced}},
        alert_book=book_to_json(st.alerts, offset),
        preflight=preflight,
        telemetry=telemetry,
    )


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
    parts = [("maintenance " if st.maintenance else "") + st.phase.value]
    e = snap.engine
    if e.kv_usage is not None:
        parts.append(f"kv {e.kv_usage * 100:.0f}% ({e.free_blocks or 0:.0f} free blocks)")
    g = snap.gpu
    if g.memory_used is not None and g.memory_total:
        parts.append(f"gpu {g.memory_used / MIB:.0f}/{g.memory_total / MIB:.0f} MiB")
    if st.restarts_total:
        parts.append(f"restarts {st.restarts_total} (last: {st.last_restart_reason})")
    return ", ".join(parts)


def next_action(st: PolicyState, snap: Snapshot, cfg: Config) -> str | None:
    if st.phase is Phase.BACKOFF and st.next_start_at is not None:
        return f"start engine in {max(0.0, st.next_start_at - snap.now):.0f} s"
    if st.phase is Phase.DRAINING and st.stop_due_at is not None:
        return f"drained stop of the engine in {max(0.0, st.stop_due_at - snap.now):.0f} s (load balancer grace)"
    if st.phase in (Phase.RESTARTING, Phase.DRAINING):
        return "start engine once the old process tree is gone"
    if st.phase is Phase.STARTING:
        return f"give up waiting for /health in {max(0.0, st.phase_since + cfg.engine.startup_timeout - snap.now):.0f} s"
    if st.phase is Phase.GIVEN_UP:
        return "none until r3090ctl restart (after fixing the cause; r3090ctl reload applies a fixed config)"
    return None
