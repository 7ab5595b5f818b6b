"""A stdlib HTTP server on 127.0.0.1, run in a thread, that answers through a handler class a test writes.

`QuietHandler` is the base for such a handler: HTTP/1.1, no access log, `answer()` for a whole body.
`serving()` runs a handler class on a free port for the length of a `with` block; `base_url()` is its address.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that speaks HTTP/1.1 and writes no access log line."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass  # a line on stderr for every request would bury the output of a failing test

    def answer(self, status: int, body: bytes, content_type: str | None = "application/json") -> None:
        """Sends `body` whole with its Content-Length, and `content_type` unless that is None."""
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: a client that opens a burst of connections at once
    # (an async load generator) can then be reset on a loaded machine before it is accepted.
    request_queue_size = 128


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    """Serves `handler` on a free port of 127.0.0.1 until the block ends; the server.

    Shutting down and closing a server the block already stopped is harmless.
    """
    httpd = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def base_url(httpd: ThreadingHTTPServer) -> str:
    """The base URL a client reaches `httpd` at."""
    return f"http://127.0.0.1:{httpd.server_address[1]}"
