"""scripts/make_tiny_model.py: a deterministic tiny Qwen2 directory that vLLM's CPU path accepts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "tiny-qwen2"
    assert script.main([str(out)]) == 0
    return out


def test_two_runs_write_identical_files(script, model_dir, tmp_path):
    again = tmp_path / "again"
    assert script.main([str(again)]) == 0
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_rerun_replaces_the_directory_and_leaves_no_staging(script, model_dir, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    assert script.main([str(out)]) == 0
    assert not (out / "stale.bin").exists()
    assert not (tmp_path / "m.partial").exists()


def test_shape_suits_the_cpu_attention_path(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] >= 64
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["vocab_size"] % 64 == 0
    assert cfg["tie_word_embeddings"] is False
    # float32: the one dtype that vLLM's CPU path serves with the same kernels on every x86-64 CPU.
    assert cfg["torch_dtype"] == "float32"
    kv_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert kv_bytes == 1024  # a GiB of KV is exactly 2**20 tokens


def test_every_model_id_decodes_and_specials_are_single_tokens(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == cfg["vocab_size"]
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.encode(special).ids == [tok.token_to_id(special)]
    text = "Hello world, restart the engine 4096 times!\n\tdone"
    assert tok.decode(tok.encode(text).ids) == text
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert tok.token_to_id("<|im_end|>") in gen["eos_token_id"] and cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")


def test_chat_template_is_chatml(model_dir):
    jinja2 = pytest.importorskip("jinja2")
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    rendered = jinja2.Template(tc["chat_template"]).render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unwritable_outdir_is_a_clear_error(script, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert script.main([str(blocker / "model")]) == 73
    assert "cannot write" in capsys.readouterr().err


def test_weights_are_seeded_complete_and_give_clear_greedy_margins(script, tmp_path):
    np = pytest.importorskip("numpy")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    out, again = tmp_path / "w", tmp_path / "w2"
    assert script.main(["--weights", str(out)]) == 0
    assert script.main(["--weights", str(again)]) == 0
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    weights = safetensors_numpy.load_file(str(out / "model.safetensors"))
    assert {k: v.shape for k, v in weights.items()} == script.weight_shapes()
    assert {v.dtype for v in weights.values()} == {np.dtype("float32")}
    # The margin between the two largest logits for final hidden states of RMS 1 (what the final
    # RMSNorm hands lm_head): mostly well above the near-zero of dummy weights.
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((256, script.HIDDEN_SIZE)).astype(np.float32)
    logits = hidden @ weights["lm_head.weight"].T
    top2 = np.sort(logits, axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    assert 1.0 < np.median(margins) < 5.0
    assert (margins > 0.5).mean() > 0.7
