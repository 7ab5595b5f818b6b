"""`r3090ctl plan` inputs and outputs, in process (no engine, no GPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from r3090d import config as configmod
from r3090d.cli.common import ctl, run_click
from r3090d.config import loading as config_loading
from r3090d.core.snapshot import GpuSample, GpuStatus, HostFacts
from r3090d.measure import inputs, modelinfo, plancheck
from r3090d.measure.modelinfo import read_model_dir
from r3090d.preflight.checks import check_model_fit
from r3090d.units import GIB

DATA = Path(__file__).resolve().parent.parent / "data"
QWEN_CONFIG = DATA / "qwen2.5-7b-config.json"


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    # The NVML boundary: behave as a machine without a GPU wherever the tests run.
    monkeypatch.setattr(inputs, "gpu_from_nvml", lambda index: (None, "NVML: no_library: test machine"))
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


def test_a_gpu_estimate_is_a_range_and_never_called_exact(capsys, qwen_dir):
    code, out, err = run(capsys, "--model", qwen_dir, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936)
    assert code == 0, err
    assert "7,136 (5,295 to 8,120)" in out  # KV blocks: point (low to high)
    assert "KV blocks estimate: 5,295 to 8,120, point 7,136" in out
    for part in ("activations", "non-torch", "CUDA graphs"):
        assert any(line.strip().startswith(part) and "GiB: " in line for line in out.splitlines()), part
    assert "exact" not in out.lower()


def test_the_range_in_json_beside_the_old_keys(capsys, qwen_dir):
    code, out, err = run(capsys, "--model", qwen_dir, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    assert code == 0, err
    data = json.loads(out)
    primary = data["primary"]
    assert (primary["num_blocks_low"], primary["num_blocks"], primary["num_blocks_high"]) == (5295, 7136, 8120)
    assert primary["basis"] == "estimate"
    parts = data["overhead"]["assumptions"]
    assert [a["part"] for a in parts] == ["activations", "non-torch", "CUDA graphs"]
    assert all(a["low_bytes"] < a["point_bytes"] < a["high_bytes"] and a["reason"] for a in parts)
    assert data["overhead"]["total"] == sum(a["point_bytes"] for a in parts)
    assert data["overhead"]["low_total"] < data["overhead"]["total"] < data["overhead"]["high_total"]
    assert data["alternatives"][0]["num_blocks_low"] < data["alternatives"][0]["num_blocks_high"]


def test_help_states_the_figures_plan_prints(capsys, qwen_dir):
    code, out, _ = run(capsys, "--model", qwen_dir, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    primary = json.loads(out)["primary"]
    code, help_text, _ = run(capsys, "--help")
    assert code == 0
    words = " ".join(help_text.split())
    low, point, high = primary["num_blocks_low"], primary["num_blocks"], primary["num_blocks_high"]
    assert f"{low:,} to {high:,} blocks, point {point:,}" in words
    assert "5,306 blocks" in words and "exact only against a running engine" in words


def test_an_engine_figure_is_exact_and_placed_against_the_range(capsys, qwen_dir, monkeypatch):
    # The engine boundary: what its /metrics cache_config_info would say.
    labels = {"num_gpu_blocks": "5306", "block_size": "16", "gpu_memory_utilization": "0.9"}
    monkeypatch.setattr(inputs, "read_engine_cache", lambda url, **kw: (plancheck.engine_cache_from_labels(labels), None))
    args = ("--model", qwen_dir, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--url", "http://engine")
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "vLLM allocated (exact: its cache_config_info)" in out
    assert "engine blocks inside the estimated range 5,295 to 8,120" in out
    code, out, err = run(capsys, *args, "--json")
    assert json.loads(out)["engine"]["range_position"] == "inside"


def test_exact_kv_bytes_json(capsys, qwen_dir):
    kv = 5306 * 16 * 57_344
    code, out, err = run(capsys, "--model", qwen_dir, "--kv-cache-memory-bytes", kv, "--bandwidth-gbs", 936, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 57_344
    assert data["primary"]["num_blocks"] == 5306
    assert data["primary"]["basis"] == "exact"
    assert data["primary"]["num_blocks_low"] == data["primary"]["num_blocks_high"] == 5306
    code, out, err = run(capsys, "--model", qwen_dir, "--kv-cache-memory-bytes", kv, "--bandwidth-gbs", 936)
    assert "KV blocks exact: the KV memory was given" in out
    assert "5,306 (" not in out  # one figure, no range
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
    monkeypatch.setattr(inputs, "gpu_from_nvml", lambda index: ((24576 * 2**20, "NVIDIA GeForce RTX 3090"), ""))
    code, out, err = run(capsys, "--model", qwen_dir, "--json")
    assert code == 0, err
    hw = json.loads(out)["hardware"]
    assert hw["memory_bytes"] == 24576 * 2**20 and hw["bandwidth_bytes_per_s"] == 936e9
    assert "card profile rtx3090" in hw["source"]


def test_an_unknown_card_asks_for_its_bandwidth(capsys, qwen_dir, monkeypatch):
    # NVML memory as read on a real H200.
    monkeypatch.setattr(inputs, "gpu_from_nvml", lambda index: ((150_754_820_096, "NVIDIA H200"), ""))
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


# ------------------------------------------- plan and preflight read alike


def plan_and_fit(capsys, tmp_path, model, extra_args=(), profile="realtime"):
    """`r3090ctl plan --json` and preflight's model_fit for the same config and model directory."""
    cfg_path = tmp_path / "r3090d.toml"
    extra = json.dumps(list(extra_args))
    cfg_path.write_text(
        f'profile = "{profile}"\n[engine]\nmodel = "{model}"\nport = 9\nextra_args = {extra}\n'
    )
    code, out, err = run(
        capsys, "--config", cfg_path, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json"
    )
    assert code == 0, err
    cfg = configmod.load(cfg_path, check_files=False)
    gpu = GpuSample(status=GpuStatus.OK, memory_total=24 * GIB)
    return json.loads(out), check_model_fit(gpu, HostFacts(model=read_model_dir(model)), cfg)


