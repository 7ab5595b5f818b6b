"""Restart semantics against the vLLM double: recoverable faults never lead to a give-up;
an engine that cannot start is given up on, with its root cause, and the daemon stays up."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from r3090d import procstat
from tests.component.test_daemon_supervision import run_daemon  # noqa: F401  (fixture)
from tests.ctl_harness import ctl
from tests.daemon_harness import api_server_pid, engine_config, group_members
from tests.waiting import wait_until

pytestmark = pytest.mark.component

FAULTS = 20


def _fault(n: int, st: dict) -> None:
    """Four kinds of recoverable fault, in turn: an exit 0, the API server killed,
    EngineCore killed, /health 503 (vLLM's EngineDeadError answer)."""
    url = st["engine"]["url"]
    main = st["engine"]["pid"]
    kind = n % 4
    if kind == 0:
        httpx.post(f"{url}/fake/control", json={"exit": 0}, timeout=5, trust_env=False)
    elif kind == 1:
        os.kill(api_server_pid(main), signal.SIGKILL)
    elif kind == 2:
        core = [p for p in group_members(main) if (proc := procstat.read(p)) is not None and proc.comm == "fake-EngineCore"]
        os.kill(core[0], signal.SIGKILL)
    else:
        httpx.post(f"{url}/fake/control", json={"health": "503"}, timeout=5, trust_env=False)


def alert_lines(log: str, key: str) -> list[str]:
    """The states the daemon decided for `key`, in order (its own log lines, not the channels')."""
    marker = f" r3090d: alert {key} "
    return [line.split(marker, 1)[1].split(":", 1)[0] for line in log.splitlines() if marker in line]


def test_recoverable_faults_restart_at_once_for_ever_and_the_storm_alert_fires_then_resolves(run_daemon, tmp_path, fake_engine_python):  # noqa: F811
    window = 30.0
    d = run_daemon(
        engine_config(
            tmp_path,
            fake_engine_python,
            extra_args=["--fake-dead-exit-delay", "0.2"],
            watchdog={
                "min_uptime": 1.0,
                "backoff_initial": 20.0,  # any backoff at all would show as a 20 s gap
                "backoff_max": 20.0,
                "start_failures": 3,
                "restart_storm_restarts": 3,
                "restart_storm_window": window,
                "dead_refused_polls": 2,
            },
            alerts={"min_interval": 0.0},
        )
    )
    st = d.wait_ready()
    for n in range(FAULTS):
        # Ready for longer than min_uptime: the next failure is not a start failure.
        wait_until(lambda: _ready_for(d) > 1.5, 30, what="min_uptime passed")
        old = st["engine"]["pid"]
        _fault(n, st)
        st = d.wait_ready(timeout=30, generation_pid=old)
        assert st["restarts"]["backoff_level"] == 0 and st["restarts"]["start_failures"] == 0, st["restarts"]
        assert st["give_up_reason"] is None
    assert st["restarts"]["total"] == FAULTS
    assert "restart_storm" in st["alerts"]["firing"]
    # After the storm: the restarts age out of the window and one RESOLVED goes out.
    wait_until(lambda: "restart_storm" not in d.state()["alerts"]["firing"], window + 30, what="restart_storm resolved")
    assert alert_lines(d.log(), "restart_storm") == ["firing", "resolved"], d.log()[-3000:]
    assert d.state()["engine"]["phase"] == "ready" and d.proc.poll() is None


def _ready_for(d) -> float:
    st = d.state()
    if st["engine"]["phase"] != "ready" or not st["engine"]["ready_since"]:
        return 0.0
    return st["written_at"] - st["engine"]["ready_since"]


@pytest.mark.parametrize(
    "watchdog, expected_failures, why",
    [
        ({"start_failures": 3, "same_cause_failures": 100}, 3, "3 start failures in a row"),
        ({"start_failures": 10, "same_cause_failures": 2}, 2, "2 start failures in a row with the same cause"),
    ],
)
def test_an_engine_that_cannot_start_is_given_up_on_with_its_root_cause(run_daemon, tmp_path, fake_engine_python, watchdog, expected_failures, why):  # noqa: F811
    # The double's KV cache cannot hold its max_model_len: EngineCore raises, as vLLM's does.
    d = run_daemon(
        engine_config(
            tmp_path,
            fake_engine_python,
            extra_args=["--fake-num-gpu-blocks", "8", "--max-model-len", "4096"],
            watchdog={"backoff_initial": 0.2, "backoff_max": 0.4, **watchdog},
        )
    )
    st = d.wait_for(lambda s: s if s["engine"]["phase"] == "given-up" else None, 60, "given-up")
    cause = "ValueError: To serve at least one request"
    assert st["give_up_reason"].startswith(why) and cause in st["give_up_reason"], st["give_up_reason"]
    assert cause in st["restarts"]["last_root_cause"]
    assert st["restarts"]["total"] == expected_failures - 1  # the last failure is the give-up, not a restart
    firing = alert_lines(d.log(), "gave_up")
    assert firing == ["firing"], d.log()[-3000:]
    assert cause in next(line for line in d.log().splitlines() if "r3090d: alert gave_up firing" in line)
    # Each restart's alert carries the root cause too.
    restarted = [line for line in d.log().splitlines() if "r3090d: alert engine_restarted firing" in line]
    assert restarted and all(cause in line for line in restarted), restarted  # min_interval may hold back the later ones
    # The daemon stays, the engine is stopped.
    assert d.proc.poll() is None and st["engine"]["pid"] is None


# ------------------------------------------------------------------ across a restart of the daemon


def _kill_as_systemd_would(d, engine_pid: int | None) -> None:
    """SIGKILL the daemon, then the rest of its control group (the engine's process group), as systemd does."""
    os.kill(d.pid, signal.SIGKILL)
    d.wait_exit(10)
    if engine_pid:
        try:
            os.killpg(engine_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_until(lambda: group_members(engine_pid) == [], 10, what="the engine's process group gone")


def _ticks(st: dict) -> int:
    return st["telemetry"]["poll_duration_seconds"]["count"]


def test_a_killed_daemons_successor_counts_on_from_its_recent_restarts(run_daemon, tmp_path, fake_engine_python):  # noqa: F811
    sections = engine_config(
        tmp_path,
        fake_engine_python,
        watchdog={"min_uptime": 0.5, "restart_storm_restarts": 3, "restart_storm_window": 600.0, "backoff_initial": 20.0, "backoff_max": 20.0},
        alerts={"min_interval": 0.0, "hysteresis_polls": 1},  # a wrong RESOLVED would go out at the first tick
    )
    first = run_daemon(sections)
    st = first.wait_ready()
    for _ in range(4):
        wait_until(lambda: _ready_for(first) > 1.0, 30, what="min_uptime passed")
        old = st["engine"]["pid"]
        os.kill(api_server_pid(old), signal.SIGKILL)
        st = first.wait_ready(timeout=30, generation_pid=old)
    st = first.wait_for(lambda s: s if "restart_storm" in s["alerts"]["firing"] else None, 10, "restart_storm firing")
    assert st["restarts"]["recent"] == 4, st["restarts"]
    _kill_as_systemd_would(first, st["engine"]["pid"])

    second = run_daemon(sections)
    # Its own document: the state file holds the first daemon's last one until the second writes.
    started = second.wait_for(lambda s: s if s["daemon"]["pid"] == second.pid and s["engine"]["phase"] == "ready" else None, 30, "the second daemon ready")
    now = second.wait_for(lambda s: s if _ticks(s) >= _ticks(started) + 10 else None, 30, "10 more ticks")
    assert now["daemon"]["pid"] == second.pid
    assert alert_lines(second.log(), "restart_storm") == [], second.log()[-3000:]  # no RESOLVED, no second FIRING
    assert "restart_storm" in now["alerts"]["firing"]
    restarts = now["restarts"]
    # The window's count goes on, and so do the engine's restart counters: they count the engine's restarts, not the daemon's.
    assert (restarts["recent"], restarts["total"], restarts["by_reason"]) == (4, 4, st["restarts"]["by_reason"]), restarts
    assert restarts["last_reason"] == st["restarts"]["last_reason"] and restarts["last_at"] == pytest.approx(st["restarts"]["last_at"], abs=0.05)
    assert restarts["recent_at"] == pytest.approx(st["restarts"]["recent_at"], abs=0.05)
    status = ctl(second.config_path, "status")
    assert "Recent     4 unrequested restarts within 10 min" in status.stdout, status.stdout + status.stderr
    assert "Restarts   4 (" in status.stdout, status.stdout


def test_a_killed_daemons_successor_counts_on_from_its_start_failures(run_daemon, tmp_path, fake_engine_python):  # noqa: F811
    # The double's KV cache cannot hold its max_model_len: every start fails with the same root cause.
    # After the second failure the daemon waits out a long backoff; it is killed there.
    sections = engine_config(
        tmp_path,
        fake_engine_python,
        extra_args=["--fake-num-gpu-blocks", "8", "--max-model-len", "4096"],
        watchdog={"start_failures": 100, "same_cause_failures": 3, "backoff_initial": 120.0, "backoff_max": 120.0},
    )
    first = run_daemon(sections)
    st = first.wait_for(lambda s: s if s["engine"]["phase"] == "backoff" else None, 60, "the backoff after the second start failure")
    assert st["restarts"]["start_failures"] == 2, st["restarts"]
    _kill_as_systemd_would(first, st["engine"]["pid"])

    # The successor's first start fails the same way: the third in a row, so it gives up at once.
    second = run_daemon(sections)
    # (Counting from zero, it would fail twice, then wait out the backoff.)
    st = second.wait_for(lambda s: s if s["engine"]["phase"] == "given-up" else None, 45, "given-up")
    assert st["give_up_reason"].startswith("3 start failures in a row with the same cause"), st["give_up_reason"]
    assert "ValueError: To serve at least one request" in st["give_up_reason"]
