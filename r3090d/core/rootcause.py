"""Why an engine died, in one line. Pure.

The rule, in order:

1. the kernel's OOM killer killed a process of the engine: the unit's
   memory.events `oom_kill` count rose during the engine's life. Nothing else
   would say so: ProtectKernelLogs hides the kernel's log, and when the victim
   is EngineCore the API server exits 0;
2. the API server died by a signal: the signal. Its log stops wherever it was
   ("Application startup complete.") and says nothing of why;
3. from the log:
   a. the first exception line printed by EngineCore or a worker. When vLLM
      fails to start, EngineCore prints the real exception first; the API
      server then prints its own, follow-on traceback ("Engine core
      initialization failed. See root cause above");
   b. else the first line logged at ERROR (or CRITICAL);
   c. else the first exception line of any process: the API server's own
      uncaught exception (an invalid engine argument fails there, before
      EngineCore exists).
   A pydantic ValidationError says why in the message line under its header
   ("1 validation error for ModelConfig"), and that line is taken.
4. else nothing says why: there is no cause, and the log's last line is kept
   apart as the last log line, never presented as a cause.

The cause is used for alerts, `status`, `history`, and to give up early when
two start failures in a row have the same cause.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from r3090d.pydanticerrors import is_validation_message, validation_errors

MAX_CHARS = 400  # enough for vLLM's longest one-line explanations, short enough for a mail subject

# "(EngineCore_DP0 pid=123) ", "(VllmWorker rank=0 pid=9) ", "(Worker_TP0 pid=9) "
_PROCESS_TAG = re.compile(r"^\((?P<proc>[A-Za-z][\w]*)[^)]*\) ?")
# vLLM's log header: "ERROR 11-30 12:00:00 [core.py:708] " (the date part varies by version).
# One space ends it: what follows keeps its own indentation.
_LOG_HEADER = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(?:[\d-]+\s+[\d:.,]+\s+)?(?:\[[^\]]*\] ?)?")
# "ValueError: ...", "torch.OutOfMemoryError: ...", "KeyboardInterrupt"
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)(?::\s.*)?$")

_VALIDATION_DETAILS = " [type="  # appended to a pydantic message line (r3090d.pydanticerrors)


@dataclass(frozen=True)
class Explanation:
    cause: str | None  # the line that says why; None when nothing does
    last_log_line: str | None  # where the log stopped, whatever the cause


@dataclass(frozen=True)
class _Line:
    proc: str | None  # process tag, "EngineCore_DP0"
    level: str | None  # vLLM's or uvicorn's level word
    text: str  # the message, with its own indentation


def _split(raw: str) -> _Line:
    line = raw.rstrip()
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
    return _Line(proc, level, line)


def _is_engine_process(proc: str | None) -> bool:
    return proc is not None and (proc.startswith("EngineCore") or "Worker" in proc)


def _is_exception(line: _Line) -> bool:
    return line.text[:1] not in (" ", "\t") and bool(_EXCEPTION.match(line.text))


def _clip(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def _exception_cause(lines: Sequence[_Line], at: int) -> str:
    """The exception line at `at`, or for a pydantic ValidationError the message of its first error."""
    header = lines[at]
    if not validation_errors(header.text):
        return header.text
    location = None
    for line in lines[at + 1 :]:
        if line.proc != header.proc:
            continue  # another process's line, interleaved in the pipe
        if is_validation_message(line.text):
            message = line.text.strip()
            message = message.split(_VALIDATION_DETAILS, 1)[0]  # the input's repr says nothing more
            return f"{location}: {message}" if location else message
        if line.text[:1] in ("", " ", "\t"):
            break  # the footer, or the end of the block: no message line to take
        location = line.text  # the field the error is about
    return header.text


def find(lines: Sequence[str]) -> Explanation:
    """The cause the log gives (rule 3 of the module's docstring), and its last line."""
    parsed = [line for line in map(_split, lines) if line.text.strip()]
    last = _clip(parsed[-1].text.strip()) if parsed else None
    first_error = first_exception = None
    for i, line in enumerate(parsed):
        if _is_exception(line):
            if _is_engine_process(line.proc):
                return Explanation(_clip(_exception_cause(parsed, i)), last)
            if first_exception is None:
                first_exception = i
        if first_error is None and line.level in ("ERROR", "CRITICAL"):
            first_error = line.text.strip()
    if first_error:
        return Explanation(_clip(first_error), last)
    if first_exception is not None:
        return Explanation(_clip(_exception_cause(parsed, first_exception)), last)
    return Explanation(None, last)


def explain(*, killed_by: str | None, log_lines: Sequence[str], oom_kills_at_start: int | None = None, oom_kills_at_exit: int | None = None) -> Explanation:
    """Why the engine died: `killed_by` names the signal that ended its API server (None: it exited).
    The OOM-kill counts are None where memory.events could not be read."""
    from_log = find(log_lines)
    if oom_kills_at_start is not None and oom_kills_at_exit is not None and oom_kills_at_exit > oom_kills_at_start:
        # The same words every time (not the counts): two OOM kills in a row are the same cause.
        return Explanation("the kernel's OOM killer killed a process of the engine (memory.events oom_kill rose)", from_log.last_log_line)
    if killed_by is not None:
        return Explanation(f"killed by {killed_by}", from_log.last_log_line)
    return from_log


def nothing_says_why(cause: str | None, last_log_line: str | None) -> str:
    """What an exit's description adds when there is no cause: that there is none,
    and where the log stopped, quoted as such and not as a cause."""
    if cause is not None:
        return ""
    if last_log_line is None:
        return "; nothing says why (the engine printed nothing)"
    return f"; nothing says why (last log line: {last_log_line})"
