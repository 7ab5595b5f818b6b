"""KV cache capacity and decode-speed floor, from a model's config.json and a card.

Pure arithmetic: no files, no network, no clock. The CLI (r3090d/cli/plan_cmd.py)
gathers the inputs and prints the result; r3090d/measure/plancheck.py compares it
with a live engine's own figures.

Units: bandwidth is quoted in decimal GB/s, so every byte figure that meets a
bandwidth stays decimal (1 GB = 1e9 B). GiB figures are labelled GiB.

The arithmetic mirrors vLLM's V1 allocator:
- a full-attention layer's page holds `block_size` tokens of K and V:
  2 x kv_heads x head_dim x dtype bytes per token;
- a block spans every layer, so block bytes = block_size x per-token bytes;
- num_blocks = KV memory // block bytes;
- KV memory = total x gpu_memory_utilization - weights - profiled activations
  - non-torch memory - CUDA-graph estimate, or exactly --kv-cache-memory-bytes.
  The three subtracted parts are what vLLM's profile run measures and this
  cannot: each is assumed between a low and a high end, so on a GPU the blocks
  are a range around the point estimate, not one figure;
- its token figure (kv_cache_size_tokens) is
  int(num_blocks / ceil(max_model_len / block_size) x max_model_len).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction

from r3090d.engineflags import VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS
from r3090d.units import GIB, MIB

GB = 10**9

DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}

# vLLM's default --max-num-batched-tokens for the API server on a GPU under
# 70 GiB (engine/arg_utils.py): the token count of its memory-profiling pass.
DEFAULT_MAX_NUM_BATCHED_TOKENS = VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS
DEFAULT_BLOCK_SIZE = 16

# Decoder families whose weights we can count from config.json alone.
_ESTIMABLE = {"qwen2", "qwen3", "llama", "mistral"}


class PlanError(ValueError):
    """Inputs the arithmetic cannot work with; the message says which and why."""


# ------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Quantization:
    method: str  # "awq", "gptq", "fp8", ...
    bits: int
    group_size: int  # -1: one scale per output channel

    def describe(self) -> str:
        group = "per channel" if self.group_size <= 0 else f"group {self.group_size}"
        return f"{self.method.upper()} {self.bits}-bit, {group}"


@dataclass(frozen=True)
class ModelShape:
    """What config.json says about a decoder, with HF's fallbacks applied."""

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None
    vocab_size: int | None
    tie_word_embeddings: bool
    torch_dtype: str  # as written in config.json
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: a head_dim RMSNorm on q and on k in every layer
    quantization: Quantization | None
    max_position_embeddings: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def runtime_dtype(self) -> str:
        """vLLM's --dtype auto: float32 checkpoints run in 16 bits (bf16 on Ampere)."""
        return "bfloat16" if self.torch_dtype in ("float32", "float") else self.torch_dtype


