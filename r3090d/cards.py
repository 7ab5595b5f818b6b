"""Consumer cards r3090d knows: one table for config validation, preflight and plan.

NVML reports a card's name and memory, not its memory bandwidth, so that is the
vendors' published figure (decimal GB/s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CardProfile:
    key: str  # as config.gpu.card spells it
    label: str
    name_pattern: str  # matched against NVML's device name
    memory_mib: int
    compute_capability: tuple[int, int]
    pcie_width: int
    pcie_gen: int
    bandwidth_gbs: float


CARDS: dict[str, CardProfile] = {
    c.key: c
    for c in (
        CardProfile("rtx3090", "RTX 3090", r"RTX 3090(?!\s*Ti)", 24576, (8, 6), 16, 4, 936.0),
        CardProfile("rtx3090ti", "RTX 3090 Ti", r"RTX 3090\s*Ti", 24576, (8, 6), 16, 4, 1008.0),
        CardProfile("rtx4090", "RTX 4090", r"RTX 4090(?!\s*D)", 24564, (8, 9), 16, 4, 1008.0),
    )
}
ANY_CARD = "any"  # config.gpu.card: compare with no profile


def card_for_name(nvml_name: str | None) -> CardProfile | None:
    """The profile whose pattern matches NVML's device name, if any."""
    if not nvml_name:
        return None
    return next((c for c in CARDS.values() if re.search(c.name_pattern, nvml_name)), None)
