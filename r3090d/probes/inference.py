"""The active inference probe: one tiny request, off the loop.

A frozen EngineCore leaves /health answering 200 and the gauges flat at zero;
only a real request notices. The probe runs in its own thread so its timeout
never delays the loop; the loop reads the latest result.

The request depends on the engine's kind (engine.kind): a generative engine gets
a 1-token completion, judged by its status alone; an embedding engine, which
refuses /v1/completions, gets a 1-input embedding, judged by its status and by a
non-empty vector of finite numbers in data[0].embedding. A completion is never
sent to an embedding engine.

Whatever goes wrong in that thread, it ends by recording a failed sample: a probe
left "in flight" would never be sent again, and a frozen engine would go unseen.

Each probe's deadline learns from this engine's recent answers (core.probetime):
an engine that answers slowly on a busy host gets the time it has shown it needs.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx

from r3090d.config.schema import EngineKind
from r3090d.core.probetime import RECENT_ANSWERS, learned_probe_timeout
from r3090d.core.snapshot import InferenceProbeSample
from r3090d.probes.http import engine_client
from r3090d.probes.offloop import Exchange, OffLoop

_MAX_DETAIL = 200
OVERDUE_MARGIN_S = 2.0
# The status line arrives once the completion is done; the body is not needed, and
# not reading it means a server that trickles it cannot hold the probe.
_HEADERS = {"Connection": "close"}
# An embedding's answer is read: one vector of a few thousand floats is well under 1 MiB.
MAX_EMBEDDING_ANSWER = 4 << 20


@dataclass(frozen=True)
class ProbeRequest:
    """What the probe sends to an engine of one kind, and how it judges the answer."""

    path: str
    body: Callable[[str], dict]  # the served model name -> the JSON body
    # The 200 answer's body -> None when it is right, else what is wrong; None: the status alone decides.
    judge: Callable[[bytes], str | None] | None


def _completion_body(model: str) -> dict:
    return {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}


def _embedding_body(model: str) -> dict:
    return {"model": model, "input": "ping", "encoding_format": "float"}


def judge_embedding(body: bytes) -> str | None:
    """None when data[0].embedding is a non-empty list of finite numbers, else what is wrong."""
    try:
        answer = json.loads(body)
    except ValueError:  # also UnicodeDecodeError
        return "the answer is not JSON"
    data = answer.get("data") if isinstance(answer, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    vector = first.get("embedding") if isinstance(first, dict) else None
    if not isinstance(vector, list):
        return "the answer has no data[0].embedding list"
    if not vector:
        return "data[0].embedding is empty"
    for x in vector:
        # json.loads reads NaN and Infinity: an engine that computes them is broken.
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            return f"data[0].embedding holds {_short(repr(x)[:40])}, not a finite number"
    return None


PROBE_REQUESTS: dict[EngineKind, ProbeRequest] = {
    # The status line arrives once the completion is done; its body is not needed.
    EngineKind.GENERATE: ProbeRequest("/v1/completions", _completion_body, None),
    # /v1/completions refuses a pooling model; an embedding is its smallest real request.
    EngineKind.EMBED: ProbeRequest("/v1/embeddings", _embedding_body, judge_embedding),
}


class InferenceProber(OffLoop[InferenceProbeSample]):
    def __init__(self, base_url: str, model: str, api_key: str, timeout: float, wake=None, *, sent_before: int = 0,
                 unanswered_before: int = 0, kind: EngineKind = EngineKind.GENERATE, uds: str = ""):  # fmt: skip
        super().__init__(InferenceProbeSample(), wake, sent_before, unanswered_before)
        self._uds = uds
        self._probe = PROBE_REQUESTS[kind]
        self._url = base_url.rstrip("/") + self._probe.path
        self._model = model
        self._api_key = api_key
        self._timeout = timeout  # as configured: the floor of every probe's deadline
        self._answers: deque[float] = deque(maxlen=RECENT_ANSWERS)  # this engine's recent answer times, seconds

    def reset(self) -> None:
        """A new engine: forget the old one's failures and answer times (a late answer from it is ignored)."""
        self._reset(InferenceProbeSample())  # first: the old engine's late answers are then ignored, not learned
        with self._lock:
            self._answers.clear()

    def send(self) -> None:
        with self._lock:
            timeout = learned_probe_timeout(self._timeout, tuple(self._answers))

        def in_flight(prev: InferenceProbeSample) -> InferenceProbeSample:
            return InferenceProbeSample(sent_at=time.monotonic(), finished_at=prev.finished_at, ok=None, consecutive_failures=prev.consecutive_failures,
                                        timeout_s=timeout)  # fmt: skip

        def not_started(generation: int, exc: Exception) -> None:
            self._finish(generation, False, _short(f"probe not started: {type(exc).__name__}: {exc}"), unanswered=True)

        self._begin(in_flight, lambda generation: self._run(generation, timeout), "inference-probe", not_started)

    def _run(self, generation: int, timeout: float) -> None:
        ok, detail, timed_out = False, "the probe ended without an answer", False
        exchange = Exchange()
        unanswered = False  # unknown (a BaseException): counted as answered, as while in flight
        try:
            ok, detail = self._request(exchange, timeout)
            unanswered = not exchange.answered
        except Exception as exc:  # noqa: BLE001 - any failure is a failed probe
            ok, detail, timed_out = False, self._describe(exc, timeout), isinstance(exc, httpx.TimeoutException)
            unanswered = not exchange.answered
        finally:
            # Also reached on BaseException, with the default failure above.
            self._finish(generation, ok, detail, timed_out, unanswered=unanswered)

    def _request(self, exchange: Exchange, limit: float) -> tuple[bool, str]:
        headers = dict(_HEADERS)
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        body = self._probe.body(self._model)
        timeout = httpx.Timeout(limit, connect=min(5.0, limit))
        deadline = time.monotonic() + limit
        with engine_client(timeout, self._uds) as client:
            with client.stream("POST", self._url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    return False, f"HTTP {resp.status_code}"
                exchange.answered = True
                if self._probe.judge is None:
                    return True, ""
                answer = _read_bounded(resp, deadline, limit)
                if isinstance(answer, str):
                    return False, answer
                wrong = self._probe.judge(answer)
                return wrong is None, wrong or ""

    def _describe(self, exc: Exception, timeout: float) -> str:
        name = type(exc).__name__
        if isinstance(exc, httpx.TimeoutException):
            return f"no answer within {timeout:.3g} s ({name})"
        if isinstance(exc, httpx.HTTPError | httpx.InvalidURL):
            # Their messages can quote the request's headers, the key among them.
            return name
        message = str(exc)
        if self._api_key:
            for form in (self._api_key, repr(self._api_key)[1:-1]):
                message = message.replace(form, "<api key>")
        return _short(f"{name}: {message}")

    def _finish(self, generation: int, ok: bool, detail: str, timed_out: bool = False, *, unanswered: bool) -> None:
        def finished(prev: InferenceProbeSample) -> InferenceProbeSample:
            now = time.monotonic()
            if ok and prev.sent_at is not None:
                self._answers.append(now - prev.sent_at)  # under the lock _end holds
            return InferenceProbeSample(sent_at=prev.sent_at, finished_at=now, ok=ok, detail=detail, timed_out=timed_out and not ok,
                                        consecutive_failures=0 if ok else prev.consecutive_failures + 1, timeout_s=prev.timeout_s)  # fmt: skip

        self._end(generation, finished, unanswered=unanswered)

    def sample(self) -> InferenceProbeSample:
        """The latest result. A probe still in flight past its timeout plus a margin is
        failed here: a DNS lookup or a header trickle is not bounded by the request's own
        timeouts, and a probe stuck in flight would switch frozen-engine detection off."""
        now = time.monotonic()
        with self._lock:
            prev = self._sample
            timeout = prev.timeout_s if prev.timeout_s is not None else self._timeout
            overdue = self._in_flight and prev.sent_at is not None and now - prev.sent_at > timeout + OVERDUE_MARGIN_S
            if overdue:
                self._generation += 1  # the stuck thread's late answer is ignored
                self._in_flight = False
                self._sample = InferenceProbeSample(
                    sent_at=prev.sent_at,
                    finished_at=now,
                    ok=False,
                    detail=f"no answer within {timeout:.3g} s (the request outlived its timeout)",
                    consecutive_failures=prev.consecutive_failures + 1,
                    timed_out=True,
                    timeout_s=prev.timeout_s,
                )
            return replace(self._sample, sent_total=self._sent_total, unanswered_total=self._unanswered_total)


def _read_bounded(resp: httpx.Response, deadline: float, timeout: float) -> bytes | str:
    """The answer's body, or what kept it from being read: too big, or not done by the probe's deadline
    (each read has its own timeout, but a server can trickle a byte inside each one)."""
    chunks, size = [], 0
    for chunk in resp.iter_bytes():
        size += len(chunk)
        if size > MAX_EMBEDDING_ANSWER:
            return f"the answer is over {MAX_EMBEDDING_ANSWER >> 20} MiB"
        if time.monotonic() > deadline:
            return f"the answer was not read within {timeout:.3g} s"
        chunks.append(chunk)
    return b"".join(chunks)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."
