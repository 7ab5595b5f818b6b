"""The one line of an engine's log that says why it failed. Pure.

When vLLM fails to start, EngineCore (or a worker) prints the real exception
first; the API server then prints its own, follow-on traceback ("Engine core
initialization failed. See root cause above"), so the last lines of the log
name the symptom, not the cause. The rule, in order:

1. the first exception line printed by EngineCore or a worker;
2. else the first line logged at ERROR (or CRITICAL);
3. else the last non-empty line.

The line is used for alerts, `status`, `history`, and to give up early when two
start failures in a row have the same cause.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_CHARS = 400  # enough for vLLM's longest one-line explanations, short enough for a mail subject

# "(EngineCore_DP0 pid=123) ", "(VllmWorker rank=0 pid=9) ", "(Worker_TP0 pid=9) "
_PROCESS_TAG = re.compile(r"^\((?P<proc>[A-Za-z][\w]*)[^)]*\)\s*")
# vLLM's log header: "ERROR 11-30 12:00:00 [core.py:708] " (the date part varies by version)
_LOG_HEADER = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(?:[\d-]+\s+[\d:.,]+\s+)?(?:\[[^\]]*\]\s*)?")
# "ValueError: ...", "torch.OutOfMemoryError: ...", "KeyboardInterrupt"
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)(?::\s.*)?$")


def _split(line: str) -> tuple[str | None, str | None, str]:
    """(process tag, log level, message) of one relayed line."""
    proc = None
    m = _PROCESS_TAG.match(line)
    if m:
        proc = m.group("proc")
        line = line[m.end() :]
    level = None
    h = _LOG_HEADER.match(line)
    if h:
        level = h.group("level")
        line = line[h.end() :]
    return proc, level, line.strip()


def _is_engine_process(proc: str | None) -> bool:
    return proc is not None and (proc.startswith("EngineCore") or "Worker" in proc)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def root_cause(lines: Iterable[str]) -> str | None:
    return find(lines)[0]


def find(lines: Iterable[str]) -> tuple[str | None, bool]:
    """(the line, whether it says why): an engine exception or an ERROR line does; the
    last-line fallback (an access-log line, a throughput line) only shows where it stopped,
    and must not make two different failures look like the same cause."""
    first_error = None
    last = None
    for raw in lines:
        proc, level, message = _split(raw.rstrip())
        if not message:
            continue
        last = message
        if _is_engine_process(proc) and _EXCEPTION.match(message):
            return _clip(message), True
        if first_error is None and level in ("ERROR", "CRITICAL"):
            first_error = message
    if first_error:
        return _clip(first_error), True
    return (_clip(last), False) if last else (None, False)
