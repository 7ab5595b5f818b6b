"""KV cache and weight arithmetic on Qwen2.5-7B's published config and on small hand-checked shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r3090d import cards
from r3090d.measure import plan, plancheck
from r3090d.measure.plan import GB, GIB, Hardware, KvBasis, OverheadPart, PlanError, Settings

DATA = Path(__file__).resolve().parent.parent / "data"
QWEN = json.loads((DATA / "qwen2.5-7b-config.json").read_text())
RTX3090 = Hardware(memory_bytes=24576 * 2**20, bandwidth_bytes_per_s=936 * GB)


@pytest.fixture
def qwen():
    return plan.shape_from_config(QWEN)


def test_qwen_kv_bytes_per_token(qwen):
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim) == (28, 4, 128)
    assert plan.kv_bytes_per_token(qwen) == 57_344
    assert plan.kv_bytes_per_token(qwen, "fp8") == 28_672


def test_qwen_parameter_count_itemized(qwen):
    h, i, v, layers = 3584, 18944, 152064, 28
    q, kv = 28 * 128, 4 * 128
    per_layer = (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * i + 2 * h  # q/k/v with bias, o, MLP, 2 norms
    expected = 2 * v * h + layers * per_layer + h  # embeddings + untied lm_head + layers + final norm
    counts = plan.count_params(qwen)
    assert counts.total == expected == 7_615_616_512
    assert counts.bias == layers * (q + 2 * kv)
    assert counts.lm_head == counts.embedding == v * h


def test_qwen_bf16_weights_and_tpot_floor(qwen):
    est = plan.estimate_weights(qwen)
    assert est.scheme == "bfloat16"
    assert est.bytes == 2 * 7_615_616_512
    assert round(est.bytes / GB, 2) == 15.23
    assert "estimate" in est.assumption
    floor = plan.tpot_floor_s(est.bytes, 936 * GB)
    assert floor == pytest.approx(15.231233024e9 / 936e9)
    assert round(floor * 1000, 1) == 16.3
    # The articles' 19.7 ms at concurrency 1 is then about 83% MBU.
    assert round(floor / 0.0197, 2) == 0.83


def test_tied_embeddings_drop_the_lm_head(qwen):
    tied = plan.shape_from_config({**QWEN, "tie_word_embeddings": True})
    assert plan.count_params(qwen).total - plan.count_params(tied).total == 152064 * 3584


def test_exact_kv_memory_gives_exact_blocks(qwen):
    kv = 5306 * 16 * 57_344
    p = plan.make_plan(qwen, Settings(kv_cache_memory_bytes=kv), RTX3090)
    assert p.block_bytes == 16 * 57_344
    assert p.primary.num_blocks == 5306
    assert p.primary.tokens == 5306 * 16
    assert p.primary.kv_memory_source.startswith("exact")
    assert p.primary.basis is KvBasis.EXACT
    assert p.primary.num_blocks_low == p.primary.num_blocks_high == 5306  # nothing assumed: no range
    one_byte_short = plan.make_plan(qwen, Settings(kv_cache_memory_bytes=kv - 1), RTX3090)
    assert one_byte_short.primary.num_blocks == 5305
    # 4.87 GB = 4.53 GiB: the source articles' "~4.6 GB" was GiB.
    assert round(kv / GB, 2) == 4.87 and round(kv / GIB, 2) == 4.53


def test_budget_arithmetic_with_a_given_overhead(qwen):
    s = Settings(gpu_memory_utilization=0.9, overhead_bytes=GIB)
    p = plan.make_plan(qwen, s, RTX3090)
    budget = int(24576 * 2**20 * 0.9)
    kv = budget - 15_231_233_024 - GIB
    assert p.budget_bytes == budget
    assert p.primary.kv_memory_bytes == kv
    assert p.primary.num_blocks == kv // 917_504
    assert p.overhead.overridden


def test_overhead_estimate_names_its_parts_and_eager_drops_graphs(qwen):
    graphs = plan.estimate_overhead(qwen, Settings())
    eager = plan.estimate_overhead(qwen, Settings(enforce_eager=True))
    assert graphs.total - eager.total == plan.CUDA_GRAPH_BYTES
    assert "estimate" in graphs.description and "CUDA graphs" in graphs.description
    # A longer profiling pass needs more activation memory.
    assert plan.estimate_overhead(qwen, Settings(max_num_batched_tokens=8192)).activation_bytes > graphs.activation_bytes


def test_the_range_ends_are_the_plan_at_every_assumption_s_end(qwen):
    p = plan.make_plan(qwen, Settings(), RTX3090)
    c, o = p.primary, p.overhead
    assert [a.part for a in o.assumptions] == [OverheadPart.ACTIVATIONS, OverheadPart.NON_TORCH, OverheadPart.CUDA_GRAPHS]
    assert all(a.low_bytes < a.point_bytes < a.high_bytes and a.reason for a in o.assumptions)
    # The point figures are the single estimate plan has always made.
    assert sum(a.point_bytes for a in o.assumptions) == o.total
    assert c.basis is KvBasis.ESTIMATE and c.num_blocks_low < c.num_blocks < c.num_blocks_high
    # Each end is exactly the plan made with that end's overhead given.
    for total, blocks in ((o.high_total, c.num_blocks_low), (o.low_total, c.num_blocks_high)):
        given = plan.make_plan(qwen, Settings(overhead_bytes=total), RTX3090).primary
        assert given.num_blocks == blocks
        assert given.basis is KvBasis.GIVEN_OVERHEAD and given.num_blocks_low == given.num_blocks_high == blocks
    # The AWQ column carries its own range under the same assumptions.
    (awq,) = p.alternatives
    assert awq.num_blocks_low < awq.num_blocks < awq.num_blocks_high


def test_eager_assumes_no_graphs_and_narrows_the_range(qwen):
    graphs = plan.make_plan(qwen, Settings(), RTX3090).primary
    eager_plan = plan.make_plan(qwen, Settings(enforce_eager=True), RTX3090)
    (graph_part,) = [a for a in eager_plan.overhead.assumptions if a.part is OverheadPart.CUDA_GRAPHS]
    assert (graph_part.low_bytes, graph_part.point_bytes, graph_part.high_bytes) == (0, 0, 0)
    eager = eager_plan.primary
    assert (eager.num_blocks_low, eager.num_blocks, eager.num_blocks_high) == (7051, 7721, 8266)
    assert eager.num_blocks_high - eager.num_blocks_low < graphs.num_blocks_high - graphs.num_blocks_low


def test_more_sequences_widen_the_activation_range(qwen):
    """The dummy sampler run's fp32 logits grow with max_num_seqs: 10 copies at the high end."""
    few, many = (plan.make_plan(qwen, Settings(max_num_seqs=n), RTX3090) for n in (16, 256))
    logits_copy = 152064 * 4
    act = {n: p.overhead.assumptions[0] for n, p in ((16, few), (256, many))}
    assert act[256].high_bytes - act[16].high_bytes == 10 * 240 * logits_copy
    assert act[256].low_bytes - act[16].low_bytes == 240 * logits_copy
    assert many.primary.num_blocks_low < few.primary.num_blocks_low


