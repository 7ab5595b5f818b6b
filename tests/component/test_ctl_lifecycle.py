"""r3090ctl against a running daemon and the vLLM double, through a whole life.

start -> KV-leak restart (drained) -> backoff -> maintenance -> reload (watchdog
only, invalid, engine change) -> give-up (the daemon stays up) -> restart after
the give-up -> daemon gone. At each step `status`
(the CLI, as its own process) must give the right exit code, and its --json
must agree with what the test sees for itself: the process table (psutil), the
double's own state and request log, and when the faults were injected.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from r3090d import exitcodes
from r3090d.service import control_client
from tests.ctl_harness import CTL, ctl, ctl_json
from tests.daemon_harness import api_server_pid, ctrl_c_reaches_it
from tests.waiting import wait_until

pytestmark = pytest.mark.component

STARTUP_S = 8.0  # the double's model load: long enough for a CLI run to see "starting", even on a loaded machine
WATCHDOG = {
    "poll_interval": 0.2,
    "kv_cooldown": 0.0,
    "kv_low_polls": 3,
    "min_free_blocks": 100,
    # BACKOFF lasts this long: time for three CLI runs to see it, even on a loaded machine.
    "backoff_initial": 15.0,
    "backoff_max": 15.0,
    "start_failures": 4,  # every failure here comes within min_uptime of ready: a start failure
    "same_cause_failures": 100,
    "min_uptime": 600.0,
    "lb_grace": 6.0,  # DRAINING lasts this long: time for a CLI run to see it
}


def engine_children(daemon_pid: int) -> list[psutil.Process]:
    """The API-server processes the daemon has spawned, as the process table shows them."""
    out = []
    for child in psutil.Process(daemon_pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and any("api_server" in part for part in child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def status(d) -> tuple[int, dict]:
    rc, out = ctl_json(d.config, "status")
    assert out["exit_code"] == rc
    return rc, out


def watch_documents(text: str) -> list[dict]:
    """The documents `status --watch --json` has written, skipping a line still being written."""
    docs = []
    for line in text.splitlines():
        try:
            docs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return docs


def watched_phase(doc: dict) -> str:
    """The engine phase a watch document shows, or "daemon gone"."""
    return (doc["state"] or {}).get("engine", {}).get("phase") if doc["running"] else "daemon gone"


def agrees_with_the_process_table(d, st: dict) -> None:
    engines = engine_children(d.pid)
    if st["engine"]["pid"] is None:
        assert engines == [], f"status says no engine, psutil sees {engines}"
        return
    assert [p.pid for p in engines] == [st["engine"]["pid"]]
    fake = d.fake("GET", "/fake/state").json()
    assert fake["pid"] == api_server_pid(st["engine"]["pid"])  # the engine's pid is its launcher's
    assert {fake["pid"], fake["engine_core_pid"], fake["worker_pid"]} <= set(st["engine"]["tree_pids"])


def test_status_follows_start_kv_restart_backoff_maintenance_reload_and_give_up(make_daemon, request):
    d = make_daemon(extra_args=["--fake-startup-delay", str(STARTUP_S)], watchdog=WATCHDOG, engine={"shutdown_timeout": 2})
    d.start()

    # ---- starting: WARNING
    d.wait_phase("starting", timeout=15)
    rc, out = status(d)
    assert rc == exitcodes.WARNING, out
    assert out["running"] and out["source"] == "socket"
    assert out["state"]["engine"]["phase"] == "starting"

    # ---- ready: OK, and the same engine the process table and the double show
    d.wait_ready()
    rc, out = status(d)
    assert rc == exitcodes.OK, out
    st = out["state"]
    assert st["engine"]["phase"] == "ready" and st["daemon"]["pid"] == d.pid
    agrees_with_the_process_table(d, st)
    polls = [r for r in d.fake("GET", "/fake/requests").json()["requests"] if r["path"] == "/metrics"]
    assert polls and st["written_at"] - polls[-1]["t"] < 1.0, "the state should reflect the latest /metrics poll"
    text = ctl(d.config, "status")
    assert text.returncode == exitcodes.OK and "Status     OK: engine ready" in text.stdout, text.stdout
    first_pid = st["engine"]["pid"]

    # ---- KV leak: a drained restart, WARNING while draining
    t_inject = time.time()
    d.fake("POST", "/fake/control", json={"metrics": "leak", "kv_usage": 0.999})
    t_injected = time.time()  # the leak took effect somewhere between the two
    d.wait_phase("draining", timeout=10)
    log = d.fake("GET", "/fake/requests").json()["requests"]  # the old engine still answers during the grace
    rc, out = status(d)
    assert rc == exitcodes.WARNING, out
    st = out["state"]
    assert st["engine"]["phase"] == "draining" and st["restarts"]["last_reason"] == "kv"
    assert t_inject < st["restarts"]["last_at"] < t_inject + 3.0
    # The deciding tick stamps the restart before it polls; DRAINING polls no more.
    def polls_since(t: float) -> list[float]:
        return [r["t"] for r in log if r["path"] == "/metrics" and t < r["t"] <= st["restarts"]["last_at"] + 1.0]

    # It restarted on the 3rd low poll after the fault (4 if the fault landed mid-poll), not before.
    assert len(polls_since(t_inject)) >= WATCHDOG["kv_low_polls"], polls_since(t_inject)
    assert len(polls_since(t_injected)) <= WATCHDOG["kv_low_polls"] + 1, polls_since(t_injected)
    st = d.wait_ready(timeout=40, old_pid=first_pid)
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
    rc, out = status(d)
    assert rc == exitcodes.OK
    agrees_with_the_process_table(d, out["state"])
    assert out["state"]["restarts"]["by_reason"] == {"kv": 1}
    rc, hist = ctl_json(d.config, "history")
    assert rc == 0 and hist[0]["reason"] == "kv" and hist[0]["ready_after_s"] is not None
    second_pid = out["state"]["engine"]["pid"]

    # ---- the engine exits: a failure, backoff (15 s): WARNING, no engine process
    d.fake("POST", "/fake/control", json={"exit": 1})
    st = d.wait_phase("backoff", timeout=10)
    rc, out = status(d)
    assert rc == exitcodes.WARNING, out
    assert out["state"]["engine"]["phase"] == "backoff"
    assert out["state"]["next_action"].startswith("start engine in")
    agrees_with_the_process_table(d, out["state"])
    text = ctl(d.config, "status")
    assert "engine backoff (exited)" in text.stdout and text.returncode == exitcodes.WARNING
    st = d.wait_ready(timeout=40, old_pid=second_pid)
    third_pid = st["engine"]["pid"]

    # ---- maintenance: WARNING; a leak is not remediated
    on = ctl(d.config, "maintenance", "on")
    assert on.returncode == 0 and "maintenance on" in on.stdout
    wait_until(lambda: d.state()["engine"]["maintenance"], 5, what="maintenance in the state")
    rc, out = status(d)
    assert rc == exitcodes.WARNING and "maintenance mode" in out["reasons"]
    d.fake("POST", "/fake/control", json={"metrics": "leak", "kv_usage": 0.999})

    def leak_seen() -> bool:
        free = d.state()["metrics"]["free_blocks"]
        return free is not None and free < WATCHDOG["min_free_blocks"]

    wait_until(leak_seen, 5, what="the leak in the state")
    # Time passing on purpose: ten polls of the leak, and no restart in maintenance.
    time.sleep(10 * WATCHDOG["poll_interval"])
    st = d.state()
    assert st["engine"]["pid"] == third_pid and st["restarts"]["total"] == 2
    assert st["metrics"]["free_blocks"] < WATCHDOG["min_free_blocks"]
    d.fake("POST", "/fake/control", json={"metrics": "live"})
    wait_until(lambda: (d.state()["metrics"]["free_blocks"] or 0) > 5000, 5, what="live metrics again")
    assert ctl(d.config, "maintenance", "off").returncode == 0
    wait_until(lambda: not d.state()["engine"]["maintenance"], 5, what="maintenance off")
    assert status(d)[0] == exitcodes.OK

    # ---- reload, watchdog only: applied, same engine
    d.rewrite(watchdog={"poll_interval": 0.25})
    out = ctl(d.config, "reload")
    assert out.returncode == 0 and "applied without an engine restart" in out.stdout, out
    wait_until(lambda: d.state()["daemon"]["poll_interval"] == 0.25, 5, what="the new poll interval")
    assert d.state()["engine"]["pid"] == third_pid

    # ---- reload, invalid: refused, the daemon keeps the old config and keeps answering
    good = d.config.read_text()
    d.config.write_text(good + "\n[watchdog]\npoll_interval = 9\n")  # a duplicate table: TOML error
    # The CLI cannot even read it (nor find the socket in it): not sent, exit 78.
    out = ctl(d.config, "reload")
    assert out.returncode == exitcodes.CONFIG and "not sent, the config is invalid" in out.stderr and "TOML syntax error" in out.stderr, out
    # Sent anyway (as SIGHUP would): the daemon refuses it.
    reply = control_client.request(d.runtime_dir, {"cmd": "reload"}, 60)
    assert reply["ok"] is False and reply["error"].startswith("refused, the running config stays") and "TOML syntax error" in reply["error"]
    d.config.write_text(good.replace("kv_low_polls = 3", "kv_low_polls = -1"))
    reply = control_client.request(d.runtime_dir, {"cmd": "reload"}, 60)
    assert reply["ok"] is False and "watchdog.kv_low_polls" in reply["error"]
    # Valid for the CLI, but the daemon checks files too: a model that does not exist.
    d.config.write_text(good.replace(str(d.dir / "model"), str(d.dir / "no-such-model")))
    out = ctl(d.config, "reload")
    assert out.returncode == 1 and "refused, the running config stays" in out.stderr and "does not exist" in out.stderr, out
    # Another engine python (this one has no vLLM): refused at once, without asking it anything.
    d.config.write_text(good.replace(d.sections["engine"]["python"], sys.executable))
    assert sys.executable in d.config.read_text()
    reply = control_client.request(d.runtime_dir, {"cmd": "reload"}, 60)
    assert reply["ok"] is False and "engine.python" in reply["error"] and "restart the daemon" in reply["error"], reply
    d.config.write_text(good)
    assert d.proc.proc.poll() is None
    rc, out = status(d)
    assert rc == exitcodes.OK and out["state"]["daemon"]["poll_interval"] == 0.25 and out["state"]["engine"]["pid"] == third_pid

    # ---- reload, engine change: a drained restart onto the new argv
    d.rewrite(engine={"extra_args": ["--fake-ignore-sigterm"]})
    out = ctl(d.config, "reload")
    assert out.returncode == 0 and "drained restart" in out.stdout, out
    st = d.wait_ready(timeout=40, old_pid=third_pid)
    fourth_pid = st["engine"]["pid"]
    assert "--fake-ignore-sigterm" in psutil.Process(fourth_pid).cmdline()
    assert st["restarts"]["by_reason"] == {"kv": 1, "exited": 1, "requested": 1}

    # ---- failure 3 (backoff), then failure 4: give up. The daemon stays up, the
    # engine stays stopped; a CLI already running (`status --watch`) sees it.
    watch_path = d.dir / "watch.out"
    watch_out = watch_path.open("w")
    watcher = subprocess.Popen([*CTL, "status", "--watch", "0.2", "--json", "--config", str(d.config)], stdout=watch_out, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it)
    request.addfinalizer(lambda: watcher.poll() is None and watcher.kill())  # never left running by a failed assertion

    def watched() -> list[str]:
        """The phases the watcher has printed so far, in order ("daemon gone" once it is)."""
        return [watched_phase(doc) for doc in watch_documents(watch_path.read_text())]

    def watched_after(first: str, then: str) -> bool:
        keys = watched()
        return first in keys and then in keys[keys.index(first) :]

    # Each phase is waited for in the watcher's own output, so a slow machine cannot
    # make it miss one: its interpreter may take seconds to start.
    wait_until(lambda: "ready" in watched(), 30, what="the watcher's first document")
    d.fake("POST", "/fake/control", json={"exit": 1})
    d.wait_ready(timeout=40, old_pid=fourth_pid)
    wait_until(lambda: watched_after("backoff", "ready"), 10, what="the watcher seeing the backoff, then ready")
    t_fault = time.time()
    d.fake("POST", "/fake/control", json={"health": "503"})
    wait_until(lambda: _phase(d) == "given-up", 10, interval=0.005, what="given-up")
    wait_until(lambda: "given-up" in watched(), 10, what="the watcher seeing given-up")
    reason = "gave up: 4 start failures in a row (last: dead: /health answered 503)"
    rc, out = status(d)
    assert rc == exitcodes.CRITICAL and out["running"] is True and out["reasons"][0].startswith(reason), out["reasons"]
    assert t_fault < out["state"]["engine"]["since"] < t_fault + 3.0
    wait_until(lambda: not engine_children(d.pid), 10, what="the given-up engine stopped")
    assert d.proc.proc.poll() is None, "the daemon exited on give-up"
    agrees_with_the_process_table(d, d.state())
    wait_until(lambda: "gave_up" in d.state()["alerts"]["firing"], 5, what="gave_up firing")
    # A reload alone never starts a given-up engine.
    out = ctl(d.config, "reload")
    assert out.returncode == 0 and "applied" in out.stdout, out
    assert _phase(d) == "given-up"

    # ---- restart after the give-up: from zero failures; --wait is not fooled by the given-up it starts from
    out = ctl(d.config, "restart", "--wait", timeout=90)
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith("ready after "), out
    st = d.state()
    assert st["restarts"]["start_failures"] == 0 and st["give_up_reason"] is None
    wait_until(lambda: "gave_up" not in d.state()["alerts"]["firing"], 10, what="gave_up resolved")
    wait_until(lambda: watched_after("given-up", "ready"), 10, what="the watcher seeing ready after given-up")
    fifth_pid = st["engine"]["pid"]

    d.proc.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait_exit(timeout=30) == exitcodes.OK
    wait_until(lambda: "daemon gone" in watched(), 10, what="the watcher's view of the daemon gone")
    watcher.send_signal(signal.SIGINT)
    _, err = watcher.communicate(timeout=10)
    watch_out.close()
    out = watch_path.read_text()
    seen: dict[str, set[int]] = {}
    why: dict[tuple[str, int], list] = {}  # the reasons, for the failure message
    docs = watch_documents(out)
    assert len(docs) == len(out.splitlines()), out  # once the watcher has exited, every line is whole
    for doc in docs:
        key = watched_phase(doc)
        seen.setdefault(key, set()).add(doc["exit_code"])
        why.setdefault((key, doc["exit_code"]), doc["reasons"])
        if key == "given-up":
            assert doc["reasons"][0].startswith(reason), doc["reasons"]
    assert seen.get("given-up") == {exitcodes.CRITICAL}, (seen, err)
    assert seen.get("backoff") == {exitcodes.WARNING}, why
    assert seen.get("ready"), why
    assert seen.get("daemon gone") == {exitcodes.UNKNOWN}, seen
    assert watcher.returncode == exitcodes.UNKNOWN  # --watch exits with its last verdict
    assert not psutil.pid_exists(fifth_pid) or psutil.Process(fifth_pid).status() == psutil.STATUS_ZOMBIE

    # ---- the daemon is gone: UNKNOWN, with how to start it
    text = ctl(d.config, "status")
    assert text.returncode == exitcodes.UNKNOWN
    assert f"r3090d is not running (pid {d.pid} is gone)" in text.stdout
    assert "Start it with: systemctl start r3090d" in text.stdout
    assert "Traceback" not in text.stdout + text.stderr
    rc, out = status(d)
    assert rc == exitcodes.UNKNOWN and out["running"] is False
    # Commands that need the daemon say so in one line and exit 1.
    for args in (("restart",), ("maintenance", "on"), ("silence", "gpu_memory", "1h"), ("reload",)):
        out = ctl(d.config, *args)
        assert out.returncode == 1 and out.stdout == "", (args, out)
        assert out.stderr.strip().splitlines() == [f"r3090ctl: r3090d is not running (no control socket at {d.runtime_dir}/control.sock)"]
    # history still works without the daemon; the give-up and the operator's restart are in it.
    rc, hist = ctl_json(d.config, "history")
    assert rc == 0 and [h["reason"] for h in hist] == ["dead", "exited", "requested", "exited", "kv"]


def _phase(d) -> str | None:
    try:
        reply = control_client.request(d.runtime_dir, {"cmd": "status"}, 1.0)
    except control_client.ClientError:
        return None
    return ((reply.get("state") or {}).get("engine") or {}).get("phase")


def test_restart_wait_shows_progress_and_silence_is_applied(make_daemon):
    d = make_daemon(watchdog={"poll_interval": 0.2, "lb_grace": 0.5}, engine={"shutdown_timeout": 2})
    d.start()
    old = d.wait_ready()["engine"]["pid"]
    out = ctl(d.config, "restart", "--wait")
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert lines[0] == "drain restart requested"
    assert any("draining" in line and "load balancer grace" in line for line in lines), lines
    assert lines[-1].startswith("ready after ")
    new = d.state()["engine"]["pid"]
    assert new != old and f"engine pid {new}" in lines[-1]
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE

    out = ctl(d.config, "restart", "--no-drain", "--wait", "--json")
    assert out.returncode == 0
    reply = json.loads(out.stdout)
    assert reply["ok"] and reply["ready_after_s"] > 0 and reply["pid"] == d.state()["engine"]["pid"] != new
    assert d.state()["restarts"]["total"] == 2 and "fast stop: SIGTERM to engine group" in d.log()

    out = ctl(d.config, "silence", "gpu_temperature", "2h")
    assert out.returncode == 0 and "gpu_temperature silenced until" in out.stdout
    rc, st = ctl_json(d.config, "status")
    until = st["state"]["alerts"]["silenced"]["gpu_temperature"]
    assert 7200 - 30 < until - time.time() <= 7200  # applied by the next tick, on the policy's clock
    out = ctl(d.config, "silence", "gpu_temperature", "2 fortnights")
    assert out.returncode == 64 and "not a duration" in out.stderr

    # Restarting what is not ready is refused with the daemon's reason.
    ctl(d.config, "maintenance", "on")
    d.fake("POST", "/fake/control", json={"exit": 1})
    d.wait_phase("backoff", timeout=10)
    out = ctl(d.config, "restart")
    assert out.returncode == 1 and "refused: engine is backoff, not ready" in out.stderr
