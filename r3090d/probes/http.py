"""The one HTTP client setup for every request the daemon makes to its own engine.

The engine is local and the daemon holds its API key. Nothing from the process
environment may steer these requests: an HTTP_PROXY, HTTPS_PROXY or ALL_PROXY
(either spelling) would receive the key in the Authorization header, and its
error answers would read as a failing engine; NO_PROXY is ignored along with them;
.netrc credentials must not be added either. `trust_env=False` turns off every
one of those look-ups in httpx, on redirects too.

Redirects are followed, as a browser or curl -L would: an engine behind a path
prefix may answer /metrics with a redirect to /metrics/. httpx drops the
Authorization header on a redirect to another host.

An engine on a unix socket (engine.listen = "uds") is reached through httpx's
transport for it: the URL's host is then a placeholder, the socket is where
every request goes.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # Loading the CA bundle is most of what building a client costs (15 ms here), and
    # the inference probe builds one each time it runs; a context is safe to share.
    return httpx.create_ssl_context(trust_env=False)


def engine_client(timeout: httpx.Timeout | float = 5.0, uds: str = "") -> httpx.Client:
    """An httpx client that reads nothing from the environment: no proxies, no .netrc.

    `timeout` is the client's default; the probes give their own on each request.
    `uds`: the engine's unix socket, where every request goes; empty: TCP, to the URL's host.
    """
    transport = httpx.HTTPTransport(uds=uds, verify=_tls_context()) if uds else None
    return httpx.Client(timeout=timeout, verify=_tls_context(), trust_env=False, follow_redirects=True, transport=transport)
