"""The control socket's connection limit against clients that connect and send nothing.

Idle connections cost the server a buffer each; only connections it is
actually serving (a command the loop is answering) may make it refuse others
as busy. A request must arrive whole within the idle timeout of the connect,
however slowly its bytes trickle in.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from r3090d.service import control, control_client
from tests.slow_client import dribble
from tests.waiting import wait_until

pytestmark = pytest.mark.component

STATE = {"engine": {"phase": "ready"}}


class Loop:
    """The daemon loop's side of submit(): holds every command unanswered until told."""

    def __init__(self):
        self.held: list = []

    def submit(self, request: dict, reply) -> None:
        self.held.append((request, reply))

    def answer_all(self) -> None:
        for _, reply in self.held:
            reply({"ok": True})
        self.held.clear()


@pytest.fixture
def loop():
    return Loop()


@pytest.fixture
def server(rundir, loop):
    srv = control.ControlServer(rundir, lambda: STATE, loop.submit).start()
    yield srv
    srv.stop()


def connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def test_64_idle_connections_do_not_turn_40_requests_away(rundir, server):
    idle = [connect(server.path) for _ in range(control.MAX_CONNECTIONS)]
    try:
        wait_until(lambda: server.counters["connections"] >= len(idle), 10, what="the idle connections accepted")
        outcomes = []
        t0 = time.monotonic()
        for _ in range(40):
            try:
                rep = control_client.request(rundir, {"cmd": "status"}, 5.0)
                outcomes.append("ok" if rep.get("ok") and rep["state"] == STATE else str(rep)[:100])
            except control_client.ClientError as exc:
                outcomes.append(str(exc))
        took = time.monotonic() - t0
        closed = []
        for s in idle:
            s.settimeout(0)
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            closed.append(data)
    finally:
        for s in idle:
            s.close()
    bad = [o for o in outcomes if o != "ok"]
    print(
        f"\n40 status requests past {len(idle)} idle connections in {took * 1000:.0f} ms: {len(bad)} failed; "
        f"idle connections closed to make room {len(closed)}; busy refusals {server.counters['refused_busy']}"
    )
    assert bad == [], bad[:3]
    assert server.counters["refused_busy"] == 0
    # Those closed to make room were told why (or had already been closed when they read).
    told = [json.loads(d.splitlines()[0]) for d in closed if d]
    assert all(r["ok"] is False and "idle" in r["error"] for r in told), told[:3]
    assert took < 5.0  # no request waited for an idle connection's timeout


def test_busy_applies_only_when_every_connection_is_being_served(rundir, server, loop):
    served = [connect(server.path) for _ in range(control.MAX_CONNECTIONS)]
    try:
        for s in served:
            s.sendall(b'{"cmd": "restart"}\n')  # the loop holds each one unanswered
        wait_until(lambda: len(loop.held) == len(served), 10, what="every restart handed to the loop")
        rep = control_client.request(rundir, {"cmd": "status"}, 5.0)
        assert rep["ok"] is False and rep["error"].startswith("busy:"), rep
        loop.answer_all()
        replies = [json.loads(s.recv(4096).splitlines()[0]) for s in served]
        assert all(r == {"ok": True} for r in replies), replies[:3]
        # Served and answered, those connections are idle now: they no longer count.
        rep = control_client.request(rundir, {"cmd": "status"}, 5.0)
        assert rep["ok"] is True and rep["state"] == STATE
    finally:
        for s in served:
            s.close()


def test_a_request_sent_a_byte_at_a_time_is_cut_at_the_deadline(rundir, server, monkeypatch):
    monkeypatch.setattr(control, "IDLE_TIMEOUT_S", 1.0)
    data = b'{"cmd": "status"' + b" " * 10_000
    with connect(server.path) as s:
        got, took = dribble(s, data, give_up_after=5.0, answered=lambda got: got.endswith(b"\n"))
    print(f"\ndribbling control client cut after {took:.2f} s: {got[:80]!r}")
    assert 0.9 <= took < 2.0
    assert json.loads(got.splitlines()[0]) == {"ok": False, "error": "incomplete request (no newline) within 1 s"}


def test_a_client_still_writing_an_oversized_request_reads_why_it_was_refused(server):
    # 300 KB is more than a unix socket buffers: the server answers after 64 KB while
    # the client is still inside sendall. Closing then would break the client's send
    # (EPIPE) before it could read the reply; the server must take and drop the rest.
    data = b'{"cmd": "status", "x": "' + b"a" * 300_000 + b'"}\n'
    with connect(server.path) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert json.loads(got) == {"ok": False, "error": f"request longer than {control.MAX_REQUEST_BYTES} bytes"}
    wait_until(lambda: not server._conns, timeout=5, what="the server to let the connection go")
