"""Swap mode across a restart of the daemon: each model's restart history and alert book, and the card's alert book,
are handed on to the next daemon as in single mode (component: the vLLM double, the router)."""

from __future__ import annotations

import os
import signal

from tests.component.test_swap_daemon import BOUND, swap_rig  # noqa: F401 (a fixture)
from tests.daemon_harness import api_server_pid


def _firing_lines(log: str, key: str) -> list[str]:
    return [line for line in log.splitlines() if f"alert {key} firing" in line]


def test_a_restarted_swap_daemon_counts_on_from_each_models_restarts_and_alerts(swap_rig):  # noqa: F811
    settings = {"gpu": False, "watchdog": {"restart_storm_restarts": 1, "restart_storm_window": 600.0, "min_uptime": 0.0},
                "extra": {"alerts": {"min_interval": 0.0, "hysteresis_polls": 1}}}  # fmt: skip
    first = swap_rig(**settings)
    assert first.complete("alpha").status_code == 200
    st = first.wait_model("alpha", "ready")
    engine = first.model(st, "alpha")["engine"]["pid"]
    os.kill(api_server_pid(engine), signal.SIGKILL)

    def restarted(s):
        m = first.model(s, "alpha")
        new_engine = m["engine"]["pid"] not in (None, engine)
        return s if m["residency"] == "ready" and new_engine and "restart_storm:alpha" in s["alerts"]["firing"] else None

    st = first.proc.wait_for(restarted, BOUND, "alpha restarted, restart_storm:alpha firing")
    before = first.model(st, "alpha")["restarts"]
    assert before["total"] == 1 and before["recent"] == 1, before
    assert len(_firing_lines(first.proc.log(), "restart_storm:alpha")) == 1
    first.card.stop.set()
    first.proc.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait_exit(BOUND) == 0
    log_before = len(first.proc.log())

    second = swap_rig(**settings)
    st = second.proc.wait_for(lambda s: s if s["daemon"]["pid"] == second.proc.pid else None, BOUND, "the second daemon's document")
    after = second.model(st, "alpha")["restarts"]
    # The engine's restart counters count the engine's restarts, not the daemon's.
    assert (after["total"], after["recent"], after["by_reason"], after["last_reason"]) == (
        before["total"], before["recent"], before["by_reason"], before["last_reason"]), after  # fmt: skip
    assert second.model(st, "beta")["restarts"]["total"] == 0
    # The storm still holds: still firing, and not sent again (nor resolved) by the successor.
    assert "restart_storm:alpha" in st["alerts"]["firing"], st["alerts"]
    assert second.complete("alpha").status_code == 200
    second.wait_model("alpha", "ready")
    log = second.proc.log()[log_before:]
    assert _firing_lines(log, "restart_storm:alpha") == [], log[-3000:]
    assert "alert restart_storm:alpha resolved" not in log, log[-3000:]
