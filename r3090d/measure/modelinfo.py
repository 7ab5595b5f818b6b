"""Facts about a model directory, read without loading the model.

This module only reads files: `read_config()` reads config.json (from a model
directory or as a bare file), and `read_model_dir()` reads it, the safetensors
index if there is one, and each safetensors file's *header* (8 bytes of
length, then a JSON table); tensor data is never read, so sizing a 15 GB
model costs a few kilobytes of I/O.

What config.json's keys mean (architecture, dtype, quantization, shapes) is
decided in one place, r3090d.measure.plan.shape_from_config, which is pure,
as is the arithmetic over these facts (KV bytes per token, weight estimates
for a config-only directory, KV capacity).

Which weight files count: with `model.safetensors.index.json` present, only
the shards its `weight_map` names (some repositories also ship a
`consolidated.safetensors` beside the shards, and vLLM skips files the index
does not name); without an index, every `*.safetensors` in the directory.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from r3090d.measure.plan import architecture_of

SAFETENSORS_INDEX = "model.safetensors.index.json"
# The safetensors format caps its JSON header at 100 MB; a larger length
# prefix means the file is not safetensors (or is corrupt).
MAX_SAFETENSORS_HEADER = 100_000_000
MAX_CONFIG_BYTES = 16_000_000
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class WeightFile:
    name: str  # relative to the model directory
    format: str  # "safetensors" | "bin" | "pt" | "pth" | "gguf"
    size_on_disk: int | None  # None: the file is missing (named by the index)
    tensor_bytes: int | None = None  # sum of data_offsets spans; safetensors only
    tensor_count: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class ModelFacts:
    """What the model directory holds. `error` is None when everything read cleanly."""

    path: str
    is_dir: bool
    config: dict | None = None  # config.json as parsed, None if absent or unreadable
    index_file: str | None = None  # SAFETENSORS_INDEX when present
    index_total_size: int | None = None  # the index's metadata.total_size, as its writer claimed
    weight_files: tuple[WeightFile, ...] = ()
    weight_bytes: int | None = None  # from safetensors headers only; None if no safetensors counted
    tensor_count: int | None = None
    parameter_count: int | None = None  # elements stored (packed quantized ints count as stored)
    bytes_by_dtype: tuple[tuple[str, int], ...] = ()  # safetensors dtype -> bytes, sorted by dtype
    error: str | None = None  # every problem found, "; "-joined
    problems: tuple[str, ...] = field(default=(), repr=False)

    @property
    def architecture(self) -> str | None:
        """The architecture config.json names, as r3090d.measure.plan reads it; None without a config."""
        return architecture_of(self.config) if self.config is not None else None


# ------------------------------------------------------------------ reading


class ModelConfigError(ValueError):
    """config.json cannot be read; the text names the file and why ("config.json: missing")."""


def read_config(path: Path | str) -> dict:
    """config.json as a dict, from a model directory or a bare config file, at most MAX_CONFIG_BYTES.

    Only reads: its keys are r3090d.measure.plan's to interpret. Raises ModelConfigError.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    problems: list[str] = []
    config = _read_json(p, problems, required=True)
    if problems:
        raise ModelConfigError(problems[0])
    if not isinstance(config, dict):
        raise ModelConfigError(f"{p.name}: not a JSON object")
    return config


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True)
class SafetensorsHeader:
    tensor_bytes: int
    tensor_count: int
    elements: int
    bytes_by_dtype: dict[str, int]


def read_safetensors_header(path: Path | str) -> SafetensorsHeader:
    """Parse one safetensors header. Raises SafetensorsError (or OSError) on a bad file.

    Layout: u64 little-endian N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}, then the data region,
    to which the offsets are relative.
    """
    path = Path(path)
    with path.open("rb") as fh:
        size = path.stat().st_size
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise SafetensorsError(f"header length {n} does not fit a {size}-byte file (corrupt or not safetensors)")
        raw = fh.read(n)
    if len(raw) != n:
        raise SafetensorsError("header cut short")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    data_size = size - 8 - n
    total = count = elements = 0
    by_dtype: dict[str, int] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            dtype = str(info["dtype"])
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"tensor {name!r}: malformed entry") from None
        if not (isinstance(begin, int) and isinstance(end, int)) or not 0 <= begin <= end:
            raise SafetensorsError(f"tensor {name!r}: bad data_offsets {info['data_offsets']!r}")
        if end > data_size:
            raise SafetensorsError(f"tensor {name!r} ends at byte {end} of a {data_size}-byte data region (truncated file)")
        total += end - begin
        count += 1
        elements += math.prod(shape)
        by_dtype[dtype] = by_dtype.get(dtype, 0) + end - begin
    return SafetensorsHeader(total, count, elements, by_dtype)


