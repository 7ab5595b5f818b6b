"""parse(): /metrics text in, MetricsSample out, on real vLLM captures and on bad input."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from r3090d.core.snapshot import MetricsSample
from r3090d.probes import engine
from r3090d.probes.engine import parse

DATA = Path(__file__).resolve().parent.parent / "data"
IDLE = (DATA / "vllm-0.32-metrics-idle.txt").read_text()
KV_FULL = (DATA / "vllm-0.32-metrics-kv-full.txt").read_text()
MODEL = "tiny"  # the model_name label in both captures


def full_parse_value(text: str, sample_name: str, model: str = MODEL) -> float:
    """The same number read the slow way: a full prometheus_client parse."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name and sample.labels.get("model_name") == model:
                return sample.value
    raise LookupError(sample_name)


def full_parse_cache_config(text: str) -> dict[str, str]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return sample.labels
    raise LookupError("vllm:cache_config_info")


# ------------------------------------------------------------ real captures


def test_idle_capture():
    sample = parse(IDLE, MODEL)
    assert sample.error is None
    assert sample.kv_usage == 0.0
    assert sample.num_gpu_blocks == 32768
    assert sample.free_blocks == 32767
    assert sample.block_size == 128
    assert sample.kv_cache_size_tokens == 4194304
    assert sample.running == 0 and sample.waiting == 0 and sample.preemptions_total == 0


def test_kv_full_capture():
    sample = parse(KV_FULL, MODEL)
    assert sample.error is None
    assert sample.kv_usage == 1.0
    assert sample.free_blocks == 0
    assert sample.preemptions_total == 2
    assert sample.num_gpu_blocks == 8
    assert sample.running == 2 and sample.waiting == 3


@pytest.mark.parametrize("text", [IDLE, KV_FULL], ids=["idle", "kv-full"])
def test_agrees_with_a_full_prometheus_client_parse(text):
    sample = parse(text, MODEL)
    assert sample.kv_usage == full_parse_value(text, "vllm:kv_cache_usage_perc")
    assert sample.running == full_parse_value(text, "vllm:num_requests_running")
    assert sample.waiting == full_parse_value(text, "vllm:num_requests_waiting")
    assert sample.preemptions_total == full_parse_value(text, "vllm:num_preemptions_total")
    assert sample.generation_tokens_total == full_parse_value(text, "vllm:generation_tokens_total")
    assert sample.prompt_tokens_total == full_parse_value(text, "vllm:prompt_tokens_total")
    assert sample.itl_sum == full_parse_value(text, "vllm:inter_token_latency_seconds_sum")
    assert sample.itl_count == full_parse_value(text, "vllm:inter_token_latency_seconds_count")
    config = full_parse_cache_config(text)
    assert sample.cache_config == tuple(sorted(config.items()))
    assert sample.num_gpu_blocks == int(config["num_gpu_blocks"])
    assert sample.free_blocks == (int(config["num_gpu_blocks"]) - 1) * (1 - sample.kv_usage)


def test_cache_config_keeps_every_label_sorted():
    sample = parse(KV_FULL, MODEL)
    keys = [key for key, _ in sample.cache_config]
    assert keys == sorted(keys)
    assert {"num_gpu_blocks", "block_size", "kv_cache_size_tokens", "gpu_memory_utilization"} <= set(keys)
    assert dict(sample.cache_config)["num_gpu_blocks_override"] == "8"


def test_counters_keep_their_total_suffix():
    # prometheus_client names a counter family without _total; make sure that did not hide them.
    sample = parse(KV_FULL, MODEL)
    assert sample.generation_tokens_total == 1638
    assert sample.prompt_tokens_total == 26


def test_look_alike_families_are_not_counted():
    # vllm:num_requests_waiting_by_reason shares a prefix with vllm:num_requests_waiting.
    text = KV_FULL.replace(
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 3.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 99.0',
    )
    assert text != KV_FULL
    assert parse(text, MODEL).waiting == 3


# ------------------------------------------------------------- model names


def test_empty_model_name_takes_the_single_model():
    assert parse(KV_FULL, "") == parse(KV_FULL, MODEL)


