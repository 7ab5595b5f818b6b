"""The canary's baselines on disk (state_dir/canary-baselines.json), each with what it depends on.

A new engine's first canary is compared with an earlier engine's baseline only
when nothing it depends on has changed: the model's files (names, sizes,
mtimes), the vLLM version, the GPU's name, the vLLM flags that change numerics,
and the canary's own prompt, length and seed. The newest few are kept, so a
switch back to an earlier model finds its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
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


def _model_files(model: str) -> list[list]:
    path = Path(model)
    if not path.is_dir():
        return [[model]]  # a hub name: the cache's content is named by it
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


def dependencies(cfg: Config, argv: list[str], vllm_version: object, gpu_name: str | None) -> dict:
    """What a baseline depends on, as plain data (its hash is the store's key)."""
    cc = cfg.canary
    args = list(argv)
    return {
        "model": cfg.engine.model,
        "model_files": _model_files(cfg.engine.model),
        "vllm": str(vllm_version) if vllm_version is not None else None,
        "gpu": gpu_name,
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
            if entry.get("key") == key:
                try:
                    return answer_from_json(entry.get("answer"))
                except ValueError:
                    return None
        return None

    def save(self, deps: dict, answer: CanaryAnswer) -> None:
        key = key_of(deps)
        kept = [e for e in self._entries() if e.get("key") != key][: KEEP - 1]
        entry = {"key": key, "saved_at": time.time(), "deps": deps, "answer": answer_to_json(answer)}
        try:
            write_json_atomic(self.path, {"format": FORMAT, "entries": [entry, *kept]})
        except OSError as exc:
            log.error("cannot write %s: %s: the next engine's canary has no earlier baseline", self.path, exc.strerror or exc)
