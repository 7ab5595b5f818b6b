"""One request passed to an engine and its answer passed back: status, headers, and the body chunk by chunk.

Nothing is buffered: each piece of the engine's body is written to the client
as it arrives, so an SSE stream's first token reaches the client when vLLM
sends it. A client that disconnects cancels its handler (the server runs with
handler cancellation); the engine's connection is then closed, not pooled, and
vLLM aborts the request. A failure before the engine sent any byte raises
Unreachable, so the caller can queue the request again; after that, the
client's connection is cut, so the client sees a broken stream, not a
truncated one that looks whole.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from r3090d.router.link import UNIX_PREFIX, ModelEntry

log = logging.getLogger("r3090d.router")

# RFC 9110 section 7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade")
)  # fmt: skip
# Set by the client library for the new connection, or by the router itself.
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "authorization", "expect"}
CONNECT_TIMEOUT_S = 10.0  # 127.0.0.1 answers or refuses at once; a full accept queue is the only wait
# vLLM's uvicorn closes an idle keep-alive connection after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): the
# pool drops its own sooner, so a request is not sent on a connection the engine is closing.
KEEPALIVE_S = 4.0


class Unreachable(Exception):
    """The engine answered nothing. `refused`: nobody listens there (a swap or a crash), so wait for a newer table."""

    def __init__(self, refused: bool, reason: str):
        super().__init__(reason)
        self.refused = refused


class BadAnswer(Exception):
    """The engine's answer was not HTTP that could be read; nothing was sent to the client yet."""


# An engine on a unix socket: the URL's host is a placeholder (the connector goes to the socket).
UNIX_BASE_URL = "http://localhost"


def session(socket_path: str = "") -> aiohttp.ClientSession:
    """A client session: no pool limit (every stream holds a connection), no proxy from the environment,
    no overall timeout (a stream lasts as long as it generates), bodies passed as they are.
    `socket_path`: every request goes to that unix socket; empty: TCP, to the URL's host."""
    if socket_path:
        connector: aiohttp.BaseConnector = aiohttp.UnixConnector(
            path=socket_path, limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
        )
    else:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S, use_dns_cache=False
        )
    return aiohttp.ClientSession(
        connector=connector,
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=None),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        cookie_jar=aiohttp.DummyCookieJar(),
        raise_for_status=False,
    )


class Clients:
    """The sessions toward the engines: one for those on TCP ports, one per unix socket (aiohttp's
    connector for a socket goes to that socket alone). Made on first use, inside the event loop."""

    def __init__(self) -> None:
        self._tcp: aiohttp.ClientSession | None = None
        self._unix: dict[str, aiohttp.ClientSession] = {}

    def url_for(self, entry: ModelEntry, raw_path: str) -> tuple[aiohttp.ClientSession, str]:
        """The session that reaches `entry`'s engine, and the URL of `raw_path` there."""
        if entry.upstream.startswith(UNIX_PREFIX):
            path = entry.upstream[len(UNIX_PREFIX) :]
            client = self._unix.get(path)
            if client is None:
                client = self._unix[path] = session(path)
            return client, UNIX_BASE_URL + raw_path
        if self._tcp is None:
            self._tcp = session()
        return self._tcp, entry.upstream + raw_path

    async def close(self) -> None:
        for client in [self._tcp, *self._unix.values()]:
            if client is not None:
                await client.close()
        self._tcp, self._unix = None, {}


def _connection_tokens(headers: CIMultiDictProxy[str]) -> set[str]:
    """The headers a Connection header names: hop-by-hop for this connection too."""
    return {
        t.strip().lower() for value in headers.getall("Connection", ()) for t in value.split(",") if t.strip()
    }


def request_headers(incoming: CIMultiDictProxy[str], upstream_key: str) -> CIMultiDict[str]:
    """The client's headers for the engine: hop-by-hop ones and the client's key dropped, the engine's key added."""
    drop = NOT_FORWARDED | _connection_tokens(incoming)
    out = CIMultiDict((k, v) for k, v in incoming.items() if k.lower() not in drop)
    if upstream_key:
        out["Authorization"] = f"Bearer {upstream_key}"
    return out


def response_headers(incoming: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    drop = HOP_BY_HOP | _connection_tokens(incoming)
    return CIMultiDict((k, v) for k, v in incoming.items() if k.lower() not in drop)


async def forward(
    clients: Clients, request: web.Request, body: bytes, entry: ModelEntry
) -> web.StreamResponse:
    """Sends `request` (its body already read) to `entry`'s engine and streams the answer back."""
    client, url = clients.url_for(entry, request.raw_path)
    try:
        upstream = await client.request(
            request.method, url, data=body, headers=request_headers(request.headers, entry.upstream_key)
        )
    except (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError) as exc:  # refused, or no accept in time
        raise Unreachable(True, str(exc) or type(exc).__name__) from None
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise Unreachable(False, str(exc) or type(exc).__name__) from None
    except aiohttp.ClientError as exc:  # it answered, but not in HTTP the client library can read
        raise BadAnswer(" ".join((str(exc) or type(exc).__name__).split())[:200]) from None
    complete = False
    out = web.StreamResponse(
        status=upstream.status, reason=upstream.reason, headers=response_headers(upstream.headers)
    )
    try:
        await out.prepare(request)
        content = upstream.content
        while True:
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
                log.warning("%s %s: the engine for %s broke off its answer (%s); cutting the client's stream",
                            request.method, request.path, entry.name, exc or type(exc).__name__)  # fmt: skip
                _cut(request)
                return out
            if not chunk:
                break
            await out.write(chunk)
        complete = True  # the engine's answer is whole: its connection can serve another request
        await out.write_eof()
        return out
    except ConnectionError:  # the client left (aiohttp's reset error is a ConnectionResetError)
        return out
    finally:
        if complete:
            upstream.release()
        else:
            upstream.close()  # cancelled (the client left) or failed: never back into the pool, so vLLM aborts


def _cut(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()
