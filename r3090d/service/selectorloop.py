"""What the control socket's server and the exporter's HTTP server share: both run one
thread over a selector, with a socket pair that wakes it."""

from __future__ import annotations

import selectors
import socket


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
