"""The GPU reset hold on disk: kept across a daemon restart, dropped by a reboot.

A card that needs a reset still needs it after systemd restarts the daemon, so
the hold is written to state_dir. A reboot resets the card, so the file carries
the kernel's boot id and a hold from another boot is dropped. `r3090ctl restart`
clears the hold (the operator has reset the card) and the file with it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from r3090d.atomicfile import write_text_atomic
from r3090d.core.xid import ResetHold

log = logging.getLogger("r3090d")

HOLD_FILE = "gpu-reset-hold.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def load(state_dir: Path, *, boot: str | None) -> ResetHold | None:
    """The hold an earlier daemon of this boot recorded, or None (none, another boot, or a damaged file, logged)."""
    path = state_dir / HOLD_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("reason"), str) or not isinstance(raw.get("since"), int | float):
        log.warning("ignoring %s: not a reset hold record", path)
        return None
    if boot is None or raw.get("boot_id") != boot:
        log.info("dropping the GPU reset hold of another boot (%s): the reboot reset the card", raw["reason"])
        _remove(path)
        return None
    return ResetHold(raw["reason"], float(raw["since"]))


def save(state_dir: Path, hold: ResetHold | None, *, boot: str | None) -> None:
    """Record the hold, or remove the record when it is cleared."""
    path = state_dir / HOLD_FILE
    if hold is None:
        _remove(path)
        return
    record = {"reason": hold.reason, "since": hold.since_wall, "boot_id": boot}
    try:
        write_text_atomic(path, json.dumps(record), durable=True)
    except OSError as exc:
        log.error("cannot write %s: %s (a daemon restart would forget that the GPU needs a reset)", path, exc)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("cannot remove %s: %s", path, exc)