def _int(config: dict, key: str, *, required: bool = True) -> int | None:
    value = config.get(key)
    if value is None:
        if required:
            raise PlanError(f"config.json has no {key}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"config.json {key} = {value!r} is not a positive integer")
    return value


def parse_quantization(qc: dict | None) -> Quantization | None:
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise PlanError(f"quantization_config is {type(qc).__name__}, expected a table")
    method = str(qc.get("quant_method") or qc.get("quant_type") or "unknown").lower()
    if method in ("fp8", "fbgemm_fp8"):
        return Quantization(method, 8, -1)
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size", -1))
    if not isinstance(bits, int) or isinstance(bits, bool):
        return Quantization(method, 0, -1)  # known to be quantized, width unknown
    return Quantization(method, bits, group if isinstance(group, int) else -1)


def decoder_config(config: dict) -> dict:
    """The decoder's part of config.json: multimodal wrappers keep it under text_config, the rest on top."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        inner = dict(config["text_config"])
        for key in ("torch_dtype", "dtype", "quantization_config", "architectures", "tie_word_embeddings"):
            inner.setdefault(key, config.get(key))
        return inner
    return config


def architecture_of(config: dict) -> str | None:
    """The architecture config.json names first (e.g. "Qwen2ForCausalLM"), or None."""
    archs = decoder_config(config).get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else None


def shape_from_config(config: dict) -> ModelShape:
    """Read a HF config.json dict: the one interpreter of its keys. Raises PlanError naming the missing key."""
    if not isinstance(config, dict):
        raise PlanError("config.json is not a JSON object")
    config = decoder_config(config)
    notes: list[str] = []
    layers = _int(config, "num_hidden_layers")
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", required=False)
    if kv_heads is None:
        kv_heads = heads
        notes.append("no num_key_value_heads: multi-head attention assumed (kv heads = attention heads)")
    head_dim = _int(config, "head_dim", required=False)
    if head_dim is None:
        if hidden % heads:
            raise PlanError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}; config.json needs head_dim")
        head_dim = hidden // heads
    architecture = architecture_of(config) or "unknown"
    model_type = str(config.get("model_type") or "").lower()
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype is None:
        dtype = "bfloat16"
        notes.append("no torch_dtype in config.json: bfloat16 assumed")
    dtype = str(dtype).removeprefix("torch.").lower()
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"config.json torch_dtype {dtype!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    tie = config.get("tie_word_embeddings")
    if tie is None:
        # Qwen2Config, LlamaConfig and MistralConfig all default to untied.
        tie = False
    return ModelShape(
        architecture=architecture,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int(config, "intermediate_size", required=False),
        vocab_size=_int(config, "vocab_size", required=False),
        tie_word_embeddings=bool(tie),
        torch_dtype=dtype,
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        quantization=parse_quantization(config.get("quantization_config")),
        max_position_embeddings=_int(config, "max_position_embeddings", required=False),
        notes=tuple(notes),
    )


# ------------------------------------------------------------- context limit

# The config.json keys vLLM reads a model's context length from; the smallest one present is the
# longest max_model_len it derives. model_max_length, where given, is accepted up to as well.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length", "max_seq_length", "seq_len")  # fmt: skip
# Rope scalings whose max_position_embeddings already is the stretched length.
_ROPE_ALREADY_STRETCHED = frozenset({"su", "longrope", "llama3"})


@dataclass(frozen=True)
class ContextLimit:
    """The longest max_model_len vLLM starts a model with (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set)."""

    tokens: int
    source: str  # what in config.json gives it: "max_position_embeddings = 4096", "... x rope_scaling factor 4"


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _stretched(tokens: int, source: str, config: dict) -> tuple[int, str]:
    """`tokens` as vLLM stretches it by the config's rope scaling (gemma3's is local-attention only)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(rope, dict) or "gemma3" in str(config.get("model_type") or ""):
        return tokens, source
    rope_type = str(rope.get("rope_type") or rope.get("type") or "")
    factor = rope.get("factor")
    if rope_type in _ROPE_ALREADY_STRETCHED or isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 1:
        return tokens, source
    original = rope.get("original_max_position_embeddings")
    if rope_type == "yarn" and _positive_int(original):
        tokens, source = original, f"rope_scaling original_max_position_embeddings = {original}"
    return int(tokens * factor), f"{source} x rope_scaling factor {factor:g}"


def context_limit(config: dict) -> ContextLimit | None:
    """The model's context limit as vLLM derives it from config.json; None when the file names no length.

    Where vLLM's reading is uncertain, the longer figure is taken: a limit too
    short here would refuse a context vLLM serves.
    """
    if not isinstance(config, dict):
        return None
    config = decoder_config(config)
    limits: list[tuple[int, str]] = []
    present = [(config[key], key) for key in CONTEXT_KEYS if _positive_int(config.get(key))]
    if present:
        tokens, key = min(present)
        limits.append(_stretched(tokens, f"{key} = {tokens}", config))
    override = config.get("model_max_length")
    if _positive_int(override):
        limits.append(_stretched(override, f"model_max_length = {override}", config))
    if not limits:
        return None
    tokens, source = max(limits)
    return ContextLimit(tokens, source)


# ---------------------------------------------------------------- KV per token


def kv_dtype_bytes(shape: ModelShape, kv_cache_dtype: str = "auto") -> int:
    name = shape.runtime_dtype if kv_cache_dtype in ("auto", "", None) else kv_cache_dtype.lower()
    if name not in DTYPE_BYTES:
        raise PlanError(f"unknown KV cache dtype {kv_cache_dtype!r}")
    return DTYPE_BYTES[name]


