"""The engines' unix sockets (engine.listen = "uds"): their directory, and a stale socket cleared before a start.

vLLM checks its API key only under /v1, /v2, /inference and /cohere; its other
routes (/invocations, /pooling, /pause, /sleep, ...) answer anyone who can
connect. On a unix socket, who can connect is who can enter its directory:
daemon.runtime_dir/engines, mode 0700, the daemon's user alone (root aside).

vLLM binds its socket without removing one already there, so the socket an
earlier engine left (vLLM does not remove it on exit, nor after a kill) would
fail the next start with EADDRINUSE: it is removed just before each start.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from r3090d.service.safedir import UnsafeDirectory, user_name

log = logging.getLogger("r3090d")

DIR_MODE = 0o700


def ensure_directory(directory: str | Path, key: str = "daemon.runtime_dir") -> Path:
    """Create the sockets' directory (0700), or make an existing one 0700. Raises UnsafeDirectory when it is
    not a directory of the daemon's own user."""
    directory = Path(directory)
    try:
        directory.mkdir(mode=DIR_MODE, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        raise UnsafeDirectory(f"{key}: cannot create the engines' socket directory {directory}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{directory} is not a directory (fix: remove it; r3090d keeps the engines' sockets there)")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{directory} belongs to {user_name(st.st_uid)}, not to {user_name(os.geteuid())}, so its owner could "
                              f"reach the engines (fix: remove it, and r3090d makes it again)")  # fmt: skip
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(directory, DIR_MODE)  # ours: closed to everyone else before any engine binds in it
    return directory


def clear_for_start(socket_path: str) -> None:
    """Before an engine starts on `socket_path`: its directory private, and what an earlier engine left there gone."""
    path = Path(socket_path)
    ensure_directory(path.parent)
    try:
        path.unlink()
        log.info("removed the socket %s an earlier engine left", path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a directory in its place: vLLM then fails to bind, and says so
        log.warning("cannot remove %s before the engine starts: %s", path, exc.strerror or exc)