def test_a_published_3090_measurement_sits_at_the_bottom_of_the_range(qwen):
    """Qwen2.5-7B BF16 on a 3090: 5,306 blocks measured, utilization not stated; the plan at 0.90.

    The weights measured there, 15.23 GB, are what the plan counts from config.json.
    """
    p = plan.make_plan(qwen, Settings(gpu_memory_utilization=0.90), RTX3090)
    c = p.primary
    assert round(c.weight_bytes / GB, 2) == 15.23
    assert (c.num_blocks_low, c.num_blocks, c.num_blocks_high) == (5295, 7136, 8120)
    # Inside, but only just: 11 blocks above the end where every assumed part is at its high end.
    assert c.num_blocks_low <= 5306 < c.num_blocks
    assert (5306 - c.num_blocks_low) / (c.num_blocks_high - c.num_blocks_low) < 0.005
    # It implies 2.88 GiB besides the weights: the point assumes 1.32 GiB, the high end 2.89 GiB.
    implied = plancheck.compare(p, _engine()).implied_overhead_bytes
    assert round(implied / GIB, 2) == 2.88 and round(p.overhead.total / GIB, 2) == 1.32
    assert p.overhead.total < implied <= p.overhead.high_total
    assert plancheck.compare(p, _engine()).range_position is plancheck.RangePosition.INSIDE
    # Or, at the point assumptions, a utilization of 0.835 rather than 0.90.
    utilization = (c.weight_bytes + p.overhead.total + 5306 * p.block_bytes) / RTX3090.memory_bytes
    assert round(utilization, 3) == 0.835
    assert abs(plan.make_plan(qwen, Settings(gpu_memory_utilization=0.835), RTX3090).primary.num_blocks - 5306) < 5
    # With vLLM's own default of 256 sequences the sampler's logits grow and 5,306 is well inside.
    default_seqs = plan.make_plan(qwen, Settings(max_num_seqs=256), RTX3090).primary
    assert default_seqs.num_blocks_low + 1000 < 5306 < default_seqs.num_blocks


