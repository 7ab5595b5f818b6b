"""What the control socket's server and the exporter's HTTP server share: one thread
over a selector, non-blocking sockets, a socket pair that wakes the thread, and a
loop that no client and no bug can stop.

A subclass says how a connection is served (`_ready`), what happens once every
pass (`_after_events`), how a connection is taken in (`_admit`) and what a failed
accept means (`_accept_failed`); the loop, the accepting and the shutdown are here.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time

LISTENER, WAKE = "listener", "wake"  # selector keys' data; a connection's is its integer id
ACCEPTS_PER_PASS = 64  # so a flood of connects cannot keep the loop from the open ones
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def unregister_and_close(sel: selectors.BaseSelector | None, sock: socket.socket) -> None:
    """Forget a connection: a socket already gone from the selector (or a closed selector) is fine."""
    try:
        if sel is not None:
            sel.unregister(sock)
    except (KeyError, ValueError, OSError):
        pass
    sock.close()


def drain(wake_r: socket.socket) -> None:
    """Empty the wake-up socket (non-blocking) so the selector stops reporting it."""
    try:
        while wake_r.recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass


class SelectorServer:
    """One serving thread over a selector. Connections are objects with `sock`, `cid` and `deadline`."""

    def __init__(self, label: str, logger: logging.Logger):
        self._label = label  # names the thread and starts its log lines
        self._log = logger
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._conns: dict = {}  # cid -> connection, in accept order: the first is the oldest
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def _run(self, listener: socket.socket) -> None:
        """Serve a listening socket from a new thread."""
        listener.setblocking(False)
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, WAKE)
        self._thread = threading.Thread(target=self._serve, name=self._label, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(5.0)
        for conn in list(self._conns.values()):
            self._close(conn)
        for s in (self._listener, self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self._sel is not None:
            self._sel.close()

    def _wake(self) -> None:
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass  # full or closed: the thread is awake anyway

    # ---------------------------------------------------------- the thread

    def _serve(self) -> None:
        assert self._sel is not None and self._wake_r is not None
        while not self._stopping:
            now = time.monotonic()
            wake_at = min([now + 1.0, *(c.deadline for c in self._conns.values()), *self._other_wake_times()])
            try:
                events = self._sel.select(max(0.0, wake_at - now))
            except OSError as exc:  # should not happen; never spin on it
                self._log.error("%s: select failed: %s", self._label, exc)
                time.sleep(0.1)
                continue
            for key, mask in events:
                conn = self._conns.get(key.data) if isinstance(key.data, int) else None
                try:
                    if key.data == LISTENER:
                        self._accept()
                    elif key.data == WAKE:
                        drain(self._wake_r)
                    elif conn is not None:
                        self._ready(conn, mask)
                except Exception:  # a bug must cost one connection, not the server
                    self._log.exception("%s: unexpected error", self._label)
                    if conn is not None:
                        self._close(conn)
            try:
                self._after_events(time.monotonic())
            except Exception:
                self._log.exception("%s: unexpected error", self._label)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(ACCEPTS_PER_PASS):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in OUT_OF_DESCRIPTORS and self._accept_failed(exc):
                    continue
                return
            sock.setblocking(False)
            self._admit(sock)

    def _receive(self, conn) -> bytes | None:
        """What the client sent, or None: nothing yet, or the client left (the connection is then closed;
        a partial request dies with it)."""
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data = b""  # reset: as gone as a close
        if not data:
            self._close(conn)
            return None
        return data

    def _send_buffered(self, conn) -> bool:
        """Send what `conn.outbuf` holds until the socket would block (the selector then says when
        it can take more); False when the client left, and the connection is closed."""
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                self._close(conn)  # reset or broken pipe
                return False
            del conn.outbuf[:sent]
        return True

    def _end_our_side(self, conn, linger_s: float) -> bool:
        """After a connection's last reply: shut our side and keep reading (the subclass drops what
        comes) until the client closes or `linger_s` passes. Closing with input unread would reset
        the connection, which can destroy the reply in the client's buffers, or fail the client's
        send of the rest of its request before it could read why. False if the connection is closed."""
        assert self._sel is not None
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return False
        conn.deadline = time.monotonic() + linger_s
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn.cid)
        return True

    def _close(self, conn) -> None:
        if self._conns.pop(conn.cid, None) is not None:
            unregister_and_close(self._sel, conn.sock)

    # ------------------------------------------------------------ the subclass's part

    def _other_wake_times(self) -> list[float]:
        """Monotonic times, besides the connections' deadlines, at which the loop must look again."""
        return []

    def _ready(self, conn, mask: int) -> None:
        """The selector reports `conn` readable or writable (`mask`)."""
        raise NotImplementedError

    def _after_events(self, now: float) -> None:
        """Once a pass, after the events: deadlines and other work."""
        raise NotImplementedError

    def _admit(self, sock: socket.socket) -> None:
        """Take in an accepted (non-blocking) connection."""
        raise NotImplementedError

    def _accept_failed(self, exc: OSError) -> bool:
        """Out of descriptors or buffers: True to try accepting again at once."""
        self._log.warning("%s: cannot accept: %s", self._label, exc.strerror)
        return False