def kv_bytes_per_token(shape: ModelShape, kv_cache_dtype: str = "auto") -> int:
    """K and V, every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_dtype_bytes(shape, kv_cache_dtype)


# -------------------------------------------------------------- weight counting


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by kind, counted from the config's shapes."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    linear: int  # q/k/v/o and gate/up/down weight matrices: what weight quantization touches
    bias: int
    norm: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.linear + self.bias + self.norm


def count_params(shape: ModelShape) -> ParamCounts:
    """Llama/Qwen2-style decoder: embeddings, untied lm_head, attention, SwiGLU MLP, RMSNorms."""
    if shape.model_type not in _ESTIMABLE:
        raise PlanError(
            f"cannot count weights for model_type {shape.model_type or '?'} ({shape.architecture}) from config.json "
            f"(known: {', '.join(sorted(_ESTIMABLE))}); point --model at a directory with the safetensors files"
        )
    if shape.intermediate_size is None or shape.vocab_size is None:
        raise PlanError("config.json needs intermediate_size and vocab_size to estimate the weights")
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q_out = shape.num_attention_heads * shape.head_dim
    kv_out = shape.num_kv_heads * shape.head_dim
    attn = h * q_out + 2 * h * kv_out + q_out * h
    mlp = 3 * h * i
    bias = (q_out + 2 * kv_out) * shape.qkv_bias + h * shape.o_bias + (2 * i + h) * shape.mlp_bias
    norm = 2 * h + (2 * shape.head_dim if shape.qk_norm else 0)  # input and post-attention RMSNorm
    n = shape.num_layers
    return ParamCounts(
        embedding=v * h,
        lm_head=0 if shape.tie_word_embeddings else v * h,
        linear=n * (attn + mlp),
        bias=n * bias,
        norm=n * norm + h,  # + the final norm
    )


@dataclass(frozen=True)
class WeightEstimate:
    bytes: int
    params: int
    scheme: str
    assumption: str


def _quantized_linear_bytes(linear_params: int, q: Quantization, *, n_inputs_hint: int) -> int:
    """Packed weights + 16-bit scales + packed zero points, per group along the input dimension."""
    packed = linear_params * q.bits // 8
    groups = linear_params // q.group_size if q.group_size > 0 else linear_params // max(n_inputs_hint, 1)
    scales = groups * 2
    zeros = groups * q.bits // 8
    return packed + scales + zeros


def format_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def estimate_weights(shape: ModelShape, quantization: Quantization | None = None) -> WeightEstimate:
    """Bytes the weights take on the GPU, counted from the config's shapes.

    With no quantization, every parameter is stored in the runtime dtype. With
    AWQ/GPTQ, the linear layers are packed `bits`-wide with one 16-bit scale and
    one `bits`-wide zero point per group of `group_size` input channels;
    embeddings, lm_head, biases and norms stay 16-bit.
    """
    counts = count_params(shape)
    q = quantization if quantization is not None else shape.quantization
    if q is None:
        dtype = shape.runtime_dtype
        b = DTYPE_BYTES[dtype]
        return WeightEstimate(counts.total * b, counts.total, dtype, f"estimate from config.json shapes: {format_params(counts.total)} parameters x {b} B ({dtype})")
    other = counts.embedding + counts.lm_head + counts.bias + counts.norm
    if q.method in ("fp8", "fbgemm_fp8"):
        # One fp32 scale per output channel of every linear layer.
        q_out = shape.num_attention_heads * shape.head_dim
        kv_out = shape.num_kv_heads * shape.head_dim
        outputs_per_layer = q_out + 2 * kv_out + shape.hidden_size + 2 * shape.intermediate_size + shape.hidden_size
        linear_bytes = counts.linear + 4 * shape.num_layers * outputs_per_layer
        return WeightEstimate(linear_bytes + other * 2, counts.total, "fp8", "estimate: linear layers 1 B per weight + per-channel scales; embeddings, lm_head, norms 16-bit")
    if q.bits <= 0 or q.method not in ("awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors"):
        raise PlanError(f"cannot estimate weights quantized with {q.method} ({q.bits or '?'} bits); point --model at the safetensors files")
    linear_bytes = _quantized_linear_bytes(counts.linear, q, n_inputs_hint=shape.hidden_size)
    if q.method.startswith("gptq"):
        # GPTQ also stores g_idx: one int32 per input channel of every linear layer.
        per_layer_inputs = 4 * shape.hidden_size + shape.intermediate_size
        linear_bytes += 4 * per_layer_inputs * shape.num_layers
    return WeightEstimate(
        linear_bytes + other * 2,
        counts.total,
        f"{q.method}-int{q.bits}",
        f"estimate: linear layers {q.describe()} (packed weights + 16-bit scales + {q.bits}-bit zeros); "
        "embeddings, lm_head, biases and norms kept 16-bit",
    )


AWQ_INT4 = Quantization("awq", 4, 128)


# ------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Hardware:
    memory_bytes: int | None  # total device memory, as NVML/CUDA report it
    bandwidth_bytes_per_s: float | None  # decimal
    source: str = ""


@dataclass(frozen=True)
class Settings:
    gpu_memory_utilization: float = 0.90
    max_model_len: int = 4096
    max_num_seqs: int = 16
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # exact KV memory, as vLLM's flag
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enforce_eager: bool = False
    overhead_bytes: int | None = None  # replaces the activation + overhead estimate


class OverheadPart(StrEnum):
    """The parts of vLLM's profile run that plan assumes rather than measures."""

    ACTIVATIONS = "activations"
    NON_TORCH = "non-torch"
    CUDA_GRAPHS = "CUDA graphs"


