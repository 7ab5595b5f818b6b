"""`bench`'s results as JSON, under `vllm bench serve`'s keys where a figure means the same.

Per concurrency level, and per round under "rounds" (README, "Measuring", has the table):
max_concurrency; completed, failed, duration (s), total_input_tokens and
total_output_tokens, summed over rounds; request_throughput, output_throughput
and total_token_throughput, each round's over its wall time, the median round;
mean_, median_ (the p50), std_, p90_ and p99_ of ttft, tpot, itl and e2el, in
ms, the median over rounds. std is the population standard deviation, as
vLLM's np.std. A figure without samples is null (vLLM writes 0).

r3090d's own figures keep their own names: failures_by_reason,
prompt_tokens_mean, output_tokens_mean, server_itl_mean_ms (vLLM's own
inter-token latency histogram over the same rounds), server_itl_count (rounds),
mbu and rounds (levels).
"""

from __future__ import annotations

from r3090d.measure.loadgen import Dist, LevelSummary, RoundSummary

PERCENTILES = (90, 99)  # besides the median
METRICS = (
    ("ttft", "ttft"),
    ("tpot", "tpot"),
    ("itl", "itl"),
    ("e2el", "e2e"),
)  # vLLM's name, LevelSummary's field


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def dist_keys(metric: str, dist: Dist) -> dict[str, float | None]:
    """vLLM's mean_/median_/std_/pNN_ keys for one latency, in milliseconds."""
    keys = {
        f"mean_{metric}_ms": ms(dist.mean),
        f"median_{metric}_ms": ms(dist.p50),
        f"std_{metric}_ms": ms(dist.std),
    }
    for p in PERCENTILES:
        keys[f"p{p}_{metric}_ms"] = ms(getattr(dist, f"p{p}"))
    return keys


def _common(s: RoundSummary | LevelSummary) -> dict:
    out: dict = {
        "max_concurrency": s.concurrency,
        "completed": s.completed,
        "failed": s.failed,
        "duration": s.wall_s,
        "total_input_tokens": s.prompt_tokens,
        "total_output_tokens": s.output_tokens,
        "request_throughput": s.requests_s,
        "output_throughput": s.output_tok_s,
        "total_token_throughput": s.total_tok_s,
    }
    for vllm_name, field_name in METRICS:
        out.update(dist_keys(vllm_name, getattr(s, field_name)))
    out.update(
        failures_by_reason=dict(s.failures),
        prompt_tokens_mean=s.prompt_tokens_mean,
        output_tokens_mean=s.output_tokens_mean,
        server_itl_mean_ms=ms(s.server_itl_mean_s),
    )
    return out


def round_result(rnd: RoundSummary) -> dict:
    return {**_common(rnd), "server_itl_count": rnd.server_itl_count}


def level_result(level: LevelSummary) -> dict:
    return {**_common(level), "mbu": level.mbu, "rounds": [round_result(r) for r in level.rounds]}
