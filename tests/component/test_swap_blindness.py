"""Swap mode with NVML failing: one watchdog_blind, the card's, not one per model (component: the vLLM double, the
fake NVML)."""

from __future__ import annotations

from tests.component.test_swap_daemon import BOUND, swap_rig  # noqa: F401 (a fixture)


def _blind(st: dict) -> set[str]:
    return {key for key in st["alerts"]["firing"] if key.startswith("watchdog_blind")}


def _ticks(st: dict) -> int:
    return st["telemetry"]["poll_duration_seconds"]["count"]


def test_a_blind_nvml_is_one_watchdog_blind_for_the_card(swap_rig):  # noqa: F811
    # Every NVML call fails (no driver), from the daemon's start: each engine's policy and the card see it alike.
    r = swap_rig(card_extra={"fail": "DRIVER_NOT_LOADED"}, watchdog={"blind_polls": 3},
                 extra={"alerts": {"min_interval": 0.0, "hysteresis_polls": 1}})  # fmt: skip
    st = r.proc.wait_for(lambda s: s if _blind(s) else None, BOUND, "a watchdog_blind firing")
    later = r.proc.wait_for(lambda s: s if _ticks(s) >= _ticks(st) + 10 else None, BOUND, "10 more ticks")
    assert _blind(later) == {"watchdog_blind"}, later["alerts"]["firing"]
    assert "NVML failing" in later["alerts"]["firing"]["watchdog_blind"]["summary"]
    log = r.proc.log()
    assert log.count("alert watchdog_blind firing") == 1 and "alert watchdog_blind:" not in log, log[-3000:]