def test_other_model_name_is_an_error_naming_what_is_there():
    sample = parse(KV_FULL, "Qwen/Qwen2.5-7B-Instruct")
    assert sample.error is not None
    assert "'Qwen/Qwen2.5-7B-Instruct'" in sample.error and "'tiny'" in sample.error
    assert sample.kv_usage is None and sample.free_blocks is None


def two_models_text(first: str, second: str) -> str:
    return (
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{first}"}} 0.25\n'
        f'vllm:kv_cache_usage_perc{{engine="1",model_name="{second}"}} 0.75\n'
        f'vllm:num_requests_running{{engine="0",model_name="{first}"}} 1.0\n'
        f'vllm:num_requests_running{{engine="1",model_name="{second}"}} 5.0\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="201"} 1.0\n'
    )


def test_two_models_each_read_on_its_own():
    text = two_models_text("alpha", "beta")
    alpha, beta = parse(text, "alpha"), parse(text, "beta")
    assert (alpha.kv_usage, alpha.running, alpha.num_gpu_blocks, alpha.free_blocks) == (0.25, 1, 101, 75)
    assert (beta.kv_usage, beta.running, beta.num_gpu_blocks, beta.free_blocks) == (0.75, 5, 201, 50)


def test_two_models_and_no_name_is_an_error():
    sample = parse(two_models_text("alpha", "beta"), "")
    assert sample.error is not None and "several models" in sample.error


def test_engines_of_one_model_are_summed_and_the_fullest_kv_reported():
    text = two_models_text("alpha", "alpha")
    sample = parse(text, "alpha")
    assert sample.error is None
    assert sample.running == 6
    assert sample.kv_usage == 0.75


def test_label_escaping_is_honoured():
    served = 'org/my "model"}, x\\y'
    escaped = served.replace("\\", "\\\\").replace('"', '\\"')
    # An escaped newline inside a label value is not a line start: the decoy must not be read.
    decoy = '\\nvllm:kv_cache_usage_perc{engine=\\"0\\",model_name=\\"tiny\\"} 0.9'
    text = (
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{escaped}"}} 0.5\n'
        f'vllm:num_requests_running{{engine="0",model_name="{escaped}",note="{decoy}"}} 4.0\n'
        f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="11",odd="a}}b,c=\\"d\\""}} 1.0\n'
    )
    sample = parse(text, served)
    assert sample.error is None, sample.error
    assert sample.kv_usage == 0.5 and sample.running == 4
    assert sample.free_blocks == 5
    assert dict(sample.cache_config)["odd"] == 'a}b,c="d"'
    assert parse(text, "tiny").error is not None


# ------------------------------------------------------- older vLLM names


V011_TEXT = """\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.375
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 4.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 12345.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 678.0
# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{engine="0",le="0.01",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0
vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 40.0
vllm:time_per_output_token_seconds_count{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 40.0
vllm:time_per_output_token_seconds_sum{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.8
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="5306"} 1.0
"""


def test_pre_012_names_are_read():
    sample = parse(V011_TEXT, "Qwen/Qwen2.5-7B-Instruct")
    assert sample.error is None
    assert sample.kv_usage == 0.375
    assert sample.num_gpu_blocks == 5306 and sample.block_size == 16
    assert sample.free_blocks == 5305 * (1 - 0.375)
    assert sample.kv_cache_size_tokens is None  # not exported before 0.32-era vLLM
    assert (sample.running, sample.waiting, sample.preemptions_total) == (7, 1, 4)
    assert (sample.generation_tokens_total, sample.prompt_tokens_total) == (12345, 678)
    assert (sample.itl_sum, sample.itl_count) == (0.8, 40)


def test_current_name_wins_when_both_are_exported():
    # vLLM 0.9 and 0.10 exported both KV usage names.
    both = V011_TEXT + 'vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.5\n'
    assert parse(both, "Qwen/Qwen2.5-7B-Instruct").kv_usage == 0.5


# -------------------------------------------------------------- bad input


