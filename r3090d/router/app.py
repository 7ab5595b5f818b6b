"""The router's HTTP side: the routes, the API key, the body limit, and the wait for a routable model.

A request that names its model in the body goes to that model's engine; one
that names none goes, as vLLM's one model would take it, to the one resident
model (400 naming the models when not exactly one is). A request for a model
not routable now waits in the waitroom (its line, arrival order); one deadline,
the queue timeout from its arrival, bounds all its waiting, then it gets 503
with Retry-After. A model the daemon gave up on is a 503 with its reason at
once. If the engine refuses or drops the connection before answering anything
(a swap or a crash raced the table), the request waits in its line again for a
newer table that says routable, within the same deadline; a dropped connection
is first sent again at once, since it may be a pooled one the engine was
closing, and a refused one then says the engine is gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from r3090d.core.arbiter import RESIDENT
from r3090d.router import replies
from r3090d.router.link import EngineState
from r3090d.router.linkclient import LinkClient
from r3090d.router.upstream import BadAnswer, Clients, Unreachable, forward
from r3090d.router.waitroom import GaveUp, QueueTimeout, ShuttingDown, UnknownModel, Waitroom

log = logging.getLogger("r3090d.router")

# The POST routes of vLLM 0.32's server whose JSON body names the model: the OpenAI ones, vLLM's
# pooling, scoring and tokenizer routes, and the Anthropic messages route.
# Left out: /v1/audio/transcriptions and /v1/audio/translations (multipart bodies, the model a form
# field), and GET/DELETE /v1/responses/{id} (stored responses, no model to route by).
MODEL_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/score",
    "/v1/rerank",
    "/v2/rerank",
    "/score",
    "/rerank",
    "/pooling",
    "/classify",
    "/tokenize",
    "/detokenize",
)
BODY_READ_TIMEOUT_S = 60.0  # a client that sends its body slower than this holds a handler for nothing
# Sends of one request to engines that answered nothing, each after the first to what a newer table says:
# more means tables keep naming an engine that is not there, or a request that crashes its engine each time.
MAX_SENDS = 4
APP_KEY = web.AppKey("router", object)


@dataclass(frozen=True)
class Options:
    host: str
    port: int
    link: Path
    queue_timeout: float
    max_body_bytes: int
    api_key: str | None
    drain_timeout: float = 5.0


class Router:
    def __init__(self, options: Options):
        self.options = options
        self.waitroom = Waitroom(on_change=self._demand_changed)
        self.link = LinkClient(options.link, self.waitroom)
        self.clients = Clients()
        self.started_unix = int(time.time())
        self._key_digest = _digest(options.api_key) if options.api_key else None

    def _demand_changed(self, urgent: bool) -> None:
        self.link.demand_changed(urgent)

    # -- checks
    def _authorized(self, request: web.Request) -> bool:
        """vLLM's check: `Authorization: <scheme> <key>`, the scheme `bearer` in any case. Digests are
        compared, so the time taken says nothing of the key's length either."""
        if self._key_digest is None:
            return True
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        return hmac.compare_digest(_digest(given), self._key_digest) and scheme.lower() == "bearer"

    def _the_one_resident(self) -> str | web.Response:
        """The model a request without `model` goes to: the one resident (on the GPU, or going there)."""
        table = self.waitroom.table
        if table is None:
            return replies.not_linked()
        resident = [m.name for m in table.models if m.state in RESIDENT]
        if len(resident) == 1:
            return resident[0]
        return replies.no_model_named(resident, [m.name for m in table.models])

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        limit = self.options.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return replies.too_large(limit)
        try:
            async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return replies.too_large(limit)
        except TimeoutError:
            return replies.body_timeout(BODY_READ_TIMEOUT_S)

    # -- handlers
    async def route_by_model(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return replies.unauthorized()
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        name = model_of(body)
        if name is None:
            name = self._the_one_resident()
        if isinstance(name, web.Response):
            return name
        try:
            return await self._deliver(request, body, name, arrived=time.monotonic())
        except BadAnswer as exc:
            log.warning("%s for %s: the engine's answer could not be read (%s); 502", request.path, name, exc)
            return replies.unreadable(name)
        except UnknownModel:
            return replies.unknown_model(name)
        except GaveUp as exc:
            return replies.gave_up(name, exc.reason)
        except QueueTimeout:
            return replies.queue_timeout(name, self.options.queue_timeout)
        except ShuttingDown:
            return replies.shutting_down()

    async def _deliver(
        self, request: web.Request, body: bytes, name: str, arrived: float
    ) -> web.StreamResponse:
        """Sends the request to `name`'s engine once routable, and again after an engine that answered
        nothing, all within one deadline: the queue timeout from `arrived`."""
        deadline = arrived + self.options.queue_timeout
        after_generation = 0  # the table the last engine that answered nothing came from; 0: any table
        for sent in range(1, MAX_SENDS + 1):
            entry = await self.waitroom.wait(name, deadline - time.monotonic(), arrived, after_generation)
            generation = self.waitroom.generation
            try:
                return await self._send(request, body, entry)
            except Unreachable as exc:
                at_once = sent == 1 and not exc.refused
                log.warning("%s for %s: %s's engine at %s did not answer (%s); %s",
                            request.path, name, name, entry.upstream, exc,
                            "sending it again" if at_once else "waiting for it to come back")  # fmt: skip
                after_generation = 0 if at_once else generation
        log.warning("%s for %s: %d engines in a row answered nothing; 502", request.path, name, MAX_SENDS)
        return replies.unreachable(name)

    async def _send(self, request: web.Request, body: bytes, entry) -> web.StreamResponse:
        self.waitroom.started(entry.name)
        try:
            return await forward(self.clients, request, body, entry)
        finally:
            self.waitroom.finished(entry.name)

    async def list_models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return replies.unauthorized()
        table = self.waitroom.table
        data = [
            {"id": m.name, "object": "model", "created": self.started_unix, "owned_by": "r3090d"}
            for m in (table.models if table else ())
        ]
        return web.json_response({"object": "list", "data": data})

    async def healthz(self, request: web.Request) -> web.Response:
        table = self.waitroom.table
        if not self.link.linked or table is None:
            return web.json_response(
                {"status": "unavailable", "reason": "not linked to the daemon"}, status=503
            )
        if not any(m.state is not EngineState.FAILED for m in table.models):
            return web.json_response(
                {"status": "unavailable", "reason": "no model that has not failed"}, status=503
            )
        return web.json_response({"status": "ok"})

    async def not_found(self, request: web.Request) -> web.Response:
        if request.path.startswith("/v1/") and not self._authorized(request):
            return replies.unauthorized()
        return replies.not_found(request.path)

    # -- the application
    def application(self) -> web.Application:
        # The body limit is enforced in the handler (413 in OpenAI's shape); aiohttp's own is a backstop.
        app = web.Application(client_max_size=self.options.max_body_bytes)
        app[APP_KEY] = self
        for path in MODEL_ROUTES:
            app.router.add_post(path, self.route_by_model)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        return app


class OneLineHttpErrors(logging.Filter):
    """aiohttp logs a client's malformed request (a header over its limit, not HTTP at all) with a
    traceback at ERROR. It is the client's problem: one WARNING line, at most one a second."""

    def __init__(self, interval: float = 1.0):
        super().__init__()
        self.interval = interval
        self.last = float("-inf")
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return False
        more = f" ({self.suppressed} more since the last)" if self.suppressed else ""
        self.last, self.suppressed = now, 0
        text = " ".join(str(exc).split())[:200]
        log.warning("%s: a malformed request: %s%s", record.getMessage(), text, more)
        return False  # the original, with its traceback, is dropped


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def model_of(body: bytes) -> str | None | web.Response:
    """The body's `model` (None when it names none, as vLLM reads a missing or null one), or the 400
    that says what is wrong with the body."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return replies.bad_request("The request body is not valid JSON.")
    if not isinstance(obj, dict):
        return replies.bad_request("The request body must be a JSON object.")
    name = obj.get("model")
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        return replies.bad_request("`model` must be a non-empty string.", "model")
    return name


async def serve(options: Options) -> None:
    """Until SIGTERM or SIGINT: stop accepting, answer the waiting requests, let streams finish
    for up to `drain_timeout` s, close."""
    logging.getLogger("aiohttp.server").addFilter(OneLineHttpErrors())
    router = Router(options)
    runner = web.AppRunner(router.application(), handler_cancellation=True, shutdown_timeout=options.drain_timeout,
                           access_log=None)  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port, backlog=1024)
    await site.start()
    log.info("listening on %s:%d; link %s", options.host, options.port, options.link)
    link_task = asyncio.create_task(router.link.run(), name="link")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    inflight = router.waitroom.inflight()
    log.info("stopping: %d request(s) in flight get up to %g s to finish", inflight, options.drain_timeout)
    router.waitroom.close()
    await runner.cleanup()
    await router.link.close()
    link_task.cancel()
    try:
        await link_task
    except asyncio.CancelledError:
        pass
    await router.clients.close()
