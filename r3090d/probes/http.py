"""The one HTTP client setup for every request the daemon makes to its own engine.

The engine is local and the daemon holds its API key. Nothing from the process
environment may steer these requests: an HTTP_PROXY, HTTPS_PROXY or ALL_PROXY
(either spelling) would receive the key in the Authorization header, and its
error answers would read as a failing engine; NO_PROXY is ignored along with them;
.netrc credentials must not be added either. `trust_env = False` turns off
every one of those look-ups in requests, on redirects too.
"""

from __future__ import annotations

import requests


def engine_session() -> requests.Session:
    """A requests session that reads nothing from the environment: no proxies, no .netrc."""
    session = requests.Session()
    session.trust_env = False
    return session
