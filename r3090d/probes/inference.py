"""The active inference probe: one tiny completion, off the loop.

A frozen EngineCore leaves /health answering 200 and the gauges flat at zero;
only a real request notices. The probe runs in its own thread so its timeout
never delays the loop; the loop reads the latest result.
"""

from __future__ import annotations

import threading
import time

import requests

from r3090d.model import InferenceProbeSample


class InferenceProber:
    def __init__(self, base_url: str, model: str, api_key: str, timeout: float, wake=None):
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._model = model
        self._api_key = api_key
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sample = InferenceProbeSample()
        self._generation = 0
        self._in_flight = False
        self._wake = wake  # set when a result arrives, so the loop acts on it at once

    def reset(self) -> None:
        """A new engine: forget the old one's failures (a late answer from it is ignored)."""
        with self._lock:
            self._generation += 1
            self._sample = InferenceProbeSample()
            self._in_flight = False

    def send(self) -> None:
        with self._lock:
            if self._in_flight:
                return
            self._in_flight = True
            generation = self._generation
            self._sample = InferenceProbeSample(
                sent_at=time.monotonic(),
                finished_at=self._sample.finished_at,
                ok=None,
                consecutive_failures=self._sample.consecutive_failures,
            )
        threading.Thread(target=self._run, args=(generation,), name="inference-probe", daemon=True).start()

    def _run(self, generation: int) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        body = {"model": self._model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        try:
            resp = requests.post(self._url, json=body, headers=headers, timeout=(min(5.0, self._timeout), self._timeout))
            ok = resp.status_code == 200
            detail = "" if ok else f"HTTP {resp.status_code}"
        except requests.Timeout:
            ok, detail = False, f"no answer within {self._timeout:.0f} s"
        except requests.RequestException as exc:
            ok, detail = False, type(exc).__name__
        with self._lock:
            if generation != self._generation:
                return
            prev = self._sample
            self._sample = InferenceProbeSample(
                sent_at=prev.sent_at,
                finished_at=time.monotonic(),
                ok=ok,
                detail=detail,
                consecutive_failures=0 if ok else prev.consecutive_failures + 1,
            )
            self._in_flight = False
        if self._wake is not None:
            self._wake.set()

    def sample(self) -> InferenceProbeSample:
        with self._lock:
            return self._sample
