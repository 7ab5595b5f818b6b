"""The loop's pace follows systemd's watchdog when it asks for pings more often than the poll."""

from __future__ import annotations

import logging

from r3090d import config
from r3090d.service.daemon import Daemon


def make(monkeypatch, tmp_path, usec: str | None, **watchdog) -> Daemon:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    if usec is None:
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    else:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    cfg = config.from_dict(
        {"engine": {"model": "m"}, "gpu": {"required": False}, "watchdog": watchdog, "daemon": {"state_dir": str(tmp_path)}},
        check_files=False,
    )
    return Daemon(cfg, ["true"])


def test_poll_interval_without_a_watchdog(monkeypatch, tmp_path):
    assert make(monkeypatch, tmp_path, None, poll_interval=2.0).tick_interval() == 2.0


def test_pings_at_least_every_half_watchdog(monkeypatch, tmp_path):
    d = make(monkeypatch, tmp_path, "3000000", poll_interval=2.0)  # WatchdogSec=3
    assert d.tick_interval() == 1.5
    assert make(monkeypatch, tmp_path, "30000000", poll_interval=2.0).tick_interval() == 2.0


def test_warns_when_a_slow_tick_could_miss_the_watchdog(monkeypatch, tmp_path, caplog):
    d = make(monkeypatch, tmp_path, "6000000", poll_interval=2.0, health_timeout=2.0, metrics_timeout=3.0)
    with caplog.at_level(logging.WARNING):
        d.warn_if_watchdog_too_short()
    assert "WatchdogSec=6 is short" in caplog.text
    caplog.clear()
    d = make(monkeypatch, tmp_path, "30000000", poll_interval=2.0)
    with caplog.at_level(logging.WARNING):
        d.warn_if_watchdog_too_short()
    assert caplog.text == ""
