"""The control socket's client: one request, one reply, for r3090ctl.

request() refuses a runtime directory that others could write to
(r3090d.service.safedir): whoever can replace the socket can answer for the
daemon. Every failure is a ClientError, whose str() is one line for the user.
The protocol is r3090d.service.control_protocol.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from r3090d.service import safedir
from r3090d.service.control_protocol import RUNTIME_DIR_KEY, group_name, socket_path

MAX_REPLY_BYTES = 16 * 1024 * 1024  # what the client accepts


class ClientError(Exception):
    """The daemon could not be asked; str() is one line for the user, `detail` what happened to the socket."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = detail or message


class DaemonNotRunning(ClientError):
    pass


class ControlPermissionError(ClientError):
    pass


class ControlTimeout(ClientError):
    pass


class UnsafeRuntimeDir(ClientError):
    """Others could have replaced the socket: what answers there is not to be believed."""


def request(runtime_dir: str | Path, payload: dict, timeout: float = 15.0) -> dict:
    """Send one request, return the daemon's reply (a dict). Raises ClientError."""
    path = socket_path(runtime_dir)
    try:
        safedir.check(path.parent, RUNTIME_DIR_KEY, owners=None)
    except safedir.UnsafeDirectory as exc:
        raise UnsafeRuntimeDir(str(exc)) from None
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            raise DaemonNotRunning(f"r3090d is not running (no control socket at {path})", f"no control socket at {path}") from None
        except ConnectionRefusedError:
            raise DaemonNotRunning(f"r3090d is not running (nothing listens on {path})", f"nothing listens on {path}") from None
        except PermissionError:
            raise ControlPermissionError(f"permission denied on {path}: {_access_hint(path)}") from None
        except TimeoutError:
            raise ControlTimeout(f"r3090d did not accept a connection on {path} within {timeout:.0f} s") from None
        except OSError as exc:
            raise ClientError(f"cannot connect to {path}: {exc.strerror or exc}") from None
        try:
            sock.sendall(json.dumps(payload).encode() + b"\n")
            buf = bytearray()
            while b"\n" not in buf:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(65536)
                if not chunk:
                    raise ClientError(f"r3090d closed the control connection without an answer ({path})")
                buf += chunk
                if len(buf) > MAX_REPLY_BYTES:
                    raise ClientError(f"r3090d's answer is larger than {MAX_REPLY_BYTES} bytes")
        except TimeoutError:
            raise ControlTimeout(f"r3090d did not answer within {timeout:.0f} s ({path})") from None
        except (BrokenPipeError, ConnectionResetError):
            raise ClientError(f"r3090d closed the control connection ({path})") from None
    finally:
        sock.close()
    try:
        reply = json.loads(buf[: buf.index(b"\n")].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ClientError("r3090d's answer is not JSON") from None
    if not isinstance(reply, dict):
        raise ClientError("r3090d's answer is not a JSON object")
    return reply


def _access_hint(path: Path) -> str:
    try:
        gid = os.stat(path).st_gid
    except OSError:
        return "run as root or as a member of the daemon's group"
    return f"run as root or as a member of group {group_name(gid)!r}"
