"""A reload that fails leaves the engine and the old config running; a blind watchdog says so."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from r3090d import exitcodes
from r3090d.service import control_client
from tests.ctl_harness import ctl, ctl_json
from tests.waiting import wait_until

pytestmark = pytest.mark.component


def _key_file(d, text: bytes):
    key = d.dir / "api-key"
    key.write_bytes(text)
    key.chmod(0o600)
    return key


@pytest.mark.parametrize(
    "case, breaks",
    [
        ("non-UTF-8 key file", lambda d: d.rewrite(engine={"api_key_file": str(_key_file(d, b"\xff\xfe key"))})),
        ("key file is a directory", lambda d: d.rewrite(engine={"api_key_file": str(d.dir)})),
        ("key file vanished", lambda d: d.rewrite(engine={"api_key_file": str(d.dir / "no-such-key")})),
        ("config replaced by a directory", lambda d: (d.config.unlink(), d.config.mkdir())),
        ("config vanished", lambda d: d.config.unlink()),
    ],
)
def test_a_failing_reload_keeps_the_engine_and_answers_at_once(make_daemon, case, breaks):
    d = make_daemon(exporter=False)
    d.start()
    st = d.wait_ready()
    pid = st["engine"]["pid"]
    good = d.config.read_text()
    breaks(d)
    try:
        # Through the control socket (what `r3090ctl reload` sends): refused in one line, at once.
        t0 = time.monotonic()
        reply = control_client.request(d.runtime_dir, {"cmd": "reload"}, 10)
        took = time.monotonic() - t0
        assert reply["ok"] is False and reply["error"].startswith("refused, the running config stays"), (case, reply)
        assert "\n" not in reply["error"] and "Traceback" not in reply["error"]
        assert took < 2.0, f"{case}: the reload answer took {took:.2f} s"
        # And by SIGHUP: the daemon survives it.
        os.kill(d.pid, signal.SIGHUP)
        wait_until(lambda: d.log().count("reload refused") >= 2, 10, what="the SIGHUP reload refused")
        assert d.proc.proc.poll() is None, d.log()[-3000:]
        st = control_client.request(d.runtime_dir, {"cmd": "status"}, 10)["state"]  # the config file may be gone: ask the daemon
        assert st["engine"]["phase"] == "ready" and st["engine"]["pid"] == pid and st["restarts"]["total"] == 0
        assert "Traceback" not in d.log()
    finally:
        if d.config.is_dir():
            shutil.rmtree(d.config)
        d.config.write_text(good)


def test_metrics_failing_makes_status_warn_and_fires_watchdog_blind(make_daemon):
    d = make_daemon(extra_args=["--fake-garbage-metrics"], watchdog={"blind_polls": 3}, exporter=False)
    d.start()
    d.wait_ready()
    wait_until(lambda: "watchdog_blind" in d.state()["alerts"]["firing"], 20, what="watchdog_blind firing")
    rc, out = ctl_json(d.config, "status")
    assert rc == exitcodes.WARNING, out
    assert any("watchdog_blind" in r for r in out["reasons"]), out["reasons"]
    assert "/metrics failing" in out["state"]["alerts"]["firing"]["watchdog_blind"]["summary"]


def test_status_says_what_preflight_waits_for(make_daemon):
    import socket

    d = make_daemon(exporter=False)
    d.sections["preflight"] = {"transient_retry_s": 0.5, "transient_give_up_s": 120.0}
    d.rewrite()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", d.engine_port))
    holder.listen(1)
    try:
        d.start()
        def waiting():
            out = ctl(d.config, "status")
            return out if out.returncode == exitcodes.WARNING and "waiting for preflight" in out.stdout else None

        out = wait_until(waiting, 30, interval=0.2, what="status saying preflight waits")
        assert f"port {d.engine_port} in use" in out.stdout and f"pid {os.getpid()}" in out.stdout, out.stdout
    finally:
        holder.close()
    d.wait_ready(timeout=30)
    assert ctl(d.config, "status").returncode == exitcodes.OK
