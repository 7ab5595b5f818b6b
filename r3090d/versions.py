"""Version numbers, read one way: PEP 440, through packaging.version.

vLLM's own version and the NVIDIA driver's both parse here, so that
0.10.2rc1 and 0.10.2.dev45+g1234abc sort before 0.10.2, 0.11.0+cpu and
0.6.3.post1 after their releases, and driver 580.65.06 after 580.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version


def parse_version(text: str | None) -> Version | None:
    """`text` as a comparable Version, surrounding whitespace ignored; None when it is empty or no version."""
    try:
        return Version((text or "").strip())
    except InvalidVersion:
        return None
