"""The router's waitroom (who may go, who waits, in what order, what is reported) and the demand's pacing on the link."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from r3090d.router import linkclient
from r3090d.router.link import Demand, EngineState, ModelEntry, ModelKind, Table, decode, encode_table
from r3090d.router.linkclient import LinkClient
from r3090d.router.waitroom import GaveUp, QueueTimeout, ShuttingDown, UnknownModel, Waitroom


def entry(name: str, routable: bool, port: int = 18101) -> ModelEntry:
    state = EngineState.READY if routable else EngineState.PARKED
    return ModelEntry(name, ModelKind.GENERATE, state, routable, f"http://127.0.0.1:{port}", "")


def table(*models: ModelEntry, seq: int = 1) -> Table:
    return Table(seq, models)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


def test_before_a_table_every_model_waits_and_one_the_table_lacks_is_unknown():
    async def scenario():
        room = Waitroom()
        assert room.lookup("chat") is None
        known = asyncio.create_task(room.wait("chat", 5))
        unknown = asyncio.create_task(room.wait("nobody", 5))
        await asyncio.sleep(0)
        room.apply(table(entry("chat", True)))
        assert (await known).name == "chat"
        with pytest.raises(UnknownModel):
            await unknown
        with pytest.raises(UnknownModel):
            room.lookup("nobody")

    run(scenario())


def test_a_routable_model_goes_at_once_and_a_parked_one_waits_for_the_table_that_frees_it():
    async def scenario():
        room = Waitroom()
        room.apply(table(entry("chat", True), entry("code", False)))
        assert room.lookup("chat").name == "chat"
        assert room.lookup("code") is None
        waiting = asyncio.create_task(room.wait("code", 5))
        await asyncio.sleep(0)
        room.apply(table(entry("chat", True), entry("code", False), seq=2))  # still parked: still waiting
        await asyncio.sleep(0)
        assert not waiting.done()
        room.apply(table(entry("chat", False), entry("code", True, port=18102), seq=3))
        assert (await waiting).upstream == "http://127.0.0.1:18102"

    run(scenario())


def test_waiters_are_released_in_arrival_order_a_requeued_one_keeping_its_place():
    async def scenario():
        clock = Clock()
        room = Waitroom(clock=clock)
        room.apply(table(entry("chat", False)))
        order: list[str] = []

        async def waiter(label: str, **kw):
            await room.wait("chat", 5, **kw)
            order.append(label)

        tasks = []
        for label in ("first", "second"):
            tasks.append(asyncio.create_task(waiter(label)))
            await asyncio.sleep(0)
            clock.now += 1
        # A request that went out and was refused comes back with its original arrival time.
        tasks.append(asyncio.create_task(waiter("refused earlier", arrived=999.0)))
        await asyncio.sleep(0)
        assert room.demand().models["chat"].oldest_waiting_at == 999.0
        room.apply(table(entry("chat", True), seq=2))
        await asyncio.gather(*tasks)
        assert order == ["refused earlier", "first", "second"]

    run(scenario())


def test_a_requeued_request_waits_for_a_newer_table_even_when_the_current_one_says_routable():
    async def scenario():
        room = Waitroom()
        room.apply(table(entry("chat", True)))
        retry = asyncio.create_task(room.wait("chat", 5, after_generation=room.generation))
        await asyncio.sleep(0.01)
        assert not retry.done()
        room.apply(table(entry("chat", True), seq=2))
        assert (await retry).name == "chat"

    run(scenario())


def test_a_requeued_request_goes_at_once_to_a_newer_table_that_came_while_it_was_out():
    async def scenario():
        room = Waitroom()
        room.apply(table(entry("chat", True)))
        sent_with = room.generation
        room.apply(
            table(entry("chat", True, port=18102), seq=2)
        )  # the engine came back while the send failed
        again = await room.wait("chat", 5, after_generation=sent_with)
        assert again.upstream == "http://127.0.0.1:18102"
        assert room.demand().models["chat"].waiting == 0  # it never stood in the line

    run(scenario())


def test_a_model_given_up_on_answers_its_waiters_and_new_requests_at_once_with_the_reason():
    async def scenario():
        room = Waitroom()
        room.apply(table(entry("chat", False), entry("code", False)))
        waiting = asyncio.create_task(room.wait("chat", 60))
        other = asyncio.create_task(room.wait("code", 60))
        await asyncio.sleep(0)
        failed = ModelEntry("chat", ModelKind.GENERATE, EngineState.FAILED, False, "http://127.0.0.1:18101", "",
                            "5 restarts in 600 s")  # fmt: skip
        room.apply(table(failed, entry("code", False), seq=2))
        with pytest.raises(GaveUp) as caught:
            await asyncio.wait_for(waiting, 1)  # at once, not after its 60 s
        assert caught.value.reason == "5 restarts in 600 s"
        with pytest.raises(GaveUp):
            room.lookup("chat")
        with pytest.raises(GaveUp):
            await room.wait("chat", 60, after_generation=1)
        assert not other.done()  # another model's line is not touched
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        assert room.demand().models["chat"].waiting == 0

    run(scenario())


def test_past_its_timeout_a_waiter_gets_queue_timeout_and_leaves_the_line():
    async def scenario():
        room = Waitroom()
        room.apply(table(entry("chat", False)))
        started = time.monotonic()
        with pytest.raises(QueueTimeout):
            await room.wait("chat", 0.05)
        assert time.monotonic() - started >= 0.05
        assert room.demand().models["chat"].waiting == 0

    run(scenario())


def test_a_cancelled_waiter_leaves_the_line():
    async def scenario():
        room = Waitroom()
        room.apply(table(entry("chat", False)))
        task = asyncio.create_task(room.wait("chat", 5))
        await asyncio.sleep(0)
        assert room.demand().models["chat"].waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert room.demand().models["chat"].waiting == 0

    run(scenario())


def test_closing_answers_every_waiter_and_every_later_request():
    async def scenario():
        room = Waitroom()
        room.apply(table(entry("chat", False)))
        task = asyncio.create_task(room.wait("chat", 5))
        await asyncio.sleep(0)
        room.close()
        with pytest.raises(ShuttingDown):
            await task
        with pytest.raises(ShuttingDown):
            room.lookup("chat")

    run(scenario())


def test_demand_counts_waiting_inflight_and_last_use_for_every_model_of_the_table():
    async def scenario():
        clock = Clock()
        changes: list[bool] = []
        room = Waitroom(on_change=changes.append, clock=clock)
        room.apply(table(entry("chat", True), entry("code", False)))
        assert set(room.demand().models) == {"chat", "code"}
        assert room.demand().models["chat"].last_used_at is None
        room.started("chat")
        clock.now += 2
        room.started("chat")
        assert (
            room.demand().models["chat"].inflight == 2 and room.demand().models["chat"].last_used_at == 1002.0
        )
        changes.clear()
        first = asyncio.create_task(room.wait("code", 5))
        await asyncio.sleep(0)
        second = asyncio.create_task(room.wait("code", 5))
        await asyncio.sleep(0)
        assert changes == [True, False]  # a first waiter is urgent, a second is not
        code = room.demand().models["code"]
        assert (code.waiting, code.oldest_waiting_at, code.inflight) == (2, 1002.0, 0)
        clock.now += 1
        room.finished("chat")
        assert (
            room.demand().models["chat"].inflight == 1 and room.demand().models["chat"].last_used_at == 1003.0
        )
        first.cancel()
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)

    run(scenario())


def test_the_link_client_sends_a_first_waiter_at_once_and_paces_the_rest(monkeypatch):
    """Demand goes out on every table, at once for a first waiter, else at most every DEMAND_INTERVAL_S."""
    monkeypatch.setattr(linkclient, "DEMAND_INTERVAL_S", 1.0)  # long: a loaded machine cannot blur it

    async def scenario(daemon: socket.socket, path):
        room = Waitroom()
        client = LinkClient(path, room)
        room.on_change = client.demand_changed
        runner = asyncio.create_task(client.run())
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(daemon)
        conn.setblocking(False)
        received: list[tuple[float, Demand]] = []
        buffer = b""

        async def read_until(count: int, timeout: float = 5.0):
            nonlocal buffer
            async with asyncio.timeout(timeout):
                while len(received) < count:
                    data = await loop.sock_recv(conn, 65536)
                    buffer += data
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        received.append((time.monotonic(), decode(line)))

        await loop.sock_sendall(conn, encode_table(table(entry("chat", True), entry("code", False))))
        await read_until(1)  # the table is answered with the demand at once
        assert client.linked and received[0][1].models["code"].waiting == 0
        await asyncio.sleep(1.05)  # past the interval: the next change is not held back by the last send
        asked = time.monotonic()
        waiter = asyncio.create_task(room.wait("code", 5))
        await read_until(2)
        assert received[1][1].models["code"].waiting == 1
        assert received[1][0] - asked < 0.5  # a first waiter at once, well inside the 1 s interval
        room.started("chat")
        room.finished("chat")
        room.started("chat")
        await read_until(3)
        # The changes after it wait for the interval, and coalesce into one message.
        assert received[2][0] - received[1][0] >= 0.95
        assert received[2][1].models["chat"].inflight == 1
        waiter.cancel()
        runner.cancel()
        await asyncio.gather(waiter, runner, return_exceptions=True)
        conn.close()

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as daemon:
        path = f"/tmp/r3090d-test-link-{time.monotonic_ns()}.sock"
        daemon.bind(path)
        daemon.listen(1)
        daemon.setblocking(False)
        try:
            run(scenario(daemon, path))
        finally:
            os.unlink(path)
