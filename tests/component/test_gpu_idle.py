"""The GPU's own view, through the fake NVML: requests running on an idle GPU is a freeze;
a second user of the card switches the view off, and status says why."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import DaemonProcess, engine_config, group_members, write_config
from tests.waiting import wait_until

pytestmark = pytest.mark.component

FAKE_NVML = Path(__file__).resolve().parents[1] / "fakenvml"


def start(tmp_path, fake_engine_python, card: Path) -> DaemonProcess:
    card.write_text(json.dumps({"util": 90, "processes": [], "graphics_processes": []}))
    sections = engine_config(
        tmp_path,
        fake_engine_python,
        extra_args=["--fake-token-delay", "0.05"],
        watchdog={"poll_interval": 0.5, "gpu_idle_stall_seconds": 2.0, "stall_seconds": 600.0, "probe_idle_seconds": 600.0},
    )
    sections["gpu"] = {"required": True, "card": "any"}
    config = write_config(tmp_path / "r3090d.toml", sections)
    env = {"PYTHONPATH": str(FAKE_NVML), "R3090D_FAKE_NVML": str(card)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return DaemonProcess(config, tmp_path / "daemon.log", "--skip-preflight").start()
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def the_engine_holds_the_card(card: Path, st: dict, util: int, graphics=()) -> None:
    """The card lists the engine's tree as its compute processes, as NVML would."""
    pids = group_members(st["engine"]["pid"])
    card.write_text(json.dumps({"util": util, "memory_used_mib": 8000, "processes": [[p, 8000 // len(pids)] for p in pids],
                                "graphics_processes": [list(g) for g in graphics]}))  # fmt: skip


def streams(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    def one():
        body = {"model": "fake-model", "prompt": "x", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120, trust_env=False) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            return  # the engine was restarted under the stream

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


@contextmanager
def two_requests_running(
    tmp_path, fake_engine_python, util: int, graphics=()
) -> Iterator[tuple[DaemonProcess, Path, dict]]:
    """A ready daemon whose engine holds the card as `util` and `graphics` say and runs two endless streams.

    Yields the daemon, the card's file and the ready state; on the way out, ends the streams and the daemon.
    """
    card = tmp_path / "card.json"
    d = start(tmp_path, fake_engine_python, card)
    stop = threading.Event()
    try:
        st = d.wait_ready()
        the_engine_holds_the_card(card, st, util=util, graphics=graphics)
        streams(st["engine"]["url"], 2, stop)
        wait_until(lambda: (d.state()["metrics"]["running"] or 0) >= 2, 20, what="two requests running")
        yield d, card, st
    finally:
        stop.set()
        d.cleanup()


def test_requests_running_on_an_idle_gpu_restart_with_reason_gpu_idle(tmp_path, fake_engine_python):
    with two_requests_running(tmp_path, fake_engine_python, util=90) as (d, card, st):
        # Busy GPU, tokens flowing: no restart, and the view is in use.
        wait_until(lambda: d.state()["watch"]["gpu_signal_off"] == "", 10, what="the GPU view in use")
        t_freeze = time.time()
        the_engine_holds_the_card(card, st, util=0)  # the engine froze: the GPU computes nothing
        st2 = d.wait_for(lambda s: s if s["restarts"]["total"] >= 1 else None, 30, "a restart")
        assert st2["restarts"]["last_reason"] == "gpu_idle", st2["restarts"]
        took = st2["restarts"]["last_at"] - t_freeze
        print(f"gpu_idle restart {took:.1f} s after the GPU went idle (gpu_idle_stall_seconds 2, poll 0.5 s)")
        assert 2.0 <= took <= 15.0


def test_a_second_user_of_the_card_switches_the_gpu_view_off(tmp_path, fake_engine_python):
    # The card also lists a desktop's Xorg (pid 4242, 300 MiB) as a graphics process.
    with two_requests_running(tmp_path, fake_engine_python, util=0, graphics=[(4242, 300)]) as (d, _, _):
        st = wait_until(lambda: (s := d.state()) and "4242" in (s["watch"]["gpu_signal_off"] or "") and s, 20, what="the view switched off")
        assert st["watch"]["gpu_signal_off"] == "another process uses the GPU (pid 4242)"
        # Requests running, the GPU reading 0% (the desktop's share of the card is not the engine's): no gpu_idle restart.
        time_limit = time.monotonic() + 5.0  # time passing on purpose: no restart may come within it
        while time.monotonic() < time_limit:
            assert d.state()["restarts"]["total"] == 0
            time.sleep(0.1)
