"""Self-healing, end to end: the daemon with the vLLM double and the fake NVML.

An application XID after a crash is a warning and a restart; XID 79 holds every
start (status CRITICAL, the reason named) until `r3090ctl restart`; the driver's
recovery action holds on an XID outside the table; a foreign holder across a
crash makes the restart wait, named, then start with no start failure counted.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from r3090d.core.xid import ResetHold
from r3090d.service import resethold
from tests.component.test_gpu_idle import streams  # endless streams: requests keep running
from tests.ctl_harness import ctl, ctl_json
from tests.daemon_harness import api_server_pid, bind_unix_dgram, group_members
from tests.waiting import wait_until

pytestmark = pytest.mark.component

FAKE_NVML = Path(__file__).resolve().parents[1] / "fakenvml"
ENGINE_MIB = 8000


@pytest.fixture
def healing(make_daemon, tmp_path, monkeypatch):
    """A ready daemon watching a fake card; yields (daemon, card) where card(**fields) rewrites the card."""
    path = tmp_path / "card.json"
    fields: dict = {"util": 50, "processes": [], "graphics_processes": [], "xids": []}

    def card(**changes) -> dict:
        fields.update(changes)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fields))
        tmp.replace(path)  # atomic: the fake re-reads the file on every call
        return fields

    card()
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_NVML}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("R3090D_FAKE_NVML", str(path))
    d = make_daemon(args=("--skip-preflight",), watchdog={"poll_interval": 0.3, "min_uptime": 1.0, "backoff_initial": 0.5,
                                                          "stall_seconds": 600, "probe_idle_seconds": 600})  # fmt: skip
    d.rewrite(gpu={"required": True, "card": "any"})
    d.start()
    st = d.wait_ready(timeout=60)
    # The engine holds the card as NVML would list it, and has been up min_uptime: its start succeeded.
    card(processes=[[p, ENGINE_MIB // 2] for p in group_members(st["engine"]["pid"])[:2]], memory_used_mib=ENGINE_MIB)
    d.proc.wait_for(lambda s: s["healing"]["start_succeeded"], 30, "the start succeeded")
    yield d, card


def kill_engine(d, card, **card_changes) -> int:
    """SIGKILL the engine's API server; its process group goes with it; the card changes as the driver would say."""
    st = d.state()
    pid = st["engine"]["pid"]
    card(**{"processes": [], "memory_used_mib": 0, **card_changes})
    os.killpg(pid, signal.SIGKILL)
    return pid


def test_an_application_xid_right_after_a_crash_is_a_warning_and_the_engine_restarts(healing):
    d, card = healing
    old = kill_engine(d, card, xids=[31])
    st = d.wait_ready(timeout=60, old_pid=old)
    assert st["healing"]["xid_by_class"] == {"application": 1} and st["healing"]["reset_hold"] is None
    assert st["restarts"]["start_failures"] == 0
    assert "alert gpu_xid_application firing: XID 31 (GPU memory page fault)" in d.log()


def test_xid_43_during_the_fast_stop_of_a_frozen_engine_is_restarted(healing):
    d, card = healing
    st = d.state()
    pid = st["engine"]["pid"]
    os.kill(api_server_pid(pid), signal.SIGSTOP)  # /health times out: hung, a fast stop
    d.proc.wait_for(lambda s: s["engine"]["phase"] != "ready", 60, "the hang found")
    card(processes=[], memory_used_mib=0, xids=[43, 45])
    st = d.wait_ready(timeout=60, old_pid=pid)
    assert st["restarts"]["last_reason"] == "hung" and st["healing"]["reset_hold"] is None
    assert st["healing"]["xid_by_class"] == {"application": 2}


def test_xid_79_holds_every_start_until_r3090ctl_restart(healing):
    d, card = healing
    kill_engine(d, card, xids=[79])
    st = d.wait_phase("reset-needed", timeout=60)
    assert "XID 79 (GPU has fallen off the bus)" in st["healing"]["reset_hold"]
    out = ctl(d.config, "status")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "the GPU needs a reset: XID 79 (GPU has fallen off the bus)" in out.stdout
    assert "alert gpu_reset_needed firing" in d.log()
    # The hold is on disk: a restarted daemon would keep it.
    state_dir = Path(d.sections["daemon"]["state_dir"])
    assert "XID 79" in (state_dir / "gpu-reset-hold.json").read_text()
    # Still no engine a few polls on (status answers from the same document).
    d.proc.wait_for(lambda s: s["engine"]["phase"] == "reset-needed" and s["written_at"] > st["written_at"] + 1.0, 30, "a second of reset-needed")
    assert d.state()["engine"]["pid"] is None
    rc, reply = ctl_json(d.config, "restart")
    assert rc == 0 and reply["ok"], reply
    st = d.wait_ready(timeout=60)
    assert st["healing"]["reset_hold"] is None and not (state_dir / "gpu-reset-hold.json").exists()


