"""Syslog priorities for the journal: the daemon's own records and vLLM's relayed lines.

Under systemd, stdout and stderr go to journald as a stream; a line that starts
with `<N>` (N from 0 to 7) is stored at priority N with the prefix removed, and
every other line at 6 (info). So `journalctl -p warning` would show nothing of
ours unless each line says its priority. systemd sets JOURNAL_STREAM to the
stream's `<st_dev>:<st_ino>`; the prefix is written only when stderr is that
very stream (sd-daemon(3)), so a terminal, a file or a pipe (`make demo`, the
tests) see the output exactly as before, even when JOURNAL_STREAM was inherited
from somewhere else.

vLLM's lines arrive through a pipe, so journald cannot know their level; the
daemon reads it from the line (`VllmLineClassifier`) and relays the line at
that level.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass

from r3090d.core import rootcause

ENV_JOURNAL_STREAM = "JOURNAL_STREAM"
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


def priority_of(levelno: int) -> Priority:
    """A Python logging level as a syslog priority; levels in between round up in severity."""
    if levelno >= logging.CRITICAL:
        return Priority.CRIT
    if levelno >= logging.ERROR:
        return Priority.ERR
    if levelno >= logging.WARNING:
        return Priority.WARNING
    if levelno >= logging.INFO:
        return Priority.INFO
    return Priority.DEBUG


def prefixed(text: str, priority: Priority) -> str:
    """`text` with every line prefixed: journald splits a stream at newlines and
    would store the second line of a traceback at priority 6."""
    return "\n".join(f"<{int(priority)}>{line}" for line in text.split("\n"))


def is_journal_stream(fd: int, journal_stream: str | None) -> bool:
    """Whether `fd` is the stream JOURNAL_STREAM (`<st_dev>:<st_ino>`) names."""
    if not journal_stream:
        return False
    dev, sep, ino = journal_stream.partition(":")
    try:
        want = (int(dev), int(ino))
        st = os.fstat(fd)
    except (ValueError, OSError):
        return False
    return bool(sep) and (st.st_dev, st.st_ino) == want


def stderr_is_journal() -> bool:
    """Whether this process's stderr is the journal stream systemd gave it."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # closed, or replaced by something without a file
        return False
    return is_journal_stream(fd, os.environ.get(ENV_JOURNAL_STREAM))


def for_stderr(text: str, priority: Priority) -> str:
    """`text` as it should be written to stderr outside logging (click.echo): prefixed
    only when stderr is the journal."""
    return prefixed(text, priority) if stderr_is_journal() else text


def log_uncaught(exc_type, exc, tb) -> None:
    """sys.excepthook under the journal: Python would print a crash's traceback bare,
    at priority 6, the one thing `journalctl -p warning` must not hide."""
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("r3090d").critical("uncaught exception", exc_info=(exc_type, exc, tb))


def log_uncaught_in_thread(args) -> None:
    """threading.excepthook under the journal, for the same reason."""
    if args.exc_type is SystemExit:  # as the default hook: a thread may end that way
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("r3090d").critical("uncaught exception in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


class JournalFormatter(logging.Formatter):
    """A Formatter that prefixes every line of a record with its syslog priority."""

    def format(self, record: logging.LogRecord) -> str:
        return prefixed(super().format(record), priority_of(record.levelno))


# ----------------------------------------------------------------- vLLM's lines

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
                block.errors_to_come = rootcause.validation_errors(text)
            return True
        if not at_column_0:
            if not text.strip():
                return False  # a blank line ends it: what follows is a new sentence
            if rootcause.is_validation_message(text) and block.errors_to_come:
                block.errors_to_come -= 1
            return True
        return block.errors_to_come > 0  # the field name above a ValidationError's message


def setup_logging() -> None:
    # The journal stamps each line and wants its priority as a "<N>" prefix;
    # a terminal or a file gets a time stamp instead. JOURNAL_STREAM alone is not
    # enough: a shell started from a journal-connected service inherits it.
    if stderr_is_journal():
        formatter: logging.Formatter = JournalFormatter("%(levelname)s %(name)s: %(message)s")
        sys.excepthook = log_uncaught
        threading.excepthook = log_uncaught_in_thread
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.getLogger(VLLM_LOGGER).setLevel(logging.DEBUG)
