"""`r3090ctl config check` warns when the user's step budget outgrows the watchdog's no-progress windows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_harness import engine_config, write_config

pytestmark = pytest.mark.component

CTL = [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]
QWEN_CONFIG = Path(__file__).resolve().parent.parent / "data" / "qwen2.5-7b-config.json"
CONTEXT_32K = ["--max-model-len", "32768"]  # the config.json says 131072, whose last chunks take longer


def check(tmp_path: Path, engine_python: str, extra_args: list[str]) -> subprocess.CompletedProcess:
    data = engine_config(tmp_path, engine_python, extra_args=extra_args, watchdog={"poll_interval": 2.0})
    shutil.copy(QWEN_CONFIG, Path(data["engine"]["model"]) / "config.json")
    config = write_config(tmp_path / "r3090d.toml", data)
    return subprocess.run([*CTL, "config", "check", "--json", "--config", str(config)], capture_output=True, text=True, timeout=120)


def test_a_large_step_budget_is_warned_with_the_numbers(tmp_path, fake_engine_python):
    done = check(tmp_path, fake_engine_python, [*CONTEXT_32K, "--max-num-batched-tokens", "8192"])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    (stall,) = [w for w in out["warnings"] if w.startswith("watchdog.stall_seconds")]
    # Qwen2.5-7B's own config.json: its parameters counted.
    assert "8192 tokens per step (--max-num-batched-tokens) x 7.6 B parameters (the model directory)" in stall
    assert "32768-token context" in stall and "raise it to 32" in stall
    assert "WARN watchdog.stall_seconds = 10" in done.stderr
    assert out["longest_step"]["seconds"] == pytest.approx(8.0, abs=0.3)


def test_vllms_default_step_budget_passes_the_shipped_windows(tmp_path, fake_engine_python):
    done = check(tmp_path, fake_engine_python, CONTEXT_32K)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["warnings"] == [] and "WARN" not in done.stderr
    assert "2048 tokens per step (vLLM's default)" in out["longest_step"]["estimate"]


def test_the_models_full_context_lengthens_the_step(tmp_path, fake_engine_python):
    # No --max-model-len and no profile: vLLM serves the config's 131072 tokens, whose last chunks attend 4x further.
    out = json.loads(check(tmp_path, fake_engine_python, []).stdout)
    assert "131072-token context" in out["longest_step"]["estimate"] and out["longest_step"]["seconds"] > 4
    assert any(w.startswith("watchdog.stall_seconds = 10") for w in out["warnings"])
