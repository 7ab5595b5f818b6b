"""A python that the Makefile sees as Debian 12's: its stdlib carries EXTERNALLY-MANAGED.

Debian's python refuses `pip install` into its own site-packages (PEP 668).
pip looks for the marker only outside a venv (sys.prefix == sys.base_prefix),
so a venv with the marker added would not do: this is a prefix of its own, the
base interpreter's binary copied into bin/ (a symlink would be followed back to
the real prefix) and its stdlib linked in entry by entry, with an empty
site-packages. Without ensurepip it is Debian's python without the
python3-venv package, where `python3 -m venv` cannot make a venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

MARKER_TEXT = (
    "[externally-managed]\nError=this python is managed by the system (a test's stand-in for Debian 12's)\n"
)


def make_managed_python(dest: Path, *, ensurepip: bool = True, pip: bool = False) -> Path:
    """dest/bin/python3, whose stdlib has the marker; `pip`: pip importable, to show its refusal. Returns dest/bin."""
    base = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(sysconfig.get_path("stdlib"))
    lib = dest / "lib" / stdlib.name  # lib/python3.X: the landmark python finds its prefix by
    lib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        left_out = entry.name in ("site-packages", "dist-packages", "EXTERNALLY-MANAGED")
        if left_out or (entry.name == "ensurepip" and not ensurepip):
            continue
        (lib / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text(MARKER_TEXT)
    # A binary linked with a relative rpath finds its libpython beside the copy too.
    for shared in Path(sys.base_prefix, "lib").glob("libpython3*.so*"):
        (dest / "lib" / shared.name).symlink_to(shared)
    bin_dir = dest / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"
    shutil.copy2(base, python)
    if pip:  # where this python's site looks (Debian's looks in lib/python3/dist-packages)
        import pip as pip_package

        asked = subprocess.run(
            [python, "-c", "import site; print(site.getsitepackages()[0])"],
            capture_output=True,
            text=True,
            check=True,
        )
        site = Path(asked.stdout.strip())
        site.mkdir(parents=True, exist_ok=True)
        (site / "pip").symlink_to(Path(pip_package.__file__).parent)
    return bin_dir


# What `make dev` installs, as the Makefile's recipe writes it.
EXTRAS = "'.[test,bench,plot]'"
# Settings of the caller's that would change what make does: the tests run make without them.
CALLER_SETTINGS = ("PYTHON", "PYTEST", "VENV", "VENV_BASE_PYTHON", "TINY_MODEL_PYTHON", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")
