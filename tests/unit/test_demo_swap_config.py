"""etc/demo-swap.toml: swap mode on the same CPU engine as etc/demo.toml, under two names, with room for a cold start."""

from __future__ import annotations

from pathlib import Path

from r3090d import config
from r3090d.config.models import engine_configs
from r3090d.config.schema import EngineKind

ETC = Path(__file__).resolve().parents[2] / "etc"


def load(name: str) -> config.Config:
    return config.load(ETC / name, check_files=False)


def test_two_generative_models_behind_the_demo_port():
    demo, swap = load("demo.toml"), load("demo-swap.toml")
    assert [m.name for m in swap.models] == ["tiny-chat", "tiny-coder"]
    assert all(m.kind is EngineKind.GENERATE for m in swap.models)
    assert (swap.engine.host, swap.engine.port) == (demo.engine.host, demo.engine.port)
    assert swap.swap.max_resident == 1
    assert not swap.gpu.required


def test_each_engine_is_the_demo_engine():
    """What makes the CPU engine work (float32, eager, the KV size, offline) and the confident canary prompt."""
    demo = load("demo.toml")
    for name, e in engine_configs(load("demo-swap.toml")).items():
        assert e.engine.served_model_name == name
        assert (e.engine.python, e.engine.model) == (demo.engine.python, demo.engine.model)
        assert e.engine.extra_args == demo.engine.extra_args
        assert e.engine.env == demo.engine.env
        assert e.profile == demo.profile
        assert e.canary.enabled and e.canary.prompt == demo.canary.prompt


def test_a_request_outlasts_a_cold_start():
    """On CPU a swap is a stop and a cold start: a request waiting for it must not get 503 first."""
    cfg = load("demo-swap.toml")
    outgoing = cfg.swap.min_residency + cfg.swap.drain_timeout + cfg.engine.shutdown_timeout
    assert cfg.swap.queue_timeout >= outgoing + cfg.engine.startup_timeout


def test_its_own_state_and_exporter():
    demo, swap = load("demo.toml"), load("demo-swap.toml")
    assert swap.daemon.state_dir != demo.daemon.state_dir
    assert swap.daemon.runtime_dir != demo.daemon.runtime_dir
    assert swap.daemon.exporter_port != demo.daemon.exporter_port