@dataclass(frozen=True)
class Assumption:
    """One assumed part: the low and high ends that bound it, the point figure between, and why."""

    part: OverheadPart
    low_bytes: int
    point_bytes: int
    high_bytes: int
    reason: str


@dataclass(frozen=True)
class Overhead:
    """Memory inside the gpu_memory_utilization budget that is neither weights nor KV."""

    activation_bytes: int
    runtime_bytes: int
    cuda_graph_bytes: int
    description: str
    overridden: bool = False
    assumptions: tuple[Assumption, ...] = ()  # none when the overhead was given

    @property
    def total(self) -> int:
        return self.activation_bytes + self.runtime_bytes + self.cuda_graph_bytes

    @property
    def low_total(self) -> int:
        """Every assumed part at its low end: the most KV memory."""
        return self.total + sum(a.low_bytes - a.point_bytes for a in self.assumptions)

    @property
    def high_total(self) -> int:
        """Every assumed part at its high end: the least KV memory."""
        return self.total + sum(a.high_bytes - a.point_bytes for a in self.assumptions)


# What the profile run measures and plan cannot, each part as low / point / high:
# the point figures are plan's single estimate, the ends what vLLM has been seen
# to charge. Each reason is printed beside its part.
NON_TORCH_LOW_BYTES, RUNTIME_OVERHEAD_BYTES, NON_TORCH_HIGH_BYTES = 128 * MIB, 512 * MIB, GIB
NON_TORCH_REASON = (
    "low: vLLM 0.11 charged 0.13 GiB (only what grew while it profiled); point: an Ampere CUDA context, "
    "~300-500 MiB; high: that context with cuBLAS workspaces and allocator slack, generously"
)
CUDA_GRAPH_LOW_BYTES, CUDA_GRAPH_BYTES, CUDA_GRAPH_HIGH_BYTES = 128 * MIB, 512 * MIB, 1536 * MIB
CUDA_GRAPH_REASON = (
    "vLLM >= 0.21 charges its estimate of the piecewise graphs: 0.13-0.36 GiB logged for 5-16 capture sizes; "
    "its linear extrapolation over up to 512 sizes overshoots"
)
# Copies of the dummy sampler run's fp32 logits (max_num_seqs x vocab) at the activation peak.
LOGITS_COPIES_LOW, LOGITS_COPIES_POINT, LOGITS_COPIES_HIGH = 1, 2, 10
ACTIVATION_REASON = (
    "max_num_batched_tokens x (3 x intermediate, + 6 x hidden but at the low end) and "
    f"{LOGITS_COPIES_LOW} / {LOGITS_COPIES_POINT} / {LOGITS_COPIES_HIGH} copies of the sampler's fp32 logits: "
    "vLLM 0.11's H100 peaks (8,192 tokens, 1,024 sequences) fit 7.6-9.2"
)


