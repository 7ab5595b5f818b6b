"""A small HTTP/1.0 server for the exporter: one thread, a selector, non-blocking sockets.

Slow or idle clients cannot starve it: a request's head must arrive within
HEADER_TIMEOUT_S of the connect however the bytes trickle in (a 408 otherwise),
the reply must be taken within REPLY_TIMEOUT_S, and past MAX_HTTP_CONNECTIONS
the oldest connection makes room for the newest. Replies are built in the
server's thread by the `respond` callable, which must be quick (the exporter's
are well under a millisecond). Request parsing and reply rendering are pure.
"""

from __future__ import annotations

import enum
import itertools
import logging
import re
import selectors
import socket
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

from r3090d.service.selectorloop import LISTENER, SelectorServer

log = logging.getLogger("r3090d.service.exporter")

HEADER_TIMEOUT_S = 2.0  # for the whole request head, counted from the connect: bytes that trickle in buy no time
REPLY_TIMEOUT_S = 5.0  # for the whole reply, for a client that reads slowly
LINGER_S = 1.0  # after the reply, for the client to close its side
MAX_HEAD_BYTES = 16 * 1024
MAX_DISCARD_BYTES = 1024 * 1024  # read and dropped after the reply, at most
MAX_HTTP_CONNECTIONS = 512  # open at once; past it the oldest makes room for the newest
LISTEN_BACKLOG = 128
ACCEPT_PAUSE_S = 0.1  # out of file descriptors with no connection to give up


class Method(enum.Enum):
    GET = "GET"
    HEAD = "HEAD"


@dataclass(frozen=True)
class HttpRequest:
    method: Method
    path: str  # without the query string
    accept: str | None  # the Accept header(s), joined


@dataclass(frozen=True)
class HttpReply:
    code: int
    content_type: str
    body: bytes


def text_reply(code: int, text: str) -> HttpReply:
    return HttpReply(code, "text/plain; charset=utf-8", (text + "\n").encode())


_HEAD_END = re.compile(rb"\r?\n\r?\n")
_VERSION = re.compile(r"HTTP/(\d)\.(\d)")


def head_end(buf: bytes | bytearray, start: int = 0) -> int | None:
    """The length of the request head in `buf` (blank line included), or None while it is incomplete (pure)."""
    m = _HEAD_END.search(buf, start)
    return m.end() if m else None


def parse_head(head: bytes) -> HttpRequest | HttpReply:
    """The request in a complete request head, or the error reply it gets (pure)."""
    lines = head.decode("latin-1").split("\n")
    parts = lines[0].strip().split()
    if len(parts) != 3 or not _VERSION.fullmatch(parts[2]):
        return text_reply(400, "bad request line")
    method, target, version = parts
    if not version.startswith("HTTP/1."):
        return text_reply(505, "HTTP/1.x only")
    accepts = []
    for line in lines[1:]:
        line = line.rstrip("\r")
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return text_reply(400, "bad header line")
        if name.lower() == "accept":
            accepts.append(value.strip())
    if method not in Method.__members__:
        return text_reply(501, "only GET and HEAD")
    return HttpRequest(Method(method), target.split("?", 1)[0], ", ".join(accepts) or None)