def test_missing_kv_gauge_is_flagged_but_the_rest_is_kept():
    text = "".join(
        line + "\n" for line in KV_FULL.splitlines() if not line.startswith("vllm:kv_cache_usage_perc")
    )
    sample = parse(text, MODEL)
    assert sample.error is not None and "KV-cache usage" in sample.error
    assert sample.kv_usage is None and sample.free_blocks is None
    assert sample.running == 2 and sample.num_gpu_blocks == 8


def test_nan_kv_usage_is_not_a_number_we_use():
    text = KV_FULL.replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 1.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} NaN',
    )
    assert text != KV_FULL
    sample = parse(text, MODEL)
    assert sample.kv_usage is None and sample.error is not None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("  \n\n", "empty"),
        (KV_FULL[: len(KV_FULL) // 2], "truncated"),
        (KV_FULL.rstrip("\n"), "truncated"),
        ("hello world\n", "no vllm: metrics"),
        ("\x00\xff\ufffd garbage \u2028 more\n", "no vllm: metrics"),
        ('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} abc\n', "malformed"),
        ('vllm:kv_cache_usage_perc{engine="0",model_name="tiny" 1.0\n', "malformed"),
        ('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 1_0\n', "malformed"),
        ('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}\n', "malformed"),
        ('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 1 2 3\n', "malformed"),
        ("vllm:some_other_metric 1\n", "none of the watched"),
        ('vllm:cache_config_info{engine="0",num_gpu_blocks="8"} 1.0\n', "no per-model"),
        (None, "not str"),
        (b"vllm:kv_cache_usage_perc 1\n", "not str"),
    ],
    ids=[
        "empty",
        "blank",
        "cut-mid-line",
        "no-final-newline",
        "not-prometheus",
        "binary-ish",
        "bad-value",
        "unclosed-block",
        "underscore-value",
        "no-value",
        "extra-fields",
        "no-watched-family",
        "config-only",
        "none",
        "bytes",
    ],
)
def test_bad_input_gives_an_error_sample(text, reason):
    sample = parse(text, MODEL)
    assert isinstance(sample, MetricsSample)
    assert sample.error is not None and reason in sample.error, sample.error
    assert sample.kv_usage is None and sample.free_blocks is None


def test_unquoted_label_value_is_an_error():
    # How it is reported depends on the prometheus_client version; that it is, does not.
    sample = parse('vllm:kv_cache_usage_perc{engine=0,model_name="tiny"} 1\n', MODEL)
    assert sample.error is not None and sample.kv_usage is None


def test_oversized_input_is_refused():
    text = KV_FULL * (10 * 1024 * 1024 // len(KV_FULL) + 1)
    assert len(text) > 10 * 1024 * 1024
    sample = parse(text, MODEL)
    assert sample.error is not None and "too large" in sample.error


def test_an_internal_failure_becomes_an_error_sample(monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "_build_sample", explode)
    sample = parse(KV_FULL, MODEL)
    assert sample.error is not None and "RuntimeError: boom" in sample.error


# Pieces that reach the deeper paths: wanted names, label blocks, values.
NAMES = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:num_requests_running",
    "vllm:num_preemptions_total",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:num_requests_waiting_by_reason",
    "# HELP vllm:kv_cache_usage_perc",
    "# TYPE vllm:kv_cache_usage_perc",
]
BLOCKS = [
    '{engine="0",model_name="tiny"}',
    '{engine="1",model_name="tiny"}',
    '{model_name="x"}',
    '{block_size="16",engine="0",num_gpu_blocks="8"}',
    '{num_gpu_blocks="x"}',
    "{}",
    "",
    '{model_name="ti\\"ny}"}',
    '{model_name="tiny"',
    '{=""}',
]
VALUES = [
    " 1.0",
    " 0.5",
    " NaN",
    " -Inf",
    " +Inf",
    " 1e308",
    " -3",
    " 1_0",
    " 1.0 1700000000",
    " x",
    "",
    " 1 2 3",
]
PIECES = ["{", "}", '"', "\\", " ", "\t", "\r", "=", ","]

