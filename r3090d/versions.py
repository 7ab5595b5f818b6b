"""Version numbers, read one way: PEP 440, through packaging.version.

vLLM's own version and the NVIDIA driver's both parse here, so that
0.10.2rc1 and 0.10.2.dev45+g1234abc sort before 0.10.2, 0.11.0+cpu and
0.6.3.post1 after their releases, and driver 580.65.06 after 580.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

# The newest vLLM release r3090d is known to work with: the one `make engine` installs
# (mk/engine.mk's VLLM_VERSION), whose flags argv.py knows and whose /metrics the
# probes read. A newer one may have renamed either, so preflight warns about it.
VLLM_LAST_KNOWN_GOOD = Version("0.32.0")


def newer_than_known_vllm(version: Version) -> bool:
    """Whether `version` is a release after VLLM_LAST_KNOWN_GOOD.

    A build of the known release (0.32.0+cpu, 0.32.0.post1) is that release; a
    pre-release or dev build of a later one (0.33.0rc1) is not known to work.
    """
    return Version(version.base_version) > VLLM_LAST_KNOWN_GOOD


def parse_version(text: str | None) -> Version | None:
    """`text` as a comparable Version, surrounding whitespace ignored; None when it is empty or no version."""
    try:
        return Version((text or "").strip())
    except InvalidVersion:
        return None
