"""The test suite's one way to wait: poll a condition until it holds, or fail saying what never happened.

Tests wait for what they assert on, never sleep for a guessed time and then look: on a loaded
two-core machine any guess is sometimes too short. The timeouts callers pass are upper bounds
chosen for such a machine; a condition that holds sooner ends the wait sooner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_INTERVAL_S = 0.02
SHOWN_CHARS = 2000  # of the last value seen, in a timeout's message


class WaitTimeout(AssertionError):
    """The condition did not hold within the timeout."""


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    *,
    what: str,
    interval: float = DEFAULT_INTERVAL_S,
    ignoring: tuple[type[Exception], ...] = (),
    details: Callable[[], str] | None = None,
) -> T:
    """Call `predicate` every `interval` s until it returns something truthy, and return that value.

    An exception of a type in `ignoring` counts as "not yet"; any other exception propagates at
    once, so a predicate stops a wait that can no longer succeed (the process under test exited)
    by raising AssertionError. After `timeout` s, raises WaitTimeout (an AssertionError) naming
    `what`, the timeout and the last value (or ignored exception) seen, then the text of
    `details()` where given (a log's tail, say).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignoring as exc:
            last = f"raised {exc!r}"
        else:
            if value:
                return value
            last = f"returned {value!r}"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            message = f"timed out after {timeout:g} s waiting for {what}; the last check {last[:SHOWN_CHARS]}"
            if details is not None:
                message += "\n" + details()
            raise WaitTimeout(message)
        time.sleep(min(interval, remaining))
