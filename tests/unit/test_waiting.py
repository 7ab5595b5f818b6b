"""tests/waiting.py: the suite's one wait, which every other test leans on."""

from __future__ import annotations

import time

import pytest

from tests.waiting import WaitTimeout, wait_until


def answers(*values):
    """A predicate that returns `values` in turn, then the last one for good; `calls` counts its calls."""
    calls = []

    def predicate():
        calls.append(1)
        return values[min(len(calls), len(values)) - 1]

    predicate.calls = calls
    return predicate


def test_returns_the_first_truthy_value_and_stops_asking():
    predicate = answers(0, "", None, {"phase": "ready"}, {"phase": "later"})
    assert wait_until(predicate, 5, what="ready", interval=0.001) == {"phase": "ready"}
    assert len(predicate.calls) == 4


def test_a_timeout_fails_the_test_naming_the_wait_its_timeout_and_the_last_value():
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        wait_until(
            answers([], [], {}),
            0.3,
            what="the alert firing",
            interval=0.01,
            details=lambda: "the daemon's log tail",
        )
    took = time.monotonic() - started
    assert isinstance(failure.value, WaitTimeout)
    message = str(failure.value)
    assert message.startswith(
        "timed out after 0.3 s waiting for the alert firing; the last check returned {}"
    )
    assert message.endswith("\nthe daemon's log tail")
    assert 0.3 <= took < 2.0


def test_a_long_interval_still_checks_once_more_at_the_deadline():
    ready_at = time.monotonic() + 0.2
    started = time.monotonic()
    assert wait_until(lambda: time.monotonic() >= ready_at, 0.5, what="the deadline", interval=60) is True
    assert time.monotonic() - started < 2.0  # the 60 s interval was cut to the time left


def test_an_ignored_exception_is_not_yet_and_shows_as_the_last_check():
    def state():
        raise KeyError("engine")

    with pytest.raises(WaitTimeout, match=r"the last check raised KeyError\('engine'\)"):
        wait_until(state, 0.1, what="the engine's part of the state", interval=0.01, ignoring=(KeyError,))

    values = iter([KeyError("not yet"), KeyError("not yet"), "there"])

    def later():
        value = next(values)
        if isinstance(value, Exception):
            raise value
        return value

    assert wait_until(later, 5, what="the value", interval=0.001, ignoring=(KeyError,)) == "there"


def test_any_other_exception_ends_the_wait_at_once():
    calls = []

    def exited():
        calls.append(1)
        raise AssertionError("the daemon exited 1")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="the daemon exited 1"):
        wait_until(exited, 30, what="ready", interval=0.01, ignoring=(KeyError,))
    assert len(calls) == 1 and time.monotonic() - started < 1.0


def test_the_last_value_is_shown_cut_to_a_readable_length():
    class Falsy:
        def __bool__(self):
            return False

        def __repr__(self):
            return "Falsy(" + "x" * 10_000 + ")"

    with pytest.raises(WaitTimeout) as failure:
        wait_until(Falsy, 0.05, what="a huge document", interval=0.01)
    message = str(failure.value)
    assert "the last check returned Falsy(xxx" in message
    assert len(message) < 2200


def test_what_is_required():
    with pytest.raises(TypeError):
        wait_until(lambda: True, 1)  # type: ignore[call-arg]