structured_line = st.tuples(
    st.sampled_from(NAMES), st.sampled_from(BLOCKS) | st.text(max_size=12), st.sampled_from(VALUES)
).map("".join)
noisy_line = st.lists(
    st.sampled_from(NAMES + BLOCKS + VALUES + PIECES) | st.text(max_size=6), max_size=8
).map("".join)
metric_like_text = st.lists(structured_line | noisy_line, max_size=12).map(
    lambda lines: "".join(line + "\n" for line in lines)
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_random_text_never_raises(text):
    sample = parse(text, MODEL)
    assert isinstance(sample, MetricsSample)
    assert "metrics parse failed" not in (sample.error or ""), sample.error


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metric_like_text | st.text(), st.sampled_from([MODEL, "", "x"]))
def test_metric_like_text_never_raises(text, model):
    sample = parse(text, model)
    assert isinstance(sample, MetricsSample)
    # Bad text is handled on purpose; the catch-all at the boundary is only a safety net.
    assert "metrics parse failed" not in (sample.error or ""), sample.error
    if sample.error is None:
        # A sample without an error always has the KV figure the watchdog needs.
        assert sample.kv_usage is not None
        if sample.num_gpu_blocks is not None:
            assert sample.free_blocks is not None and sample.free_blocks >= 0


# ------------------------------------------- data-parallel engines of unequal size


def engine_lines(
    engine_label: str, blocks: int | None, usage: float, running: int = 0, model: str = MODEL
) -> str:
    text = (
        f'vllm:kv_cache_usage_perc{{engine="{engine_label}",model_name="{model}"}} {usage!r}\n'
        f'vllm:num_requests_running{{engine="{engine_label}",model_name="{model}"}} {running}\n'
    )
    if blocks is not None:
        text += f'vllm:cache_config_info{{block_size="16",engine="{engine_label}",num_gpu_blocks="{blocks}"}} 1.0\n'
    return text


def test_unequal_engines_report_the_one_with_the_fewest_free_blocks():
    sample = parse(engine_lines("0", 100, 0.5, running=3) + engine_lines("1", 50, 0.5, running=4), MODEL)
    assert sample.error is None
    assert sample.engines == 2
    assert sample.free_blocks == 49 * 0.5  # engine 1: 24.5 free, engine 0: 49.5
    assert sample.num_gpu_blocks == 50  # the block figures are the reported engine's
    assert dict(sample.cache_config)["engine"] == "1"
    assert sample.kv_usage == 0.5 and sample.running == 7


def test_the_fullest_engine_need_not_be_the_one_with_the_fewest_free_blocks():
    sample = parse(engine_lines("0", 100, 0.6) + engine_lines("1", 50, 0.5), MODEL)
    assert sample.kv_usage == 0.6  # engine 0 is fuller ...
    assert sample.free_blocks == 49 * 0.5  # ... but engine 1, the smaller, has fewer free blocks
    assert sample.num_gpu_blocks == 50


def test_an_engine_without_its_own_cache_config_takes_the_shared_one():
    text = (
        engine_lines("0", None, 0.5)
        + engine_lines("1", 50, 0.0)
        + 'vllm:cache_config_info{block_size="16",num_gpu_blocks="21"} 1.0\n'
    )
    sample = parse(text, MODEL)
    assert sample.free_blocks == 10  # engine 0 on the block without an engine label: 20 x 0.5
    assert sample.num_gpu_blocks == 21


def test_several_engines_without_block_counts_report_the_fullest():
    sample = parse(engine_lines("0", None, 0.25) + engine_lines("1", None, 0.75), MODEL)
    assert sample.error is None
    assert sample.kv_usage == 0.75 and sample.free_blocks is None and sample.num_gpu_blocks is None


# -------------------------------------------------------------- repeated series


def test_a_repeated_series_counts_once():
    line = 'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\n'
    text = KV_FULL + line
    assert parse(text, MODEL).running == 2


def test_a_repeated_series_takes_its_last_value():
    later = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25\n'
    sample = parse(KV_FULL + later, MODEL)
    assert sample.kv_usage == 0.25
    assert sample.free_blocks == 7 * 0.75


