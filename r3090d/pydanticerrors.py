"""pydantic's ValidationError as vLLM prints it, read from its lines. Pure: the root cause (core/rootcause.py) and
the log relay's priorities (vllmlines.py) both read it, so it sits below both."""

from __future__ import annotations

import re

# pydantic v2's ValidationError is a header, then per error: the field's location
# at column 0 (none for a model-level validator's error), the message indented by
# two spaces with " [type=..., input_value=..., input_type=...]" appended, and a
# "    For further information visit https://errors.pydantic.dev/..." footer.
VALIDATION_HEADER = re.compile(r"ValidationError: (?P<count>\d+) validation errors? for \S")


def validation_errors(exception_line: str) -> int:
    """How many errors a pydantic ValidationError's header announces; 0 for any other exception line."""
    m = VALIDATION_HEADER.search(exception_line)
    return int(m.group("count")) if m else 0


def is_validation_message(text: str) -> bool:
    """A pydantic error's message line: indented by exactly two spaces."""
    return text.startswith("  ") and text[2:3] not in ("", " ", "\t")
