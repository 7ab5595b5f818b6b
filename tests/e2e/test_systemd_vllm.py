"""The unit that `make install` ships, under a real systemd, supervising a REAL vLLM on CPU.

One service is shared by the tests of this module (each real vLLM load takes
about a minute on 2 cores); each test first makes sure it is active. The test
drop-in only shortens timeouts and redirects output: the shipped hardening is
what vLLM runs under. The config's engine.python is a wrapper of the engine's
python that can hold vLLM's start while a file exists (HOLD_FILE), so that a
test decides how long a load lasts instead of relying on this machine's speed.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import TEST_ROOT, Unit, write_public
from tests.e2e.real_vllm import (
    CPU_EXTRA_ARGS,
    DEFAULT_ENGINE_PYTHON,
    ENGINE_BOUND_ARGS,
    OFFLINE_ENV,
    TINY_MODEL_NAME,
)
from tests.e2e.systemd_ns import proc_status, process_state, start_time_ticks

pytestmark = [pytest.mark.systemd, pytest.mark.vllm]

# The shared default path, not $R3090D_ENGINE_PYTHON: the service user must be able to run it.
ENGINE_PYTHON = DEFAULT_ENGINE_PYTHON
# While HOLD_FILE exists, vLLM's API server waits before it starts (at most HOLD_MAX s).
ENGINE_WRAPPER = TEST_ROOT / "engine-python"
HOLD_FILE = TEST_ROOT / "engine-hold"
HOLD_MAX = 120
ENGINE_PORT = 18090
EXPORTER_PORT = 19490
URL = f"http://127.0.0.1:{ENGINE_PORT}"
MODEL_NAME = TINY_MODEL_NAME
TEST_START_TIMEOUT = 20  # the load is held past it: only EXTEND_TIMEOUT_USEC keeps the start alive
HOLD_PAST_START_TIMEOUT = 5  # s past TimeoutStartSec that the start test holds vLLM's load
TEST_WATCHDOG = 8
TEST_STOP_TIMEOUT = 3  # below the drain: only EXTEND_TIMEOUT_USEC keeps systemd from killing it
RESTART_SEC = 5
LOAD_TIMEOUT = 300
ENGINE_ENV = "\n".join(f'{k} = "{v}"' for k, v in OFFLINE_ENV.items())


def engine_wrapper() -> str:
    """The engine's python, except that vLLM's API server first waits while HOLD_FILE exists."""
    return f"""\
#!/bin/sh
case " $* " in
*" vllm.entrypoints.openai.api_server "*)
    i=0
    while [ -e {HOLD_FILE} ] && [ "$i" -lt {HOLD_MAX * 10} ]; do sleep 0.1; i=$((i + 1)); done ;;
esac
exec {ENGINE_PYTHON} "$@"
"""


def vllm_config(model) -> str:
    return f"""\
profile = "realtime"

[engine]
python = "{ENGINE_WRAPPER}"
model = "{model}"
served_model_name = "{MODEL_NAME}"
host = "127.0.0.1"
port = {ENGINE_PORT}
shutdown_timeout = 60  # the stream below must finish inside the drain, even on a busy machine
startup_timeout = {LOAD_TIMEOUT}
# The engine-bound model: a stream lasts as long as the engine takes to decode it, so a
# stop can land in the middle of one.
extra_args = {json.dumps([*CPU_EXTRA_ARGS, *ENGINE_BOUND_ARGS])}

[engine.env]
VLLM_CPU_KVCACHE_SPACE = "1"
{ENGINE_ENV}

[gpu]
required = false

[watchdog]
# One tick a second keeps the pings well inside the test's WatchdogSec={TEST_WATCHDOG}.
poll_interval = 1.0