def estimate_overhead(shape: ModelShape, settings: Settings) -> Overhead:
    if settings.overhead_bytes is not None:
        return Overhead(settings.overhead_bytes, 0, 0, f"given: {settings.overhead_bytes / GIB:.2f} GiB", overridden=True)
    act = DTYPE_BYTES[shape.runtime_dtype]
    t = settings.max_num_batched_tokens
    mlp = t * 3 * (shape.intermediate_size or 4 * shape.hidden_size) * act
    forward = mlp + t * 6 * shape.hidden_size * act  # + residual, norms, attention in/out
    logits = settings.max_num_seqs * (shape.vocab_size or 0) * 4
    activations = forward + LOGITS_COPIES_POINT * logits
    eager = settings.enforce_eager
    graphs = 0 if eager else CUDA_GRAPH_BYTES
    desc = (
        f"estimate: activations {activations / GIB:.2f} GiB "
        f"({t} tokens x (3 x intermediate + 6 x hidden) x {act} B + {settings.max_num_seqs} x vocab fp32 logits "
        f"x {LOGITS_COPIES_POINT}), runtime {RUNTIME_OVERHEAD_BYTES / GIB:.2f} GiB (CUDA context, workspaces), "
        f"CUDA graphs {graphs / GIB:.2f} GiB" + (" (--enforce-eager)" if eager else "")
    )
    assumptions = (
        Assumption(
            OverheadPart.ACTIVATIONS, mlp + LOGITS_COPIES_LOW * logits, activations,
            forward + LOGITS_COPIES_HIGH * logits, ACTIVATION_REASON,
        ),
        Assumption(OverheadPart.NON_TORCH, NON_TORCH_LOW_BYTES, RUNTIME_OVERHEAD_BYTES, NON_TORCH_HIGH_BYTES, NON_TORCH_REASON),
        Assumption(OverheadPart.CUDA_GRAPHS, 0, 0, 0, "none: --enforce-eager")
        if eager
        else Assumption(OverheadPart.CUDA_GRAPHS, CUDA_GRAPH_LOW_BYTES, graphs, CUDA_GRAPH_HIGH_BYTES, CUDA_GRAPH_REASON),
    )  # fmt: skip
    return Overhead(activations, RUNTIME_OVERHEAD_BYTES, graphs, desc, assumptions=assumptions)


class KvBasis(StrEnum):
    """How the KV figure was reached: only the first is exact."""

    EXACT = "exact"  # --kv-cache-memory-bytes: blocks = bytes // block bytes
    ESTIMATE = "estimate"  # assumed overhead: a range from its low and high ends
    GIVEN_OVERHEAD = "estimate from the given overhead"  # --overhead-gib: one figure, as good as the figure given


@dataclass(frozen=True)
class Capacity:
    """KV capacity for one weight size."""

    scheme: str
    weight_bytes: int
    weight_source: str  # "measured: ..." or "estimate: ..."
    kv_memory_bytes: int
    kv_memory_source: str
    num_blocks: int
    tokens: int  # num_blocks x block_size
    kv_cache_size_tokens: int  # vLLM's figure, from max concurrency x max_model_len
    max_concurrency: float  # requests of max_model_len tokens at once
    tpot_floor_s: float | None
    basis: KvBasis
    num_blocks_low: int  # every assumed overhead part at its high end; num_blocks when nothing is assumed
    num_blocks_high: int  # every assumed overhead part at its low end


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    settings: Settings
    hardware: Hardware
    kv_bytes_per_token: int
    block_bytes: int
    budget_bytes: int | None  # total x gpu_memory_utilization
    overhead: Overhead
    primary: Capacity
    alternatives: tuple[Capacity, ...] = field(default=())


def blocks_for(kv_memory_bytes: int, block_bytes: int) -> int:
    return max(kv_memory_bytes, 0) // block_bytes


