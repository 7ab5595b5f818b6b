"""The control socket in an unsafe runtime directory: the daemon will not serve there, r3090ctl will not ask there.

Another user who can write to the runtime directory can put their own
control.sock in it; root's `r3090ctl status` would then show their made-up state.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import threading
from pathlib import Path

import pytest

from r3090d.service import control, control_client, control_protocol

pytestmark = pytest.mark.component

STATE = {"engine": {"phase": "ready"}}


def start(rundir: Path) -> control.ControlServer:
    return control.ControlServer(rundir, lambda: STATE, lambda request, reply: reply({"ok": True})).start()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775], ids=oct)
def test_the_server_refuses_a_runtime_dir_others_can_write(rundir, mode):
    os.chmod(rundir, mode)
    with pytest.raises(control.ControlError) as exc:
        start(rundir).stop()
    assert str(exc.value).startswith(f"daemon.runtime_dir {rundir} is writable by ")
    assert str(exc.value).endswith(f"(fix: chmod go-w {rundir})")
    assert not control_protocol.socket_path(rundir).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_the_server_refuses_a_runtime_dir_another_user_owns(rundir):
    os.chmod(rundir, 0o755)
    os.chown(rundir, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(control.ControlError, match=f"daemon.runtime_dir {rundir} belongs to nobody, not to ") as exc:
        start(rundir).stop()
    assert "(fix: chown " in str(exc.value)
    assert not control_protocol.socket_path(rundir).exists()


def test_the_server_and_client_work_in_our_own_0755_dir(rundir):
    os.chmod(rundir, 0o755)
    server = start(rundir)
    try:
        assert control_client.request(rundir, {"cmd": "status"}, 5.0) == {"ok": True, "state": STATE}
    finally:
        server.stop()


class FakeDaemon:
    """What another user puts in a runtime directory they can write to: a control.sock with made-up answers."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.asked = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                self.asked += 1
                conn.recv(65536)
                conn.sendall(json.dumps({"ok": True, "state": {"engine": {"phase": "ready", "model": "all is well"}}}).encode() + b"\n")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770], ids=oct)
def test_the_client_refuses_a_socket_in_a_runtime_dir_others_can_write(rundir, mode):
    fake = FakeDaemon(control_protocol.socket_path(rundir))
    os.chmod(rundir, mode)
    try:
        with pytest.raises(control_client.ClientError) as exc:
            control_client.request(rundir, {"cmd": "status"}, 5.0)
    finally:
        fake.close()
    assert str(exc.value).startswith(f"daemon.runtime_dir {rundir} is writable by ")
    assert str(exc.value).endswith(f"(fix: chmod go-w {rundir})")
    assert fake.asked == 0  # not even connected
