"""Which model a request may go to now, and the requests waiting for one that cannot take them yet.

The daemon's latest table says, per model, whether it is `routable`. A request
for a routable model goes at once; any other waits in its model's line, first
come first served, until a table says routable (all of that model's waiters are
released together, in arrival order) or its deadline passes. A model the daemon
has given up on (state failed) takes no request: its waiters and every new
request are answered GaveUp at once. The counts kept here (waiting, the oldest
arrival, in flight, last use) are the demand the daemon's arbiter reads; every
change is reported through `on_change`, urgent when a model gets its first
waiter, so the daemon can start a swap at once.

One asyncio loop owns all of it: no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from r3090d.router.link import Demand, EngineState, ModelDemand, ModelEntry, Table


class UnknownModel(Exception):
    """No model of that name in the table."""


class GaveUp(Exception):
    """The daemon has given up on the model's engine (state failed); `reason` is the daemon's why, or empty."""

    def __init__(self, name: str, reason: str):
        super().__init__(name)
        self.reason = reason


class QueueTimeout(Exception):
    """The model did not become routable before the request's deadline."""


class ShuttingDown(Exception):
    """The router is stopping; waiting requests are answered at once."""


@dataclass(eq=False)
class _Waiter:
    arrived: float  # monotonic
    after_generation: int  # released only by a table newer than this one (a retry after a refused connection)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Lane:
    waiters: list[_Waiter] = field(default_factory=list)  # in arrival order
    inflight: int = 0
    last_used_at: float | None = None


class Waitroom:
    def __init__(
        self,
        on_change: Callable[[bool], None] = lambda urgent: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.table: Table | None = None
        self.generation = 0  # tables received; a new daemon restarts its seq, so seq alone cannot order them
        self._lanes: dict[str, _Lane] = {}
        self.on_change = on_change
        self._clock = clock
        self._closed = False

    # -- the daemon's side
    def apply(self, table: Table) -> None:
        """A new table: release the waiters of every model it makes routable, in arrival order, and
        answer those of models it no longer has with UnknownModel, those of models given up on with GaveUp."""
        self.table = table
        self.generation += 1
        for name, lane in self._lanes.items():
            entry = table.get(name)
            keep = []
            for waiter in lane.waiters:
                if waiter.future.done():
                    continue
                if entry is None:
                    waiter.future.set_exception(UnknownModel(name))
                elif entry.state is EngineState.FAILED:
                    waiter.future.set_exception(GaveUp(name, entry.reason))
                elif entry.routable and waiter.after_generation < self.generation:
                    waiter.future.set_result(entry)
                else:
                    keep.append(waiter)
            lane.waiters = keep
        self.on_change(False)

    def close(self) -> None:
        """Stopping: every waiter is answered ShuttingDown, and later requests too."""
        self._closed = True
        for lane in self._lanes.values():
            for waiter in lane.waiters:
                if not waiter.future.done():
                    waiter.future.set_exception(ShuttingDown())
            lane.waiters = []

    # -- the requests' side
    def lookup(self, name: str) -> ModelEntry | None:
        """The entry to send to now, or None when the request must wait. UnknownModel once a table lacks it,
        GaveUp while the daemon has given up on it."""
        if self._closed:
            raise ShuttingDown()
        if self.table is None:
            return None  # nothing known yet: everything waits, as if no model were routable
        entry = self.table.get(name)
        if entry is None:
            raise UnknownModel(name)
        if entry.state is EngineState.FAILED:
            raise GaveUp(name, entry.reason)
        return entry if entry.routable else None

    async def wait(
        self, name: str, timeout: float, arrived: float | None = None, after_generation: int = 0
    ) -> ModelEntry:
        """The entry to send to: at once when the latest table, if newer than `after_generation`, says
        routable; else after waiting in `name`'s line until a newer table does. QueueTimeout after `timeout` s.
        `arrived` keeps a re-queued request's place; `after_generation` is the table an engine that did not
        answer came from, so the request goes only to what a newer table says."""
        if self._closed:
            raise ShuttingDown()
        if after_generation < self.generation and (entry := self.lookup(name)) is not None:
            return entry
        lane = self._lanes.setdefault(name, _Lane())
        waiter = _Waiter(
            arrived=self._clock() if arrived is None else arrived, after_generation=after_generation
        )
        position = len(lane.waiters)
        while position > 0 and lane.waiters[position - 1].arrived > waiter.arrived:
            position -= 1
        lane.waiters.insert(position, waiter)
        self.on_change(len(lane.waiters) == 1)
        try:
            async with asyncio.timeout(timeout):
                return await waiter.future
        except TimeoutError:
            raise QueueTimeout(name) from None
        finally:
            if waiter in lane.waiters:
                lane.waiters.remove(waiter)
                self.on_change(False)

    def started(self, name: str) -> None:
        lane = self._lanes.setdefault(name, _Lane())
        lane.inflight += 1
        lane.last_used_at = self._clock()
        self.on_change(False)

    def finished(self, name: str) -> None:
        lane = self._lanes[name]
        lane.inflight -= 1
        lane.last_used_at = self._clock()
        self.on_change(False)

    # -- what is reported
    def demand(self) -> Demand:
        """Every model of the table, with what the router holds for it."""
        models = {}
        for entry in self.table.models if self.table else ():
            lane = self._lanes.get(entry.name) or _Lane()
            waiting = [w for w in lane.waiters if not w.future.done()]
            models[entry.name] = ModelDemand(
                waiting=len(waiting),
                oldest_waiting_at=min((w.arrived for w in waiting), default=None),
                inflight=lane.inflight,
                last_used_at=lane.last_used_at,
            )
        return Demand(models)

    def inflight(self) -> int:
        return sum(lane.inflight for lane in self._lanes.values())
