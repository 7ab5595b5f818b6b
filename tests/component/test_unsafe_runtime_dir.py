"""The control socket in an unsafe runtime directory: the daemon will not serve there, r3090ctl will not ask there.

Another user who can write to the runtime directory can put their own
control.sock in it; root's `r3090ctl status` would then show their made-up state.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
from pathlib import Path

import pytest

from r3090d.service import control, control_client, control_protocol
from tests.canned_reply_server import CannedReplyServer

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


def fake_daemon(path: Path) -> CannedReplyServer:
    """What another user puts in a runtime directory they can write to: a control.sock with made-up answers."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    made_up = {"ok": True, "state": {"engine": {"phase": "ready", "model": "all is well"}}}
    return CannedReplyServer(listener, json.dumps(made_up).encode() + b"\n")


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770], ids=oct)
def test_the_client_refuses_a_socket_in_a_runtime_dir_others_can_write(rundir, mode):
    fake = fake_daemon(control_protocol.socket_path(rundir))
    os.chmod(rundir, mode)
    try:
        with pytest.raises(control_client.ClientError) as exc:
            control_client.request(rundir, {"cmd": "status"}, 5.0)
    finally:
        fake.close()
    assert str(exc.value).startswith(f"daemon.runtime_dir {rundir} is writable by ")
    assert str(exc.value).endswith(f"(fix: chmod go-w {rundir})")
    assert fake.connections == 0  # not even connected
