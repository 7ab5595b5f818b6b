"""The control socket's server; the protocol is r3090d.service.control_protocol.

"status" is answered from the daemon's latest state document right here, in
the server thread, so it keeps answering while the loop is busy; every other
command is handed to the loop (Daemon.submit_control) and its reply awaited
with a timeout, so all changes of state still happen in the loop's one thread.

Access is the socket file's: mode 0660, group = the daemon's own group, in a
directory systemd's RuntimeDirectory= makes. Neither the server nor the client
uses a directory that others could write to (r3090d.service.safedir): whoever can
replace the socket can answer for the daemon. Requests that change anything are
logged with the peer's uid and pid (SO_PEERCRED).

The server is one thread around a selector, with non-blocking sockets: an idle
client, a slow reader or a flood of garbage costs a buffer, never a thread, and
every connection has a deadline: a request must arrive whole within
IDLE_TIMEOUT_S, however its bytes trickle in. At MAX_CONNECTIONS a new client
displaces a connection that is not being served (idle, mid-request, or not
reading its replies); it is refused as busy only when the loop is answering a
command for every open connection. Nothing a client sends can raise out of the
server thread.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import selectors
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from r3090d.config.schema import UNIX_PATH_MAX
from r3090d.service import safedir
from r3090d.service.control_protocol import (
    LOOP_TIMEOUT_S,
    RELOAD_TIMEOUT_S,
    RUNTIME_DIR_KEY,
    SOCKET_NAME,
    encode,
    error,
    group_name,
    socket_path,
    validate,
)
from r3090d.service.selectorloop import SelectorServer

log = logging.getLogger("r3090d.service.control")

SOCKET_MODE = 0o660
MAX_REQUEST_BYTES = 64 * 1024  # a request line longer than this is refused and the connection closed
MAX_PENDING_OUTPUT = 4 * 1024 * 1024  # a client that does not read its replies is dropped past this
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 5.0  # to send a (complete) request, and to read a reply
LINGER_S = 1.0  # after a connection's last reply, for the client to close its side


# ------------------------------------------------------------------ server


class ControlError(Exception):
    """The control socket cannot be set up."""


@dataclass
class _Conn:
    sock: socket.socket
    cid: int
    peer: str
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    deadline: float = 0.0
    pending: int | None = None  # token of the command the loop is answering
    pending_cmd: str = ""
    closing: bool = False  # its last reply is queued: nothing more is read as a request
    lingering: bool = False  # last reply sent and our side shut: dropping input until the client closes

    def displace_rank(self) -> int | None:
        """Which connection makes room for a new client first (lowest), or None: it is being served."""
        if self.pending is not None:
            return None  # the loop is answering a command for it
        if self.closing:
            return 0  # done, its last reply on the way out
        if not self.inbuf and not self.outbuf:
            return 1  # idle
        if not self.outbuf:
            return 2  # part of a request
        return 3  # not reading its replies


class ControlServer(SelectorServer):
    """Serves the control socket from one thread; `start()` raises ControlError, nothing after it raises."""

    def __init__(self, runtime_dir: str | Path, get_doc, submit, *, gid: int | None = None):
        super().__init__("control socket", log)
        self.path = socket_path(runtime_dir)
        self._get_doc = get_doc
        self._submit = submit
        self._gid = os.getgid() if gid is None else gid
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._conns: dict[int, _Conn] = {}
        self._next_id = 0
        self._next_token = 0
        self._inode: tuple[int, int] | None = None
        self.counters = {"connections": 0, "requests": 0, "errors": 0, "refused_busy": 0, "displaced": 0}

    # ------------------------------------------------------------ lifecycle

    def start(self) -> ControlServer:
        path = self.path
        tmp = path.with_name(f".{SOCKET_NAME}.{os.getpid()}")
        for p in (path, tmp):
            if len(os.fsencode(p)) > UNIX_PATH_MAX:
                raise ControlError(f"{p}: path longer than {UNIX_PATH_MAX} bytes, too long for a unix socket (use a shorter daemon.runtime_dir)")
        try:
            safedir.ensure(path.parent, RUNTIME_DIR_KEY)
        except safedir.UnsafeDirectory as exc:
            raise ControlError(str(exc)) from None
        self._clear_stale(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            tmp.unlink(missing_ok=True)
            # Bound under a temporary name and renamed once its mode and group are
            # right, so no client ever sees the socket with looser permissions.
            listener.bind(str(tmp))
            os.chmod(tmp, SOCKET_MODE)
            os.chown(tmp, -1, self._gid)
            listener.listen(64)
            os.rename(tmp, path)
            st = os.stat(path)
            self._inode = (st.st_dev, st.st_ino)
        except OSError as exc:
            listener.close()
            tmp.unlink(missing_ok=True)
            raise ControlError(f"cannot create the control socket {path}: {exc.strerror or exc}") from None
        self._run(listener)
        log.info("control socket %s (mode %o, group %s)", path, SOCKET_MODE, group_name(self._gid))
        return self

    @staticmethod
    def _clear_stale(path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ControlError(f"cannot inspect {path}: {exc.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlError(f"{path} exists and is not a socket; remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # left behind by a daemon that died
            return
        finally:
            probe.close()
        raise ControlError(f"another r3090d is answering on {path}; is this instance already running?")

    def stop(self) -> None:
        super().stop()
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:  # never remove a successor's socket
                self.path.unlink()
        except OSError:
            pass

    # ---------------------------------------------------------- the thread

    def _ready(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            self._read(conn)
        if conn.cid in self._conns and mask & selectors.EVENT_WRITE:
            self._flush(conn)

    def _after_events(self, now: float) -> None:
        self._deliver_replies()
        self._expire(now)

    def _admit(self, sock: socket.socket) -> None:
        assert self._sel is not None
        self.counters["connections"] += 1
        if len(self._conns) >= MAX_CONNECTIONS and not self._displace():
            self.counters["refused_busy"] += 1
            try:
                sock.send(encode(error(f"busy: the daemon is answering {MAX_CONNECTIONS} requests, try again")))
            except OSError:
                pass
            sock.close()
            return
        self._next_id += 1
        conn = _Conn(sock=sock, cid=self._next_id, peer=_peer(sock), deadline=time.monotonic() + IDLE_TIMEOUT_S)
        self._conns[conn.cid] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn.cid)
        # A client usually sends its request with the connect: read it now, before
        # a crowd of later connections could displace this one unread.
        self._read(conn)

    def _displace(self) -> bool:
        """Close the connection that is least in use, to make room; False if every one is being served."""
        ranked = [(rank, n, c) for n, c in enumerate(self._conns.values()) if (rank := c.displace_rank()) is not None]
        if not ranked:
            return False
        _, _, victim = min(ranked, key=lambda r: r[:2])  # lowest rank; the oldest (accepted first) among equals
        self.counters["displaced"] += 1
        if not victim.closing and not victim.outbuf:
            try:  # a word of why, if the client reads it; never wait for it
                victim.sock.send(encode(error(f"idle connection closed to make room for another client ({MAX_CONNECTIONS} open)")))
            except OSError:
                pass
        self._close(victim)
        return True

    def _read(self, conn: _Conn) -> None:
        data = self._receive(conn)
        if data is None or conn.closing:
            return  # nothing yet, the client left, or what it sends now is dropped
        conn.inbuf += data
        if conn.pending is not None and len(conn.inbuf) > 4 * MAX_REQUEST_BYTES:
            self._close(conn)  # pipelining far ahead of the answers
            return
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        while conn.pending is None and not conn.closing and conn.cid in self._conns:
            nl = conn.inbuf.find(b"\n")
            if nl < 0:
                if len(conn.inbuf) > MAX_REQUEST_BYTES:
                    self._reply(conn, error(f"request longer than {MAX_REQUEST_BYTES} bytes"), close=True)
                return
            if nl > MAX_REQUEST_BYTES:
                self._reply(conn, error(f"request longer than {MAX_REQUEST_BYTES} bytes"), close=True)
                return
            line = bytes(conn.inbuf[:nl]).strip()
            del conn.inbuf[: nl + 1]
            if line:
                self._handle_line(conn, line)

    def _handle_line(self, conn: _Conn, line: bytes) -> None:
        self.counters["requests"] += 1
        try:
            request = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            self._reply(conn, error("request is not UTF-8 text"))
            return
        except (ValueError, RecursionError) as exc:
            self._reply(conn, error(f"request is not JSON: {str(exc)[:80]}"))
            return
        problem = validate(request)
        if problem is not None:
            self._reply(conn, error(problem))
            return
        cmd = request["cmd"]
        if cmd == "status":
            doc = self._get_doc()
            if doc is None:
                self._reply(conn, {"ok": True, "state": None, "message": "the daemon is starting: no tick yet"})
            else:
                self._reply(conn, {"ok": True, "state": doc})
            return
        log.info("control: %s from %s", json.dumps(request, sort_keys=True), conn.peer)
        self._next_token += 1
        token = self._next_token
        conn.pending, conn.pending_cmd = token, cmd
        conn.deadline = time.monotonic() + (RELOAD_TIMEOUT_S if cmd == "reload" else LOOP_TIMEOUT_S)
        cid = conn.cid

        def reply(result: dict, cid=cid, token=token) -> None:
            # Called from the daemon's loop: only queue, never touch a socket there.
            self._replies.put((cid, token, result))
            self._wake()

        self._submit(dict(request), reply)

    def _deliver_replies(self) -> None:
        while True:
            try:
                cid, token, result = self._replies.get_nowait()
            except queue.Empty:
                return
            conn = self._conns.get(cid)
            if conn is None or conn.pending != token:
                continue  # the client left, or it already got a timeout
            conn.pending = None
            if not isinstance(result, dict):
                result = error("the daemon gave no answer")
            self._reply(conn, result)
            self._process(conn)  # requests pipelined behind this one

    def _expire(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if now < conn.deadline:
                continue
            if conn.pending is not None:
                conn.pending = None
                self._reply(conn, error(f"{conn.pending_cmd}: the daemon loop did not answer in time; it may still act on it"))
                self._process(conn)
            elif conn.closing or conn.outbuf:
                self._close(conn)  # the client does not read its replies
            else:
                why = "incomplete request (no newline)" if conn.inbuf else "no request"
                self._reply(conn, error(f"{why} within {IDLE_TIMEOUT_S:.0f} s"), close=True)

    def _reply(self, conn: _Conn, reply: dict, *, close: bool = False) -> None:
        if not reply.get("ok"):
            self.counters["errors"] += 1
        try:
            data = encode(reply)
        except (TypeError, ValueError) as exc:
            data = encode(error(f"reply could not be encoded: {exc}"))
        conn.outbuf += data
        conn.deadline = time.monotonic() + IDLE_TIMEOUT_S
        if close:
            conn.closing = True
            conn.inbuf.clear()
        if len(conn.outbuf) > MAX_PENDING_OUTPUT:
            self._close(conn)
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        assert self._sel is not None
        if not self._send_buffered(conn):
            return
        if conn.closing and not conn.outbuf:
            if not conn.lingering:
                conn.lingering = self._end_our_side(conn, LINGER_S)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        self._sel.modify(conn.sock, want, conn.cid)



def _peer(sock: socket.socket) -> str:
    try:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return f"uid {uid} pid {pid}"
    except OSError:
        return "unknown peer"


# ------------------------------------------------------------------ wiring


class ControlPlane:
    """The control socket and the exporter of one daemon; either may be missing (logged)."""

    def __init__(self, servers: list):
        self.servers = servers

    def stop(self) -> None:
        for server in reversed(self.servers):
            try:
                server.stop()
            except Exception as exc:  # shutting down: report, keep going
                log.warning("stopping %s: %s", type(server).__name__, exc)


def start_plane(daemon) -> ControlPlane:
    """Start the control socket and (if enabled) the exporter for `daemon`.

    A failure to start either is logged and the daemon goes on supervising:
    keeping the engine up matters more than being able to talk about it.
    """
    from r3090d.service.exporter import Exporter

    servers: list = []
    dc = daemon.cfg.daemon
    try:
        servers.append(ControlServer(dc.runtime_dir, lambda: daemon.latest_doc, daemon.submit_control).start())
    except ControlError as exc:
        log.error("no control socket: %s; r3090ctl will fall back to the state file", exc)
    if dc.exporter_enabled:
        try:
            servers.append(Exporter(dc.exporter_host, dc.exporter_port, lambda: daemon.latest_doc).start())
        except OSError as exc:
            log.error("no exporter on %s:%d: %s (fix: free the port or change daemon.exporter_port)", dc.exporter_host, dc.exporter_port, exc.strerror or exc)
    return ControlPlane(servers)
