"""bench's JSON under `vllm bench serve`'s keys: milliseconds, median = p50, the same names."""

from __future__ import annotations

import numpy as np
import pytest

from r3090d.measure import bench_result, loadgen
from r3090d.measure.loadgen import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
VLLM_KEYS = {
    "max_concurrency", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{m}_ms" for m in METRICS for stat in ("mean", "median", "std", "p90", "p99")),
}  # fmt: skip
OWN_ROUND_KEYS = {
    "failures_by_reason",
    "prompt_tokens_mean",
    "output_tokens_mean",
    "server_itl_mean_ms",
    "server_itl_count",
}


def request(started: float, ttft: float, gaps: list[float], prompt: int = 20) -> RequestResult:
    first = started + ttft
    times = [first]
    for gap in gaps:
        times.append(times[-1] + gap)
    ttft_s, tpot_s, itl, n = loadgen.token_timing(started, [(t, 1) for t in times])
    return RequestResult(True, None, started, times[-1] + 0.001, prompt, n, ttft_s, tpot_s, itl)


def a_round(concurrency: int = 4, wall: float = 2.0) -> loadgen.RoundSummary:
    results = [
        request(0.0, 0.100, [0.010, 0.020, 0.030]),
        request(0.1, 0.200, [0.020, 0.020, 0.020], prompt=24),
        request(0.2, 0.400, [0.050, 0.010, 0.030]),
        RequestResult(ok=False, error="HTTP 500: boom"),
    ]
    return loadgen.summarize_round(results, concurrency, wall, server_itl=(0.3, 12.0))


def test_a_round_under_vllms_keys():
    rnd = a_round()
    out = bench_result.round_result(rnd)
    assert set(out) == VLLM_KEYS | OWN_ROUND_KEYS
    assert (out["max_concurrency"], out["completed"], out["failed"], out["duration"]) == (4, 3, 1, 2.0)
    assert (out["total_input_tokens"], out["total_output_tokens"]) == (64, 12)
    assert out["request_throughput"] == pytest.approx(1.5)
    assert out["output_throughput"] == pytest.approx(6.0)
    assert out["total_token_throughput"] == pytest.approx(38.0)
    ttfts = [0.1, 0.2, 0.4]
    assert out["mean_ttft_ms"] == pytest.approx(1000 * np.mean(ttfts))
    assert out["median_ttft_ms"] == pytest.approx(200.0) == pytest.approx(1000 * rnd.ttft.p50)
    assert out["std_ttft_ms"] == pytest.approx(1000 * np.std(ttfts))  # population std, as vLLM's np.std
    assert out["p99_ttft_ms"] == pytest.approx(1000 * np.percentile(ttfts, 99))
    itls = [0.010, 0.020, 0.030, 0.020, 0.020, 0.020, 0.050, 0.010, 0.030]
    assert out["p90_itl_ms"] == pytest.approx(1000 * np.percentile(itls, 90))
    assert out["median_tpot_ms"] == pytest.approx(20.0)
    assert out["failures_by_reason"] == {"HTTP 500: boom": 1}
    assert out["server_itl_mean_ms"] == pytest.approx(25.0) and out["server_itl_count"] == 12.0


def test_a_level_is_the_median_of_its_rounds_in_ms():
    fast, slow, middle = a_round(wall=1.0), a_round(wall=4.0), a_round(wall=2.0)
    level = loadgen.summarize_level([fast, slow, middle], tpot_floor_s=0.016)
    out = bench_result.level_result(level)
    assert set(out) == VLLM_KEYS | (OWN_ROUND_KEYS - {"server_itl_count"}) | {"mbu", "rounds"}
    assert out["completed"] == 9 and out["failed"] == 3 and out["duration"] == pytest.approx(7.0)
    assert out["total_output_tokens"] == 36 and out["total_input_tokens"] == 192
    assert out["request_throughput"] == pytest.approx(1.5)  # the middle round's
    assert out["median_tpot_ms"] == pytest.approx(1000 * level.tpot.p50)
    assert out["mbu"] == pytest.approx(0.016 / level.tpot.p50)
    assert [r["duration"] for r in out["rounds"]] == [1.0, 4.0, 2.0]
    assert out["failures_by_reason"] == {"HTTP 500: boom": 3}


def test_no_samples_give_null_not_zero():
    rnd = loadgen.summarize_round([RequestResult(ok=False, error="connection refused")], 1, 1.0)
    out = bench_result.round_result(rnd)
    assert out["mean_ttft_ms"] is None and out["p99_e2el_ms"] is None and out["server_itl_mean_ms"] is None
    assert out["completed"] == 0 and out["total_input_tokens"] == 0