[daemon]
exporter_port = {EXPORTER_PORT}
"""


@pytest.fixture(scope="module")
def service(systemd_ns, installed, tiny_model, vllm_lock):
    if not os.access(ENGINE_PYTHON, os.X_OK):
        pytest.skip(f"no vLLM engine venv at {ENGINE_PYTHON}: make engine (or make install ENGINE=1)")
    HOLD_FILE.unlink(missing_ok=True)
    write_public(ENGINE_WRAPPER, engine_wrapper()).chmod(0o755)
    config = write_public(TEST_ROOT / "config-vllm.toml", vllm_config(tiny_model))
    unit = Unit(systemd_ns, "r3090d.service", "r3090d-vllm.log")
    unit.reset()
    unit.configure(
        config,
        f"TimeoutStartSec={TEST_START_TIMEOUT}",
        f"WatchdogSec={TEST_WATCHDOG}",
        f"TimeoutStopSec={TEST_STOP_TIMEOUT}",
    )
    yield unit
    HOLD_FILE.unlink(missing_ok=True)
    print(f"===== {unit.name}\n{unit.describe()}")
    unit.remove()
    assert systemd_ns.namespace_pids_matching("vllm") == {}, "vLLM processes outlived the unit"


def ensure_active(unit: Unit) -> float:
    """Starts the unit if needed; waits until active. Returns the seconds waited."""
    start = time.monotonic()
    if unit.state() not in ("active", "activating"):
        unit.ns.ctl("start", "--no-block", unit.name)
    unit.wait_for(lambda: unit.state() == "active", LOAD_TIMEOUT, "active", interval=0.5)
    return time.monotonic() - start


def monotonic_of(unit: Unit, prop: str) -> float:
    """A systemd *TimestampMonotonic property, in time.monotonic() seconds (both CLOCK_MONOTONIC)."""
    return int(unit.show(prop)[prop]) / 1e6


def tree_snapshot(unit: Unit) -> dict[int, int]:
    """pid -> start time, for every live process of the unit."""
    return {pid: ticks for pid in unit.pids() if (ticks := start_time_ticks(pid)) is not None}


def alive(pid: int, ticks: int) -> bool:
    return process_state(pid) not in (None, "Z") and start_time_ticks(pid) == ticks


class GoneWatcher(threading.Thread):
    """Polls a set of processes every 20 ms and records when one of them was last seen alive."""

    def __init__(self, procs: dict[int, int]):
        super().__init__(daemon=True)
        self.procs = dict(procs)
        self.last_seen_alive = time.monotonic()
        self.all_gone_at: float | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            now = time.monotonic()
            if any(alive(p, t) for p, t in self.procs.items()):
                self.last_seen_alive = now
            else:
                self.all_gone_at = now
                return
            time.sleep(0.02)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def engine_processes(unit: Unit, main: int) -> dict[int, str]:
    return {pid: cmdline(pid) for pid in unit.pids() - {main}}


def test_start_outlasts_the_start_timeout_and_is_ready_only_after_health(service):
    unit = service
    assert unit.show("TimeoutStartUSec")["TimeoutStartUSec"] == f"{TEST_START_TIMEOUT}s"
    unit.reset()
    health: list[tuple[float, bool]] = []
    stop_polling = threading.Event()

    def poll_health():
        with httpx.Client(timeout=0.5) as client:
            while not stop_polling.is_set():
                t = time.monotonic()
                try:
                    ok = client.get(f"{URL}/health").status_code == 200
                except httpx.TimeoutException:
                    continue  # no answer either way: on a loaded machine a healthy server can be slow
                except httpx.HTTPError:
                    ok = False
                health.append((t, ok))
                time.sleep(0.05)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    states: list[tuple[float, str, str]] = []
    # The load is held until it has outlasted TimeoutStartSec, however fast this machine loads.
    write_public(HOLD_FILE, "")
    try:
        unit.ns.ctl("start", "--no-block", unit.name)

        def active() -> bool:
            """Records every state seen on the way; lets the load go once it is past the start timeout."""
            props = unit.show("ActiveState", "MainPID")
            states.append((time.monotonic(), props["ActiveState"], props["MainPID"]))
            if props["ActiveState"] not in ("activating", "active") and len(states) > 4:
                pytest.fail(f"the unit left activating for {props['ActiveState']}: {unit.describe()}")
            if HOLD_FILE.exists() and props["ActiveState"] == "activating" and props["MainPID"] != "0":
                held = time.monotonic() - monotonic_of(unit, "ExecMainStartTimestampMonotonic")
                if held > TEST_START_TIMEOUT + HOLD_PAST_START_TIMEOUT:
                    HOLD_FILE.unlink()
            return props["ActiveState"] == "active"

        unit.wait_for(active, LOAD_TIMEOUT, "active", interval=0.5)
    finally:
        HOLD_FILE.unlink(missing_ok=True)
        stop_polling.set()
        poller.join(5)

    exec_start = monotonic_of(unit, "ExecMainStartTimestampMonotonic")
    active_at = monotonic_of(unit, "ActiveEnterTimestampMonotonic")
    load = active_at - exec_start
    print(f"start to active: {load:.1f} s under TimeoutStartSec={TEST_START_TIMEOUT}")
    assert load > TEST_START_TIMEOUT + 2, (
        f"the load took {load:.1f} s, too short to show the start timeout being extended"
    )
    late_activating = [
        t - exec_start for t, s, _ in states if s == "activating" and t - exec_start > TEST_START_TIMEOUT + 2
    ]
    assert late_activating, "never seen activating past TimeoutStartSec"
    print(f"still activating {max(late_activating):.1f} s after start")
    assert len({pid for _, _, pid in states if pid != "0"}) == 1, "r3090d was restarted during the load"
    assert unit.show("NRestarts")["NRestarts"] == "0"

    # READY=1 only once /health answered 200: systemd's active timestamp comes after
    # the start of the last failed probe before the first success.
    first_ok = next(i for i, (_, ok) in enumerate(health) if ok)
    assert first_ok > 0, "/health answered before the unit was even started"
    last_fail_start = health[first_ok - 1][0]
    assert active_at > last_fail_start, (
        f"active at {active_at:.2f}, but /health still failed at {last_fail_start:.2f}"
    )
    print(
        f"/health first 200 seen {health[first_ok][0] - exec_start:.1f} s after start; active at {load:.1f} s"
    )

    r = httpx.post(
        f"{URL}/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}, timeout=60
    )
    assert r.status_code == 200, r.text

    # The shipped hardening is what the real vLLM ran under.
    main = unit.main_pid()
    engines = engine_processes(unit, main)
    assert any("vllm.entrypoints.openai.api_server" in c for c in engines.values()), engines
    assert len(engines) >= 2, f"expected the API server and EngineCore: {engines}"
    uid = pwd.getpwnam("r3090").pw_uid
    for pid in [main, *engines]:
        status = proc_status(pid)
        assert status["Uid"].split()[0] == str(uid), (pid, cmdline(pid))
        assert status["NoNewPrivs"].strip() == "1"
        assert status["Seccomp"].strip() == "2", "the system call filter is on"
        assert int(status["CapBnd"], 16) == 0, "empty capability bounding set"
    daemon_env = environ(main)
    assert "NOTIFY_SOCKET" in daemon_env and daemon_env.get("WATCHDOG_USEC") == str(TEST_WATCHDOG * 1_000_000)
    # Only the API server's environment can be read back: EngineCore retitles itself
    # (setproctitle), which overwrites /proc/PID/environ. It inherits the API server's.
    api_server = next(p for p, c in engines.items() if "vllm.entrypoints.openai.api_server" in c)
    env = environ(api_server)
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & env.keys(), (
        "vLLM must not be able to notify systemd"
    )
    cache = (env.get("HOME"), env.get("XDG_CACHE_HOME"), env.get("VLLM_CACHE_ROOT"))
    assert cache == ("/var/cache/r3090d", "/var/cache/r3090d", "/var/cache/r3090d/vllm"), sorted(env)


def _wait_restart(unit: Unit, old_main: int, expected_result: str, started: float) -> tuple[float, float]:
    """Waits through the auto-restart; returns (seconds until the old main was ended, new main's start)."""
    acted = None

    def restarted() -> tuple[float, float] | None:
        nonlocal acted
        props = unit.show("ActiveState", "SubState", "Result", "MainPID")
        if acted is None and props["SubState"] == "auto-restart":
            assert props["Result"] == expected_result, unit.describe()
            # systemd's own stamp of the old main's end: this polling adds nothing to it.
            acted = monotonic_of(unit, "ExecMainExitTimestampMonotonic") - started
        if props["MainPID"] != "0" and unit.main_pid() not in (None, old_main):
            assert acted is not None, (
                f"never saw auto-restart with Result={expected_result}: {unit.describe()}"
            )
            return acted, monotonic_of(unit, "ExecMainStartTimestampMonotonic")
        return None

    return unit.wait_for(
        restarted, started + TEST_WATCHDOG + 60 - time.monotonic(), "a restart", interval=0.1
    )


@pytest.mark.parametrize(
    "sig, result",
    [(signal.SIGSTOP, "watchdog"), (signal.SIGKILL, "signal")],
    ids=["sigstop-watchdog", "sigkill"],
)
def test_daemon_loss_restarts_with_the_old_tree_gone_first(service, sig, result):
    unit = service
    ensure_active(unit)
    restarts_before = int(unit.show("NRestarts")["NRestarts"])
    main = unit.main_pid()
    old = tree_snapshot(unit)
    engines = {p: cmdline(p) for p in old if p != main}
    assert any("vllm.entrypoints" in c for c in engines.values()) and any(
        "EngineCore" in c for c in engines.values()
    ), engines
    assert all(process_state(p) in ("R", "S", "D") for p in old), {p: process_state(p) for p in old}
    print(f"old tree: daemon {main}, engine {engines}")

    watcher = GoneWatcher(old)
    watcher.start()
    t0 = time.monotonic()
    os.kill(main, sig)
    try:
        acted, new_start = _wait_restart(unit, main, result, t0)
    finally:
        watcher.stop()
    print(
        f"{signal.Signals(sig).name}: systemd acted after {acted:.1f} s; old tree gone {watcher.all_gone_at - t0:.1f} s after the signal"
    )
    if sig == signal.SIGSTOP:
        # The watchdog fires 8 s after the last ping (at most a tick before the signal); the
        # stopped daemon cannot take its SIGABRT, so systemd kills it TimeoutAbortSec (= the stop
        # timeout) later.
        assert TEST_WATCHDOG - 1 <= acted <= TEST_WATCHDOG + TEST_STOP_TIMEOUT + 2, "the watchdog, not something else, ended it"
    assert watcher.all_gone_at is not None, f"still alive: {[p for p, t in old.items() if alive(p, t)]}"
    assert watcher.last_seen_alive < new_start, "the new r3090d started while the old tree was still alive"
    assert int(unit.show("NRestarts")["NRestarts"]) == restarts_before + 1

    took = ensure_active(unit)
    print(f"restarted unit active again {took:.1f} s later")
    new_main = unit.main_pid()
    new_engines = engine_processes(unit, new_main)
    assert new_main != main and not set(new_engines) & set(old), "a fresh tree"


def test_stop_drains_an_in_flight_stream(service):
    """The drain outlasts the test's TimeoutStopSec: r3090d's EXTEND_TIMEOUT_USEC keeps systemd waiting."""
    unit = service
    assert unit.show("TimeoutStopUSec")["TimeoutStopUSec"] == f"{TEST_STOP_TIMEOUT}s"
    ensure_active(unit)
    pids_before = unit.pids()
    max_tokens = 600  # about 15 s at the engine-bound model's 40 tokens/s (float32): well inside the 60 s drain
    events: list[tuple[float, object]] = []
    errors: list[BaseException] = []
    got_tokens = threading.Event()

    def stream():
        body = {
            "model": MODEL_NAME,
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{URL}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    events.append((time.monotonic(), payload if payload == "[DONE]" else json.loads(payload)))
                    if len(events) >= 20:
                        got_tokens.set()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
            got_tokens.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert got_tokens.wait(60), "the stream never started"
    assert not errors, errors
    stop_at = time.monotonic()
    unit.ns.ctl("stop", unit.name, timeout=180)
    stopped_at = time.monotonic()
    reader.join(90)
    assert not errors, errors

    chunks = [p for _, p in events if isinstance(p, dict)]
    after_stop = [t for t, p in events if isinstance(p, dict) and t > stop_at]
    print(
        f"stop took {stopped_at - stop_at:.1f} s; {len(after_stop)} of {len(chunks)} chunks arrived after the stop began"
    )
    assert after_stop, "the stream was already over when the stop began: nothing was drained"
    assert stopped_at - stop_at > TEST_STOP_TIMEOUT + 1, (
        "the drain did not outlast TimeoutStopSec: nothing shown"
    )
    assert events[-1][1] == "[DONE]"
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"][0].get("finish_reason")]
    assert finish == ["length"], finish
    text_chunks = [c for c in chunks if c["choices"][0].get("text")]
    assert len(text_chunks) >= max_tokens * 0.9, f"only {len(text_chunks)} chunks for {max_tokens} tokens"

    props = unit.show("ActiveState", "Result", "ExecMainStatus")
    assert props == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, unit.describe()
    assert unit.pids() == set()
    assert not [p for p in pids_before if process_state(p) not in (None, "Z")], "processes outlived the stop"
    assert unit.ns.namespace_pids_matching("vllm") == {}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{URL}/health", timeout=2)
