"""Files replaced whole: a reader sees the old file or the new one, never half of one.

The state file, the forensics records, the suspension record and the
Alertmanager table are all written this way, by the service and the effectors.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json_atomic(path: Path, data, mode: int = 0o640) -> None:
    # No fsync: the rename alone keeps readers from seeing half a file, and an fsync
    # every tick for months is pointless wear for a file rewritten two seconds later.
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str), mode, durable=False)


def write_text_atomic(path: Path, text: str, mode: int = 0o640, *, durable: bool) -> None:
    """Write to a temporary file and rename it over `path`: a reader sees the old file or the
    new one, never half of one. `durable` adds an fsync, for a file that must survive a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