def kv_text(planned: dict) -> str:
    """Preflight's words for the KV cache of one max_model_len sequence, from the plan's figures."""
    max_len = planned["settings"]["max_model_len"]
    return f"KV {planned['kv_bytes_per_token'] * max_len / GIB:.2f} GiB for one {max_len}-token sequence"


def test_plan_and_preflight_take_the_last_of_a_flag_given_twice(capsys, qwen_dir, tmp_path):
    # vLLM's parser keeps the last occurrence: fp8 (1 byte a value), not bfloat16 (2).
    planned, fit = plan_and_fit(
        capsys, tmp_path, qwen_dir, ["--kv-cache-dtype", "bfloat16", "--kv-cache-dtype=fp8"]
    )
    assert planned["settings"]["kv_cache_dtype"] == "fp8"
    assert planned["kv_bytes_per_token"] == 57_344 // 2
    assert kv_text(planned) in fit.measured


def test_plan_reads_the_last_block_size_in_either_spelling(capsys, qwen_dir, tmp_path):
    planned, _ = plan_and_fit(
        capsys, tmp_path, qwen_dir, ["--block-size", "16", "--block_size=32", "--enforce_eager"]
    )
    assert planned["settings"]["block_size"] == 32
    assert planned["settings"]["enforce_eager"] is True


def test_plan_and_preflight_judge_a_model_directory_alike(capsys, tmp_path):
    # A multimodal wrapper, quantized, with the newer "dtype" key: one reading of its architecture, dtype and quantization.
    text = json.loads(QWEN_CONFIG.read_text())
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "torch_dtype": None,
        "dtype": "float16",
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128},
        "text_config": {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")},
    }
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    planned, fit = plan_and_fit(capsys, tmp_path, model)
    facts = read_model_dir(model)
    assert planned["model"]["architecture"] == facts.architecture == "Qwen2VLForConditionalGeneration"
    assert (
        planned["model"]["torch_dtype"] == "float16" and planned["model"]["quantization"]["method"] == "awq"
    )
    assert fit.measured.startswith(
        f"weights {planned['primary']['weight_bytes'] / GIB:.2f} GiB (estimated from config.json)"
    )
    assert kv_text(planned) in fit.measured  # float16 KV: 2 bytes a value
    assert planned["kv_bytes_per_token"] == 57_344


def test_a_bare_config_json_is_read_like_a_directorys(capsys, tmp_path, monkeypatch):
    bare = tmp_path / "config.json"
    bare.write_text("[1, 2]")
    for model in (bare, tmp_path):
        code, _, err = run(capsys, "--model", model, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936)
        assert code == 64 and "config.json: not a JSON object" in err, err
    shutil.copy(QWEN_CONFIG, bare)
    monkeypatch.setattr(modelinfo, "MAX_CONFIG_BYTES", 100)  # the cap holds for a bare file too
    for model in (bare, tmp_path):
        code, _, err = run(capsys, "--model", model, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936)
        assert code == 64 and "config.json: larger than 100 bytes" in err, err


def test_without_a_profile_plan_and_preflight_take_the_engine_flags(capsys, qwen_dir, tmp_path):
    extra = ["--max-model-len", "4096", "--gpu_memory_utilization=0.8"]
    planned, fit = plan_and_fit(capsys, tmp_path, qwen_dir, extra, profile="none")
    settings = planned["settings"]
    assert settings["max_model_len"] == 4096 and settings["gpu_memory_utilization"] == 0.8
    assert kv_text(planned) in fit.measured and fit.expected.startswith("<= 0.8 x ")
