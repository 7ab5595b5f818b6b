"""A client that sends its request one byte at a time, for tests of a server's deadline on a whole request."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

PACE_S = 0.05  # between bytes: each byte well inside any per-read timeout a server might keep


def dribble(
    sock: socket.socket,
    data: bytes,
    *,
    give_up_after: float,
    answered: Callable[[bytes], bool] = lambda got: False,
) -> tuple[bytes, float]:
    """Send `data` a byte every PACE_S, reading between bytes, until the server closes or `answered(what came back)`.

    Returns what came back and the seconds from the first byte to the end. Stops sending after
    `give_up_after` s, so a server with no deadline fails the caller's bound instead of hanging the test.
    """
    sock.setblocking(False)
    t0 = time.monotonic()
    got = b""
    for i in range(len(data)):
        try:
            chunk = sock.recv(4096)
        except BlockingIOError:
            chunk = None
        except OSError:
            break
        if chunk is not None:
            got += chunk
            if not chunk or answered(got):
                break
        try:
            sock.send(data[i : i + 1])
        except OSError:
            pass  # closed by the server: its reply is read next round
        if time.monotonic() - t0 > give_up_after:
            break
        time.sleep(PACE_S)  # the slow client's pace, not a wait for a condition
    return got, time.monotonic() - t0