def render(reply: HttpReply, *, body: bool, now: float) -> bytes:
    """The reply on the wire: HTTP/1.0, and the connection closes after it (pure)."""
    head = (
        f"HTTP/1.0 {reply.code} {HTTPStatus(reply.code).phrase}\r\n"
        f"Server: r3090d\r\n"
        f"Date: {formatdate(now, usegmt=True)}\r\n"
        f"Content-Type: {reply.content_type}\r\n"
        f"Content-Length: {len(reply.body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + (reply.body if body else b"")


class Stage(enum.Enum):
    READING = "reading"  # the request head
    WRITING = "writing"  # the reply
    LINGERING = "lingering"  # reply sent: what the client still sends is dropped until it closes


@dataclass(eq=False)
class _HttpConn:
    sock: socket.socket
    cid: int
    stage: Stage
    deadline: float
    inbuf: bytearray = field(default_factory=bytearray)
    scanned: int = 0  # inbuf[:scanned] holds no head end
    outbuf: bytearray = field(default_factory=bytearray)
    discarded: int = 0


class _HttpServer(SelectorServer):
    """HTTP/1.0 on one thread; `start()` raises OSError (the port), nothing after it raises."""

    def __init__(self, host: str, port: int, family: socket.AddressFamily, respond):
        super().__init__("exporter", log)
        self._address = (host, port)
        self._family = family
        self._respond = respond  # HttpRequest -> HttpReply; must not raise
        self._conns: dict[int, _HttpConn] = {}
        self._ids = itertools.count(1)
        self._accept_paused_until: float | None = None
        self.counters = {"connections": 0, "displaced": 0, "timed_out": 0}

    def start(self) -> int:
        """Listen, start the thread; returns the port."""
        listener = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(self._address)
            listener.listen(LISTEN_BACKLOG)
        except OSError:
            listener.close()
            raise
        self._run(listener)
        return listener.getsockname()[1]

    # ---------------------------------------------------------- the thread

    def _other_wake_times(self) -> list[float]:
        return [] if self._accept_paused_until is None else [self._accept_paused_until]

    def _ready(self, conn: _HttpConn, mask: int) -> None:
        self._step(conn)

    def _after_events(self, now: float) -> None:
        self._expire(now)

    def _accept_failed(self, exc: OSError) -> bool:
        if self._conns:
            self._displace_oldest()  # frees a descriptor for the next try
            return True
        super()._accept_failed(exc)
        self._pause_accepting()
        return False

    def _admit(self, sock: socket.socket) -> None:
        assert self._sel is not None
        self.counters["connections"] += 1
        while len(self._conns) >= MAX_HTTP_CONNECTIONS:
            self._displace_oldest()
        conn = _HttpConn(sock=sock, cid=next(self._ids), stage=Stage.READING, deadline=time.monotonic() + HEADER_TIMEOUT_S)
        self._conns[conn.cid] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn.cid)
        self._step(conn)  # most clients send their request with the connect: answer it now

    def _displace_oldest(self) -> None:
        self.counters["displaced"] += 1
        self._close(next(iter(self._conns.values())))

    def _pause_accepting(self) -> None:
        # Out of descriptors with no connection to give up: the listener would stay
        # readable and spin the loop, so stop watching it for a moment.
        assert self._sel is not None and self._listener is not None
        self._sel.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S

    def _step(self, conn: _HttpConn) -> None:
        if conn.stage is Stage.WRITING:
            self._flush(conn)
            return
        data = self._receive(conn)
        if data is None:
            return
        if conn.stage is Stage.LINGERING:
            conn.discarded += len(data)
            if conn.discarded > MAX_DISCARD_BYTES:
                self._close(conn)
            return
        conn.inbuf += data
        end = head_end(conn.inbuf, conn.scanned)
        if end is None:
            conn.scanned = max(0, len(conn.inbuf) - 3)
            if len(conn.inbuf) > MAX_HEAD_BYTES:
                self._answer(conn, text_reply(431, f"request head longer than {MAX_HEAD_BYTES} bytes"))
            return
        if end > MAX_HEAD_BYTES:
            self._answer(conn, text_reply(431, f"request head longer than {MAX_HEAD_BYTES} bytes"))
            return
        parsed = parse_head(bytes(conn.inbuf[:end]))
        if isinstance(parsed, HttpReply):
            self._answer(conn, parsed)
        else:
            self._answer(conn, self._respond(parsed), body=parsed.method is Method.GET)

    def _answer(self, conn: _HttpConn, reply: HttpReply, *, body: bool = True) -> None:
        assert self._sel is not None
        conn.outbuf = bytearray(render(reply, body=body, now=time.time()))
        conn.inbuf.clear()
        conn.stage = Stage.WRITING
        conn.deadline = time.monotonic() + REPLY_TIMEOUT_S
        self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn.cid)
        self._flush(conn)

    def _flush(self, conn: _HttpConn) -> None:
        if not self._send_buffered(conn) or conn.outbuf:
            return
        if self._end_our_side(conn, LINGER_S):
            conn.stage = Stage.LINGERING

    def _expire(self, now: float) -> None:
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            assert self._sel is not None and self._listener is not None
            self._accept_paused_until = None
            self._sel.register(self._listener, selectors.EVENT_READ, LISTENER)
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            if conn.stage is Stage.READING:
                self.counters["timed_out"] += 1
                self._answer(conn, text_reply(408, f"request head not received within {HEADER_TIMEOUT_S:g} s"))
            else:
                self._close(conn)  # a reply not taken in time, or a client that does not close
