"""Engines on private unix sockets. In swap mode (their default) another local user cannot reach an engine's routes
that vLLM serves without its key (here /invocations); the router serves the same request. On TCP (engine.listen =
"tcp") it could. The one engine of a single-engine config serves on its socket when the file asks, and is probed there.

The daemon, its router and the vLLM double run for real (the double serves on --uds as vLLM does); the other user is
nobody, through tests/unprivileged.py (the tests need root to drop to it).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import tempfile
import tomllib
from pathlib import Path

import httpx
import psutil
import pytest

from tests import unprivileged as unprivileged_mod
from tests.component.test_swap_daemon import BOUND, swap_rig  # noqa: F401 -- the fixture
from tests.daemon_harness import DaemonProcess, engine_config, write_config
from tests.waiting import wait_until

pytestmark = pytest.mark.component

# vLLM's /invocations (a completion here) takes no API key: sent by another user, straight to the engine.
OTHER_USERS_REQUEST = r"""
import errno, json, socket, sys
address = sys.argv[1]
body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
try:
    if address.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(address[len("unix:"):])
    else:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST /invocations HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    s.sendall(head.encode() + body)
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    print(reply.split(b"\r\n", 1)[0].decode())
except OSError as exc:
    print(errno.errorcode.get(exc.errno, repr(exc)))
"""


@pytest.fixture
def other_user(unprivileged):
    if unprivileged_mod.expected_uid() == os.geteuid():
        pytest.skip("needs root, to send a request as another user")
    return unprivileged


def engine_cmdlines(daemon_pid: int) -> list[list[str]]:
    """The command lines that start vLLM under the daemon, as ps shows them."""
    out = []
    for p in psutil.Process(daemon_pid).children(recursive=True):
        try:
            cmdline = p.cmdline()
        except psutil.Error:
            continue
        if "vllm.entrypoints.openai.api_server" in cmdline:
            out.append(cmdline)
    return out


def test_an_engine_on_its_socket_refuses_another_user_and_serves_through_the_router(swap_rig, other_user):  # noqa: F811
    r = swap_rig(models=("alpha",), gpu=False)
    served = r.complete("alpha")
    assert served.status_code == 200, served.text  # through the router
    st = r.wait_model("alpha", "ready")
    address = r.model(st, "alpha")["engine"]["url"]
    assert address.startswith("unix:") and r.model(st, "alpha")["port"] is None, address
    sock = Path(address.removeprefix("unix:"))
    assert stat.S_ISSOCK(sock.lstat().st_mode) and stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    engines = engine_cmdlines(r.proc.proc.pid)  # the launcher's and vLLM's own
    assert engines and all(c[c.index("--uds") + 1] == str(sock) and "--port" not in c and "--host" not in c for c in engines), engines
    assert r.engine_get(st, "alpha", "/health").status_code == 200  # the daemon's user reaches it, as its probes do

    # Only the engines' directory may stand in the way: the rig's runtime_dir (private to the test) and the socket
    # itself (its mode follows the umask) are opened to everyone.
    os.chmod(sock.parent.parent, 0o755)
    os.chmod(sock, 0o777)
    out = other_user.python(OTHER_USERS_REQUEST, address)
    assert out.stdout.strip() == "EACCES", (out.stdout, out.stderr)
    # The same request, the directory opened: served, with no key. The refusal above was the directory's.
    os.chmod(sock.parent, 0o755)
    try:
        out = other_user.python(OTHER_USERS_REQUEST, address)
    finally:
        os.chmod(sock.parent, 0o700)
    assert out.stdout.strip().startswith("HTTP/1.1 200"), (out.stdout, out.stderr)
    assert "Traceback" not in r.proc.log()


def test_engines_on_tcp_when_the_file_asks_serve_on_their_ports_to_anyone(swap_rig, other_user):  # noqa: F811
    """The option kept for setups that need the ports, and the hole it leaves (preflight warns of it)."""
    r = swap_rig(models=("alpha",), gpu=False, listen="tcp")
    served = r.complete("alpha")
    assert served.status_code == 200, served.text
    st = r.wait_model("alpha", "ready")
    port = tomllib.loads(r.config.read_text())["swap"]["engine_port_base"]
    assert r.model(st, "alpha")["port"] == port and r.model(st, "alpha")["engine"]["url"] == f"http://127.0.0.1:{port}"
    engines = engine_cmdlines(r.proc.proc.pid)
    assert engines and all(c[c.index("--port") + 1] == str(port) and "--uds" not in c for c in engines), engines
    out = other_user.python(OTHER_USERS_REQUEST, f"127.0.0.1:{port}")
    assert out.stdout.strip().startswith("HTTP/1.1 200"), (out.stdout, out.stderr)


def test_an_engine_killed_comes_back_on_the_socket_it_left(swap_rig):  # noqa: F811
    """vLLM leaves its socket behind when it dies (and binds without removing one): the daemon removes it before the
    next start, or that start would fail with EADDRINUSE."""
    r = swap_rig(models=("alpha",), gpu=False)
    assert r.complete("alpha").status_code == 200
    st = r.wait_model("alpha", "ready")
    sock = Path(r.model(st, "alpha")["engine"]["url"].removeprefix("unix:"))
    pid = r.engine_get(st, "alpha", "/fake/state").json()["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, BOUND, what="the engine gone")
    assert stat.S_ISSOCK(sock.lstat().st_mode)  # left behind, as vLLM leaves it
    again = r.complete("alpha")
    assert again.status_code == 200, again.text
    st = r.wait_model("alpha", "ready")
    assert r.model(st, "alpha")["restarts"]["total"] >= 1 and r.engine_get(st, "alpha", "/fake/state").json()["pid"] != pid
    assert f"removed the socket {sock} an earlier engine left" in r.proc.log()


def test_the_one_engine_on_a_socket_when_the_file_asks_is_probed_there(tmp_path, fake_engine_python):
    runtime = Path(tempfile.mkdtemp(prefix="r3090d-", dir="/tmp"))  # pytest's tmp_path is too long for a socket's path
    sections = engine_config(tmp_path, fake_engine_python, engine={"listen": "uds"}, watchdog={"probe_idle_seconds": 1.0},
                             daemon={"runtime_dir": str(runtime)})  # fmt: skip
    proc = DaemonProcess(write_config(tmp_path / "r3090d.toml", sections), tmp_path / "daemon.log").start()
    try:
        st = proc.wait_ready(BOUND)
        sock = runtime / "engines" / "0.sock"
        assert st["engine"]["url"] == f"unix:{sock}"
        st = proc.wait_for(lambda s: s if (s.get("inference") or {}).get("ok") else None, BOUND, "a passing inference probe")
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), trust_env=False, timeout=5.0) as engine:
            log = engine.get("http://localhost/fake/requests").json()["requests"]
        assert {("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/completions")} <= {(e["method"], e["path"]) for e in log}
        engines = engine_cmdlines(proc.proc.pid)
        assert engines and all(c[c.index("--uds") + 1] == str(sock) and "--port" not in c for c in engines), engines
    finally:
        proc.cleanup()
        shutil.rmtree(runtime, ignore_errors=True)
