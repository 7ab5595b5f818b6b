"""How long reading one /metrics payload costs: r3090d's parse against two baselines.

Run: python bench/bench_parse.py [--rounds N] [--file PATH] [--model NAME]

All parsers read the same real vLLM 0.32 capture (about 50 KB) in one run, their
calls interleaved round by round so that machine noise falls on all of them alike.
Reports the median time per call and the ratios:
  parse (steady)   r3090d.probes.engine.parse as the daemon runs it, poll after
                   poll: label blocks, which repeat from poll to poll, are memoized;
  parse (cold)     the same with that memo cleared before every call (a first poll);
  prometheus_client  a full text_string_to_metric_families parse, materialized;
  vllm-htop        vllm_htop.parse_snapshot (pip install 'r3090d[bench]').
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from r3090d.probes import engine

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SAMPLE = ROOT / "tests" / "data" / "vllm-0.32-metrics-kv-full.txt"
TARGET_VS_PROMETHEUS = 30.0
TARGET_VS_HTOP = 3.0


def full_prometheus_parse(text: str) -> int:
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def load_htop() -> Callable[[str], object] | None:
    try:
        import vllm_htop
    except ImportError:
        return None
    return vllm_htop.parse_snapshot


def time_calls(
    call: Callable[[], object], repeat: int, before: Callable[[], object] | None = None
) -> list[float]:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    cli.add_argument("--file", type=Path, default=DEFAULT_SAMPLE, help="a /metrics capture")
    cli.add_argument("--model", default="tiny", help="model_name label in the capture")
    args = cli.parse_args(argv)

    try:
        text = args.file.read_text(encoding="utf-8")
    except OSError as exc:
        print(f"cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    sample = engine.parse(text, args.model)
    if sample.error is not None or sample.kv_usage is None:
        print(f"parse() does not read {args.file} for model {args.model!r}: {sample.error}", file=sys.stderr)
        return 1

    parse_htop = load_htop()
    # Per round: enough calls of each that a round takes tens of milliseconds.
    plan: dict[str, tuple[Callable[[], object], int, Callable[[], object] | None]] = {
        "parse (steady)": (lambda: engine.parse(text, args.model), 200, None),
        "parse (cold)": (lambda: engine.parse(text, args.model), 50, engine._parse_label_block.cache_clear),
        "prometheus_client": (lambda: full_prometheus_parse(text), 3, None),
    }
    if parse_htop is not None:
        plan["vllm-htop"] = (lambda: parse_htop(text), 20, None)

    for call, _, before in plan.values():  # warm-up: imports, caches, first-call costs
        if before is not None:
            before()
        call()

    samples: dict[str, list[float]] = {name: [] for name in plan}
    for _ in range(args.rounds):
        for name, (call, repeat, before) in plan.items():
            samples[name] += time_calls(call, repeat, before)

    median_ms = {name: statistics.median(times) * 1e3 for name, times in samples.items()}
    print(
        f"sample: {args.file.name}, {len(text.encode())} bytes, {text.count(chr(10))} lines; {args.rounds} rounds"
    )
    print(f"{'parser':<20}{'calls':>8}{'median ms':>12}{'p90 ms':>10}")
    for name, times in samples.items():
        p90 = statistics.quantiles(times, n=10)[-1] * 1e3
        print(f"{name:<20}{len(times):>8}{median_ms[name]:>12.4f}{p90:>10.4f}")
    if parse_htop is None:
        print("vllm-htop not installed: skipping that comparison (pip install 'r3090d[bench]')")

    print()
    for which in ("parse (steady)", "parse (cold)"):
        ours = median_ms[which]
        vs_prom = median_ms["prometheus_client"] / ours
        line = f"{which}: {vs_prom:6.1f}x faster than prometheus_client (target >= {TARGET_VS_PROMETHEUS:g}x)"
        if parse_htop is not None:
            vs_htop = median_ms["vllm-htop"] / ours
            line += f", {vs_htop:5.1f}x faster than vllm-htop (target >= {TARGET_VS_HTOP:g}x)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
