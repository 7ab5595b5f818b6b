"""A socket server that answers every connection with the same bytes, whatever it was asked.

A stand-in for a peer whose answer a test fixes in advance: an HTTP proxy that refuses everything,
a forged control socket. It counts the connections and keeps what they sent, so a test can tell
whether a client came to it at all.
"""

from __future__ import annotations

import socket
import threading

ACCEPT_POLL_S = 0.05  # how often accept() wakes to see whether close() was called
CLIENT_TIMEOUT_S = 2.0  # a client that connects and never sends must not hold the server up


class CannedReplyServer:
    """Serves `listener` (bound and listening, TCP or Unix) in a thread until `close()`.

    Each connection is counted in `connections`, its first read (64 KiB at most) is added to
    `received`, and `reply` is sent back before the connection is closed.
    """

    def __init__(self, listener: socket.socket, reply: bytes):
        self.listener = listener
        self.listener.settimeout(ACCEPT_POLL_S)
        self.reply = reply
        self.connections = 0
        self.received = b""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(CLIENT_TIMEOUT_S)
                try:
                    self.received += conn.recv(65536)
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()
