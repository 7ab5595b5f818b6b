"""Running a check as a user without privileges, for the permission tests.

Root reads any file whatever its mode, so a test of an unreadable file proves
nothing as root (and CI runs as root). Such a test runs its check in a child:
as root, dropped to nobody:nogroup by setpriv; as anyone else, as themselves.

The child is Debian's /usr/bin/python3: the development python may live under
/root, which nobody cannot enter. It imports a copy of the package from a
scratch directory under /tmp that every user can traverse (pytest's tmp_path
is private to its owner), and needs nothing outside the standard library for
what the permission tests load (the config and the model directory reader).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"  # a python other users can run (the dev python may live under /root)
NOBODY_UID = 65534
DROP_TO_NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")


def copy_source(dest: Path) -> Path:
    """The package copied to dest/r3090d, readable by every user; returns dest, for PYTHONPATH or sys.path."""
    shutil.copytree(REPO / "r3090d", dest / "r3090d", ignore=shutil.ignore_patterns("__pycache__"))
    for root, _dirs, files in os.walk(dest):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(Path(root) / name, 0o644)
    return dest


class Unprivileged:
    """A scratch directory any user can traverse, and Python run there without root's reach."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="r3090d-unprivileged-", dir="/tmp"))
        os.chmod(self.dir, 0o755)
        self._source = copy_source(self.dir / "src")

    def mkdir(self, name: str) -> Path:
        """A directory in the scratch space that every user can traverse and list."""
        path = self.dir / name
        path.mkdir(mode=0o755)
        os.chmod(path, 0o755)  # whatever the umask
        return path

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess:
        """`code` run by the system python as nobody (when root) or as oneself, with the package importable."""
        prefix = DROP_TO_NOBODY if os.geteuid() == 0 else ()
        env = {"PYTHONPATH": str(self._source), "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
        argv = [*prefix, SYSTEM_PYTHON, "-B", "-c", code, *args]  # -B: nobody could not write bytecode anyway
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd="/")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def expected_uid() -> int:
    """The uid the child runs as."""
    return NOBODY_UID if os.geteuid() == 0 else os.geteuid()


def available() -> str | None:
    """Why the permission tests cannot run here, or None when they can."""
    if not Path(SYSTEM_PYTHON).exists():
        return f"no {SYSTEM_PYTHON}"
    if os.geteuid() == 0 and shutil.which(DROP_TO_NOBODY[0]) is None:
        return "no setpriv to drop root's privileges (util-linux)"
    return None
