"""Watchdog rules end to end: the real daemon, the vLLM double, faults injected from outside."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.daemon_harness import DaemonProcess, api_server_pid, engine_config, group_members, write_config
from tests.fakevllm.harness import FakeVllm
from tests.waiting import wait_until

pytestmark = pytest.mark.component

POLL = 0.2


@pytest.fixture
def run_daemon(tmp_path):
    started: list[DaemonProcess] = []

    def run(sections: dict) -> DaemonProcess:
        cfg = write_config(tmp_path / f"r3090d-{len(started)}.toml", sections)
        d = DaemonProcess(cfg, tmp_path / f"daemon-{len(started)}.log").start()
        started.append(d)
        return d

    yield run
    for d in started:
        d.cleanup()


def double_of(d: DaemonProcess, python: str) -> FakeVllm:
    """A handle on the double the daemon launched (for its control endpoint)."""
    import tomllib

    port = tomllib.loads(d.config_path.read_text())["engine"]["port"]
    return FakeVllm(python, port=port)


def restarts(d: DaemonProcess) -> int:
    return d.state()["restarts"]["total"]


def test_kv_leak_gives_exactly_one_drained_restart(run_daemon, tmp_path, fake_engine_python):
    d = run_daemon(
        engine_config(
            tmp_path,
            fake_engine_python,
            watchdog={"poll_interval": POLL, "min_free_blocks": 1000, "kv_low_polls": 5, "kv_cooldown": 0.0, "probe_idle_seconds": 600},
        )
    )
    first = d.wait_ready()
    fake = double_of(d, fake_engine_python)
    t_leak = time.time()
    fake.control(metrics="leak", kv_usage=0.99)  # blocks held, nothing running, no tokens
    st = d.wait_for(lambda s: s["restarts"]["total"] >= 1 and s, 20, "a KV restart")
    assert st["restarts"]["last_reason"] == "kv"
    # Detected at the 5th low poll, not before: the first may come right after the fault.
    detect = st["restarts"]["last_at"] - t_leak
    assert 4 * POLL <= detect <= 5 * POLL + 2.0, detect
    new = d.wait_ready(generation_pid=first["engine"]["pid"])
    # The old engine got a drained stop (SIGTERM to the API server only).
    assert f"drained stop: SIGTERM to engine pid {first['engine']['pid']}" in d.log()
    time.sleep(10 * POLL)  # time passing on purpose: the new engine is healthy, no second restart
    assert restarts(d) == 1
    assert d.state()["engine"]["pid"] == new["engine"]["pid"]


def test_kv_full_under_load_alerts_and_keeps_the_engine(run_daemon, tmp_path, fake_engine_python):
    d = run_daemon(
        engine_config(
            tmp_path,
            fake_engine_python,
            watchdog={"poll_interval": POLL, "min_free_blocks": 1000, "kv_low_polls": 5, "kv_cooldown": 0.0},
            alerts={"hysteresis_polls": 2},
        )
    )
    first = d.wait_ready()
    fake = double_of(d, fake_engine_python)
    fake.control(metrics="load", kv_usage=0.99)  # requests running, tokens flowing
    st = d.wait_for(lambda s: "kv_pressure" in s["alerts"]["firing"] and s, 20, "kv_pressure alert")
    assert "running" in st["alerts"]["firing"]["kv_pressure"]["summary"]
    time.sleep(15 * POLL)  # time passing on purpose: three times kv_low_polls, and no restart
    st = d.state()
    assert st["restarts"]["total"] == 0
    assert st["engine"]["pid"] == first["engine"]["pid"]
    assert "alert kv_pressure firing" in d.log()


def test_sigstop_of_the_api_server_is_a_hang_restart_within_t_plus_a_poll(run_daemon, tmp_path, fake_engine_python):
    hang_timeout, health_timeout, metrics_timeout = 3.0, 0.5, 0.5
    d = run_daemon(
        engine_config(
            tmp_path,
            fake_engine_python,
            watchdog={"poll_interval": POLL, "hang_timeout": hang_timeout, "health_timeout": health_timeout,
                      "metrics_timeout": metrics_timeout, "probe_idle_seconds": 600},  # fmt: skip
        )
    )
    first = d.wait_ready()
    pid = first["engine"]["pid"]
    t_stop = time.time()
    os.kill(api_server_pid(pid), signal.SIGSTOP)
    st = d.wait_for(lambda s: s["restarts"]["total"] >= 1 and s, 30, "a hang restart")
    assert st["restarts"]["last_reason"] == "hung"
    detect = st["restarts"]["last_at"] - t_stop
    # The first timed-out probe ends health_timeout after the stop (a /metrics fetch the stop
    # caught may delay it by metrics_timeout); T later it is a hang.
    assert hang_timeout <= detect <= health_timeout + metrics_timeout + hang_timeout + POLL + 1.0, detect
    d.wait_ready(generation_pid=pid, timeout=30)
    assert group_members(pid) == []  # the stopped tree was killed


def test_frozen_engine_core_is_found_by_the_active_probe(run_daemon, tmp_path, fake_engine_python):
    d = run_daemon(
        engine_config(
            tmp_path,
            fake_engine_python,
            watchdog={"poll_interval": POLL, "probe_idle_seconds": 1.0, "probe_timeout": 1.0, "probe_failures": 2, "stall_seconds": 600},
        )
    )
    first = d.wait_ready()
    fake = double_of(d, fake_engine_python)
    core = fake.state()["engine_core_pid"]
    t_freeze = time.time()
    os.kill(core, signal.SIGSTOP)  # EngineCore, not the API server: /health stays 200
    wait_until(lambda: fake.state()["engine_core_state"] == "T", 2.0, what="the EngineCore stopped")
    import httpx

    assert httpx.get(fake.url + "/health", timeout=2).status_code == 200
    st = d.wait_for(lambda s: s["restarts"]["total"] >= 1 and s, 30, "a stall restart")
    assert st["restarts"]["last_reason"] == "probe_failed"
    assert "inference probes failed" in d.log()
    detect = st["restarts"]["last_at"] - t_freeze
    # Two probes that each time out (1 s), after at most probe_idle_seconds of no tokens.
    assert 2 * 1.0 - 0.1 <= detect <= 1.0 + 2 * 1.0 + 2 * POLL + 2.0, detect
    d.wait_ready(generation_pid=first["engine"]["pid"], timeout=30)
    assert group_members(first["engine"]["pid"]) == []


def test_passive_stall_running_requests_without_tokens(run_daemon, tmp_path, fake_engine_python):
    d = run_daemon(
        engine_config(
            tmp_path,
            fake_engine_python,
            watchdog={"poll_interval": POLL, "stall_seconds": 2.0, "probe_idle_seconds": 600},
        )
    )
    d.wait_ready()
    fake = double_of(d, fake_engine_python)
    fake.control(metrics="load", load_tokens_per_s=0)  # requests running, the token counter flat
    st = d.wait_for(lambda s: s["restarts"]["total"] >= 1 and s, 20, "a passive stall restart")
    assert st["restarts"]["last_reason"] == "stalled"
    assert "no progress (tokens or KV blocks)" in d.log()


def test_health_503_is_a_dead_engine(run_daemon, tmp_path, fake_engine_python):
    d = run_daemon(engine_config(tmp_path, fake_engine_python, watchdog={"poll_interval": POLL}))
    first = d.wait_ready()
    double_of(d, fake_engine_python).control(health="503")
    st = d.wait_for(lambda s: s["restarts"]["total"] >= 1 and s, 10, "a dead restart")
    assert st["restarts"]["last_reason"] == "dead"
    d.wait_ready(generation_pid=first["engine"]["pid"])


def test_garbage_metrics_do_not_crash_or_restart(run_daemon, tmp_path, fake_engine_python):
    d = run_daemon(engine_config(tmp_path, fake_engine_python, watchdog={"poll_interval": POLL}))
    d.wait_ready()
    double_of(d, fake_engine_python).control(metrics="garbage")
    st = d.wait_for(lambda s: s["metrics"]["error"] and s, 10, "a metrics parse error in the state")
    time.sleep(10 * POLL)  # time passing on purpose: ten polls of garbage, and no restart or crash
    assert d.state()["restarts"]["total"] == 0
    assert d.proc.poll() is None
    assert "Traceback" not in d.log()
    assert st["metrics"]["error"]
