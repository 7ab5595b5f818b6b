"""The router's end of the link: connects to the daemon's socket, applies each table, reports demand.

The connection is retried with a short backoff for as long as the router runs
(the daemon may start after the router, or restart). The last table is kept
across a drop: a request for an engine that is gone meets a refused connection
and waits for the next table. Demand is sent on connect, at once when a model
gets its first waiting request, and otherwise at most every DEMAND_INTERVAL_S,
only when it changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from r3090d.router.link import MAX_LINE_BYTES, Demand, LinkError, Table, decode, encode_demand
from r3090d.router.waitroom import Waitroom

log = logging.getLogger("r3090d.router")

DEMAND_INTERVAL_S = 0.05
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0
WRITE_BUFFER_LIMIT = 64 * 1024


class LinkClient:
    def __init__(self, path: Path, waitroom: Waitroom):
        self.path = path
        self.waitroom = waitroom
        self.linked = False  # connected, and a table received on this connection
        self._writer: asyncio.StreamWriter | None = None
        self._last_sent: Demand | None = None
        self._last_sent_at = float("-inf")
        self._pending: asyncio.TimerHandle | None = None

    # -- demand
    def demand_changed(self, urgent: bool) -> None:
        """Waitroom's on_change: send now when urgent or the interval has passed, else once it has."""
        if self._writer is None:
            return
        if urgent:
            self._send_demand()
        elif self._pending is None:
            # Later in this loop turn at the soonest: a request that just started goes to its engine first.
            wait = max(0.0, self._last_sent_at + DEMAND_INTERVAL_S - time.monotonic())
            self._pending = asyncio.get_running_loop().call_later(wait, self._send_demand)

    def _send_demand(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._writer is None or self.waitroom.table is None:
            return
        demand = self.waitroom.demand()
        if demand == self._last_sent:
            return
        if self._writer.transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            # The daemon is not reading; keep the latest state for when it does, not a backlog.
            self._pending = asyncio.get_running_loop().call_later(DEMAND_INTERVAL_S, self._send_demand)
            return
        try:
            self._writer.write(encode_demand(demand))
        except (OSError, RuntimeError):
            return  # the reader sees the connection go and reconnects
        self._last_sent = demand
        self._last_sent_at = time.monotonic()

    # -- the connection
    async def run(self) -> None:
        """Forever: connect, read tables until the connection drops, back off, again."""
        backoff = BACKOFF_FIRST_S
        complained = False
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.path), limit=MAX_LINE_BYTES + 1)
            except OSError as exc:
                if not complained:
                    log.warning(
                        "link: cannot connect to %s (%s); retrying until it answers",
                        self.path,
                        exc.strerror or exc,
                    )
                    complained = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            log.info("link: connected to %s", self.path)
            complained = False
            backoff = BACKOFF_FIRST_S
            self._writer = writer
            self._last_sent = None
            try:
                await self._read(reader)
            finally:
                self.linked = False
                self._writer = None
                if self._pending is not None:
                    self._pending.cancel()
                    self._pending = None
                writer.close()
            log.warning("link: the daemon closed the link; reconnecting")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        bad_lines = 0
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # over the limit: the stream cannot be resynchronised
                log.warning("link: a line over %d bytes; dropping the connection", MAX_LINE_BYTES)
                return
            except OSError:
                return
            if not line:
                return
            try:
                message = decode(line)
            except LinkError as exc:
                bad_lines += 1
                if bad_lines == 1 or bad_lines % 100 == 0:  # one line per problem, not one per message
                    log.warning("link: ignoring a bad message (%d so far): %s", bad_lines, exc)
                continue
            if isinstance(message, Table):
                self.waitroom.apply(message)
                self.linked = True
                self._send_demand()
            # The daemon sends no demand; a demand line is ignored.

    async def close(self) -> None:
        if self._writer is not None:
            try:
                self._send_demand()
                await asyncio.wait_for(self._writer.drain(), 1.0)
            except (OSError, TimeoutError, RuntimeError):
                pass
