"""A TCP server that accepts connections and never says a word: a peer hung behind its port."""

from __future__ import annotations

import socket
import threading


class SilentServer:
    """Listens on 127.0.0.1 (`port` 0: any free one), accepts every connection, answers none.

    An SMTP server hung before its banner, an Alertmanager hung behind its port.
    `accepted` shows that a client really did connect.
    """

    def __init__(self, port: int = 0, backlog: int = 64):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(backlog)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        # A thread blocked in accept() keeps the socket listening past close(): shutdown() wakes it first.
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()