def test_the_drivers_recovery_action_holds_on_an_xid_outside_the_table(healing):
    d, card = healing
    kill_engine(d, card, xids=[140], recovery_action=1)
    st = d.wait_phase("reset-needed", timeout=60)
    assert "recovery action is gpu reset" in st["healing"]["reset_hold"]
    assert "alert gpu_xid_unknown firing: unknown XID 140" in d.log()


def test_a_foreign_holder_across_a_crash_makes_the_restart_wait_then_start(healing):
    d, card = healing
    borrower = os.getpid()  # a real process, so its name can be read
    kill_engine(d, card, processes=[[borrower, 12000]], memory_used_mib=12000)
    st = d.wait_phase("waiting-for-gpu", timeout=60)
    holders = st["healing"]["gpu_wait_holders"]
    assert [h["pid"] for h in holders] == [borrower] and holders[0]["used_bytes"] == 12000 * 2**20
    out = ctl(d.config, "status")
    assert out.returncode == 1 and f"pid {borrower}" in out.stdout, out.stdout
    card(processes=[], memory_used_mib=0)  # the borrower lets go
    st = d.wait_ready(timeout=60)
    assert st["restarts"]["start_failures"] == 0


def test_a_card_held_by_others_at_boot_waits_with_the_unit_active_then_starts(make_daemon, tmp_path, sockdir, monkeypatch):
    """Preflight finds the card taken: no exit 75 and systemd's restart loop, but READY=1 and waiting-for-gpu
    naming the holder (preflight gives up on what is transient within the second this test allows it)."""
    path = tmp_path / "card.json"
    borrower = os.getpid()  # a real process, so its name can be read

    def card(**fields) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"util": 0, "graphics_processes": [], **fields}))
        tmp.replace(path)

    card(processes=[[borrower, 20000]], memory_used_mib=20000)
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_NVML}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("R3090D_FAKE_NVML", str(path))
    d = make_daemon(watchdog={"poll_interval": 0.3})
    d.rewrite(gpu={"required": True, "card": "any"}, preflight={"transient_retry_s": 0.5, "transient_give_up_s": 1.0})
    notify = bind_unix_dgram(sockdir / "notify.sock", timeout=1.0)
    try:
        d.start(prefix=["env", f"NOTIFY_SOCKET={sockdir / 'notify.sock'}"])
        st = d.wait_phase("waiting-for-gpu", timeout=60)
        assert st["engine"]["pid"] is None
        assert [h["pid"] for h in st["healing"]["gpu_wait_holders"]] == [borrower]
        messages: list[bytes] = []

        def ready_naming_the_holder() -> bool:
            try:
                messages.append(notify.recv(4096))
            except TimeoutError:
                pass
            return any(b"READY=1" in m for m in messages) and any(b"STATUS=" in m and f"pid {borrower}".encode() in m for m in messages)

        wait_until(ready_naming_the_holder, 30, what="READY=1 and the holder in STATUS=", interval=0.0)
        notify.close()  # unread, its queue would fill with WATCHDOG=1 and block the daemon's next send
        # Well past preflight's give-up: still up, still waiting, no engine started.
        d.proc.wait_for(lambda s: s["engine"]["phase"] == "waiting-for-gpu" and s["written_at"] > st["written_at"] + 2.0, 30,
                        "two seconds of waiting-for-gpu")  # fmt: skip
        assert "starting engine" not in d.log()
        card(processes=[], memory_used_mib=0)  # the borrower lets go
        st = d.wait_ready(timeout=60)
        assert st["restarts"]["start_failures"] == 0
    finally:
        notify.close()


# ------------------------------------------------------------------ a give-up retries by itself


def test_a_give_up_whose_cause_goes_away_is_retried_by_itself_and_clears(make_daemon, tmp_path):
    mount = tmp_path / "mounted"  # the model's network mount, absent for now
    d = make_daemon(args=("--skip-preflight",), extra_args=["--fake-fail-start-unless", str(mount)],
                    watchdog={"poll_interval": 0.3, "backoff_initial": 0.2, "backoff_max": 0.5, "give_up_retry": 3.0})  # fmt: skip
    d.start()
    st = d.wait_phase("given-up", timeout=60)
    assert "does not exist" in st["give_up_reason"] and st["healing"]["next_retry_at"] is not None
    out = ctl(d.config, "status")
    assert out.returncode == 2 and "Retry      attempt 1 at" in out.stdout, out.stdout
    # An attempt fails: given up again, attempts counted, the alert not sent again.
    d.proc.wait_for(lambda s: s["healing"]["retry_attempts"] >= 1 and s["engine"]["phase"] == "given-up", 60, "a failed attempt")
    mount.mkdir()  # the mount comes back
    st = d.wait_ready(timeout=60)
    st = d.proc.wait_for(lambda s: s["healing"]["start_succeeded"] and s, 90, "the start succeeded")
    assert st["give_up_reason"] is None and st["healing"]["retry_attempts"] == 0
    log = d.log()
    assert log.count("alert gave_up firing") == 1, log
    d.proc.wait_for(lambda s: "gave_up" not in s["alerts"]["firing"], 30, "gave_up resolved")


