"""`r3090ctl config check` refuses a context longer than the model's: vLLM would refuse to start with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from r3090d import exitcodes
from tests.daemon_harness import engine_config, write_config

pytestmark = pytest.mark.component

CTL = [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]
LLAMA_4K = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}  # fmt: skip


def check(tmp_path: Path, engine_python: str, model_config: dict, **sections) -> tuple[subprocess.CompletedProcess, Path]:
    raw = sections.pop("raw", {})  # tables as written, e.g. [profiles.long]
    data = {**engine_config(tmp_path, engine_python, **sections), **raw}
    (Path(data["engine"]["model"]) / "config.json").write_text(json.dumps(model_config))
    config = write_config(tmp_path / "r3090d.toml", data)
    done = subprocess.run([*CTL, "config", "check", "--config", str(config)], capture_output=True, text=True, timeout=120)
    return done, config


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == exitcodes.CONFIG, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_profile_context_above_the_models_is_a_config_error_with_both_numbers(tmp_path, fake_engine_python):
    done, config = check(tmp_path, fake_engine_python, LLAMA_4K, top={"profile": "long"},
                         raw={"profiles.long": {"max_model_len": 999999}})  # fmt: skip
    line = one_error_line(done)
    assert f"{config}: profiles.long.max_model_len" in line
    assert "999999" in line and "max_position_embeddings = 4096" in line
    assert "fix: lower it to 4096 or less" in line


def test_max_model_len_in_extra_args_above_the_models_is_a_config_error(tmp_path, fake_engine_python):
    done, config = check(tmp_path, fake_engine_python, LLAMA_4K, extra_args=["--enforce-eager", "--max-model-len=8192"])
    line = one_error_line(done)
    assert f"{config}: engine.extra_args[1]" in line
    assert "--max-model-len 8192" in line and "max_position_embeddings = 4096" in line and "fix: lower it to 4096" in line


def test_the_built_in_profile_against_a_short_model_names_the_profile(tmp_path, fake_engine_python):
    short = {**LLAMA_4K, "max_position_embeddings": 2048}
    done, config = check(tmp_path, fake_engine_python, short, top={"profile": "realtime"})
    line = one_error_line(done)
    assert f"{config}: profile" in line and "4096" in line and "max_position_embeddings = 2048" in line
    assert "[profiles.realtime] max_model_len = 2048" in line


@pytest.mark.parametrize(
    "model_config, extra_args",
    [
        (LLAMA_4K, ["--max-model-len", "4096"]),  # exactly the limit
        (LLAMA_4K, []),  # vLLM's default: the model's own
        ({**LLAMA_4K, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
         ["--max-model-len", "16384"]),  # the rope scaling stretches it
        ({**LLAMA_4K, "model_max_length": 8192}, ["--max-model-len", "8192"]),  # the model's own override
        ({"architectures": ["SomethingNew"]}, ["--max-model-len", "999999"]),  # no length in config.json: not judged
    ],
)  # fmt: skip
def test_a_context_vllm_accepts_passes(tmp_path, fake_engine_python, model_config, extra_args):
    done, _ = check(tmp_path, fake_engine_python, model_config, extra_args=extra_args)
    assert done.returncode == 0, done.stderr


def test_vllms_own_override_in_the_engine_environment_passes(tmp_path, fake_engine_python):
    done, _ = check(tmp_path, fake_engine_python, LLAMA_4K, extra_args=["--max-model-len", "8192"],
                    env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr
