"""Which engines are on the GPU: the card-level arbiter of swap mode. Pure: views and `now` in, moves out.

Each engine keeps its own policy (core/policy.py); the arbiter only decides
residency, from what the daemon knows of each engine and what the router reports
of its demand. Its rules:

1. One swap at a time: while an engine is starting, parking, resuming or stopping
   nothing is brought in and nothing is parked. Evicting a parked engine (it holds
   no GPU memory) may still happen. An engine whose start waits for memory held
   outside r3090d is not in transition: it blocks nothing.
2. An engine wants the GPU when requests wait for it at the router, or when it is
   parked with requests frozen in it. Its turn is its oldest waiting request (or
   the moment it was parked, for frozen ones, whichever is older); the target is
   the engine out of the GPU with the earliest turn: arrival order across models,
   and a model's waiting requests all go together once it is resident.
3. Below `max_resident` the target comes in: resumed when parked, cold-started when cold.
4. Otherwise a resident engine makes room: one waiting for memory held outside
   r3090d first (it gives its place up at no cost), then an idle ready one (least recently used
   first), else one resident at least `min_residency`, busy or not (its requests
   are frozen with it and come back in its turn: no busy model starves another
   for ever). None: nothing moves, and `recheck_at` says when one will be. An
   engine whose own requests have waited since before the target's turn is not
   chosen: they came first.
5. The outgoing engine is parked when the card can checkpoint it and host memory
   holds it, evicting least recently used parked engines without frozen requests
   to make room; else it is stopped (cold), but only once nothing runs in it: a
   busy one is closed first (no new requests; those it runs finish), since a
   stop would cut them. The target's own move comes in
   a later plan, once the outgoing engine has left the GPU (rule 1).
6. A parked engine with frozen requests is never evicted.
7. Whatever the demand, parked engines over the host budget (it shrank) are
   evicted, least recently used first, never one with frozen requests.
8. Nobody waits: nothing to do.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from r3090d.core.hostmemory import parked_cost_mib


class Residency(enum.StrEnum):
    """Where an engine is; the link table's `state` words."""

    COLD = "cold"  # no process
    STARTING = "starting"
    WAITING = "waiting"  # its start waits for GPU memory that processes outside r3090d hold
    READY = "ready"  # resident, serving
    PARKING = "parking"  # draining, then its GPU memory going to host RAM
    PARKED = "parked"  # suspended: its GPU memory in host RAM, its process frozen
    RESUMING = "resuming"  # its memory going back to the GPU, then the canary
    STOPPING = "stopping"  # a drained stop towards cold
    FAILED = "failed"  # given up, or cannot start


# Moves of GPU memory in progress: while one is, no other swap begins (rule 1).
IN_TRANSITION = frozenset({Residency.STARTING, Residency.PARKING, Residency.RESUMING, Residency.STOPPING})
# Engines that hold (or are taking) a place on the GPU, counted against max_resident. A waiting engine keeps its
# place but moves nothing: it is not in transition, and it gives its place up first (it holds no memory).
RESIDENT = frozenset({Residency.READY, Residency.STARTING, Residency.RESUMING, Residency.WAITING})
# Engines whose GPU memory is (or is going) into host RAM, counted against the host budget.
IN_HOST_MEMORY = frozenset({Residency.PARKING, Residency.PARKED})


@dataclass(frozen=True)
class EngineView:
    """What the arbiter knows of one engine. Times are the daemon's monotonic clock, shared with the router."""

    name: str
    residency: Residency
    gpu_mib: int = 0  # GPU memory it holds when resident, or held before parking: its host cost when parked
    base_rss_mib: int = 0  # its host memory outside the GPU's
    inflight: int = 0  # requests open at the router toward it; for a parked engine, its frozen requests
    waiting: int = 0  # requests queued at the router for it
    oldest_waiting_at: float | None = None
    last_used_at: float | None = None  # None: never used
    resident_since: float | None = None  # set while READY
    parked_at: float | None = None  # set while PARKED
    can_checkpoint: bool = True  # the card and driver can suspend this engine
    failed: bool = False  # given up, or cannot start: never a target

    @property
    def parked_cost_mib(self) -> int:
        return parked_cost_mib(self.gpu_mib, self.base_rss_mib)

    @property
    def frozen(self) -> bool:
        """Parked with requests frozen in it: pending work, never evicted."""
        return self.residency is Residency.PARKED and self.inflight > 0

    @property
    def wants_gpu(self) -> bool:
        return self.waiting > 0 or self.frozen

    @property
    def idle(self) -> bool:
        return self.inflight == 0 and self.waiting == 0


@dataclass(frozen=True)
class ArbiterConfig:
    max_resident: int = 1
    min_residency: float = 0.0  # seconds a busy engine stays resident before it can be swapped out
    host_budget_mib: int = 0  # the parked engines' total cost must stay within it


