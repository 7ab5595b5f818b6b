"""The fleet's count of failed parks and wakes by sleep: two in a row and the model parks as park = "auto" until
r3090ctl restart --model; one that worked clears the count."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest

from r3090d.config.schema import ParkMode
from r3090d.core import policy
from r3090d.core.arbiter import Park
from r3090d.core.suspension import Result, SuspendResult
from r3090d.service.commands import Pending
from r3090d.service.fleet import Fleet, ModelRecord
from r3090d.service.swaps import SwapTracker
from tests.configs import bare_config


def fleet(park: ParkMode) -> Fleet:
    """A fleet of one model, "chat", with its engine's policy READY: only what parks and counts is used."""
    f = Fleet.__new__(Fleet)
    cfg = dataclasses.replace(bare_config(gpu={"required": True}), park_mode=park)
    st = dataclasses.replace(policy.initial_state(0.0), phase=policy.Phase.READY)
    f.units = {"chat": SimpleNamespace(cfg=cfg, st=st, pending=Pending())}
    f.models = {"chat": ModelRecord()}
    f.swaps, f.plan, f.wake, f.clock = (
        SwapTracker(),
        SimpleNamespace(target="coder"),
        threading.Event(),
        lambda: 0.0,
    )
    return f


def failed(op: str) -> SuspendResult:
    return SuspendResult(1, op, Result.FAILED, "wrong output after resume", 0.0, by_sleep=True)


@pytest.mark.parametrize("park", list(ParkMode))
def test_only_park_sleep_asks_for_a_park_by_sleep(park):
    f = fleet(park)
    f._request(Park("chat", "to bring coder in"), None, 0.0)
    assert f.units["chat"].pending.park_by_sleep is (park is ParkMode.SLEEP)
    assert f._can_checkpoint("chat", f.units["chat"], None) is (park is not ParkMode.STOP)


def test_two_failures_in_a_row_turn_sleep_off_until_restart_model():
    f = fleet(ParkMode.SLEEP)
    rec = f.models["chat"]
    Fleet._count_sleep("chat", rec, failed("resume"))
    assert (rec.sleep_failures, rec.sleep_off, f.parks_by_sleep("chat")) == (1, False, True)
    Fleet._count_sleep("chat", rec, SuspendResult(2, "resume", Result.RESUMED, "", 0.0, by_sleep=True))
    assert rec.sleep_failures == 0  # one that worked: the next failure is the first again
    Fleet._count_sleep("chat", rec, failed("suspend"))
    Fleet._count_sleep("chat", rec, failed("resume"))
    assert (rec.sleep_failures, rec.sleep_off, f.parks_by_sleep("chat")) == (2, True, False)
    f._request(Park("chat", "to bring coder in"), None, 0.0)
    assert f.units["chat"].pending.park and not f.units["chat"].pending.park_by_sleep
    assert rec.state(0.0).sleep_off
    f.restart("chat")  # r3090ctl restart --model chat: sleep is tried again
    assert (rec.sleep_failures, rec.sleep_off, f.parks_by_sleep("chat")) == (0, False, True)


def test_an_engine_that_dies_under_a_sleep_or_a_wake_counts_and_a_refusal_for_room_does_not():
    rec = ModelRecord()
    Fleet._count_sleep("chat", rec, SuspendResult(1, "resume", Result.REFUSED, "no room", 0.0, by_sleep=True))
    assert rec.sleep_failures == 0
    Fleet._count_sleep(
        "chat", rec, SuspendResult(2, "suspend", Result.SUSPENDED, "exited", 0.0, by_sleep=True, lost=True)
    )
    Fleet._count_sleep(
        "chat", rec, SuspendResult(3, "resume", Result.REFUSED, "exited", 0.0, by_sleep=True, lost=True)
    )
    assert (rec.sleep_failures, rec.sleep_off) == (2, True)
