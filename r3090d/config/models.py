"""Swap mode's engines: each [[models]] entry as the single-engine Config that today's daemon code expects.

Pure: no I/O. The loader has already checked the entries and read their key
files; this module only lays each entry over the shared settings:

- the engine: the entry's model, served name, extra args, kind and key; [engine]'s
  python, timeouts and listen; engine.env with the entry's env on top; its own unix
  socket (socket_path), or 127.0.0.1 and its own port (engine_port) when engine.listen
  is tcp;
- the profile: the entry's, else the top-level one;
- its own state directory, <state_dir>/models/<name> (the name as one path
  component, model_dir_name), so that records, baselines and forensics of two
  engines never mix;
- no exporter (the node has one, the daemon's) and the canary for generative
  models only (an embedding engine refuses a completion);
- no [[models]] and a default [swap] but its sleep_timeout; the entry's park: the
  result is a single-engine Config.
"""

from __future__ import annotations

import dataclasses
from pathlib import PurePosixPath

from r3090d.config.schema import PORTS_PER_INSTANCE, Config, EngineKind, EngineListen, ModelConfig, SwapConfig

ENGINE_HOST = "127.0.0.1"  # engines listen on loopback only; the router serves [engine].host
MODELS_SUBDIR = "models"
# The engines' sockets: a directory of daemon.runtime_dir that only the daemon's user may enter (mode 0700),
# so no other local user reaches an engine's routes that vLLM serves without its key.
SOCKETS_SUBDIR = "engines"

# Characters a served name may hold that are also plain in a file name; the rest (":" and "/") are escaped.
_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def port_for(engine_port_base: int, instance: int | None, index: int) -> int:
    """The port of engine `index` of r3090d@`instance` (the plain service counts as instance 0)."""
    return engine_port_base + PORTS_PER_INSTANCE * (instance or 0) + index


def engine_port(cfg: Config, index: int) -> int:
    """The 127.0.0.1 port of the engine of cfg.models[index]: swap.engine_port_base + 100 x instance + index."""
    return port_for(cfg.swap.engine_port_base, cfg.instance, index)


def socket_path(runtime_dir: str, index: int) -> str:
    """The unix socket of engine `index` (the one engine outside swap mode is 0): short, as a socket's path must be."""
    return str(PurePosixPath(runtime_dir) / SOCKETS_SUBDIR / f"{index}.sock")


def model_dir_name(name: str) -> str:
    """A served name as one path component, one to one: "Qwen/Qwen2.5:7b" -> "Qwen%2FQwen2.5%3A7b".

    The loader refuses names made only of dots, so the result is never "." or "..".
    """
    return "".join(ch if ch in _PLAIN else f"%{ord(ch):02X}" for ch in name)


def engine_configs(cfg: Config) -> dict[str, Config]:
    """Each model's engine as a single-engine Config, by served name, in the file's order. Empty outside swap mode."""
    return {m.name: _engine_config(cfg, index, m) for index, m in enumerate(cfg.models)}


def _engine_config(cfg: Config, index: int, m: ModelConfig) -> Config:
    engine = dataclasses.replace(
        cfg.engine,
        model=m.model,
        served_model_name=m.name,
        extra_args=list(m.extra_args),
        kind=m.kind,
        env={**cfg.engine.env, **m.env},
        host=ENGINE_HOST,
        port=engine_port(cfg, index),
        uds=socket_path(cfg.daemon.runtime_dir, index) if cfg.engine.listen is EngineListen.UDS else "",
        api_key_file=m.api_key_file,
    )
    daemon = dataclasses.replace(
        cfg.daemon,
        state_dir=str(PurePosixPath(cfg.daemon.state_dir) / MODELS_SUBDIR / model_dir_name(m.name)),
        exporter_enabled=False,
    )
    canary = dataclasses.replace(cfg.canary, enabled=cfg.canary.enabled and m.kind is EngineKind.GENERATE)
    return dataclasses.replace(
        cfg,
        profile=m.profile or cfg.profile,
        engine=engine,
        daemon=daemon,
        canary=canary,
        models=(),
        swap=SwapConfig(sleep_timeout=cfg.swap.sleep_timeout),  # the rest of [swap] is the fleet's
        api_key=m.api_key,
        park_mode=m.park,
    )