class StopWhy(enum.StrEnum):
    EVICT = "evict"  # a parked engine stopped to make room in host memory
    NO_CHECKPOINT = "no_checkpoint"  # the card or driver cannot suspend it: a drained stop instead of parking
    NO_ROOM = "no_room"  # host memory cannot hold it parked: a drained stop instead of parking
    YIELD = "yield"  # its start waits for memory held outside r3090d: it gives its place to the target


@dataclass(frozen=True)
class Park:
    """Drain (bounded; what still runs is frozen with it), then suspend to host RAM."""

    name: str
    why: str = ""


@dataclass(frozen=True)
class Unpark:
    """Resume from host RAM."""

    name: str
    why: str = ""


@dataclass(frozen=True)
class ColdStart:
    name: str
    why: str = ""


@dataclass(frozen=True)
class StopCold:
    """Stop the engine (drained when it runs; a parked one holds no GPU memory) and leave it cold."""

    name: str
    why: StopWhy
    detail: str = ""


@dataclass(frozen=True)
class Close:
    """Send the engine no new request (they wait at the router); a StopCold follows once nothing runs in it."""

    name: str
    why: StopWhy
    detail: str = ""


Move = Park | Unpark | ColdStart | StopCold | Close


@dataclass(frozen=True)
class Plan:
    moves: tuple[Move, ...] = ()
    target: str | None = None  # the engine whose turn it is, if any
    why: str = ""  # one line for the log and status
    recheck_at: float | None = None  # when a move blocked only by min_residency becomes possible


def plan(engines: tuple[EngineView, ...], cfg: ArbiterConfig, now: float) -> Plan:
    """The moves to make now. Each plan makes at most one swap step; the daemon plans again
    whenever an engine's residency or the router's demand changes, and at `recheck_at`."""
    evictions, engines = _fit_budget(engines, cfg.host_budget_mib)
    target = _target(engines, now)

    def decided(text: str, moves: tuple[Move, ...] = (), recheck_at: float | None = None) -> Plan:
        why = "; ".join(p for p in (_eviction_text(evictions), text) if p)
        return Plan((*evictions, *moves), target.name if target else None, why, recheck_at)

    if target is None:
        return decided("nobody waits")
    wait = f"{target.name} waits {max(0.0, now - _turn(target, now)):.1f} s"
    moving = sorted(e.name for e in engines if e.residency in IN_TRANSITION)
    if moving:
        return decided(f"{wait}; {', '.join(moving)} in transition")
    resident = [e for e in engines if e.residency in RESIDENT]
    if len(resident) < cfg.max_resident:
        move = _bring_in(target, wait)
        return decided(move.why, (move,))
    victim, recheck_at = _victim(resident, cfg.min_residency, now, _turn(target, now))
    if victim is None:
        until = f"until {recheck_at - now:.1f} s from now" if recheck_at is not None else "for now"
        return decided(
            f"{wait}; every resident engine is busy and within its minimum residency {until}", (), recheck_at
        )
    moves = _make_room(victim, target, engines, cfg.host_budget_mib, wait)
    last = moves[-1]
    return decided(last.why if isinstance(last, Park) else last.detail, moves)


# --------------------------------------------------------------------- rules


def _lru_key(engine: EngineView) -> tuple[float, str]:
    return (-math.inf if engine.last_used_at is None else engine.last_used_at, engine.name)


def _parked_total(engines: Iterable[EngineView]) -> int:
    return sum(e.parked_cost_mib for e in engines if e.residency in IN_HOST_MEMORY)


def _evictable(engines: Iterable[EngineView], keep: str | None = None) -> list[EngineView]:
    """Parked engines that may be stopped for host room, in eviction order: those nobody waits for
    before those somebody does, least recently used first. Never one with frozen requests (rule 6)."""
    found = [e for e in engines if e.residency is Residency.PARKED and not e.frozen and e.name != keep]
    return sorted(found, key=lambda e: (e.waiting > 0, *_lru_key(e)))


def _evict(engines: tuple[EngineView, ...], names: set[str]) -> tuple[EngineView, ...]:
    return tuple(
        replace(e, residency=Residency.COLD, parked_at=None) if e.name in names else e for e in engines
    )


def _fit_budget(
    engines: tuple[EngineView, ...], budget_mib: int
) -> tuple[tuple[StopCold, ...], tuple[EngineView, ...]]:
    """Rule 7: parked engines over the budget are evicted until the rest fit (or only frozen ones are left)."""
    total = _parked_total(engines)
    evictions: list[StopCold] = []
    for engine in _evictable(engines):
        if total <= budget_mib:
            break
        total -= engine.parked_cost_mib
        over = f"{engine.name} evicted: parked engines over the host budget of {budget_mib} MiB"
        evictions.append(StopCold(engine.name, StopWhy.EVICT, over))
    return tuple(evictions), _evict(engines, {s.name for s in evictions})