def test_a_repeated_series_is_the_same_whatever_its_label_order():
    text = KV_FULL + 'vllm:num_requests_waiting{model_name="tiny",engine="0"} 5.0\n'
    assert parse(text, MODEL).waiting == 5


# -------------------------------------------------------------- oversized lines

PAD = "a" * (engine.MAX_LINE_CHARS + 1)


def test_an_oversized_label_drops_that_series_alone():
    text = KV_FULL + f'vllm:num_requests_running{{engine="1",model_name="tiny",note="{PAD}"}} 40.0\n'
    sample = parse(text, MODEL)
    assert sample.error is None
    assert sample.running == 2 and sample.engines == 1
    assert sample.kv_usage == 1.0 and sample.preemptions_total == 2


def test_an_oversized_malformed_line_is_skipped_not_an_error():
    text = f'vllm:num_requests_running{{engine="1",model_name="tiny",note="{PAD}\\"}} x\n' + KV_FULL
    sample = parse(text, MODEL)
    assert sample.error is None and sample.running == 2


def test_an_oversized_label_full_of_escapes_is_not_parsed(monkeypatch):
    # prometheus_client's time on a block of escapes grows with the square of its
    # length (seconds at 1 MB): a block over the limit must never reach it.
    block = '{engine="1",model_name="tiny",note="' + '\\"' * (engine.MAX_LINE_CHARS // 2 + 1) + '"}'
    seen: list[int] = []
    real = engine._parse_label_block

    def spy(text: str):
        seen.append(len(text))
        return real(text)

    monkeypatch.setattr(engine, "_parse_label_block", spy)
    sample = parse(KV_FULL + "vllm:num_requests_running" + block + " 40.0\n", MODEL)
    assert sample.running == 2
    assert seen and max(seen) < engine.MAX_LINE_CHARS


def test_an_oversized_kv_gauge_leaves_the_kv_rules_blind_but_the_rest_readable():
    text = KV_FULL.replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 1.0',
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny",note="{PAD}"}} 1.0',
    )
    assert text != KV_FULL
    sample = parse(text, MODEL)
    assert sample.error is not None and "KV-cache usage" in sample.error
    assert sample.running == 2 and sample.num_gpu_blocks == 8


def test_a_line_at_the_limit_is_read():
    head = 'vllm:num_requests_running{engine="1",model_name="tiny",note="'
    tail = '"} 40.0'
    line = head + "a" * (engine.MAX_LINE_CHARS - len(head) - len(tail)) + tail
    assert len(line) == engine.MAX_LINE_CHARS
    assert parse(KV_FULL + line + "\n", MODEL).running == 42


# ------------------------------------------- property: engines, repeats, oversized


@dataclass(frozen=True)
class Line:
    """One sample line as the generator writes it, and what the reference needs of it."""

    name: str
    engine: str
    value: float
    oversized: bool = False
    flipped: bool = False  # labels written in another order: still the same series

    def text(self) -> str:
        pair = [f'engine="{self.engine}"', f'model_name="{MODEL}"']
        labels = ",".join(reversed(pair) if self.flipped else pair)
        if self.oversized:
            labels += f',note="{PAD}"'
        return f"{self.name}{{{labels}}} {self.value!r}\n"


@dataclass(frozen=True)
class Engine:
    label: str
    blocks: int
    usage: float
    running: int
    waiting: int


def config_line(e: Engine) -> str:
    return f'vllm:cache_config_info{{block_size="16",engine="{e.label}",num_gpu_blocks="{e.blocks}"}} 1.0\n'


def reference(engines: list[Engine], lines: list[Line]) -> dict[str, float | int | None]:
    """What parse() must say, worked out the plain way: last value of each series, then per engine."""
    last: dict[tuple[str, str], float] = {}
    for line in lines:
        if not line.oversized:
            last[(line.name, line.engine)] = line.value
    blocks = {e.label: e.blocks for e in engines}
    usage = {eng: v for (name, eng), v in last.items() if name == "vllm:kv_cache_usage_perc"}
    free = {eng: (blocks[eng] - 1) * (1 - min(max(u, 0.0), 1.0)) for eng, u in usage.items()}
    fewest = min(free, key=lambda eng: (free[eng], -usage[eng], eng)) if free else None
    return {
        "free_blocks": free[fewest] if fewest is not None else None,
        "num_gpu_blocks": blocks[fewest] if fewest is not None else None,
        "kv_usage": max(usage.values()) if usage else None,
        "running": sum(v for (name, _), v in last.items() if name == "vllm:num_requests_running"),
        "waiting": sum(v for (name, _), v in last.items() if name == "vllm:num_requests_waiting"),
        "engines": len({eng for _, eng in last}),
    }


