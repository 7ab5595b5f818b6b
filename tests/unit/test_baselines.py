"""The canary's baselines on disk: what their key depends on, and a start mismatch kept beside the reference."""

from __future__ import annotations

import json
import stat

import pytest

from r3090d.core.snapshot import CanaryAnswer
from r3090d.service.baselines import BaselineStore, dependencies, key_of, torch_version
from tests.configs import bare_config

GOOD = CanaryAnswer((1, 2, 3, 4), (3.0,) * 4, (9,) * 4, "one two")
BAD = CanaryAnswer((1, 2, 7, 8), (3.0,) * 4, (9,) * 4, "one bad")
HUB = "org/some-model"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def deps(tmp_path, *, env=None, driver="550.54.14", torch="2.5.1", commit=COMMIT_A, extra_args=(), environ=None):
    """A hub model's dependencies, its hub cache under tmp_path resolving main to `commit`."""
    refs = tmp_path / "hf" / "hub" / "models--org--some-model" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(commit)
    cfg = bare_config(engine={"model": HUB, "env": dict(env or {}), "extra_args": list(extra_args)})
    engine_env = {"HF_HOME": str(tmp_path / "hf"), **(environ or {}), **cfg.engine.env}
    return dependencies(cfg, list(extra_args), "0.11.0", "RTX 3090", driver=driver, torch=torch, env=engine_env)


@pytest.mark.parametrize(
    "changed",
    [
        {"env": {"VLLM_ATTENTION_BACKEND": "FLASHINFER"}},
        {"environ": {"VLLM_ATTENTION_BACKEND": "FLASHINFER"}},  # inherited by the engine from the daemon's environment
        {"driver": "560.35.03"},
        {"torch": "2.6.0"},
        {"commit": COMMIT_B},  # the hub cache's main moved on: another download
        {"extra_args": ["--revision", COMMIT_B]},
    ],
    ids=["engine.env", "inherited-VLLM_", "driver", "torch", "hub-commit", "revision-flag"],
)
def test_the_key_changes_with_what_changes_the_answer(tmp_path, changed):
    assert key_of(deps(tmp_path)) == key_of(deps(tmp_path))
    assert key_of(deps(tmp_path, **changed)) != key_of(deps(tmp_path))


def test_the_key_ignores_what_does_not_change_the_answer_and_never_holds_a_secret(tmp_path):
    base = deps(tmp_path)
    # The daemon's own environment beyond vLLM's variables (a systemd invocation id, PATH) changes every start.
    assert key_of(deps(tmp_path, environ={"INVOCATION_ID": "x1", "VLLM_API_KEY": "k1"})) == key_of(base)
    secret = deps(tmp_path, env={"HF_TOKEN": "hf_verysecretvalue", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN"})
    assert "hf_verysecretvalue" not in json.dumps(secret) and "HF_TOKEN" in json.dumps(secret)


def test_a_start_mismatch_is_stored_beside_the_reference_never_over_it(tmp_path):
    store, d = BaselineStore(tmp_path), deps(tmp_path)
    store.save(d, GOOD)
    store.save(d, BAD, beside=True)  # this engine's first answer differed from GOOD
    assert store.load(d) == GOOD
    entries = json.loads(store.path.read_text())["entries"]
    assert sorted((e["answer"]["text"], e.get("beside", False)) for e in entries) == [("one bad", True), ("one two", False)]
    store.save(d, BAD, beside=True)  # again: the one beside is replaced, the reference stays
    assert store.load(d) == GOOD and len(json.loads(store.path.read_text())["entries"]) == 2
    store.save(d, BAD)  # an engine whose first answer raised no doubt: its answer is the reference
    assert store.load(d) == BAD


def test_torch_version_is_what_the_engines_python_reports_or_none(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 2.5.1+cu124\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    assert torch_version(str(python)) == "2.5.1+cu124"
    python.write_text("#!/bin/sh\nexit 1\n")
    assert torch_version(str(python)) is None
    assert torch_version(str(tmp_path / "absent")) is None
