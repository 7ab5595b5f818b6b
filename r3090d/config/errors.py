"""ConfigError, and the quoting its messages use: one line, bounded, whatever the file holds."""

from __future__ import annotations

import json
import re
import reprlib
from pathlib import Path


def _printable(text: str) -> str:
    """Control characters escaped, so that a message stays one line whatever the file holds."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii") for ch in text)


def format_message(path: str, key: str | None, problem: str, fix: str) -> str:
    where = f"{path}: {key}" if key else path
    text = f"{where}: {problem}"
    if fix:
        text += f" (fix: {fix})"
    return _printable(text)


class ConfigError(Exception):
    """A user mistake in the configuration: file, key and how to fix it."""

    def __init__(self, path: Path | str | None, key: str | None, problem: str, fix: str = ""):
        self.path = str(path) if path is not None else "<config>"
        self.key = key
        self.problem = problem
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return format_message(self.path, self.key, self.problem, self.fix)


class _ShortRepr(reprlib.Repr):
    """repr() for values quoted in messages: bounded in length and depth, and
    safe on integers too long for str() (over 4300 digits raise ValueError)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict, self.maxstring, self.maxother = 3, 6, 4, 60, 60

    def repr_int(self, x, level):
        if x.bit_length() > 128:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


show = _ShortRepr().repr

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: object) -> str:
    """One part of a dotted key as TOML writes it: bare if it can be, else quoted; long ones cut."""
    text = key if isinstance(key, str) else show(key)
    cut = len(text) > 60
    text = text[:60]
    quoted = text if _BARE_KEY.fullmatch(text) else json.dumps(text)
    return quoted + "..." if cut else quoted