def test_compare_places_the_engine_against_the_range(qwen):
    p = plan.make_plan(qwen, Settings(), RTX3090)
    low, high = p.primary.num_blocks_low, p.primary.num_blocks_high
    assert plancheck.compare(p, _engine(num_gpu_blocks=str(low - 1))).range_position is plancheck.RangePosition.BELOW
    assert plancheck.compare(p, _engine(num_gpu_blocks=str(high))).range_position is plancheck.RangePosition.INSIDE
    assert plancheck.compare(p, _engine(num_gpu_blocks=str(high + 1))).range_position is plancheck.RangePosition.ABOVE
    # An override is no measurement, another block size no comparable range, an exact plan no range at all.
    assert plancheck.compare(p, _engine(num_gpu_blocks_override="5306")).range_position is None
    assert plancheck.compare(p, _engine(block_size="32")).range_position is None
    exact = plan.make_plan(qwen, Settings(kv_cache_memory_bytes=5306 * 917_504), RTX3090)
    assert plancheck.compare(exact, _engine()).range_position is None


def test_awq_int4_side_by_side(qwen):
    p = plan.make_plan(qwen, Settings(), RTX3090)
    (awq,) = p.alternatives
    counts = plan.count_params(qwen)
    groups = counts.linear // 128
    expected = counts.linear // 2 + groups * 2 + groups // 2 + 2 * (counts.embedding + counts.lm_head + counts.bias + counts.norm)
    assert awq.weight_bytes == expected
    assert 5.4 * GB < awq.weight_bytes < 5.7 * GB  # the published Qwen2.5-7B-Instruct-AWQ is about 5.6 GB
    assert "16-bit" in awq.weight_source
    # Same overhead, smaller weights: more KV and a lower floor.
    assert awq.num_blocks > p.primary.num_blocks
    assert awq.kv_memory_bytes - p.primary.kv_memory_bytes == p.primary.weight_bytes - awq.weight_bytes
    assert awq.tpot_floor_s < p.primary.tpot_floor_s


def test_a_quantized_config_is_estimated_quantized():
    awq_cfg = {**QWEN, "torch_dtype": "float16", "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}
    shape = plan.shape_from_config(awq_cfg)
    assert shape.quantization == plan.Quantization("awq", 4, 128)
    p = plan.make_plan(shape, Settings(), RTX3090)
    assert p.primary.scheme == "awq-int4"
    assert p.alternatives == ()  # already quantized: no second column
    assert plan.kv_bytes_per_token(shape) == 57_344  # KV stays 16-bit


def test_measured_weights_override_the_estimate(qwen):
    p = plan.make_plan(qwen, Settings(kv_cache_memory_bytes=GIB), RTX3090, measured_weight_bytes=15_000_000_000, measured_source="measured: test")
    assert p.primary.weight_bytes == 15_000_000_000
    assert p.primary.weight_source == "measured: test"
    assert p.primary.tpot_floor_s == pytest.approx(15e9 / 936e9)


def test_mha_fallback_and_head_dim_from_hidden():
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "torch_dtype": "float16"}
    shape = plan.shape_from_config(cfg)
    assert shape.num_kv_heads == 8 and shape.head_dim == 64
    assert any("multi-head" in n for n in shape.notes)
    assert plan.kv_bytes_per_token(shape) == 2 * 2 * 8 * 64 * 2


