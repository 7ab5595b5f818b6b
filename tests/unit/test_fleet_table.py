"""The router's table as the fleet makes it: a model the daemon gave up on carries the reason the clients' 503 gives."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from r3090d.core import policy
from r3090d.core.vocabulary import Phase
from r3090d.router.link import EngineState
from r3090d.service.fleet import Fleet
from tests.configs import bare_config


def unit(phase: Phase, give_up_reason: str | None):
    """What the table reads of an engine unit: its policy state and its config."""
    st = dataclasses.replace(policy.initial_state(100.0), phase=phase, give_up_reason=give_up_reason)
    return SimpleNamespace(st=st, cfg=bare_config())


def test_a_given_up_model_carries_its_reason_and_others_none():
    gave_up = Fleet._entry("chat", unit(Phase.GIVEN_UP, "5 restarts in 600 s"), routable=False)
    assert (gave_up.state, gave_up.reason) == (EngineState.FAILED, "5 restarts in 600 s")
    # The reason lingers in the policy's state until the engine is ready again; the table says it only while failed.
    retrying = Fleet._entry("chat", unit(Phase.STARTING, "5 restarts in 600 s"), routable=False)
    assert (retrying.state, retrying.reason) == (EngineState.STARTING, "")
    assert Fleet._entry("chat", unit(Phase.RESET_NEEDED, None), routable=False).reason == ""
