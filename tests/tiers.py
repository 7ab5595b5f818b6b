"""The test tiers, and the lines a run ends with for each tier that did not run fully.

The tests that need haproxy, promtool, prometheus, alertmanager, amtool,
setpriv, systemd or root skip with a reason where those are missing, so a run
on a fresh machine passes having run only part of the suite. pytest's own
summary counts skips; these lines say, tier by tier, how many did not run and
why, where they cannot be missed: after pytest's last line.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


class Tier(enum.Enum):
    """Each tier's name as the summary line says it, in the order `make test` runs them."""

    UNIT = "unit"
    COMPONENT = "component"
    SYSTEMD = "real systemd"
    VLLM = "real vLLM"
    END_TO_END = "end-to-end"  # a test file of tests/e2e/ skipped whole, before its marks could be read


@dataclass(frozen=True)
class Skip:
    """One test (or, skipped at collection, one whole test file) that did not run, and why."""

    tier: Tier
    reason: str
    whole_file: bool = False


def tier_of(nodeid: str, markers: Iterable[str]) -> Tier:
    """The tier of a test: its mark (pyproject's markers), else the folder it lives in.

    A test marked both systemd and vllm is in the systemd tier: it needs root and systemd first."""
    marks = set(markers)
    if "systemd" in marks:
        return Tier.SYSTEMD
    if "vllm" in marks:
        return Tier.VLLM
    if "component" in marks or nodeid.startswith("tests/component/"):
        return Tier.COMPONENT
    if nodeid.startswith("tests/e2e/"):
        return Tier.END_TO_END
    return Tier.UNIT


def skip_reason(longrepr) -> str:
    """The reason pytest keeps for a skip: a (path, line, "Skipped: why") tuple, else its text."""
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip() or "no reason given"


def _count(tests: int, files: int) -> str:
    parts = []
    if tests:
        parts.append(f"{tests} test{'' if tests == 1 else 's'}")
    if files:
        parts.append(f"{files} whole test file{'' if files == 1 else 's'}")
    return " and ".join(parts)


def summary_lines(skips: Iterable[Skip]) -> list[str]:
    """One line per tier with skips: `real systemd tier: skipped 9 tests: needs root: ...`.

    Several reasons are joined by "; ", most frequent first, each with its count."""
    by_tier: dict[Tier, list[Skip]] = {}
    for skip in skips:
        by_tier.setdefault(skip.tier, []).append(skip)
    lines = []
    for tier in Tier:
        skipped = by_tier.get(tier)
        if not skipped:
            continue
        reasons = Counter(skip.reason for skip in skipped)
        said = [reason if len(reasons) == 1 else f"{reason} ({n})" for reason, n in reasons.most_common()]
        counted = _count(sum(not s.whole_file for s in skipped), sum(s.whole_file for s in skipped))
        lines.append(f"{tier.value} tier: skipped {counted}: {'; '.join(said)}")
    return lines