def test_float32_checkpoint_runs_in_16_bits():
    shape = plan.shape_from_config({**QWEN, "torch_dtype": "float32"})
    assert shape.runtime_dtype == "bfloat16"
    assert plan.kv_bytes_per_token(shape) == 57_344


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"torch_dtype": "int3"}, "torch_dtype"),
    ],
)
def test_bad_configs_name_the_key(change, needle):
    cfg = {**QWEN, **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(PlanError, match=needle):
        plan.shape_from_config(cfg)


def test_weights_of_an_unknown_family_are_not_guessed():
    shape = plan.shape_from_config({**QWEN, "model_type": "mixtral", "num_local_experts": 8})
    with pytest.raises(PlanError, match="safetensors"):
        plan.estimate_weights(shape)
    # The KV arithmetic still works, given measured weights.
    p = plan.make_plan(shape, Settings(kv_cache_memory_bytes=GIB), RTX3090, measured_weight_bytes=1)
    assert p.kv_bytes_per_token == 57_344 and p.alternatives == ()


def test_no_memory_left_means_no_blocks(qwen):
    small = Hardware(memory_bytes=16 * GIB, bandwidth_bytes_per_s=936 * GB)
    p = plan.make_plan(qwen, Settings(), small)
    assert p.primary.kv_memory_bytes < 0
    assert p.primary.num_blocks == 0 and p.primary.tokens == 0


def test_gpu_size_is_needed_unless_kv_is_exact(qwen):
    no_size = Hardware(memory_bytes=None, bandwidth_bytes_per_s=None)
    with pytest.raises(PlanError, match="--gpu-memory-gib"):
        plan.make_plan(qwen, Settings(), no_size)
    p = plan.make_plan(qwen, Settings(kv_cache_memory_bytes=GIB), no_size)
    assert p.primary.tpot_floor_s is None


@pytest.mark.parametrize(
    "blocks, block_size, max_len, tokens, concurrency",
    [
        (8192, 128, 512, 1_048_576, 2048.0),  # block-aligned: blocks x block size
        (8, 128, 512, 1024, 2.0),  # the reference capture with --num-gpu-blocks-override 8
        (32768, 128, 512, 4_194_304, 8192.0),
        (8, 128, 500, 1000, 2.0),  # not aligned: a request still takes 4 whole blocks
        (5306, 16, 4096, 84_896, 5306 / 256),
        (7, 16, 4096, 112, 7 / 256),
    ],
)
def test_vllm_token_figure(blocks, block_size, max_len, tokens, concurrency):
    assert plan.kv_cache_size_tokens(blocks, block_size, max_len) == tokens
    assert plan.max_concurrency(blocks, block_size, max_len) == pytest.approx(concurrency)


def test_reference_capture_agrees_with_the_arithmetic():
    """The real vLLM 0.32 capture: 1 GiB of KV, 32768 blocks of 128 tokens, max_model_len 512."""
    from r3090d.probes import engine

    sample = engine.parse((DATA / "vllm-0.32-metrics-idle.txt").read_text(), "")
    cache = plancheck.engine_cache_from_labels(dict(sample.cache_config))
    assert cache.kv_cache_memory_bytes == GIB and cache.block_size == 128
    block_bytes = cache.kv_cache_memory_bytes // cache.num_gpu_blocks
    assert plan.blocks_for(cache.kv_cache_memory_bytes, block_bytes) == cache.num_gpu_blocks
    assert plan.kv_cache_size_tokens(cache.num_gpu_blocks, 128, 512) == cache.kv_cache_size_tokens


def _engine(**labels):
    base = {"num_gpu_blocks": "5306", "block_size": "16", "kv_cache_size_tokens": "None", "kv_cache_memory_bytes": "None", "gpu_memory_utilization": "0.9", "num_gpu_blocks_override": "None"}
    return plancheck.engine_cache_from_labels({**base, **labels})


def test_compare_reports_engine_minus_prediction(qwen):
    p = plan.make_plan(qwen, Settings(overhead_bytes=GIB), RTX3090)
    c = plancheck.compare(p, _engine())
    assert c.predicted_blocks == p.primary.num_blocks
    assert c.block_difference == 5306 - p.primary.num_blocks
    assert c.engine_tokens == 5306 * 16  # no kv_cache_size_tokens label: blocks x block size
    assert c.engine_kv_bytes == 5306 * 917_504
    # What vLLM's allocation says the non-KV, non-weight memory really was.
    assert c.implied_overhead_bytes == p.budget_bytes - p.primary.weight_bytes - 5306 * 917_504


def test_compare_exact_kv_matches_and_checks_per_token_size(qwen):
    kv = 5306 * 16 * 57_344
    p = plan.make_plan(qwen, Settings(kv_cache_memory_bytes=kv, max_model_len=4096), RTX3090)
    c = plancheck.compare(p, _engine(kv_cache_memory_bytes=str(kv), kv_cache_size_tokens=str(84_896)))
    assert (c.block_difference, c.token_difference) == (0, 0)
    assert c.arithmetic_check_blocks == 5306
    assert c.notes == ()
    # An engine that stored 4-byte KV would hold half the blocks: the check says so.
    c2 = plancheck.compare(p, _engine(num_gpu_blocks="2653", kv_cache_memory_bytes=str(kv)))
    assert c2.block_difference == -2653
    assert any("per-token size differs" in n for n in c2.notes)


def test_compare_uses_the_engines_block_size(qwen):
    p = plan.make_plan(qwen, Settings(kv_cache_memory_bytes=128 * 57_344 * 100, block_size=16), RTX3090)
    c = plancheck.compare(p, _engine(num_gpu_blocks="100", block_size="128"))
    assert c.predicted_blocks == 100 and c.block_difference == 0
    assert any("block size 128" in n for n in c.notes)


def test_card_names():
    assert cards.card_for_name("NVIDIA GeForce RTX 3090").key == "rtx3090"
    assert cards.card_for_name("NVIDIA H200") is None
    assert cards.CARDS["rtx3090"].bandwidth_gbs == 936.0


@pytest.mark.parametrize(
    "config, tokens, source",
    [
        ({"max_position_embeddings": 4096}, 4096, "max_position_embeddings = 4096"),
        # The smallest of vLLM's length keys, whichever names it.
        ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048, "seq_length = 2048"),
        ({"n_positions": 1024}, 1024, "n_positions = 1024"),
        # Rope scaling stretches it; yarn from its original length.
        ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
         131072, "rope_scaling original_max_position_embeddings = 32768 x rope_scaling factor 4"),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2}}, 8192,
         "max_position_embeddings = 4096 x rope_scaling factor 2"),
        # Llama 3.1's and longrope's max_position_embeddings already is the stretched length; gemma3's is local.
        ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072, "max_position_embeddings = 131072"),
        ({"model_type": "gemma3_text", "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
         131072, "max_position_embeddings = 131072"),
        # model_max_length is accepted up to, where longer.
        ({"max_position_embeddings": 4096, "model_max_length": 8192}, 8192, "model_max_length = 8192"),
        ({"max_position_embeddings": 4096, "model_max_length": 2048}, 4096, "max_position_embeddings = 4096"),
        # A multimodal wrapper's decoder is under text_config.
        ({"text_config": {"num_hidden_layers": 2, "max_position_embeddings": 8192}, "vision_config": {"max_position_embeddings": 256}},
         8192, "max_position_embeddings = 8192"),
    ],
)  # fmt: skip
def test_context_limit_as_vllm_derives_it(config, tokens, source):
    assert plan.context_limit(config) == plan.ContextLimit(tokens, source)


@pytest.mark.parametrize("config", [{}, {"architectures": ["X"]}, {"max_position_embeddings": "4096"}, {"max_position_embeddings": True}, [], None])
def test_no_context_limit_without_a_length_in_config_json(config):
    assert plan.context_limit(config) is None


def test_the_shipped_qwen_config_allows_its_full_context():
    assert plan.context_limit(QWEN).tokens == 131072
