"""One request at a time, each in its own thread, off the loop: what the inference probe and the canary share.

The loop asks (`_begin`), a thread does the request, its end is recorded
(`_end`) and wakes the loop. A new engine (`_reset`) bumps the generation, so a
late answer from the old one is ignored. Every request ever begun is counted
across engines and reloads (`sent_before`: the replaced sender's count), and so is
every one that ended without an answer (`unanswered_before`): the policy subtracts
the daemon's own requests from vLLM's completed ones, less those vLLM never completed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S")


@dataclass
class Exchange:
    """How far one request got, filled in by the thread that sends it."""

    answered: bool = False  # an HTTP 200 came back: vLLM completed the request (reading its body may still fail)


class OffLoop(Generic[S]):
    def __init__(self, empty: S, wake: threading.Event | None, sent_before: int, unanswered_before: int = 0):
        self._lock = threading.Lock()
        self._sample = empty
        self._generation = 0
        self._in_flight = False
        self._sent_total = sent_before
        self._unanswered_total = unanswered_before
        self._wake = wake  # set when a result arrives, so the loop acts on it at once

    def _reset(self, empty: S) -> None:
        with self._lock:
            self._generation += 1
            self._sample = empty
            self._in_flight = False

    def _begin(self, in_flight: Callable[[S], S], run: Callable[[int], None], name: str, not_started: Callable[[int, Exception], None]) -> None:
        """Start `run(generation)` in a thread unless a request is in flight; `in_flight` maps the last sample to the new one's."""
        with self._lock:
            if self._in_flight:
                return
            self._in_flight = True
            self._sent_total += 1
            generation = self._generation
            self._sample = in_flight(self._sample)
        try:
            threading.Thread(target=run, args=(generation,), name=name, daemon=True).start()
        except Exception as exc:  # noqa: BLE001 - e.g. no thread to be had: a failed request, never one stuck in flight
            not_started(generation, exc)

    def _end(self, generation: int, finished: Callable[[S], S], *, unanswered: bool) -> None:
        """Record the request's end (`finished` maps the in-flight sample to the result), unless a reset came first.

        `unanswered`: it ended for good without an answer (refused, timed out, an HTTP error), so vLLM never
        counts it as completed. A request whose end is ignored stays counted as answered: the engine's baseline,
        taken since, already holds it."""
        with self._lock:
            if generation != self._generation:
                return
            self._unanswered_total += unanswered
            self._sample = finished(self._sample)
            self._in_flight = False
        if self._wake is not None:
            self._wake.set()

    @property
    def sent_total(self) -> int:
        with self._lock:
            return self._sent_total

    @property
    def unanswered_total(self) -> int:
        with self._lock:
            return self._unanswered_total
