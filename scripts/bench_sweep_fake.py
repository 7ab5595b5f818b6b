#!/usr/bin/env python3
"""Run `r3090ctl bench` across concurrency levels against the vLLM test double and draw the sweep.

    python3 scripts/bench_sweep_fake.py [OUT.png] [--delay S] [--concurrency 1,4,...]

The double produces one token per running request every --delay seconds, so
the picture shows the client, not a GPU: TPOT should stay at the delay and
throughput should grow with the number of streams. The prompts are 64 tokens by
the double's /tokenize. docs/bench-sweep.png is made with this script's
defaults, under `nice -n -5` so that other work on a small machine does not
starve the double's engine mid-round.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fakevllm.harness import FakeVllm, make_engine_python  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=str(REPO / "docs" / "bench-sweep.png"))
    ap.add_argument("--delay", type=float, default=0.05, help="the double's seconds per token")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", help="also keep the results here (per level under `vllm bench serve`'s keys)")
    args = ap.parse_args()
    # SIGTERM too must reach the finally below, or the double outlives us in its own session.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        python = make_engine_python(Path(tmp) / "venv")
        double = FakeVllm(python, "--fake-token-delay", str(args.delay), "--max-num-seqs", "512",
                          served_model_name=f"test-double-{args.delay * 1000:g}ms", log_path=Path(tmp) / "double.log")  # fmt: skip
        double.start()
        try:
            double.wait_healthy(30)
            cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()",
                   "bench", "--url", double.url, "--concurrency", args.concurrency, "--rounds", str(args.rounds),
                   "--max-tokens", str(args.max_tokens), "--prompt-tokens", "64", "--plot", args.out]  # fmt: skip
            if args.json:
                cmd += ["--json", args.json]
            return subprocess.run(cmd, cwd=REPO).returncode
        finally:
            double.kill_all()


if __name__ == "__main__":
    sys.exit(main())
