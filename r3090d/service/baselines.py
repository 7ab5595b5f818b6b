"""The canary's baselines on disk (state_dir/canary-baselines.json), each with what it depends on.

A new engine's first canary is compared with an earlier engine's baseline only
when nothing it depends on has changed: the model's files (names, sizes,
mtimes; for a hub name, the commit its cache resolves the revision to), the
vLLM and torch versions, the GPU's name and driver, the vLLM flags that change
numerics, the engine's environment (engine.env and the VLLM_ variables it
inherits, as a digest: values may be secrets), and the canary's own prompt,
length and seed. The newest few are kept, so a switch back to an earlier model
finds its own.

A first answer that differed from the stored one is kept beside it, never over
it: the stored one stays the reference, so a load gone wrong does not replace
a good answer. Removing the file starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from r3090d.atomicfile import write_json_atomic
from r3090d.config import Config
from r3090d.core.snapshot import CanaryAnswer
from r3090d.engineflags import flag_value

log = logging.getLogger(__name__)

FILE_NAME = "canary-baselines.json"
FORMAT = 1
KEEP = 8
MAX_FILES = 1000  # a model directory listed beyond this is cut: the key still changes with what is listed
# The flags that change what the engine computes (each with its short alias, where vLLM has one).
NUMERICS_FLAGS = (
    ("--dtype",), ("--quantization", "-q"), ("--kv-cache-dtype",), ("--enforce-eager",),
    ("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"), ("--attention-backend",),
    ("--compilation-config", "-O"), ("--load-format",), ("--tokenizer",), ("--revision",), ("--hf-overrides",),
    ("--max-model-len",), ("--seed",),
)  # fmt: skip


def answer_to_json(a: CanaryAnswer) -> dict:
    # An infinite margin (a position with one candidate) is written as null: JSON has no infinity.
    return {"token_ids": list(a.token_ids), "margins": [m if math.isfinite(m) else None for m in a.margins],
            "runner_up": list(a.runner_up), "text": a.text}  # fmt: skip


def answer_from_json(raw) -> CanaryAnswer:
    """ValueError if `raw` is not an answer."""
    try:
        ids = tuple(int(t) for t in raw["token_ids"])
        margins = tuple(math.inf if m is None else float(m) for m in raw["margins"])
        runners = tuple(None if r is None else int(r) for r in raw["runner_up"])
        text = raw.get("text", "")
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError("not a canary answer") from None
    if not (len(ids) == len(margins) == len(runners)) or not isinstance(text, str) or any(m < 0 for m in margins):
        raise ValueError("not a canary answer")
    return CanaryAnswer(ids, margins, runners, text)


# Run with engine.python: torch's version as its metadata has it, nothing imported.
_TORCH_PROBE = r"""
import importlib.metadata as md
try:
    print(md.version("torch"))
except md.PackageNotFoundError:
    pass
"""


def torch_version(python: str, timeout: float = 10.0) -> str | None:
    """The torch version installed for `python`; None when there is none or it cannot be asked."""
    try:
        out = subprocess.run([python, "-I", "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if out.returncode == 0 and lines else None


def _hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps its downloads for the engine's environment."""
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(env.get("HF_HOME") or Path(cache) / "huggingface") / "hub"


def _hub_commit(model: str, revision: str | None, env: Mapping[str, str]) -> str | None:
    """The commit the hub cache resolves `revision` (main by default) of `model` to: a new download moves it."""
    rev = revision or "main"
    if re.fullmatch(r"[0-9a-f]{40}", rev):
        return rev
    try:
        return (_hub_cache(env) / f"models--{model.replace('/', '--')}" / "refs" / rev).read_text().strip() or None
    except OSError:
        return None


def _engine_env(cfg: Config, env: Mapping[str, str]) -> dict:
    """engine.env and the VLLM_ variables the engine inherits: the names, and one digest of the values."""
    names = sorted((set(cfg.engine.env) | {k for k in env if k.startswith("VLLM_")}) - {"VLLM_API_KEY"})
    values = json.dumps([[k, env.get(k, cfg.engine.env.get(k))] for k in names])
    return {"names": names, "sha256": hashlib.sha256(values.encode()).hexdigest()}


def _model_files(model: str, revision: str | None, env: Mapping[str, str]) -> list[list]:
    path = Path(model)
    if not path.is_dir():
        return [[model, _hub_commit(model, revision, env)]]  # a hub name: the cache's content is named by its commit
    out = []
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as exc:
        return [[model, f"unreadable: {exc.strerror}"]]
    for entry in entries[:MAX_FILES]:
        try:
            st = entry.stat()
        except OSError:
            continue
        if entry.is_file():
            out.append([entry.name, st.st_size, st.st_mtime_ns])
    return out


def dependencies(cfg: Config, argv: list[str], vllm_version: object, gpu_name: str | None, *, driver: str | None = None,
                 torch: str | None = None, env: Mapping[str, str] | None = None) -> dict:  # fmt: skip
    """What a baseline depends on, as plain data (its hash is the store's key). `env`: the engine's environment."""
    cc = cfg.canary
    args = list(argv)
    env = dict(cfg.engine.env) if env is None else env
    return {
        "model": cfg.engine.model,
        "model_files": _model_files(cfg.engine.model, flag_value(args, "--revision"), env),
        "vllm": str(vllm_version) if vllm_version is not None else None,
        "torch": torch,
        "gpu": gpu_name,
        "driver": driver,
        "env": _engine_env(cfg, env),
        "flags": {flags[0]: flag_value(args, *flags) if flags[0] != "--enforce-eager" else ("--enforce-eager" in args) for flags in NUMERICS_FLAGS},
        "canary": {"prompt": cc.prompt, "max_tokens": cc.max_tokens, "seed": cc.seed},
    }


def key_of(deps: dict) -> str:
    return hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()


class BaselineStore:
    def __init__(self, state_dir: str | Path):
        self.path = Path(state_dir) / FILE_NAME

    def _entries(self) -> list[dict]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("%s is unreadable (%s): earlier engines' canary baselines are not compared", self.path, getattr(exc, "strerror", None) or exc)
            return []
        entries = raw.get("entries") if isinstance(raw, dict) and raw.get("format") == FORMAT else None
        return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []

    def load(self, deps: dict) -> CanaryAnswer | None:
        key = key_of(deps)
        for entry in self._entries():
            if entry.get("key") == key and not entry.get("beside"):
                try:
                    return answer_from_json(entry.get("answer"))
                except ValueError:
                    return None
        return None

    def save(self, deps: dict, answer: CanaryAnswer, *, beside: bool = False) -> None:
        """Keep `answer` as the reference for `deps`; `beside`: the engine's first answer differed from the
        reference, so it is kept next to it (one per key) and the reference stays."""
        key = key_of(deps)
        kept = [e for e in self._entries() if not (e.get("key") == key and bool(e.get("beside")) == beside)][: KEEP - 1]
        entry = {"key": key, "saved_at": time.time(), "deps": deps, "answer": answer_to_json(answer), **({"beside": True} if beside else {})}
        try:
            write_json_atomic(self.path, {"format": FORMAT, "entries": [entry, *kept]})
        except OSError as exc:
            log.error("cannot write %s: %s: the next engine's canary has no earlier baseline", self.path, exc.strerror or exc)
