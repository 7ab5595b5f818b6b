"""What a reload in swap mode cannot apply: the keys set up once at the daemon's start (service/swapreload.py)."""

from __future__ import annotations

import pytest

from r3090d import config
from r3090d.service.swapreload import needs_daemon_restart

MODELS = [{"name": "chat", "model": "/m/chat"}, {"name": "coder", "model": "/m/coder", "profile": "batch"}]


def swap_cfg(models=MODELS, **sections) -> config.Config:
    return config.from_dict({"models": models, **sections}, check_files=False)


@pytest.mark.parametrize(
    ("new", "keys"),
    [
        (swap_cfg(), []),
        (swap_cfg(watchdog={"stall_seconds": 99.0}, alerts={"min_interval": 5.0}, canary={"interval": 600.0}), []),
        (swap_cfg([MODELS[0], {**MODELS[1], "extra_args": ["--seed", "8"], "profile": "realtime"}]), []),
        (swap_cfg(swap={"max_resident": 2, "min_residency": 5.0, "drain_timeout": 3.0, "host_memory_budget_mib": 9000}), []),
        (swap_cfg([*MODELS, {"name": "emb", "model": "/m/emb"}]), ["models"]),
        (swap_cfg(MODELS[::-1]), ["models"]),
        (swap_cfg([MODELS[0], {**MODELS[1], "name": "code"}]), ["models"]),
        (swap_cfg(engine={"port": 9000}), ["engine.port"]),
        (swap_cfg(engine={"python": "/other/python"}), ["engine.python"]),
        (swap_cfg(swap={"queue_timeout": 5.0, "engine_port_base": 20000}), ["swap.queue_timeout", "swap.engine_port_base"]),
        (swap_cfg(daemon={"exporter_port": 9500}), ["daemon.exporter_port"]),
        (swap_cfg(gpu={"index": 1}), ["gpu.index"]),
        (config.from_dict({"engine": {"model": "/m/chat"}}, check_files=False), ["models"]),
    ],
    ids=["same", "watchdog-alerts-canary", "a-models-settings", "arbiter-limits", "a-model-more", "reordered", "renamed",
         "router-port", "python", "router-settings", "exporter", "gpu", "single-mode"],
)  # fmt: skip
def test_the_keys_a_reload_cannot_apply(new, keys):
    assert [k.split(" ")[0] for k in needs_daemon_restart(swap_cfg(), new)] == keys
