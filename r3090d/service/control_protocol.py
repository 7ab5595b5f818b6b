"""The control socket's protocol: newline-delimited JSON over a unix socket in runtime_dir.

One request per line, one reply per request, both JSON objects. Replies are
{"ok": true, ...} or {"ok": false, "error": "..."}. validate() checks a
request against COMMANDS before the server acts on it.

Pure but for group_name(), which reads the group database. The server is
r3090d.service.control, the client r3090d.service.control_client.
"""

from __future__ import annotations

import grp
import json
import math
import re
from pathlib import Path

from r3090d.config.schema import MAX_MODEL_NAME

SOCKET_NAME = "control.sock"
RUNTIME_DIR_KEY = "daemon.runtime_dir"
LOOP_TIMEOUT_S = 10.0  # the loop's answer to a command
RELOAD_TIMEOUT_S = 45.0  # reload asks the engine's python for its vLLM version (up to 30 s)
MAX_SILENCE_S = 30 * 86400
ALERT_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# A served model's name, as [[models]] name has it: printable, one line. Whether the daemon serves it is the daemon's answer.
MODEL_NAME = re.compile(rf"[^\x00-\x1f\x7f]{{1,{MAX_MODEL_NAME}}}")


def is_model_name(value) -> bool:
    return isinstance(value, str) and MODEL_NAME.fullmatch(value) is not None


# Swap mode: the model whose engine a command acts on (its served name). Single mode has one engine and takes none.
MODEL_FIELD = (False, is_model_name, f"a served model name (1 to {MAX_MODEL_NAME} printable characters)")

COMMANDS = {
    # cmd -> {field: (required, checker, what it must be)}
    "status": {},
    "restart": {"drain": (False, lambda v: isinstance(v, bool), "true or false"), "model": MODEL_FIELD},
    "maintenance": {"on": (True, lambda v: isinstance(v, bool), "true or false")},
    "silence": {
        "alert": (True, lambda v: isinstance(v, str) and ALERT_KEY.fullmatch(v) is not None, "an alert name (letters, digits, _ . : -; at most 64)"),
        "seconds": (
            True,
            lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and 1 <= v <= MAX_SILENCE_S,
            f"a number of seconds from 1 to {MAX_SILENCE_S}",
        ),
    },
    "reload": {},
    # Answered at once ("accepted" and a request number); the work runs over many ticks.
    "suspend": {"model": MODEL_FIELD},
    "resume": {"model": MODEL_FIELD},
    # Swap mode: bring this model onto the GPU now, making room as the arbiter would. Answered at once.
    "swap": {"model": (True, *MODEL_FIELD[1:])},
}


def socket_path(runtime_dir: str | Path) -> Path:
    return Path(runtime_dir) / SOCKET_NAME


def validate(request) -> str | None:
    """None if `request` is a well-formed command, else what is wrong with it (pure)."""
    if not isinstance(request, dict):
        return f"a request is a JSON object, not {type(request).__name__}"
    cmd = request.get("cmd")
    if not isinstance(cmd, str):
        return 'missing "cmd" (one of: ' + ", ".join(COMMANDS) + ")"
    if cmd not in COMMANDS:
        return f"unknown command {cmd[:40]!r}; known: {', '.join(COMMANDS)}"
    spec = COMMANDS[cmd]
    for key in request:
        if key != "cmd" and key not in spec:
            return f"{cmd}: unknown field {str(key)[:40]!r}" + (f"; known: {', '.join(spec)}" if spec else "; it takes none")
    for key, (required, check, what) in spec.items():
        if key not in request:
            if required:
                return f"{cmd}: missing {key!r} ({what})"
            continue
        if not check(request[key]):
            return f"{cmd}: {key!r} must be {what}"
    return None


def encode(reply: dict) -> bytes:
    return json.dumps(reply, separators=(",", ":"), default=str).encode() + b"\n"


def error(text: str) -> dict:
    return {"ok": False, "error": text}


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
