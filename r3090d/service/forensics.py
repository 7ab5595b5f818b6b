"""Restart forensics: one JSON record per restart in the state directory, the last 10 kept."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from r3090d.atomicfile import write_json_atomic
from r3090d.service.state import plain, read_json

log = logging.getLogger("r3090d")

KEEP = 10
RECORD_GLOB = "restart-*.json"


def records_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / "restarts"


def write_record(state_dir: str | Path, *, reason: str, detail: str, root_cause: str | None = None, snapshot, log_tail: list[str], metrics_text: str | None, gpu) -> Path:
    folder = records_dir(state_dir)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"{time.time() % 1:.3f}"[1:]
    safe_reason = re.sub(r"[^a-z0-9_-]", "_", reason.lower())
    path = folder / f"restart-{stamp}-{safe_reason}.json"
    write_json_atomic(
        path,
        {
            "time": time.time(),
            "reason": reason,
            "detail": detail,
            "root_cause": root_cause,
            "ready_after_s": None,
            "snapshot": plain(snapshot),
            "engine_log_tail": log_tail,
            "metrics_text": metrics_text,
            "gpu": plain(gpu),
        },
    )
    for old in list_records(state_dir)[KEEP:]:
        old.unlink(missing_ok=True)
    return path


def record(state_dir: str | Path, action, snapshot, log_tail: list[str], metrics_text: str | None) -> Path | None:
    """Write the record of one RecordRestart action; None (and a logged error) if the disk refuses."""
    try:
        return write_record(state_dir, reason=action.reason, detail=action.detail, root_cause=action.root_cause, snapshot=snapshot,
                            log_tail=log_tail, metrics_text=metrics_text, gpu=snapshot.gpu)  # fmt: skip
    except OSError as exc:
        log.error("cannot write the restart record in %s: %s", state_dir, exc)
        return None


def list_records(state_dir: str | Path) -> list[Path]:
    """Newest first."""
    return sorted(records_dir(state_dir).glob(RECORD_GLOB), reverse=True)


def mark_ready(path: Path, ready_after_s: float) -> None:
    """Fill in how long the engine took to come back after this restart."""
    data = read_json(path)
    if data is not None:
        data["ready_after_s"] = round(ready_after_s, 3)
        write_json_atomic(path, data)
