"""Configs for tests of the pure policy and what it feeds: the bare config with a test's own sections over it."""

from __future__ import annotations

import copy

from r3090d import config

# No profile's defaults, an engine whose model is "m", no GPU required: what is left is what a test sets.
BARE = {"profile": "none", "engine": {"model": "m"}, "gpu": {"required": False}}


def bare_config(**sections: dict) -> config.Config:
    """BARE with each given section's keys laid over the section of that name; files named in it are not checked."""
    data = copy.deepcopy(BARE)
    for name, table in sections.items():
        data[name] = {**data.get(name, {}), **table}
    return config.from_dict(data, check_files=False)