# ------------------------------------------------------------------ a fast detector fooled twice


def test_gpu_idle_firing_twice_in_a_row_widens_its_window(make_daemon, tmp_path, monkeypatch):
    path = tmp_path / "card.json"
    path.write_text(json.dumps({"util": 0, "processes": [], "graphics_processes": []}))
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_NVML}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("R3090D_FAKE_NVML", str(path))
    d = make_daemon(args=("--skip-preflight",), extra_args=["--fake-token-delay", "0.05"],
                    watchdog={"poll_interval": 0.3, "gpu_idle_stall_seconds": 1.5, "stall_seconds": 600, "probe_idle_seconds": 600,
                              "backoff_initial": 0.2, "backoff_max": 0.5, "start_failures": 50, "same_cause_failures": 50})  # fmt: skip
    d.rewrite(gpu={"required": True, "card": "any"})
    d.start()
    stop = threading.Event()
    old = None
    try:
        for trip in (1, 2):
            st = d.wait_ready(timeout=60, old_pid=old)
            old = st["engine"]["pid"]
            pids = group_members(old)
            path.write_text(json.dumps({"util": 0, "memory_used_mib": ENGINE_MIB, "processes": [[p, ENGINE_MIB // len(pids)] for p in pids],
                                        "graphics_processes": []}))  # fmt: skip
            streams(d.engine_url, 2, stop)
            d.proc.wait_for(lambda s, n=trip: s["restarts"]["by_reason"].get("gpu_idle", 0) >= n, 60, f"gpu_idle restart {trip}")
            path.write_text(json.dumps({"util": 0, "processes": [], "graphics_processes": []}))
        st = d.proc.wait_for(lambda s: s["healing"]["detector_scale"].get("gpu_idle") == 2 and s, 30, "the window widened")
    finally:
        stop.set()
    assert "alert detector_widened firing: gpu_idle fired again on engines it had restarted before they served: its window is 3 s, 2x watchdog.gpu_idle_stall_seconds = 1.5 s" in d.log()


def test_exit_on_give_up_says_what_it_does_and_exits_79(make_daemon):
    d = make_daemon(args=("--skip-preflight",), extra_args=["--fake-exit-during-start", "1"], daemon={"exit_on_give_up": True},
                    watchdog={"poll_interval": 0.3, "backoff_initial": 0.2, "backoff_max": 0.5, "give_up_retry": 0})  # fmt: skip
    d.start()
    assert d.proc.wait_exit(90) == 79
    log = d.log()
    assert "the daemon exits 79 once the engine is stopped (daemon.exit_on_give_up)" in log
    assert "alert gave_up firing: gave up (the daemon exits with code 79" in log
    assert "the daemon stays up" not in log and "stays stopped" not in log, log[-3000:]


def test_a_hold_an_earlier_daemon_of_this_boot_recorded_keeps_the_engine_down_with_the_unit_active(make_daemon, tmp_path, sockdir, monkeypatch):
    """A daemon restarted by systemd keeps the card's reset hold: no engine, READY=1 with the reason in STATUS=."""
    path = tmp_path / "card.json"
    path.write_text(json.dumps({"util": 0, "processes": [], "graphics_processes": []}))
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_NVML}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("R3090D_FAKE_NVML", str(path))
    d = make_daemon(args=("--skip-preflight",), watchdog={"poll_interval": 0.3})
    d.rewrite(gpu={"required": True, "card": "any"})
    state_dir = Path(d.sections["daemon"]["state_dir"])
    state_dir.mkdir(parents=True, exist_ok=True)
    resethold.save(state_dir, ResetHold("XID 79 (GPU has fallen off the bus)", time.time() - 60), boot=resethold.boot_id())
    notify = bind_unix_dgram(sockdir / "notify.sock", timeout=1.0)
    try:
        d.start(prefix=["env", f"NOTIFY_SOCKET={sockdir / 'notify.sock'}"])
        st = d.wait_phase("reset-needed", timeout=60)
        assert st["engine"]["pid"] is None and "XID 79" in st["healing"]["reset_hold"]
        messages: list[bytes] = []

        def ready_with_the_reason() -> bool:
            try:
                messages.append(notify.recv(4096))
            except TimeoutError:
                pass
            return any(b"READY=1" in m for m in messages) and any(b"STATUS=engine stopped: the GPU needs a reset" in m for m in messages)

        wait_until(ready_with_the_reason, 30, what="READY=1 and the hold in STATUS=", interval=0.0)
        assert "recorded by an earlier daemon of this boot" in d.log()
    finally:
        notify.close()
