"""prctl(2) for the daemon's children that must not outlive it: the launcher and the router, through ctypes.

PR_SET_PDEATHSIG asks the kernel for a signal when the parent goes. It is tied to the
thread that forked the child, not to the whole parent process, so the daemon spawns these
children from its loop thread, which lives as long as it does. The daemon may die before the
child gets to set it: `die_with` therefore checks the parent afterwards, and says whether the
parent is still the one that started the child (if not, nobody would send the signal).
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # prctl.h
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def die_with(parent: int, signum: signal.Signals) -> bool:
    """Ask for `signum` when the parent dies; True if the parent is still `parent`, False if it is already gone."""
    prctl(PR_SET_PDEATHSIG, signum)
    return os.getppid() == parent
