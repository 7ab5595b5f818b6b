"""The router's process and its link to the daemon, with real children: the router goes when its daemon
goes, and only the router the daemon started holds the link (the table carries the engines' keys).

The daemon's two pieces are wired here as swap mode's fleet wires them: the link server (the
daemon's end of the socket) and the router's process (`python -m r3090d.router`), the router
spawned and restarted from the thread that runs the test, as the daemon's loop thread does.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from r3090d import exitcodes, procstat
from r3090d.effectors.routerproc import RouterProcess, router_argv, router_env
from r3090d.router.link import EngineState, ModelEntry, ModelKind, Table
from r3090d.service.routerlink import LinkServer
from tests.fakevllm.harness import free_port, http
from tests.waiting import wait_until

pytestmark = pytest.mark.component

BOUND = 30.0  # Python processes starting on a busy 2-core machine
ENGINE_KEY = "engine-key-only-the-router-may-read"
MAX_BODY = 64 * 1024


def table(seq: int, *names: str) -> Table:
    return Table(seq=seq, models=tuple(
        ModelEntry(name, ModelKind.GENERATE, EngineState.READY, True, "http://127.0.0.1:9", ENGINE_KEY) for name in names
    ))  # fmt: skip


def gone(pid: int) -> bool:
    st = procstat.read(pid)
    return st is None or not st.live


@pytest.fixture
def runtime_dir():
    """Unix socket paths hold 107 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="r3090d-link-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Node:
    """The daemon's side in swap mode: its link server and the router it starts; `pump` is one turn of its loop."""

    def __init__(self, runtime_dir: Path):
        self.wake = threading.Event()
        self.port = free_port()
        self.router: RouterProcess | None = None
        self.link = LinkServer(runtime_dir, self.wake, router_pid=lambda: self.router.running_pid())
        argv = router_argv("127.0.0.1", self.port, str(self.link.path), 10.0, MAX_BODY, "")
        self.router = RouterProcess(argv, router_env(dict(os.environ)), self.wake)
        self.table = table(1, "chat")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Node:
        self.link.start()
        self.router.keep_running(time.monotonic())
        return self

    def pump(self) -> None:
        self.router.keep_running(time.monotonic())
        self.link.publish(self.table)

    def served_models(self) -> list[str] | None:
        """What the router lists once it has a table and says it is healthy; None before."""
        self.pump()
        if http().get(self.url + "/healthz", timeout=2.0).status_code != 200:
            return None
        return [m["id"] for m in http().get(self.url + "/v1/models", timeout=2.0).json()["data"]]

    def wait_serving(self, names: list[str]) -> None:
        wait_until(lambda: self.served_models() == names, BOUND, what=f"the router serving {names}",
                   ignoring=(httpx.TransportError,))  # fmt: skip

    def close(self) -> None:
        self.router.stop()
        self.link.close()


@pytest.fixture
def node(runtime_dir):
    n = Node(runtime_dir)
    yield n
    n.close()


def read_until_closed(sock: socket.socket, pump) -> tuple[bytes, bool]:
    """What `sock` receives while the daemon runs its loop, until it closes the connection or sends something."""
    got = bytearray()

    def closed_or_sent() -> bool:
        pump()
        try:
            chunk = sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return bool(got)
        if not chunk:
            return True
        got.extend(chunk)
        return False  # read on: the whole line, and the close if one comes

    try:
        wait_until(closed_or_sent, BOUND, what="the link to close the impostor's connection")
    except AssertionError:
        if not got:
            raise
        return bytes(got), False
    return bytes(got), True


def test_an_impostor_on_the_link_is_refused_and_sent_nothing_and_the_router_stays_linked(node, caplog):
    caplog.set_level(logging.WARNING, logger="r3090d")
    node.start()
    node.wait_serving(["chat"])
    router = node.router.sample().pid

    # The router paused: it cannot open a connection of its own meanwhile, so whatever the impostor is
    # sent, it is sent because the daemon took it for the router.
    os.kill(router, signal.SIGSTOP)
    # The impostor: this test's process, of the same user, not the router.
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        impostor.connect(str(node.link.path))
        node.table = table(2, "chat", "coder")  # a change: the daemon sends it to whoever holds the link
        got, closed = read_until_closed(impostor, node.pump)
    finally:
        impostor.close()
        os.kill(router, signal.SIGCONT)
    assert got == b"", f"the impostor was sent {len(got)} bytes (the table, with the engines' keys)"
    assert closed
    refused = [r.getMessage() for r in caplog.records if f"pid {os.getpid()}" in r.getMessage()]
    assert len(refused) == 1 and refused[0].startswith("router link: refused"), caplog.text
    assert all(ENGINE_KEY not in r.getMessage() for r in caplog.records)

    node.wait_serving(["chat", "coder"])  # the router still holds the link and got the change
    assert node.router.sample().pid == router and node.link.linked


def test_a_restarted_router_is_linked_again(node):
    node.start()
    node.wait_serving(["chat"])
    first = node.router.sample().pid
    os.kill(first, signal.SIGKILL)

    def restarted() -> bool:
        node.pump()
        return node.router.sample().pid not in (None, first)

    wait_until(restarted, BOUND, what="a new router", details=lambda: repr(node.router.sample()))
    node.table = table(2, "chat", "coder")
    node.wait_serving(["chat", "coder"])
    assert node.link.linked


PARENT = textwrap.dedent("""
    import os, sys, threading, time
    from r3090d.effectors.routerproc import RouterProcess, router_argv, router_env
    router = RouterProcess(router_argv("127.0.0.1", int(sys.argv[1]), sys.argv[2], 10.0, 65536, ""),
                           router_env(dict(os.environ)), threading.Event())
    router.keep_running(time.monotonic())
    print(router.sample().pid, flush=True)
    time.sleep(300)
""")


def test_a_router_whose_daemon_is_killed_exits_and_frees_the_port(runtime_dir):
    port = free_port()
    daemon = subprocess.Popen([sys.executable, "-c", PARENT, str(port), str(runtime_dir / "router.sock")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    router = None
    try:
        router = int(daemon.stdout.readline())
        wait_until(lambda: http().get(f"http://127.0.0.1:{port}/healthz", timeout=2.0).status_code == 503, BOUND,
                   what="the router answering (not linked)", ignoring=(httpx.TransportError,))  # fmt: skip
        daemon.kill()
        daemon.wait()
        wait_until(lambda: gone(router), BOUND, what=f"the router (pid {router}) to go with its daemon")
        # The public port is free for the next daemon's router, which binds as this (SO_REUSEADDR, as
        # aiohttp does: the TIME_WAIT of this test's own requests does not count).
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        daemon.kill()
        daemon.wait()
        if router is not None and not gone(router):
            os.kill(router, signal.SIGKILL)


def test_a_router_whose_daemon_is_already_gone_does_not_serve(runtime_dir):
    """The daemon died between the fork and the router's parent-death signal: the router sees another parent."""
    port = free_port()
    not_its_parent = os.getppid()  # the router's parent is this process
    argv = router_argv("127.0.0.1", port, str(runtime_dir / "router.sock"), 10.0, MAX_BODY, "")
    done = subprocess.run([*argv, "--parent", str(not_its_parent)], env=router_env(dict(os.environ)),
                          capture_output=True, text=True, timeout=BOUND)  # fmt: skip
    assert done.returncode == exitcodes.TEMPFAIL, done
    assert done.stderr.splitlines() == [
        f"python -m r3090d.router: the daemon that started it (pid {not_its_parent}) is gone; not serving"
    ]
