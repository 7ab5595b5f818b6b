"""A park by vLLM's sleep mode: its dev endpoints, one exchange at a time, in a thread off the loop.

decide() asks (SleepEngine, WakeEngine, UnpauseEngine); a thread runs the calls
against the engine's 127.0.0.1 port, all within the exchange's deadline
(swap.sleep_timeout); the loop reads the result as a frozen SleepSample.

    sleep    POST /pause?mode=wait   answers once what runs has finished (new requests wait in vLLM)
             POST /sleep?level=1     the level in the query string: vLLM reads no body
             GET  /is_sleeping       must say true
    wake     POST /wake_up, POST /resume
    unpause  POST /resume            a failed sleep gives the scheduler back before the drained stop

Level 2 (weights dropped, reloaded by /collective_rpc reload_weights) is not used.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import httpx

from r3090d.core.suspend_types import SleepOp, SleepSample
from r3090d.probes.http import engine_client

SLEEP_LEVEL = 1

# (method, path) of each call, in order.
_CALLS: dict[SleepOp, tuple[tuple[str, str], ...]] = {
    SleepOp.SLEEP: (
        ("POST", "/pause?mode=wait"),
        ("POST", f"/sleep?level={SLEEP_LEVEL}"),
        ("GET", "/is_sleeping"),
    ),
    SleepOp.WAKE: (("POST", "/wake_up"), ("POST", "/resume")),
    SleepOp.UNPAUSE: (("POST", "/resume"),),
}


class Sleeper:
    def __init__(
        self, base_url: Callable[[], str], api_key: str, wake: threading.Event | None, clock=time.monotonic,
        uds: Callable[[], str] = lambda: "",
    ):  # fmt: skip
        self._base_url = base_url
        self._uds = uds  # the engine's unix socket, where it serves on one (engine.listen = "uds"); "": TCP
        self._api_key = api_key
        self._wake = wake
        self._clock = clock
        self._lock = threading.Lock()
        self._sample = SleepSample()

    def sample(self) -> SleepSample:
        with self._lock:
            return self._sample

    def start(self, op: SleepOp, timeout_s: float) -> bool:
        """Begin `op` unless one is in flight (then False: the core's deadline answers for it)."""
        now = self._clock()
        with self._lock:
            if self._sample.in_flight:
                return False
            self._sample = SleepSample(op=op, in_flight=True, started_at=now)
        try:
            threading.Thread(
                target=self._run, args=(op, now, timeout_s), name=f"sleeper-{op.value}", daemon=True
            ).start()
        except Exception as exc:  # noqa: BLE001 - no thread to be had: a failed exchange, never one stuck in flight
            self._finish(now, False, f"{op.value} could not start: {exc}")
        return True

    def _run(self, op: SleepOp, started: float, timeout_s: float) -> None:
        ok, error = False, ""
        try:
            ok, error = self._exchange(op, started + timeout_s)
        except Exception as exc:  # noqa: BLE001 - whatever goes wrong ends the exchange with a one-line error
            error = f"{type(exc).__name__}: {exc}"
        self._finish(started, ok, error)

    def _exchange(self, op: SleepOp, deadline: float) -> tuple[bool, str]:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        base = self._base_url()
        with engine_client(uds=self._uds()) as client:
            for method, path in _CALLS[op]:
                left = deadline - self._clock()
                if left <= 0:
                    return False, f"{method} {path}: past the deadline"
                try:
                    r = client.request(method, base + path, headers=headers, timeout=left)
                except httpx.TimeoutException:
                    return False, f"{method} {path}: no answer within the deadline"
                except httpx.HTTPError as exc:
                    return False, f"{method} {path}: {type(exc).__name__}: {exc}"
                if r.status_code // 100 != 2:
                    return False, f"{method} {path}: HTTP {r.status_code} {r.text[:200].strip()}".strip()
                if path == "/is_sleeping":
                    try:
                        asleep = r.json().get("is_sleeping")
                    except ValueError:
                        asleep = None
                    if asleep is not True:
                        return False, f"GET /is_sleeping answered {r.text[:100].strip()!r} after the sleep"
        return True, ""

    def _finish(self, started: float, ok: bool, error: str) -> None:
        with self._lock:
            if self._sample.started_at != started:
                return
            self._sample = replace(
                self._sample, in_flight=False, finished_at=self._clock(), ok=ok, error=" ".join(error.split())
            )
        if self._wake is not None:
            self._wake.set()
