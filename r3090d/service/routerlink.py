"""The daemon's end of the router link (swap mode): a unix socket only the service user can use.

The router connects and reads the model table (r3090d.router.link); the daemon sends it on
connect and whenever it changes, from the loop, so the router learns that an engine is
ready in the tick it became so. The router's demand (waiting and running requests per
model) is read by a thread, kept as the latest, and wakes the loop, so the arbiter plans
a swap as soon as a request for a parked model arrives. A line that does not decode is
logged and skipped.

The table carries the engines' API keys, so the link is the router's alone: a connection is
accepted only from the router process the daemon started last (its pid, from SO_PEERCRED),
which replaces any connection held before (the router reconnecting, or a restarted one).
Any other connection, of our own user or not, is closed unread and unanswered, with one
warning line; it never takes the router's place.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from r3090d.router.link import Demand, LinkError, Table, decode, encode_table

log = logging.getLogger("r3090d")

LINK_FILE = "router.sock"
SEND_TIMEOUT_S = 1.0  # a router that does not read its table in this long is not waited for


class LinkServer:
    def __init__(self, runtime_dir: str | Path, wake: threading.Event, router_pid: Callable[[], int | None]):
        """`router_pid`: the pid of the router the daemon started, while it runs (RouterProcess.running_pid)."""
        self.path = Path(runtime_dir) / LINK_FILE
        self.wake = wake
        self.router_pid = router_pid
        self.lock = threading.Lock()
        self.conn: socket.socket | None = None
        self.sent: Table | None = None  # what the connected router has
        self.demand = Demand(models={})
        self.listener: socket.socket | None = None
        self.closed = False

    def start(self) -> LinkServer:
        self.path.unlink(missing_ok=True)  # left behind by a daemon that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # mode 0600 from the start: no moment when others could connect
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(4)
        self.listener = sock
        threading.Thread(target=self._accept, name="router-link", daemon=True).start()
        return self

    @property
    def linked(self) -> bool:
        return self.conn is not None

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            peer, router = _peer(conn), self.router_pid()
            if peer is None or peer != (router, os.getuid()):
                log.warning("router link: refused a connection from %s: only the router this daemon started (%s) may hold the link",
                            _who(peer), f"pid {router}" if router else "none runs now")  # fmt: skip
                _close(conn)
                continue
            with self.lock:
                old, self.conn, self.sent = self.conn, conn, None
                self.demand = Demand(models={})
            if old is not None:
                _close(old)
            threading.Thread(target=self._read, args=(conn,), name="router-link-read", daemon=True).start()
            self.wake.set()  # the loop sends the table to the new router now

    def _read(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._line(line)
                if len(buf) > 1 << 20:
                    log.warning("router link: a line over 1 MiB, dropped")
                    buf = b""
        except OSError:
            pass
        with self.lock:
            if self.conn is conn:
                self.conn, self.sent = None, None
                self.demand = Demand(models={})
        _close(conn)
        self.wake.set()

    def _line(self, line: bytes) -> None:
        try:
            msg = decode(line)
        except LinkError as exc:
            log.warning("router link: %s", exc)
            return
        if isinstance(msg, Demand):
            with self.lock:
                changed = msg != self.demand
                self.demand = msg
            if changed:
                self.wake.set()

    def latest(self) -> Demand:
        with self.lock:
            return self.demand

    def publish(self, table: Table) -> None:
        """Send the table if the connected router does not have it (same models and states)."""
        with self.lock:
            conn = self.conn
            if conn is None or (self.sent is not None and self.sent.models == table.models):
                return
        try:
            _send_all(conn, encode_table(table), SEND_TIMEOUT_S)
        except OSError as exc:
            log.warning("router link: cannot send the table (%s); the router will be sent it when it connects again", exc)
            _close(conn)
            return
        with self.lock:
            if self.conn is conn:
                self.sent = table

    def close(self) -> None:
        self.closed = True
        if self.listener is not None:
            _close(self.listener)
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is not None:
            _close(conn)
        self.path.unlink(missing_ok=True)


def _peer(conn: socket.socket) -> tuple[int, int] | None:
    """The (pid, uid) of the process that connected, from the kernel; None if it cannot be read."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _who(peer: tuple[int, int] | None) -> str:
    return "an unknown process" if peer is None else f"pid {peer[0]} (uid {peer[1]})"


def _send_all(conn: socket.socket, data: bytes, timeout: float) -> None:
    """Without blocking the loop past `timeout`; not with settimeout, which would time out the reader's recv too."""
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    while view:
        try:
            view = view[conn.send(view, socket.MSG_DONTWAIT) :]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [conn], [], left)[1]:
            raise TimeoutError(f"the router did not read {len(data)} bytes in {timeout:.0f} s")


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