def kv_cache_size_tokens(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """vLLM's `kv_cache_size_tokens`: int(num_blocks / ceil(len / block) x len), kept exact."""
    per_request_blocks = -(-max_model_len // block_size)
    return math.floor(Fraction(num_blocks, per_request_blocks) * max_model_len)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    return num_blocks / -(-max_model_len // block_size)


def tpot_floor_s(weight_bytes: int, bandwidth_bytes_per_s: float | None) -> float | None:
    """Each decode step reads every weight once: bytes / bandwidth is the best possible TPOT."""
    if not bandwidth_bytes_per_s or weight_bytes <= 0:
        return None
    return weight_bytes / bandwidth_bytes_per_s


def _capacity(scheme, weight_bytes, weight_source, settings, hardware, overhead, block_bytes) -> Capacity:
    if settings.kv_cache_memory_bytes is not None:
        kv = settings.kv_cache_memory_bytes
        kv_source = "exact: --kv-cache-memory-bytes"
        basis, kv_low, kv_high = KvBasis.EXACT, kv, kv
    else:
        if hardware.memory_bytes is None:
            raise PlanError("GPU memory size unknown: give --gpu-memory-gib or --kv-cache-memory-bytes")
        budget = int(hardware.memory_bytes * settings.gpu_memory_utilization)
        kv = budget - weight_bytes - overhead.total
        kv_source = (
            f"estimate: {hardware.memory_bytes / GIB:.2f} GiB x {settings.gpu_memory_utilization:g} "
            f"- weights - activations/overhead ({overhead.total / GIB:.2f} GiB)"
        )
        basis = KvBasis.GIVEN_OVERHEAD if overhead.overridden else KvBasis.ESTIMATE
        kv_low = kv - (overhead.high_total - overhead.total)
        kv_high = kv + (overhead.total - overhead.low_total)
    blocks = blocks_for(kv, block_bytes)
    return Capacity(
        scheme=scheme,
        weight_bytes=weight_bytes,
        weight_source=weight_source,
        kv_memory_bytes=kv,
        kv_memory_source=kv_source,
        num_blocks=blocks,
        tokens=blocks * settings.block_size,
        kv_cache_size_tokens=kv_cache_size_tokens(blocks, settings.block_size, settings.max_model_len),
        max_concurrency=max_concurrency(blocks, settings.block_size, settings.max_model_len),
        tpot_floor_s=tpot_floor_s(weight_bytes, hardware.bandwidth_bytes_per_s),
        basis=basis,
        num_blocks_low=blocks_for(kv_low, block_bytes),
        num_blocks_high=blocks_for(kv_high, block_bytes),
    )


def make_plan(
    shape: ModelShape,
    settings: Settings,
    hardware: Hardware,
    *,
    measured_weight_bytes: int | None = None,
    measured_source: str = "measured: safetensors headers",
    compare_awq: bool = True,
) -> Plan:
    """The plan for `shape` on `hardware`; with measured weights when given, else estimated."""
    if settings.block_size <= 0:
        raise PlanError(f"block size {settings.block_size} must be positive")
    if settings.max_model_len <= 0:
        raise PlanError(f"max_model_len {settings.max_model_len} must be positive")
    if not 0 < settings.gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization {settings.gpu_memory_utilization} must be in (0, 1]")
    if settings.kv_cache_memory_bytes is not None and settings.kv_cache_memory_bytes <= 0:
        raise PlanError("--kv-cache-memory-bytes must be positive")
    per_token = kv_bytes_per_token(shape, settings.kv_cache_dtype)
    block_bytes = per_token * settings.block_size
    overhead = estimate_overhead(shape, settings)
    if measured_weight_bytes:
        scheme = shape.quantization.describe() if shape.quantization else shape.runtime_dtype
        weight_bytes, source = measured_weight_bytes, measured_source
    else:
        est = estimate_weights(shape)
        scheme, weight_bytes, source = est.scheme, est.bytes, est.assumption
    primary = _capacity(scheme, weight_bytes, source, settings, hardware, overhead, block_bytes)
    alternatives: list[Capacity] = []
    if compare_awq and shape.quantization is None and shape.model_type in _ESTIMABLE:
        try:
            awq = estimate_weights(shape, AWQ_INT4)
        except PlanError:
            awq = None
        if awq is not None:
            alternatives.append(_capacity(awq.scheme, awq.bytes, awq.assumption, settings, hardware, overhead, block_bytes))
    budget = int(hardware.memory_bytes * settings.gpu_memory_utilization) if hardware.memory_bytes else None
    return Plan(shape, settings, hardware, per_token, block_bytes, budget, overhead, primary, tuple(alternatives))
