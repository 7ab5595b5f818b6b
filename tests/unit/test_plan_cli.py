"""`r3090ctl plan` inputs and outputs, in process (no engine, no GPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from r3090d.cli import plan_cmd
from r3090d.cli.common import ctl, run_click
from r3090d.config import loading as config_loading

DATA = Path(__file__).resolve().parent.parent / "data"
QWEN_CONFIG = DATA / "qwen2.5-7b-config.json"


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    # The NVML boundary: behave as a machine without a GPU wherever the tests run.
    monkeypatch.setattr(plan_cmd, "gpu_from_nvml", lambda index: (None, "NVML: no_library: test machine"))
    monkeypatch.delenv("R3090D_CONFIG", raising=False)
    # resolve_path() reads the default where it is defined, not the package's re-export.
    monkeypatch.setattr(config_loading, "DEFAULT_PATH", Path("/nonexistent/r3090d.toml"))


@pytest.fixture
def qwen_dir(tmp_path):
    d = tmp_path / "qwen"
    d.mkdir()
    shutil.copy(QWEN_CONFIG, d / "config.json")
    return d


def run(capsys, *args):
    code = run_click(ctl, ["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_qwen_on_a_3090_in_text(capsys, qwen_dir):
    code, out, err = run(capsys, "--model", qwen_dir, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936)
    assert code == 0, err
    assert "57,344 B" in out
    assert "15.23 GB (14.19 GiB)" in out
    assert "16.3 ms" in out
    assert "awq-int4 (estimate)" in out
    assert "estimate" in out and "no weight files" in out


def test_exact_kv_bytes_json(capsys, qwen_dir):
    kv = 5306 * 16 * 57_344
    code, out, err = run(capsys, "--model", qwen_dir, "--kv-cache-memory-bytes", kv, "--bandwidth-gbs", 936, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 57_344
    assert data["primary"]["num_blocks"] == 5306
    assert data["primary"]["weight_bytes"] == 15_231_233_024
    assert data["primary"]["tpot_floor_s"] == pytest.approx(15_231_233_024 / 936e9)
    assert data["hardware"]["memory_bytes"] is None  # not needed with an exact KV size


def test_a_bare_config_json_is_accepted(capsys):
    code, out, _ = run(capsys, "--model", QWEN_CONFIG, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    assert code == 0
    assert json.loads(out)["model"]["num_kv_heads"] == 4


def test_without_a_gpu_the_sizes_are_asked_for(capsys, qwen_dir):
    code, _, err = run(capsys, "--model", qwen_dir)
    assert code == 64
    assert "--gpu-memory-gib" in err and "--bandwidth-gbs" in err and "Traceback" not in err
    code, _, err = run(capsys, "--model", qwen_dir, "--kv-cache-memory-bytes", 10**9)
    assert code == 64
    assert "give --bandwidth-gbs B (" in err and "give --gpu-memory-gib" not in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "/nonexistent/model"], "does not exist"),
        ([], "no model"),
        (["--profile", "turbo"], "unknown profile"),
    ],
)
def test_bad_inputs(capsys, qwen_dir, args, needle):
    if "--model" not in args and args:
        args = ["--model", str(qwen_dir), *args]
    code, _, err = run(capsys, *args, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936)
    assert code == 64
    assert needle in err and "Traceback" not in err


def test_a_broken_config_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2')
    code, _, err = run(capsys, "--model", tmp_path, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936)
    assert code == 64 and "config.json" in err
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    code, _, err = run(capsys, "--model", tmp_path, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936)
    assert code == 64 and "hidden_size" in err


def test_profiles_and_overrides(capsys, qwen_dir):
    code, out, _ = run(capsys, "--model", qwen_dir, "--profile", "batch", "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    batch = json.loads(out)
    assert batch["settings"]["gpu_memory_utilization"] == 0.92 and batch["settings"]["max_num_seqs"] == 64
    code, out, _ = run(capsys, "--model", qwen_dir, "--gpu-memory-utilization", 0.5, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    low = json.loads(out)
    assert low["primary"]["num_blocks"] == 0  # 12 GiB cannot hold 15 GB of weights
    code, out, _ = run(capsys, "--model", qwen_dir, "--profile", "none", "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    assert json.loads(out)["settings"]["max_model_len"] == 131072  # vLLM's default: the model's full context


def test_config_supplies_model_profile_and_engine_flags(capsys, qwen_dir, tmp_path):
    cfg = tmp_path / "r3090d.toml"
    cfg.write_text(
        f'profile = "batch"\n[engine]\nmodel = "{qwen_dir}"\nport = 9\n'
        'extra_args = ["--block-size", "32", "--enforce-eager"]\n'
        "[watchdog]\ngpu_memory_alert_mib = 24000\n"
    )
    code, out, err = run(capsys, "--config", cfg, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    assert code == 0, err  # the config's engine (port 9) is unreachable: noted, not an error
    data = json.loads(out)
    assert data["settings"]["block_size"] == 32 and data["settings"]["enforce_eager"] is True
    assert data["settings"]["gpu_memory_utilization"] == 0.92
    assert data["block_bytes"] == 32 * 57_344
    assert "engine_error" in data


def test_an_unreachable_url_given_explicitly_is_an_error(capsys, qwen_dir):
    code, out, err = run(capsys, "--model", qwen_dir, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--url", "http://127.0.0.1:9")
    assert code == 1
    assert "16.3 ms" in out  # the plan is still printed
    assert "could not read the engine at http://127.0.0.1:9" in err and "Traceback" not in err


def test_a_3090_seen_by_nvml_needs_no_flags(capsys, qwen_dir, monkeypatch):
    monkeypatch.setattr(plan_cmd, "gpu_from_nvml", lambda index: ((24576 * 2**20, "NVIDIA GeForce RTX 3090"), ""))
    code, out, err = run(capsys, "--model", qwen_dir, "--json")
    assert code == 0, err
    hw = json.loads(out)["hardware"]
    assert hw["memory_bytes"] == 24576 * 2**20 and hw["bandwidth_bytes_per_s"] == 936e9
    assert "card profile rtx3090" in hw["source"]


def test_an_unknown_card_asks_for_its_bandwidth(capsys, qwen_dir, monkeypatch):
    # NVML memory as read on a real H200.
    monkeypatch.setattr(plan_cmd, "gpu_from_nvml", lambda index: ((150_754_820_096, "NVIDIA H200"), ""))
    code, _, err = run(capsys, "--model", qwen_dir)
    assert code == 64
    assert "NVIDIA H200" in err and "give --bandwidth-gbs" in err
    code, out, err = run(capsys, "--model", qwen_dir, "--bandwidth-gbs", 4800, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["hardware"]["memory_bytes"] == 150_754_820_096
    assert data["primary"]["tpot_floor_s"] == pytest.approx(15_231_233_024 / 4800e9)


def test_measured_weights_come_from_the_safetensors_headers(capsys, qwen_dir):
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    # 3 MB of weights in two files: the plan must use these bytes, not the 15 GB estimate.
    st.save_file({"a": np.zeros((1000, 500), dtype=np.float32)}, str(qwen_dir / "model-00001-of-00002.safetensors"))
    st.save_file({"b": np.zeros((1000, 500), dtype=np.float16)}, str(qwen_dir / "model-00002-of-00002.safetensors"))
    code, out, err = run(capsys, "--model", qwen_dir, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["primary"]["weight_bytes"] == 1000 * 500 * 4 + 1000 * 500 * 2
    assert data["primary"]["weight_source"].startswith("measured") and "2 file(s)" in data["primary"]["weight_source"]
    assert data["primary"]["tpot_floor_s"] == pytest.approx(3_000_000 / 936e9)