def read_model_dir(path: Path | str) -> ModelFacts:
    """Everything knowable about a model directory without loading tensors. Never raises."""
    root = Path(path).expanduser()
    problems: list[str] = []
    if not root.is_dir():
        why = "does not exist" if not root.exists() else "is not a directory"
        return ModelFacts(path=str(path), is_dir=False, error=f"{path} {why}", problems=(f"{path} {why}",))

    try:
        config = read_config(root)
    except ModelConfigError as exc:
        problems.append(str(exc))
        config = None

    index_file = index_total = None
    shard_names: list[str] | None = None
    if (root / SAFETENSORS_INDEX).exists():
        index_file = SAFETENSORS_INDEX
        index = _read_json(root / SAFETENSORS_INDEX, problems, required=False)
        shard_names, index_total = _parse_index(index, problems)

    try:
        listing = sorted(p for p in root.iterdir() if p.is_file())
    except OSError as exc:
        problems.append(f"cannot list the directory: {exc.strerror or exc}")
        listing = []
    if shard_names is None:
        shard_names = [p.name for p in listing if p.suffix == ".safetensors"]
    files: list[WeightFile] = []
    weight_bytes = tensors = elements = 0
    by_dtype: dict[str, int] = {}
    counted = 0
    for name in shard_names:
        wf, header = _read_shard(root, name)
        files.append(wf)
        if header is None:
            problems.append(f"{name}: {wf.error}")
            continue
        counted += 1
        weight_bytes += header.tensor_bytes
        tensors += header.tensor_count
        elements += header.elements
        for k, v in header.bytes_by_dtype.items():
            by_dtype[k] = by_dtype.get(k, 0) + v
    for p in listing:
        if p.suffix in OTHER_WEIGHT_SUFFIXES and not p.name.startswith("training_args"):
            files.append(WeightFile(p.name, p.suffix.lstrip("."), _size(p)))

    complete = counted > 0 and counted == len(shard_names)
    return ModelFacts(
        path=str(path),
        is_dir=True,
        config=config,
        index_file=index_file,
        index_total_size=index_total,
        weight_files=tuple(files),
        weight_bytes=weight_bytes if complete else None,
        tensor_count=tensors if complete else None,
        parameter_count=elements if complete else None,
        bytes_by_dtype=tuple(sorted(by_dtype.items())) if complete else (),
        error="; ".join(problems) or None,
        problems=tuple(problems),
    )


def _read_shard(root: Path, name: str) -> tuple[WeightFile, SafetensorsHeader | None]:
    p = root / name
    if not p.is_file():
        return WeightFile(name, "safetensors", None, error="missing (named by the index)"), None
    try:
        header = read_safetensors_header(p)
    except SafetensorsError as exc:
        return WeightFile(name, "safetensors", _size(p), error=str(exc)), None
    except OSError as exc:
        return WeightFile(name, "safetensors", _size(p), error=f"unreadable: {exc.strerror or exc}"), None
    return WeightFile(name, "safetensors", _size(p), header.tensor_bytes, header.tensor_count), header


def _parse_index(index, problems: list[str]) -> tuple[list[str] | None, int | None]:
    if index is None:
        return None, None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        problems.append(f"{SAFETENSORS_INDEX}: no weight_map of tensor -> file")
        return None, None
    names = sorted(set(weight_map.values()))
    bad = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
    if bad:
        problems.append(f"{SAFETENSORS_INDEX}: shard names leave the model directory: {', '.join(bad)}")
        names = [n for n in names if n not in bad]
    total = index.get("metadata", {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
    return names, total if isinstance(total, int) else None


def _read_json(p: Path, problems: list[str], *, required: bool):
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            problems.append(f"{p.name}: larger than {MAX_CONFIG_BYTES} bytes")
            return None
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            problems.append(f"{p.name}: missing")
        return None
    except OSError as exc:
        problems.append(f"{p.name}: unreadable: {exc.strerror or exc}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"{p.name}: not valid JSON ({exc})")
    return None


def _size(p: Path) -> int | None:
    try:
        return p.stat().st_size
    except OSError:
        return None