usage_value = st.floats(min_value=0.0, max_value=1.0)
engine_spec = st.builds(
    Engine,
    label=st.just(""),
    blocks=st.integers(min_value=2, max_value=200_000),
    usage=usage_value,
    running=st.integers(min_value=0, max_value=64),
    waiting=st.integers(min_value=0, max_value=64),
)


@st.composite
def data_parallel_metrics(draw) -> tuple[list[Engine], list[Line], str]:
    specs = draw(st.lists(engine_spec, min_size=1, max_size=6))
    engines = [Engine(str(i), e.blocks, e.usage, e.running, e.waiting) for i, e in enumerate(specs)]
    lines = [
        Line(name, e.label, value)
        for e in engines
        for name, value in (
            ("vllm:kv_cache_usage_perc", e.usage),
            ("vllm:num_requests_running", float(e.running)),
            ("vllm:num_requests_waiting", float(e.waiting)),
        )
    ]
    # Repeats of a series, with another value, sometimes with the labels in another order.
    for index, value, flipped in draw(
        st.lists(st.tuples(st.integers(0, len(lines) - 1), usage_value, st.booleans()), max_size=6)
    ):
        line = lines[index]
        value = value if "usage" in line.name else float(round(value * 64))
        lines.append(Line(line.name, line.engine, value, flipped=flipped))
    # Oversized lines that would change every answer if they were read.
    for name, engine_label in draw(
        st.lists(
            st.tuples(
                st.sampled_from(["vllm:kv_cache_usage_perc", "vllm:num_requests_running"]),
                st.sampled_from([e.label for e in engines] + ["99"]),
            ),
            max_size=3,
        )
    ):
        lines.append(Line(name, engine_label, 1.0 if "usage" in name else 1000.0, oversized=True))
    lines = draw(st.permutations(lines))
    # Engine 99 exists only in oversized lines; its 2 blocks would be the fewest free if they were read.
    configs = "".join(config_line(e) for e in engines) + config_line(Engine("99", 2, 0, 0, 0))
    return engines, lines, configs + "".join(line.text() for line in lines)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data_parallel_metrics())
def test_data_parallel_engines_against_a_reference(case):
    engines, lines, text = case
    sample = parse(text, MODEL)
    assert sample.error is None, sample.error
    expected = reference(engines, lines)
    assert sample.engines == expected["engines"]
    assert sample.kv_usage == expected["kv_usage"]
    assert sample.free_blocks == pytest.approx(expected["free_blocks"], rel=1e-12, abs=1e-9)
    assert sample.num_gpu_blocks == expected["num_gpu_blocks"]
    assert dict(sample.cache_config)["num_gpu_blocks"] == str(expected["num_gpu_blocks"])
    assert sample.running == expected["running"] and sample.waiting == expected["waiting"]


def test_served_counts_completed_requests_not_aborted_or_failed_ones():
    """vllm:request_success_total in stop, length and repetition says the engine served; abort and error do not."""
    text = IDLE
    for reason, n in (("stop", 7), ("length", 3), ("repetition", 1), ("abort", 50), ("error", 9)):
        old = f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="tiny"}} 0.0'
        assert old in text
        text = text.replace(old, old.replace(" 0.0", f" {n}.0"))
    assert parse(IDLE, "tiny").served_total == 0.0
    assert parse(text, "tiny").served_total == 11.0
    only_aborts = IDLE.replace('finished_reason="abort",model_name="tiny"} 0.0', 'finished_reason="abort",model_name="tiny"} 4.0')
    assert parse(only_aborts, "tiny").served_total == 0.0
