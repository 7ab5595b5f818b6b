"""Prometheus text in the shape vLLM 0.32 writes it (see shared/reference/*.txt).

vLLM runs prometheus_client in multiprocess mode, which is why counters carry
their `_total` name in HELP/TYPE and `_created` comes as a separate gauge.
Everything here is pure: values in, text out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# Qwen2.5-7B in bf16: 2 x 28 layers x 4 KV heads x 128 head_dim x 2 bytes.
KV_BYTES_PER_TOKEN = 57344


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float, times: int = 1) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += times
        self.count += times
        self.total += value * times


@dataclass(frozen=True)
class EngineValues:
    running: int
    waiting: int
    kv_cache_usage_perc: float
    preemptions: int
    prompt_tokens: int
    generation_tokens: int


def go_float(value: float) -> str:
    """A number as prometheus_client writes it (Go's formatting: 1.0, 2.5e+09, +Inf)."""
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    if "e" not in text and abs(value) >= 1e6:
        mantissa, exponent = f"{value:.16e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
        return f"{mantissa}e{exponent[0]}{int(exponent[1:]):02d}"
    return text


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items())) + "}"


class _Writer:
    def __init__(self, base: dict[str, str], created: float):
        self.base = base
        self.created = created
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]], *, name_suffix: str = ""):
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for extra, value in samples:
            self.lines.append(f"{name}{name_suffix}{_labels({**self.base, **extra})} {go_float(value)}")

    def created_family(self, stem: str, help_text: str, label_sets: list[dict[str, str]]):
        self.family(f"{stem}_created", "gauge", help_text, [(extra, self.created) for extra in label_sets])

    def counter(self, stem: str, help_text: str, samples: list[tuple[dict[str, str], float]]):
        self.family(f"{stem}_total", "counter", help_text, samples)
        self.created_family(stem, help_text, [extra for extra, _ in samples])

    def histogram(self, name: str, help_text: str, hist: Histogram):
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        for upper, count in zip(hist.buckets, hist.counts, strict=True):
            self.lines.append(f"{name}_bucket{_labels({**self.base, 'le': go_float(upper)})} {go_float(count)}")
        self.lines.append(f"{name}_bucket{_labels({**self.base, 'le': '+Inf'})} {go_float(hist.count)}")
        self.lines.append(f"{name}_count{_labels(self.base)} {go_float(hist.count)}")
        self.lines.append(f"{name}_sum{_labels(self.base)} {go_float(hist.total)}")
        self.created_family(name, help_text, [{}])


def cache_config_labels(*, num_gpu_blocks: int, block_size: int, gpu_memory_utilization: float, max_model_len: int,
                        enable_prefix_caching: bool, num_gpu_blocks_override: int | None,
                        user_specified_block_size: bool) -> dict[str, str]:  # fmt: skip
    size_tokens = num_gpu_blocks * block_size
    return {
        "_block_size_resolved": "True",
        "block_size": str(block_size),
        "cache_dtype": "auto",
        "effective_attention_block_size": str(block_size),
        "enable_prefix_caching": str(enable_prefix_caching),
        "gpu_memory_utilization": str(gpu_memory_utilization),
        "is_attention_free": "False",
        "kv_cache_max_concurrency": str(size_tokens / max_model_len),
        "kv_cache_memory_bytes": str(size_tokens * KV_BYTES_PER_TOKEN),
        "kv_cache_size_tokens": str(size_tokens),
        "kv_offloading_backend": "native",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(num_gpu_blocks_override),
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        "user_specified_block_size": str(user_specified_block_size),
    }


def render(*, model_name: str, values: EngineValues, success: dict[str, int], ttft: Histogram, itl: Histogram,
           e2e: Histogram, cache_labels: dict[str, str], created: float, process_start: float) -> str:  # fmt: skip
    out = _Writer({"engine": "0", "model_name": model_name}, created)
    out.lines += [
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {go_float(process_start)}",
    ]
    out.family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", [({}, values.running)])
    out.family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", [({}, values.waiting)])
    out.family(
        "vllm:num_requests_waiting_by_reason",
        "gauge",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
        "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
        "Sum of all reasons equals vllm:num_requests_waiting.",
        [({"reason": "capacity"}, values.waiting), ({"reason": "deferred"}, 0)],
    )
    out.family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [({}, values.kv_cache_usage_perc)])
    out.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", [({}, values.preemptions)])
    out.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [({}, values.prompt_tokens)])
    out.counter("vllm:generation_tokens", "Number of generation tokens processed.", [({}, values.generation_tokens)])
    out.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [({"finished_reason": r}, success.get(r, 0)) for r in FINISH_REASONS],
    )
    out.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft)
    out.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl)
    out.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e2e)
    out.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(cache_labels, 1.0)])
    return "\n".join(out.lines) + "\n"