def _turn(engine: EngineView, now: float) -> float:
    """When an engine's demand began: its oldest waiting request, or when it was parked with frozen ones.
    A time not reported counts as now (the back of the line)."""
    times = []
    if engine.waiting > 0:
        times.append(now if engine.oldest_waiting_at is None else engine.oldest_waiting_at)
    if engine.frozen:
        times.append(now if engine.parked_at is None else engine.parked_at)
    return min(times)


def _target(engines: tuple[EngineView, ...], now: float) -> EngineView | None:
    """Rule 2: the engine out of the GPU, not failed, with the earliest turn."""
    candidates = [
        e
        for e in engines
        if e.residency in (Residency.COLD, Residency.PARKED) and not e.failed and e.wants_gpu
    ]
    return min(candidates, key=lambda e: (_turn(e, now), e.name), default=None)


def _bring_in(target: EngineView, wait: str) -> Unpark | ColdStart:
    """Rule 3."""
    if target.residency is Residency.PARKED:
        frozen = f", {target.inflight} frozen" if target.inflight else ""
        return Unpark(target.name, f"{wait}{frozen}: resume it")
    return ColdStart(target.name, f"{wait}: start it")


def _victim(
    resident: list[EngineView], min_residency: float, now: float, turn: float
) -> tuple[EngineView | None, float | None]:
    """Rule 4: an idle ready engine, least recently used first; else one resident at least min_residency.
    None, with the earliest time one will have been: every ready engine is busy and recent.

    Arrival order holds here too: an engine with requests waiting since before the target's turn (it
    has just come in, and the router is sending them) serves those first, whatever min_residency says."""
    waiting = sorted((e for e in resident if e.residency is Residency.WAITING and not _ahead_of(e, turn)), key=_lru_key)
    if waiting:
        return waiting[0], None
    ready = [e for e in resident if e.residency is Residency.READY and not _ahead_of(e, turn)]
    idle = sorted((e for e in ready if e.idle), key=_lru_key)
    if idle:
        return idle[0], None
    # A ready engine without resident_since counts as resident long enough: a missing time must
    # never pin an engine on the GPU for ever.
    done = sorted(
        (e for e in ready if e.resident_since is None or now - e.resident_since >= min_residency),
        key=_lru_key,
    )
    if done:
        return done[0], None
    return None, min(
        (e.resident_since + min_residency for e in ready if e.resident_since is not None), default=None
    )


def _ahead_of(engine: EngineView, turn: float) -> bool:
    return engine.waiting > 0 and engine.oldest_waiting_at is not None and engine.oldest_waiting_at <= turn


def _make_room(
    victim: EngineView, target: EngineView, engines: tuple[EngineView, ...], budget_mib: int, wait: str
) -> tuple[Move, ...]:
    """Rule 5: park the victim if host memory can hold it (after evictions), else stop it drained."""
    if victim.residency is Residency.WAITING:
        return (StopCold(victim.name, StopWhy.YIELD, f"{wait}; {victim.name} gives up its place: its start waits for memory held outside r3090d"),)
    if victim.idle:
        out = f"{wait}; {victim.name} makes room, idle"
    else:
        busy = f"{victim.inflight} in flight, {victim.waiting} waiting"
        out = f"{wait}; {victim.name} makes room, busy ({busy}) past its minimum residency"
    if not victim.can_checkpoint:
        return (_stop_or_close(victim, StopWhy.NO_CHECKPOINT, f"{out}: it cannot be suspended here"),)
    cost = victim.parked_cost_mib
    total = _parked_total(engines)
    evictable = _evictable(engines, keep=target.name)
    if total - sum(e.parked_cost_mib for e in evictable) + cost > budget_mib:
        why = f"{out}: host memory cannot hold its {cost} MiB parked (budget {budget_mib} MiB)"
        return (_stop_or_close(victim, StopWhy.NO_ROOM, why),)
    moves: list[Move] = []
    for engine in evictable:
        if total + cost <= budget_mib:
            break
        total -= engine.parked_cost_mib
        moves.append(StopCold(engine.name, StopWhy.EVICT, f"{engine.name} evicted to park {victim.name}"))
    moves.append(Park(victim.name, f"{out}: park it ({cost} MiB of host memory)"))
    return tuple(moves)


def _stop_or_close(victim: EngineView, why: StopWhy, text: str) -> StopCold | Close:
    """An engine that cannot be parked would lose what it runs if stopped now (a drain is bounded): it takes no new
    request and is stopped once the router says nothing runs in it."""
    if victim.inflight > 0:
        return Close(victim.name, why, f"{text}: it takes no new request and is stopped once its {victim.inflight} running finish")
    return StopCold(victim.name, why, f"{text}: stop it")


def _eviction_text(evictions: tuple[StopCold, ...]) -> str:
    return f"host budget exceeded: evict {', '.join(s.name for s in evictions)}" if evictions else ""
