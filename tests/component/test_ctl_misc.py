"""r3090ctl edge cases against a real daemon: instances, --watch, a lost socket, a killed daemon, history N."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest

from r3090d import exitcodes
from r3090d.service import control_client, control_protocol
from tests.ctl_harness import CTL, ctl, ctl_json, engine_config, write_config
from tests.daemon_harness import ctrl_c_reaches_it
from tests.waiting import wait_until

pytestmark = pytest.mark.component


def test_instance_is_addressed_by_its_own_socket_and_state(make_daemon):
    d = make_daemon(args=("--instance", "1"))
    d.start()
    inst_run = d.runtime_dir / "1"
    wait_until(lambda: (inst_run / "control.sock").exists(), 20, what="the instance's control socket")

    def phase():
        try:
            return control_client.request(inst_run, {"cmd": "status"}, 2.0)["state"]["engine"]["phase"]
        except (control_client.ClientError, TypeError, KeyError):
            return None

    wait_until(lambda: phase() == "ready", 30, what="instance 1 ready")
    rc, out = ctl_json(d.config, "status", "--instance", "1")
    assert rc == exitcodes.OK and out["state"]["daemon"]["instance"] == 1
    assert out["state"]["engine"]["url"].endswith(f":{d.engine_port + 1}")  # engine.port + N
    rc, out = ctl_json(d.config, "status")  # the unnumbered daemon is not running
    assert rc == exitcodes.UNKNOWN and out["running"] is False
    assert (d.dir / "state" / "1" / "state.json").exists()
    import httpx

    r = httpx.get(f"http://127.0.0.1:{d.exporter_port + 1}/healthz", trust_env=False, timeout=2)  # exporter_port + N
    assert (r.status_code, r.text.strip()) == (200, "ready")


def test_watch_prints_a_document_per_interval_until_interrupted(make_daemon):
    d = make_daemon(exporter=False)
    d.start()
    d.wait_ready()
    with (d.dir / "watch.out").open("w") as sink:  # a file, not a pipe: nobody reads while it runs
        proc = subprocess.Popen([*CTL, "status", "--watch", "0.3", "--json", "--config", str(d.config)], stdout=sink, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it)
        # Interrupted after its third document, however slowly it started.
        wait_until(lambda: len((d.dir / "watch.out").read_text().splitlines()) >= 4, 20, what="three documents")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    out = (d.dir / "watch.out").read_text()
    docs = [json.loads(line) for line in out.splitlines()]
    assert proc.returncode == exitcodes.OK, err
    assert len(docs) >= 3, out
    assert all(doc["verdict"] == "OK" and doc["state"]["engine"]["phase"] == "ready" for doc in docs)
    stamps = [doc["state"]["written_at"] for doc in docs]
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0]  # fresh state each time
    assert "Traceback" not in err


def test_lost_socket_falls_back_to_the_state_file_and_a_killed_daemon_is_unknown(make_daemon):
    d = make_daemon(exporter=False)
    d.start()
    st = d.wait_ready()
    sock = control_protocol.socket_path(d.runtime_dir)
    sock.unlink()  # someone cleaned /run by hand
    rc, out = ctl_json(d.config, "status")
    assert rc == exitcodes.OK and out["running"] is True and out["source"] == "state-file"
    assert out["note"].startswith(f"pid {d.pid} runs but its control socket does not answer: no control socket at {sock}")
    text = ctl(d.config, "status")
    assert text.returncode == exitcodes.OK and "not running" not in text.stdout
    assert f"showing {d.dir / 'state' / 'state.json'}" in text.stdout

    engine_pgid = st["engine"]["pid"]
    os.kill(d.pid, signal.SIGKILL)  # no chance to clean up
    d.proc.proc.wait(10)
    try:
        rc, out = ctl_json(d.config, "status")
        assert rc == exitcodes.UNKNOWN and out["running"] is False
        text = ctl(d.config, "status")
        assert text.returncode == exitcodes.UNKNOWN
        assert f"r3090d is not running (pid {d.pid} is gone)" in text.stdout
        assert "engine ready since" in text.stdout
    finally:
        try:
            os.killpg(engine_pgid, signal.SIGKILL)  # the engine it left behind
        except ProcessLookupError:
            pass


def test_history_shows_one_record_in_full(make_daemon):
    d = make_daemon(exporter=False, watchdog={"lb_grace": 0.2})
    d.start()
    old = d.wait_ready()["engine"]["pid"]
    assert ctl(d.config, "history").stdout.startswith("no restarts recorded in ")
    assert control_client.request(d.runtime_dir, {"cmd": "restart"})["ok"]
    d.wait_ready(old_pid=old)
    wait_until(lambda: json.loads(ctl(d.config, "history", "--json").stdout)[0]["ready_after_s"] is not None, 10, interval=0.2, what="ready_after_s")
    out = ctl(d.config, "history", "1")
    assert out.returncode == 0, out
    assert "Reason     requested: restart requested by operator" in out.stdout
    assert f"Engine     pid {old}, alive True" in out.stdout
    assert "Engine log (last " in out.stdout and "Metrics    " in out.stdout
    out = ctl(d.config, "history", "2")
    assert out.returncode == exitcodes.USAGE and "there are 1 restart records" in out.stderr
    rc, rec = ctl_json(d.config, "history", "1")
    assert rc == 0 and rec["reason"] == "requested" and rec["snapshot"]["child"]["pid"] == old
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE


def test_status_of_a_state_in_a_newer_format_is_one_line_saying_restart_the_daemon(tmp_path, fake_engine_python):
    # What a newer r3090d left behind: this r3090ctl cannot tell what it means.
    config = write_config(tmp_path / "r3090d.toml", engine_config(tmp_path, fake_engine_python))
    state = tmp_path / "state" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"format": 99, "written_at": 1.0, "engine": {"phase": "ready"}, "daemon": {"pid": os.getpid()}}))
    out = ctl(config, "status")
    assert out.returncode == exitcodes.UNKNOWN, out
    [line] = out.stdout.splitlines()
    assert line.startswith(f"UNKNOWN: {state}: the state was written in format 99, this r3090ctl reads ") and ": restart the daemon" in line
    assert out.stderr == ""
    rc, doc = ctl_json(config, "status")
    assert rc == exitcodes.UNKNOWN and doc["verdict"] == "UNKNOWN" and doc["reasons"] == [line.removeprefix("UNKNOWN: ")]
    assert doc["state"]["format"] == 99  # --json still shows the document as written
