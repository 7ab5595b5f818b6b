"""The active inference probe: one tiny completion, off the loop.

A frozen EngineCore leaves /health answering 200 and the gauges flat at zero;
only a real request notices. The probe runs in its own thread so its timeout
never delays the loop; the loop reads the latest result.

Whatever goes wrong in that thread, it ends by recording a failed sample: a probe
left "in flight" would never be sent again, and a frozen engine would go unseen.
"""

from __future__ import annotations

import time
from dataclasses import replace

import httpx

from r3090d.core.snapshot import InferenceProbeSample
from r3090d.probes.http import engine_client
from r3090d.probes.offloop import OffLoop

_MAX_DETAIL = 200
OVERDUE_MARGIN_S = 2.0
# The status line arrives once the completion is done; the body is not needed, and
# not reading it means a server that trickles it cannot hold the probe.
_HEADERS = {"Connection": "close"}


class InferenceProber(OffLoop[InferenceProbeSample]):
    def __init__(self, base_url: str, model: str, api_key: str, timeout: float, wake=None, *, sent_before: int = 0):
        super().__init__(InferenceProbeSample(), wake, sent_before)
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._model = model
        self._api_key = api_key
        self._timeout = timeout

    def reset(self) -> None:
        """A new engine: forget the old one's failures (a late answer from it is ignored)."""
        self._reset(InferenceProbeSample())

    def send(self) -> None:
        def in_flight(prev: InferenceProbeSample) -> InferenceProbeSample:
            return InferenceProbeSample(sent_at=time.monotonic(), finished_at=prev.finished_at, ok=None, consecutive_failures=prev.consecutive_failures)

        def not_started(generation: int, exc: Exception) -> None:
            self._finish(generation, False, _short(f"probe not started: {type(exc).__name__}: {exc}"))

        self._begin(in_flight, self._run, "inference-probe", not_started)

    def _run(self, generation: int) -> None:
        ok, detail = False, "the probe ended without an answer"
        try:
            ok, detail = self._request()
        except Exception as exc:  # noqa: BLE001 - any failure is a failed probe
            ok, detail = False, self._describe(exc)
        finally:
            # Also reached on BaseException, with the default failure above.
            self._finish(generation, ok, detail)

    def _request(self) -> tuple[bool, str]:
        headers = dict(_HEADERS)
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        body = {"model": self._model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        timeout = httpx.Timeout(self._timeout, connect=min(5.0, self._timeout))
        with engine_client(timeout) as client:
            with client.stream("POST", self._url, json=body, headers=headers) as resp:
                ok = resp.status_code == 200
                return ok, "" if ok else f"HTTP {resp.status_code}"

    def _describe(self, exc: Exception) -> str:
        name = type(exc).__name__
        if isinstance(exc, httpx.TimeoutException):
            return f"no answer within {self._timeout:.0f} s ({name})"
        if isinstance(exc, httpx.HTTPError | httpx.InvalidURL):
            # Their messages can quote the request's headers, the key among them.
            return name
        message = str(exc)
        if self._api_key:
            for form in (self._api_key, repr(self._api_key)[1:-1]):
                message = message.replace(form, "<api key>")
        return _short(f"{name}: {message}")

    def _finish(self, generation: int, ok: bool, detail: str) -> None:
        def finished(prev: InferenceProbeSample) -> InferenceProbeSample:
            return InferenceProbeSample(sent_at=prev.sent_at, finished_at=time.monotonic(), ok=ok, detail=detail,
                                        consecutive_failures=0 if ok else prev.consecutive_failures + 1)  # fmt: skip

        self._end(generation, finished)

    def sample(self) -> InferenceProbeSample:
        """The latest result. A probe still in flight past its timeout plus a margin is
        failed here: a DNS lookup or a header trickle is not bounded by the request's own
        timeouts, and a probe stuck in flight would switch frozen-engine detection off."""
        now = time.monotonic()
        with self._lock:
            prev = self._sample
            overdue = self._in_flight and prev.sent_at is not None and now - prev.sent_at > self._timeout + OVERDUE_MARGIN_S
            if overdue:
                self._generation += 1  # the stuck thread's late answer is ignored
                self._in_flight = False
                self._sample = InferenceProbeSample(
                    sent_at=prev.sent_at,
                    finished_at=now,
                    ok=False,
                    detail=f"no answer within {self._timeout:.0f} s (the request outlived its timeout)",
                    consecutive_failures=prev.consecutive_failures + 1,
                )
            return replace(self._sample, sent_total=self._sent_total)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."
