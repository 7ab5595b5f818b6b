"""The syslog priority of each line vLLM prints, and the logger it is relayed through.

vLLM's lines reach the daemon through a pipe with no level attached; the
engine's output reader (r3090d.effectors.child) classifies each and relays it
at that level, and the journal setup (r3090d.effectors.journal) stores it at that
priority. Pure: text in, a priority out.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass

from r3090d import pydanticerrors

# Relayed vLLM lines go through their own logger, set to DEBUG by the daemon:
# vLLM already decided which of its lines to print (VLLM_LOGGING_LEVEL), and the
# daemon's INFO threshold must not drop its DEBUG lines a second time.
VLLM_LOGGER = "r3090d.engine.vllm"


class Priority(enum.IntEnum):
    """syslog(3) priorities, as journald stores them."""

    CRIT = 2
    ERR = 3
    WARNING = 4
    INFO = 6
    DEBUG = 7

    @property
    def logging_level(self) -> int:
        return _LOGGING_LEVEL[self]


_LOGGING_LEVEL = {
    Priority.CRIT: logging.CRITICAL,
    Priority.ERR: logging.ERROR,
    Priority.WARNING: logging.WARNING,
    Priority.INFO: logging.INFO,
    Priority.DEBUG: logging.DEBUG,
}


# "(EngineCore_DP0 pid=4242) ", "(APIServer pid=1) ", "(VllmWorker TP0 pid=9) "
_PROCESS_TAG = re.compile(r"^\([A-Za-z][\w-]*[^()\n]*\bpid=\d+\) ?")
# vLLM's "ERROR 11-30 12:00:19 [core.py:708] ..." and uvicorn's "ERROR:    ...".
_LEVEL_WORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)(?::|\s)")
_TRACEBACK_START = re.compile(r"^(?:Traceback \(most recent call last\):|Exception Group Traceback \(most recent call last\):)")
# What ends a traceback: the exception at column 0, "ValueError: ...",
# "torch.OutOfMemoryError: ...", "KeyboardInterrupt", "test.<locals>.Oops: x".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_<][\w<>]*\.)*[A-Z]\w*(?::(?:\s.*)?)?$")
# Lines of an error that are not inside a traceback block: the links of a chained
# exception, multiprocessing's "Process EngineCore_DP0:" before a child's
# traceback, and the interpreter's own last words.
_ERROR_SENTENCES = re.compile(
    r"^(?:During handling of the above exception, another exception occurred:$"
    r"|The above exception was the direct cause of the following exception:$"
    r"|Process [\w-]+:$"
    r"|Fatal Python error: )"
)
# The warnings module: "/x/y.py:12: UserWarning: text".
_PYTHON_WARNING = re.compile(r"^\S+:\d+: [A-Z]\w*Warning: ")
# A block that never sees its exception line (the process died mid-print) must
# not keep every later line at ERROR.
MAX_TRACEBACK_LINES = 2000

_LEVELS = {
    "DEBUG": Priority.DEBUG,
    "INFO": Priority.INFO,
    "WARNING": Priority.WARNING,
    "ERROR": Priority.ERR,
    "CRITICAL": Priority.CRIT,
}


@dataclass
class _Traceback:
    """An open traceback block of one process."""

    lines: int = 0  # seen since its first line
    ended: bool = False  # its exception line was seen: only that exception's own lines may follow
    errors_to_come: int = 0  # a pydantic ValidationError's errors whose message line has not come yet


class VllmLineClassifier:
    """The priority of each line of one engine's output, in order.

    Most lines carry vLLM's or uvicorn's level word. An uncaught exception does
    not: Python prints `Traceback (most recent call last):`, indented frames,
    then the exception at column 0, all bare. Those lines are ERROR, and so are
    the exception's own lines after it: indented ones (a pydantic
    ValidationError's message and footer, an exception group's members) and a
    ValidationError's field names at column 0, because the line that says why
    is often among them and `journalctl -p warning` must show it. The
    classifier remembers an open traceback, per process tag: vLLM's processes
    share one pipe, and EngineCore's traceback may interleave with the API
    server's lines.
    """

    def __init__(self) -> None:
        self._open: dict[str, _Traceback] = {}  # process tag -> its open traceback

    def classify(self, line: str) -> Priority:
        m = _PROCESS_TAG.match(line)
        tag = m.group(0).strip() if m else ""
        text = line[m.end() :] if m else line
        level = _LEVEL_WORD.match(text)
        if level:
            # A logged line inside a traceback (another thread) keeps its own level.
            return _LEVELS[level.group(1)]
        if _TRACEBACK_START.match(text):
            self._open[tag] = _Traceback()
            return Priority.ERR
        block = self._open.get(tag)
        if block is not None and self._in_block(block, text):
            block.lines += 1
            if block.lines >= MAX_TRACEBACK_LINES:
                del self._open[tag]
            return Priority.ERR
        self._open.pop(tag, None)
        if _ERROR_SENTENCES.match(text):
            return Priority.ERR
        if _PYTHON_WARNING.match(text):
            return Priority.WARNING
        return Priority.INFO

    @staticmethod
    def _in_block(block: _Traceback, text: str) -> bool:
        """Whether `text` belongs to the open traceback `block` (and update what it waits for)."""
        at_column_0 = text[:1] not in ("", " ", "\t")
        if not block.ended:
            if at_column_0 and _EXCEPTION_LINE.match(text):
                block.ended = True
                block.errors_to_come = pydanticerrors.validation_errors(text)
            return True
        if not at_column_0:
            if not text.strip():
                return False  # a blank line ends it: what follows is a new sentence
            if pydanticerrors.is_validation_message(text) and block.errors_to_come:
                block.errors_to_come -= 1
            return True
        return block.errors_to_come > 0  # the field name above a ValidationError's message
