"""The directories r3090d and r3090ctl trust: daemon.runtime_dir (the control socket) and daemon.state_dir (the state file).

Whoever can write to such a directory can replace what is in it: put their own
control.sock there, and root's `r3090ctl status` shows whatever that socket
says. So a directory writable by group or others is refused outright (a sticky
bit does not help: it stops renaming others' files, not creating a socket before
the daemon does), and the daemon also refuses one owned by anyone but itself or
root. r3090ctl checks the mode only: root and the members of the daemon's group
rightly talk to a daemon that runs as its own service user, whose uid they
cannot know; the daemon's own check keeps it out of a directory someone else
owns.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path


class UnsafeDirectory(Exception):
    """str() is one line: the directory, what is wrong and the fix."""


@dataclass(frozen=True)
class DirFacts:
    """What os.stat says about a directory, as far as trusting it goes."""

    is_dir: bool
    uid: int
    mode: int  # the permission bits, S_IMODE

    @classmethod
    def of(cls, st: os.stat_result) -> DirFacts:
        return cls(is_dir=stat.S_ISDIR(st.st_mode), uid=st.st_uid, mode=stat.S_IMODE(st.st_mode))


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def problem(path: str, key: str, facts: DirFacts, owners: frozenset[int] | None, me: int) -> str | None:
    """None if `path` may be trusted, else the one-line reason with its fix (pure but for user names).

    owners: the uids that may own it (None: any); me: the uid that should, named in the fix.
    """
    if not facts.is_dir:
        return f"{key} {path} is not a directory (fix: remove it, or point {key} at a directory)"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if facts.mode & bit]
    if writable:
        return (
            f"{key} {path} is writable by {' and '.join(writable)} (mode {facts.mode:04o}), so another user could "
            f"replace the files in it (fix: chmod go-w {path})"
        )
    if owners is not None and facts.uid not in owners:
        allowed = " or ".join(dict.fromkeys([user_name(me), "root"]))
        return (
            f"{key} {path} belongs to {user_name(facts.uid)}, not to {allowed}, so its owner could replace "
            f"the files in it (fix: chown {user_name(me)} {path}, or point {key} at a directory of your own)"
        )
    return None


def check(path: str | Path, key: str, *, owners: frozenset[int] | None) -> None:
    """Raise UnsafeDirectory unless `path` is safe to trust.

    A directory that is missing or out of reach passes: nothing in it can be used
    either, and the use (connect, open) reports that better than a check could.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return
    except OSError as exc:
        raise UnsafeDirectory(f"{key} {path}: cannot inspect it: {exc.strerror or exc}") from None
    why = problem(str(path), key, DirFacts.of(st), owners, os.geteuid())
    if why is not None:
        raise UnsafeDirectory(why)


def daemon_owners() -> frozenset[int]:
    """Who may own the daemon's directories: the daemon's own user, or root."""
    return frozenset({os.geteuid(), 0})


def ensure(path: str | Path, key: str) -> Path:
    """The daemon's side: create `path` (mode 0750) if missing, then refuse it unless the daemon or root owns it
    and no one else may write to it. Raises UnsafeDirectory."""
    path = Path(path)
    try:
        path.mkdir(mode=0o750, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: check() says so
    except OSError as exc:
        raise UnsafeDirectory(f"{key} {path}: cannot create it: {exc.strerror or exc}") from None
    check(path, key, owners=daemon_owners())
    return path
