"""A copy of this checkout as git would commit it, for tests that run make in a tree of their own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def copy_checkout(dest: Path) -> None:
    """The files git would commit (tracked and new, not ignored), links kept as links; never build/."""
    listed = (
        subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = REPO / rel
        if not (src.exists() or src.is_symlink()):
            continue  # deleted in the working tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, target)
