"""The control socket of a running daemon: who may connect, and what bad clients cannot do.

A user outside the daemon's group is refused by the socket's mode; a member of
the group is served. A flood of 1,000 malformed requests (garbage, oversize,
wrong types, clients that vanish mid-request or never send) gets error replies
while `status` keeps answering, quickly, throughout.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from r3090d.service import control, control_client, control_protocol
from tests.unprivileged import SYSTEM_PYTHON, copy_source
from tests.waiting import wait_until

pytestmark = pytest.mark.component

GROUP = "r3090d-ctltest"
INSIDER = "r3090d-ctlin"
OUTSIDER = "r3090d-ctlout"


def raw(path: Path, data: bytes, *, read: bool = True, timeout: float = 10.0, close_write: bool = False) -> bytes:
    """Send bytes, return everything the server sends back until it closes or a reply line arrives."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        if data:
            s.sendall(data)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        if not read:
            return b""
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        return buf


def reply_of(data: bytes) -> dict:
    return json.loads(data.decode().splitlines()[0])


def test_socket_file_mode_group_and_a_daemon_that_keeps_answering_through_1000_malformed_requests(make_daemon):
    d = make_daemon(exporter=False, watchdog={"poll_interval": 0.2})
    d.start()
    d.wait_ready()
    path = control_protocol.socket_path(d.runtime_dir)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getgid()  # the daemon's own group (it runs as this test's user)
    pid_before = d.state()["engine"]["pid"]

    # --- the malformed requests, each with the error it must get (None: the client leaves, no reply)
    too_long = b"{" + b'"x": "' + b"a" * (control.MAX_REQUEST_BYTES + 10)
    cases: list[tuple[str, bytes, str | None, dict]] = [
        ("garbage", b"\x00\xff\xfe garbage\n", "not UTF-8", {}),
        ("not json", b"hello daemon\n", "not JSON", {}),
        ("json array", b"[1, 2, 3]\n", "JSON object", {}),
        ("json string", b'"status"\n', "JSON object", {}),
        ("no cmd", b"{}\n", 'missing "cmd"', {}),
        ("unknown cmd", b'{"cmd": "rm -rf /"}\n', "unknown command", {}),
        ("wrong type", b'{"cmd": "maintenance", "on": "yes"}\n', "'on' must be true or false", {}),
        ("wrong type seconds", b'{"cmd": "silence", "alert": "gpu_memory", "seconds": "1h"}\n', "'seconds' must be", {}),
        ("bad alert name", b'{"cmd": "silence", "alert": "a b\\n", "seconds": 60}\n', "'alert' must be", {}),
        ("extra field", b'{"cmd": "restart", "now": true}\n', "unknown field 'now'", {}),
        ("deep nesting", b"[" * 100000 + b"\n", "request longer than", {}),
        ("nested 5000", b"[" * 5000 + b"]" * 5000 + b"\n", "not JSON", {}),
        ("too long, no newline", too_long, "request longer than", {}),
        ("half then close", b'{"cmd": "stat', None, {"close_write": True}),
        ("connect and close", b"", None, {"read": False}),
        ("huge number", b'{"cmd": "silence", "alert": "x", "seconds": 1e999}\n', "'seconds' must be", {}),
    ]
    results = {"replies": 0, "wrong": [], "sent": 0}
    lock = threading.Lock()
    status_latencies: list[float] = []
    status_times: list[float] = []
    status_failures: list[str] = []
    stop = threading.Event()

    def flood(worker: int, n: int) -> None:
        for i in range(n):
            name, data, want, kw = cases[(worker * n + i) % len(cases)]
            try:
                got = raw(path, data, **kw)
            except OSError as exc:
                with lock:
                    results["wrong"].append(f"{name}: {exc}")
                continue
            with lock:
                results["sent"] += 1
                if want is None:
                    continue
                try:
                    rep = reply_of(got)
                except (ValueError, IndexError):
                    results["wrong"].append(f"{name}: no reply line: {got[:80]!r}")
                    continue
                results["replies"] += 1
                if rep.get("ok") is not False or want not in rep.get("error", ""):
                    results["wrong"].append(f"{name}: {rep}")

    def poll_status() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                rep = control_client.request(d.runtime_dir, {"cmd": "status"}, 5.0)
                if not rep.get("ok") or rep["state"]["engine"]["phase"] != "ready":
                    status_failures.append(str(rep)[:200])
            except control_client.ClientError as exc:
                status_failures.append(str(exc))
            status_latencies.append(time.monotonic() - t0)
            status_times.append(t0)
            time.sleep(0.01)

    # A few clients that connect and never send hold their slots until the idle timeout.
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(5)]
    for s in idle:
        s.settimeout(15)
        s.connect(str(path))
    poller = threading.Thread(target=poll_status)
    poller.start()
    t0 = time.monotonic()
    workers = [threading.Thread(target=flood, args=(w, 250)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    t_end = time.monotonic()
    flood_s = t_end - t0
    during = sum(1 for t in status_times if t0 <= t <= t_end)
    idle_replies = [reply_of(s.recv(4096)) for s in idle]
    for s in idle:
        assert s.recv(4096) == b""  # and then it closed the connection
        s.close()
    stop.set()
    poller.join(10)

    print(
        f"\n1000 malformed requests in {flood_s:.2f} s: {results['replies']} error replies; {during} status requests "
        f"during the flood, {len(status_latencies)} in all, max {max(status_latencies) * 1000:.0f} ms, "
        f"median {sorted(status_latencies)[len(status_latencies) // 2] * 1000:.1f} ms"
    )
    assert results["sent"] == 1000, results["wrong"][:10]
    assert results["wrong"] == [], results["wrong"][:10]
    assert results["replies"] == sum(1 for k in range(1000) if cases[k % len(cases)][2] is not None)  # those that leave get none
    assert all(r == {"ok": False, "error": f"no request within {control.IDLE_TIMEOUT_S:.0f} s"} for r in idle_replies), idle_replies
    assert status_failures == []
    assert len(status_latencies) >= 20 and during >= 3
    assert max(status_latencies) < 2.0
    # The daemon, its engine and its loop are unharmed.
    assert d.proc.proc.poll() is None
    assert d.state()["engine"]["pid"] == pid_before
    assert time.time() - d.state()["written_at"] < 2.0
    assert "Traceback" not in d.log()


def test_pipelined_requests_get_one_reply_each_in_order(make_daemon):
    d = make_daemon(exporter=False)
    d.start()
    d.wait_ready()
    path = control_protocol.socket_path(d.runtime_dir)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(b'{"cmd": "status"}\n\nnope\n{"cmd": "silence", "alert": "gpu_power", "seconds": 60}\n{"cmd": "status"}\n')
        buf = b""
        while buf.count(b"\n") < 4:
            buf += s.recv(1 << 20)
    replies = [json.loads(line) for line in buf.splitlines()]
    assert [r["ok"] for r in replies] == [True, False, True, True]  # the blank line is no request
    assert replies[0]["state"]["engine"]["phase"] == "ready"
    assert "not JSON" in replies[1]["error"]
    assert replies[2]["message"].startswith("gpu_power silenced for 60 s")
    assert "gpu_power" in replies[3]["state"]["alerts"]["silenced"] or wait_until(
        lambda: "gpu_power" in d.state()["alerts"]["silenced"], 3, what="the silence in the state"
    )


def test_idle_connections_at_the_cap_make_room_for_a_request(make_daemon):
    d = make_daemon(exporter=False)
    d.start()
    d.wait_ready()
    path = control_protocol.socket_path(d.runtime_dir)
    held = []
    for _ in range(control.MAX_CONNECTIONS):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(path))
        held.append(s)
    # The server accepts in order, so this one comes after all the held ones; they
    # are idle, not being served, so the oldest of them makes room for it.
    t0 = time.monotonic()
    rep = reply_of(raw(path, b'{"cmd": "status"}\n'))
    took = time.monotonic() - t0
    assert rep.get("ok") is True and rep["state"]["engine"]["phase"] == "ready", (took, str(rep)[:200])
    assert took < control.IDLE_TIMEOUT_S  # answered without waiting for an idle one's timeout
    assert reply_of(held[0].recv(4096)) == {"ok": False, "error": f"idle connection closed to make room for another client ({control.MAX_CONNECTIONS} open)"}
    for s in held:
        s.close()


# ------------------------------------------------------------------ users and groups


def _ensure_users(request) -> None:
    """The test's group and users; those this test creates are removed after it."""

    def run(*argv):
        subprocess.run(argv, check=True, capture_output=True)

    try:
        grp.getgrnam(GROUP)
    except KeyError:
        run("groupadd", "--system", GROUP)
        request.addfinalizer(lambda: subprocess.run(["groupdel", GROUP], capture_output=True))
    for user, groups in ((INSIDER, [GROUP]), (OUTSIDER, [])):
        try:
            pwd.getpwnam(user)
        except KeyError:
            run("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", *(["--groups", ",".join(groups)] if groups else []), user)
            request.addfinalizer(lambda user=user: subprocess.run(["userdel", user], capture_output=True))


CLIENT = (
    "import json, sys; sys.path.insert(0, sys.argv[1]); from r3090d.service import control_client\n"
    "try:\n"
    "    print(json.dumps(control_client.request(sys.argv[2], {'cmd': 'status'}, 10)))\n"
    "except control_client.ClientError as exc:\n"
    "    print(type(exc).__name__ + ': ' + str(exc)); sys.exit(3)\n"
)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd") or not Path(SYSTEM_PYTHON).exists(), reason="needs root, useradd and /usr/bin/python3")
def test_a_user_outside_the_daemons_group_is_refused_and_a_member_is_served(request, make_daemon):
    _ensure_users(request)
    gid = grp.getgrnam(GROUP).gr_gid
    d = make_daemon(exporter=False)
    # Run the daemon with GROUP as its own group, as systemd's Group= would.
    os.chmod(d.runtime_dir, 0o755)  # only the socket's own mode guards it here
    d.start(prefix=["setpriv", f"--regid={gid}", "--clear-groups"])
    d.wait_ready()
    path = control_protocol.socket_path(d.runtime_dir)
    st = os.stat(path)
    assert st.st_gid == gid and stat.S_IMODE(st.st_mode) == 0o660

    # The client library, as another user, with the system python (it needs only the stdlib).
    # pytest's tmp_path is private to root: the code goes where other users can read it.
    code_dir = Path(tempfile.mkdtemp(prefix="r3090d-client-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(code_dir, ignore_errors=True))
    copy_source(code_dir)

    def as_user(user: str) -> subprocess.CompletedProcess:
        argv = ["runuser", "-u", user, "--", SYSTEM_PYTHON, "-I", "-c", CLIENT, str(code_dir), str(d.runtime_dir)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd="/")

    out = as_user(OUTSIDER)
    assert out.returncode == 3, out
    assert out.stdout.strip() == f"ControlPermissionError: permission denied on {path}: run as root or as a member of group '{GROUP}'"

    out = as_user(INSIDER)
    assert out.returncode == 0, out
    rep = json.loads(out.stdout)
    assert rep["ok"] and rep["state"]["engine"]["phase"] == "ready" and rep["state"]["daemon"]["pid"] == d.pid

    # setpriv as well: the outsider's uid with the daemon's group is let in by the group alone.
    out = subprocess.run(
        ["setpriv", f"--reuid={pwd.getpwnam(OUTSIDER).pw_uid}", f"--regid={gid}", "--clear-groups", SYSTEM_PYTHON, "-I", "-c", CLIENT, str(code_dir), str(d.runtime_dir)],
        capture_output=True, text=True, timeout=30, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out
