"""Percentiles, per-request timing and per-round / per-level aggregation of the load generator."""

from __future__ import annotations

import random

import numpy as np
import pytest

from r3090d.measure import loadgen
from r3090d.measure.loadgen import Dist, RequestResult


@pytest.mark.parametrize(
    "values, q, expected",
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 90, 3.7),
        ([1, 2, 3, 4], 99, 3.97),
        ([1, 2, 3, 4], 0, 1),
        ([1, 2, 3, 4], 100, 4),
        ([4, 1, 3, 2], 50, 2.5),  # order does not matter
        ([7.0], 99, 7.0),
        ([10, 20], 25, 12.5),
    ],
)
def test_percentile_by_hand(values, q, expected):
    assert loadgen.percentile(values, q) == pytest.approx(expected)


def test_percentile_agrees_with_numpys_default():
    rng = random.Random(1)
    for n in (2, 3, 10, 101, 1000):
        data = [rng.expovariate(50) for _ in range(n)]
        for q in (50, 90, 99):
            assert loadgen.percentile(data, q) == pytest.approx(float(np.percentile(data, q)), rel=1e-12)


def test_std_is_numpys_population_std():
    rng = random.Random(2)
    for n in (1, 2, 17, 500):
        data = [rng.expovariate(20) for _ in range(n)]
        assert Dist.of(data).std == pytest.approx(float(np.std(data)), rel=1e-12, abs=1e-15)


def test_percentile_edges():
    assert loadgen.percentile([], 50) is None
    with pytest.raises(ValueError):
        loadgen.percentile([1], 101)
    assert Dist.of([]) == Dist()


def test_token_timing_leaves_the_first_token_out():
    ttft, tpot, itl, n = loadgen.token_timing(0.5, [(1.0, 1), (1.1, 1), (1.2, 1), (1.3, 1)])
    assert ttft == pytest.approx(0.5)
    assert tpot == pytest.approx(0.1)  # 0.3 s over 3 tokens after the first
    assert itl == pytest.approx((0.1, 0.1, 0.1))
    assert n == 4


def test_token_timing_with_a_chunk_of_several_tokens():
    # 4 tokens: one at 1.0, three arriving together at 1.3 -> (1.3 - 1.0) / 3
    ttft, tpot, itl, n = loadgen.token_timing(0.0, [(1.0, 1), (1.3, 3)])
    assert (ttft, n) == (1.0, 4)
    assert tpot == pytest.approx(0.1)
    assert itl == pytest.approx((0.3,))


def test_token_timing_ignores_empty_chunks_and_single_tokens():
    assert loadgen.token_timing(0.0, [(0.2, 0), (0.5, 1)]) == (0.5, None, (), 1)
    assert loadgen.token_timing(0.0, []) == (None, None, (), 0)


def _ok(started, ttft, tpot, n, itl=None, prompt=10):
    first = started + ttft
    return RequestResult(
        ok=True,
        started=started,
        finished=first + tpot * (n - 1),
        prompt_tokens=prompt,
        output_tokens=n,
        ttft_s=ttft,
        tpot_s=tpot,
        itl_s=tuple(itl if itl is not None else [tpot] * (n - 1)),
    )


def test_round_summary():
    results = [
        _ok(0.0, 0.10, 0.020, 11),
        _ok(0.0, 0.30, 0.040, 11),
        RequestResult(ok=False, error="HTTP 500: boom"),
        RequestResult(ok=False, error="HTTP 500: boom"),
        RequestResult(ok=False, error="timeout (ReadTimeout)"),
    ]
    s = loadgen.summarize_round(results, concurrency=4, wall_s=2.0, server_itl=(0.6, 20.0))
    assert (s.requests, s.completed, s.failed) == (5, 2, 3)
    assert s.failures == {"HTTP 500: boom": 2, "timeout (ReadTimeout)": 1}
    assert s.output_tokens == 22 and s.prompt_tokens == 20
    assert s.output_tok_s == pytest.approx(11.0)
    assert s.total_tok_s == pytest.approx(21.0)
    assert s.requests_s == pytest.approx(1.0)
    assert s.ttft.p50 == pytest.approx(0.2)
    assert s.tpot.mean == pytest.approx(0.03)
    assert s.itl.n == 20 and s.itl.p50 == pytest.approx(0.03)
    assert s.server_itl_mean_s == pytest.approx(0.03)
    assert s.prompt_tokens_mean == 10


def test_round_without_successes_or_server_counts():
    s = loadgen.summarize_round([RequestResult(ok=False, error="connection refused")], 1, 1.0, server_itl=(0.0, 0.0))
    assert s.completed == 0 and s.tpot == Dist() and s.output_tok_s == 0
    assert s.server_itl_mean_s is None


def test_level_takes_the_median_round_and_mbu():
    rounds = [
        loadgen.summarize_round([_ok(0, 0.1, tpot, 5)], 1, wall)
        for tpot, wall in ((0.010, 1.0), (0.030, 3.0), (0.020, 2.0))
    ]
    lv = loadgen.summarize_level(rounds, tpot_floor_s=0.016)
    assert lv.tpot.p50 == pytest.approx(0.020)
    assert lv.output_tok_s == pytest.approx(5 / 2.0)
    assert lv.total_tok_s == pytest.approx((10 + 5) / 2.0)
    assert lv.completed == 3
    assert (lv.wall_s, lv.prompt_tokens, lv.output_tokens) == (pytest.approx(6.0), 30, 15)  # summed over rounds
    assert lv.mbu == pytest.approx(0.8)
    assert loadgen.summarize_level(rounds).mbu is None
    with pytest.raises(ValueError):
        loadgen.summarize_level([])


def test_level_collects_failure_reasons_over_rounds():
    r1 = loadgen.summarize_round([RequestResult(ok=False, error="a"), _ok(0, 0.1, 0.01, 3)], 2, 1.0)
    r2 = loadgen.summarize_round([RequestResult(ok=False, error="a"), RequestResult(ok=False, error="b")], 2, 1.0)
    lv = loadgen.summarize_level([r1, r2])
    assert lv.failures == {"a": 2, "b": 1}
    assert lv.failed == 3


def test_parse_levels():
    assert loadgen.parse_levels("1,4, 8,16,32") == (1, 4, 8, 16, 32)
    for bad in ("", "0", "1,x", "-1"):
        with pytest.raises(ValueError):
            loadgen.parse_levels(bad)


def test_requests_per_round_default_and_total():
    p = loadgen.BenchPlan(levels=(1, 4, 32), requests=None, rounds=5, warmup=10)
    assert [p.requests_for(c) for c in p.levels] == [8, 16, 128]
    assert p.round_sizes() == [8] * 5 + [16] * 5 + [128] * 5
    assert p.total_requests() == 10 + 5 * (8 + 16 + 128)


def test_request_body_keeps_the_key_out_and_fixes_lengths():
    t = loadgen.Target(url="http://x", model="m", api_key="sk-secret", max_tokens=64)
    body = t.body("hi")
    assert body["ignore_eos"] is True and body["max_tokens"] == 64 and body["stream"] is True
    assert "sk-secret" not in repr(t) and "sk-secret" not in str(body)
    assert t.headers()["Authorization"] == "Bearer sk-secret"
    chat = loadgen.Target(url="http://x", model="m", chat=True, ignore_eos=False).body("hi")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
