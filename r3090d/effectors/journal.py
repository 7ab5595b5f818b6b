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
engine's output reader reads it from the line (r3090d.vllmlines) and relays the
line at that level.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from r3090d.vllmlines import VLLM_LOGGER, Priority

ENV_JOURNAL_STREAM = "JOURNAL_STREAM"
QUIET_LIBRARY_LOGGERS = ("httpx", "httpcore")


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
    # The HTTP client logs every request at INFO: the daemon polls /health and /metrics each
    # tick, and the journal would fill with them. Its warnings still come through.
    for chatty in QUIET_LIBRARY_LOGGERS:
        logging.getLogger(chatty).setLevel(logging.WARNING)
