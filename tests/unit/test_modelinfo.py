"""Model directory facts from real safetensors files, written here byte by byte."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from r3090d.measure import modelinfo
from r3090d.measure.modelinfo import (
    SAFETENSORS_INDEX,
    ModelConfigError,
    read_config,
    read_model_dir,
    read_safetensors_header,
)
from r3090d.measure.plan import Quantization, shape_from_config
from tests import unprivileged as unprivileged_mod

ELEMENT_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I8": 1, "U8": 1}
QWEN_CONFIG = json.loads((Path(__file__).parents[1] / "data" / "qwen2.5-7b-config.json").read_text())


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], *, metadata=None, cut: int = 0, sparse=False) -> int:
    """The safetensors layout: u64 LE header length, JSON header (space-padded to 8), data. Returns data bytes."""
    header: dict = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * ELEMENT_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        if sparse:
            fh.truncate(8 + len(raw) + offset - cut)
        else:
            fh.write(b"\x01" * (offset - cut))
    return offset


def raw_file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def model_dir(tmp_path: Path, config: dict | None = QWEN_CONFIG) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def test_single_file_sums_the_header_spans(tmp_path):
    d = model_dir(tmp_path)
    n = write_safetensors(
        d / "model.safetensors",
        {"embed": ("BF16", [100, 16]), "norm": ("F32", [16]), "q": ("I32", [4, 8]), "s": ("F16", [4])},
        metadata={"format": "pt"},
    )
    f = read_model_dir(d)
    assert f.error is None and f.is_dir
    assert f.weight_bytes == n == 100 * 16 * 2 + 16 * 4 + 4 * 8 * 4 + 4 * 2
    assert f.tensor_count == 4 and f.parameter_count == 1600 + 16 + 32 + 4
    assert dict(f.bytes_by_dtype) == {"BF16": 3200, "F32": 64, "I32": 128, "F16": 8}
    assert [(w.name, w.format, w.tensor_bytes) for w in f.weight_files] == [("model.safetensors", "safetensors", n)]
    assert f.architecture == "Qwen2ForCausalLM" and f.index_file is None
    shape = shape_from_config(f.config)  # the one reading of config.json's keys
    assert shape.num_kv_heads == 4 and shape.torch_dtype == "bfloat16" and shape.quantization is None


def test_tensor_data_is_never_read(tmp_path):
    d = model_dir(tmp_path)
    # 64 GiB declared, stored sparse: reading it would take minutes, the header milliseconds.
    n = write_safetensors(d / "model.safetensors", {"w": ("BF16", [32 * 1024, 1024 * 1024])}, sparse=True)
    t0 = time.monotonic()
    f = read_model_dir(d)
    assert time.monotonic() - t0 < 1.0
    assert f.weight_bytes == n == 64 * 1024**3


def test_sharded_with_index_counts_only_the_indexed_shards(tmp_path):
    d = model_dir(tmp_path)
    a = write_safetensors(d / "model-00001-of-00002.safetensors", {"a": ("BF16", [10, 10]), "b": ("BF16", [10])})
    b = write_safetensors(d / "model-00002-of-00002.safetensors", {"c": ("F32", [5, 5])})
    write_safetensors(d / "consolidated.safetensors", {"a": ("BF16", [10, 10]), "b": ("BF16", [10]), "c": ("F32", [5, 5])})
    index = {
        "metadata": {"total_size": a + b},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"},
    }
    (d / SAFETENSORS_INDEX).write_text(json.dumps(index))
    f = read_model_dir(d)
    assert f.error is None
    assert f.index_file == SAFETENSORS_INDEX and f.index_total_size == a + b
    assert f.weight_bytes == a + b and f.tensor_count == 3
    assert [w.name for w in f.weight_files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_without_an_index_every_safetensors_file_counts(tmp_path):
    d = model_dir(tmp_path)
    a = write_safetensors(d / "part-a.safetensors", {"a": ("U8", [7])})
    b = write_safetensors(d / "part-b.safetensors", {"b": ("U8", [9])})
    assert read_model_dir(d).weight_bytes == a + b == 16


def test_a_shard_named_by_the_index_but_missing(tmp_path):
    d = model_dir(tmp_path)
    write_safetensors(d / "model-00001-of-00002.safetensors", {"a": ("BF16", [4])})
    (d / SAFETENSORS_INDEX).write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    f = read_model_dir(d)
    assert f.weight_bytes is None  # an incomplete set has no total
    assert "model-00002-of-00002.safetensors: missing" in f.error
    assert [w.size_on_disk is None for w in f.weight_files] == [False, True]


def test_index_without_weight_map_is_an_error(tmp_path):
    d = model_dir(tmp_path)
    write_safetensors(d / "model.safetensors", {"a": ("BF16", [4])})
    (d / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}}))
    f = read_model_dir(d)
    assert "weight_map" in f.error
    assert f.weight_bytes == 8  # falls back to the files present


def test_index_cannot_point_outside_the_directory(tmp_path):
    d = model_dir(tmp_path)
    (d / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    f = read_model_dir(d)
    assert "leave the model directory" in f.error and f.weight_files == ()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes(b"\x01\x02"), "too short"),
        (lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"), "does not fit"),
        (lambda p: p.write_bytes(struct.pack("<Q", 8) + b"not json"), "not valid JSON"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2) + b"[]"), "not a JSON object"),
        (lambda p: write_safetensors(p, {"a": ("F32", [100])}, cut=4), "truncated"),
        (lambda p: p.write_bytes(raw_file({"a": {"dtype": "F32", "shape": [1]}})), "malformed"),
        (lambda p: p.write_bytes(raw_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, b"\0" * 8)), "bad data_offsets"),
    ],
)  # fmt: skip
def test_corrupt_files_give_an_error_not_an_exception(tmp_path, damage, message):
    d = model_dir(tmp_path)
    damage(d / "model.safetensors")
    f = read_model_dir(d)
    assert f.weight_bytes is None
    assert f.error.startswith("model.safetensors: ") and message in f.error
    assert f.weight_files[0].error


def test_missing_and_corrupt_config(tmp_path):
    d = model_dir(tmp_path, config=None)
    assert read_model_dir(d).config is None and "config.json: missing" in read_model_dir(d).error
    (d / "config.json").write_text("{not json")
    f = read_model_dir(d)
    assert f.config is None and "config.json: not valid JSON" in f.error
    (d / "config.json").write_text("[1, 2]")
    assert "not a JSON object" in read_model_dir(d).error


def test_quantized_and_newer_dtype_key(tmp_path):
    config = {k: v for k, v in QWEN_CONFIG.items() if k != "torch_dtype"}
    config |= {
        "architectures": ["LlamaForCausalLM"],
        "dtype": "float16",
        "quantization_config": {"quant_method": "awq", "bits": 4},
    }
    f = read_model_dir(model_dir(tmp_path, config))
    assert f.weight_files == () and f.weight_bytes is None and f.error is None
    shape = shape_from_config(f.config)
    assert shape.quantization == Quantization("awq", 4, -1) and shape.torch_dtype == "float16"
    assert shape.architecture == f.architecture == "LlamaForCausalLM"


def test_a_bare_config_file_reads_as_its_directory_does(tmp_path, monkeypatch):
    d = model_dir(tmp_path)
    assert read_config(d) == read_config(d / "config.json") == QWEN_CONFIG
    for text, problem in [
        ("{not json", "config.json: not valid JSON"),
        ("[1, 2]", "config.json: not a JSON object"),
        ("null", "config.json: not a JSON object"),
    ]:
        (d / "config.json").write_text(text)
        for path in (d, d / "config.json"):
            with pytest.raises(ModelConfigError, match=problem):
                read_config(path)
        assert problem in read_model_dir(d).error
    (d / "config.json").write_text(json.dumps(QWEN_CONFIG))
    # The one cap, for a directory and a bare file alike.
    monkeypatch.setattr(modelinfo, "MAX_CONFIG_BYTES", 100)
    for path in (d, d / "config.json"):
        with pytest.raises(ModelConfigError, match="config.json: larger than 100 bytes"):
            read_config(path)
    (d / "config.json").unlink()
    with pytest.raises(ModelConfigError, match="config.json: missing"):
        read_config(d)


def test_other_weight_formats_are_listed_but_not_summed(tmp_path):
    d = model_dir(tmp_path)
    (d / "pytorch_model.bin").write_bytes(b"\0" * 123)
    (d / "training_args.bin").write_bytes(b"\0" * 5)
    f = read_model_dir(d)
    assert [(w.name, w.format, w.size_on_disk) for w in f.weight_files] == [("pytorch_model.bin", "bin", 123)]
    assert f.weight_bytes is None and f.weight_files


def test_not_a_directory(tmp_path):
    f = read_model_dir(tmp_path / "absent")
    assert not f.is_dir and "does not exist" in f.error
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in read_model_dir(tmp_path / "file").error


# The model directory read in a child without root's privileges: its uid, the error, each file's error, the bytes.
READ_MODEL = """
import os, sys
from r3090d.measure.modelinfo import read_model_dir
facts = read_model_dir(sys.argv[1])
print(os.geteuid())
print(facts.error)
print([(w.name, w.error) for w in facts.weight_files])
print(facts.weight_bytes)
"""


def test_unreadable_shard(unprivileged):
    d = model_dir(unprivileged.dir)
    d.chmod(0o755)
    (d / "config.json").chmod(0o644)
    shard = d / "model.safetensors"
    write_safetensors(shard, {"a": ("BF16", [4])})
    uid = unprivileged_mod.expected_uid()
    # Readable, the same child counts the shard: what fails below is the file's mode alone.
    shard.chmod(0o644)
    readable = unprivileged.python(READ_MODEL, str(d))
    assert (readable.returncode, readable.stdout) == (0, f"{uid}\nNone\n[('model.safetensors', None)]\n8\n"), readable.stderr
    shard.chmod(0)
    out = unprivileged.python(READ_MODEL, str(d))
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    unreadable = "unreadable: Permission denied"
    assert out.stdout == f"{uid}\nmodel.safetensors: {unreadable}\n[('model.safetensors', {unreadable!r})]\nNone\n"


def test_agrees_with_the_safetensors_library(tmp_path):
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"a": np.zeros((3, 5), np.float16), "b": np.zeros(7, np.float32), "c": np.zeros((2, 2, 2), np.int8)}
    st.save_file(tensors, str(tmp_path / "x.safetensors"))
    header = read_safetensors_header(tmp_path / "x.safetensors")
    assert header.tensor_bytes == sum(t.nbytes for t in tensors.values())
    assert header.elements == sum(t.size for t in tensors.values()) and header.tensor_count == 3
