"""Swap mode's swaps, timed: from the arbiter's decision until the router routes to the target.

Each tick the loop (polling every 0.1 s while a swap is under way) says where the
outgoing and the incoming engine are; the time since the tick before goes to the stage
they are seen in (and the last tick's, when the target is seen ready, to the stage seen
last), so the stages add up to the swap's time but for the decision's own tick: the outgoing engine's drain, checkpoint or drained stop; the target's
restore, cold start or known-answer check. The swap ends when the target is ready
and in the router's table (`routing_s`: that tick's decision to the table sent), or
fails when the target gives up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from r3090d.core.suspension import Stage
from r3090d.core.vocabulary import Phase
from r3090d.service.statedoc import SWAP_BUCKETS, Histogram, SwapProgress, SwapRecord

# Where the time of a tick goes, by the engine's phase and suspension stage.
_OUTGOING = {Stage.DRAINING: "drain_s", Stage.BASELINING: "drain_s", Stage.CHECKPOINTING: "checkpoint_s", Stage.QUERYING: "checkpoint_s",
             Stage.SLEEPING: "checkpoint_s", Stage.UNPAUSING: "stop_s"}  # fmt: skip
_INCOMING = {Stage.CHECKING: "restore_s", Stage.RESTORING: "restore_s", Stage.QUERYING: "restore_s", Stage.VERIFYING: "canary_s",
             Stage.CANARY: "canary_s", Stage.WAKING: "restore_s"}  # fmt: skip
_STAGE_WORDS = {"drain_s": "draining", "checkpoint_s": "parking", "stop_s": "stopping", "restore_s": "restoring",
                "start_s": "starting", "canary_s": "checking"}  # fmt: skip


@dataclass
class Swap:
    to_model: str | None
    from_model: str | None
    started_at: float  # monotonic
    started_wall: float
    cold: bool = False
    frozen: int = 0
    times: dict[str, float] = field(default_factory=dict)
    last_at: float = 0.0
    stage: str = ""
    bucket: str | None = None  # the stage seen last


class SwapTracker:
    def __init__(self) -> None:
        self.current: Swap | None = None
        self.total = 0
        self.failed = 0
        self.abandoned = 0  # ended before the target was brought in: its requests left (not a failure of the card)
        self.last: SwapRecord | None = None
        self.latency = Histogram.empty(SWAP_BUCKETS)

    def begin(self, target: str | None, outgoing: str | None, now: float, *, parked: bool, bring_in: bool = False) -> None:
        """A move of the arbiter's: a swap starts with its first move, and learns the target's way in with the second."""
        if self.current is None:
            self.current = Swap(target, outgoing, now, time.time(), cold=bring_in and not parked, last_at=now)
        elif bring_in and self.current.to_model in (None, target):
            self.current.to_model = target
            self.current.cold = not parked

    def observe(self, units: dict, now: float, routable: set[str] | None = None, closing: frozenset[str] | set[str] = frozenset()) -> bool:
        """This tick's time, into the stage each engine of the swap is in; True when the swap has just ended well
        (the caller then says how long the router's table took: routed())."""
        s = self.current
        if s is None:
            return False
        dt, s.last_at = max(0.0, now - s.last_at), now
        out = units.get(s.from_model) if s.from_model else None
        target = units.get(s.to_model) if s.to_model else None
        bucket = None
        if target is not None and target.st.phase is Phase.READY and routable is not None and s.to_model not in routable:
            bucket = "canary_s"  # ready, its first canary not answered yet: not routed
        elif target is not None and target.st.phase is Phase.READY:
            if s.bucket is not None:  # the last stage lasted until the target was seen ready
                s.times[s.bucket] = s.times.get(s.bucket, 0.0) + dt
            self._end(s, now, ok=True)
            return True
        if target is not None and target.st.phase in (Phase.GIVEN_UP, Phase.RESET_NEEDED):
            self._end(s, now, ok=False, error=target.st.give_up_reason or f"{s.to_model} is {target.st.phase.value}")
            return False
        if target is not None and bucket is None:
            bucket = self._incoming(target.st)
        if out is not None and out.st.phase is Phase.SUSPENDING and out.st.suspension is not None:
            s.frozen = out.st.suspension.frozen_requests  # what the drain's deadline left running, once the lock is asked
        if bucket is None and out is not None:
            bucket = "drain_s" if s.from_model in closing and out.st.phase is Phase.READY else self._outgoing(out.st)
        if bucket == "start_s":
            s.cold = True  # a cold start, even of an unpark whose parked engine had died
        if bucket is not None:
            s.bucket = bucket
            s.times[bucket] = s.times.get(bucket, 0.0) + dt
            s.stage = f"{_STAGE_WORDS[bucket]} {s.to_model if bucket in ('restore_s', 'start_s', 'canary_s') else s.from_model}"
        return False

    def routed(self, routing_s: float) -> None:
        """The swap that just ended: the target's routable table went out `routing_s` after the decision."""
        if self.last is not None and self.last.ok:
            seconds = (self.last.seconds or 0.0) + routing_s
            self.last = replace(self.last, routing_s=round(routing_s, 4), seconds=round(seconds, 3))
            self.latency = self.latency.observed(self.last.seconds)

    @staticmethod
    def _outgoing(st) -> str | None:
        if st.phase is Phase.SUSPENDING and st.suspension is not None:
            return _OUTGOING.get(st.suspension.stage)
        if st.phase is Phase.DRAINING and st.cold_after:
            return "stop_s"
        return None

    @staticmethod
    def _incoming(st) -> str | None:
        if st.phase is Phase.RESUMING and st.suspension is not None:
            return _INCOMING.get(st.suspension.stage)
        if st.phase in (Phase.STARTING, Phase.WAITING_FOR_GPU, Phase.RESTARTING, Phase.BACKOFF):
            return "start_s"
        return None

    def abandon(self, now: float, why: str) -> None:
        """The swap under way ends without its target: nobody asks for it any more. The next target's swap is
        a record of its own, so that none stays open for ever."""
        if self.current is not None:
            self._end(self.current, now, ok=False, error=f"abandoned: {why}", abandoned=True)

    def _end(self, s: Swap, now: float, *, ok: bool, error: str = "", abandoned: bool = False) -> None:
        seconds = now - s.started_at
        t = {k: round(v, 3) for k, v in s.times.items()}
        self.last = SwapRecord(
            from_model=s.from_model, to_model=s.to_model or "", cold=s.cold, ok=ok, seconds=round(seconds, 3),
            drain_s=t.get("drain_s"), checkpoint_s=t.get("checkpoint_s"), stop_s=t.get("stop_s"), restore_s=t.get("restore_s"),
            start_s=t.get("start_s"), canary_s=t.get("canary_s"),
            frozen_requests=s.frozen, error=error, at=time.time(), abandoned=abandoned,
        )  # fmt: skip
        self.total += 1
        self.abandoned += abandoned
        self.failed += not ok and not abandoned
        self.current = None

    def progress(self) -> SwapProgress | None:
        s = self.current
        if s is None:
            return None
        return SwapProgress(from_model=s.from_model, to_model=s.to_model or "", stage=s.stage, since=s.started_wall)


