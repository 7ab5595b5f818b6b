"""`r3090ctl bench` against the vLLM double: real processes, real HTTP, a set per-token delay."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from r3090d.measure import loadgen, prompts
from r3090d.probes import engine as engine_probe
from r3090d.probes.http import engine_client
from tests.fakevllm.harness import http

pytestmark = pytest.mark.component

QWEN_CONFIG = Path(__file__).resolve().parent.parent / "data" / "qwen2.5-7b-config.json"
CTL = [sys.executable, "-c", "import sys; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()"]


def bench(*args, env=None, timeout=300):
    return subprocess.run([*CTL, "bench", *map(str, args)], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def double(fake_vllm):
    def start(delay: float, *extra, **kwargs):
        d = fake_vllm("--fake-token-delay", str(delay), *extra, **kwargs)
        d.wait_healthy(30)
        return d

    return start


def server_sample(url: str, model: str, client: httpx.Client | None = None):
    """The double's /metrics as the daemon's probe reads them; None while they cannot be fetched."""
    text, _ = engine_probe.fetch_metrics(client or http(), url, 5.0)
    return None if text is None else engine_probe.parse(text, model)


def server_itl(url: str, model: str) -> tuple[float, float]:
    sample = server_sample(url, model)
    assert sample is not None, f"no /metrics from {url}"
    return sample.itl_sum, sample.itl_count


def test_tpot_equals_the_token_delay(double, tmp_path):
    delay = 0.05
    d = double(delay)
    out = tmp_path / "bench.json"
    r = bench("--url", d.url, "--concurrency", "1,4", "--requests", 8, "--rounds", 3, "--warmup", 2, "--max-tokens", 40, "--prompt-tokens", 32,
              "--model-dir", QWEN_CONFIG, "--bandwidth-gbs", 936, "--json", out)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["target"]["model"] == "fake"  # the first model the engine lists
    floor = result["floor"]["tpot_floor_s"]
    assert floor == pytest.approx(15_231_233_024 / 936e9)  # Qwen2.5-7B bf16 on a 3090, from the plan
    for level in result["levels"]:
        print(f"c={level['max_concurrency']}: TPOT median {level['median_tpot_ms']:.2f} ms, mean {level['mean_tpot_ms']:.2f} ms, "
              f"server ITL {level['server_itl_mean_ms']:.2f} ms, {level['output_throughput']:.1f} tok/s")  # fmt: skip
        assert level["failed"] == 0 and level["completed"] == 8 * 3
        assert level["output_tokens_mean"] == 40  # ignore_eos: fixed lengths
        assert level["total_output_tokens"] == 8 * 3 * 40
        assert level["median_tpot_ms"] == pytest.approx(delay * 1000, rel=0.02)
        # The client's TPOT and the server's own inter-token latency describe the same gaps
        # (loosely: on a loaded machine the double's HTTP threads deliver with some jitter).
        assert level["mean_tpot_ms"] == pytest.approx(level["server_itl_mean_ms"], rel=0.05)
        assert len(level["rounds"]) == 3
        assert level["mbu"] == pytest.approx(floor / (level["median_tpot_ms"] / 1000))
    assert "TPOT" in r.stdout and "client CPU" in r.stdout
    assert "Traceback" not in r.stderr


def test_prompt_tokens_are_exact_through_tokenize(double, tmp_path):
    """The double's chat template adds tokens a word count does not see; /tokenize does."""
    d = double(0.001)
    for chat in (False, True):
        out = tmp_path / f"bench-{chat}.json"
        # 1 + 2 x 16 = 33 prompts: enough for the tokenizing step to show its progress.
        r = bench("--url", d.url, "--concurrency", "4", "--requests", 16, "--rounds", 2, "--warmup", 1, "--max-tokens", 4,
                  "--prompt-tokens", 37, "--progress", *(["--chat"] if chat else []), "--json", out)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads(out.read_text())
        assert result["prompts"] == {"wanted": 37, "unit": "tokens", "prompts": 33, "exact": 33, "shortest": 37, "longest": 37}
        (level,) = result["levels"]
        # Measured from the completions' usage, not from what /tokenize said.
        assert level["prompt_tokens_mean"] == 37
        assert [rnd["total_input_tokens"] for rnd in level["rounds"]] == [16 * 37, 16 * 37]
        assert level["total_input_tokens"] == 2 * 16 * 37
        assert "prompt 37 tokens (exact, via /tokenize)" in r.stdout
        assert "tokenizing prompts" in r.stderr and "33/33" in r.stderr
        assert "Traceback" not in r.stderr


def test_without_tokenize_the_prompt_is_counted_in_words(double, tmp_path):
    d = double(0.001, "--fake-no-tokenize")
    out = tmp_path / "bench.json"
    r = bench("--url", d.url, "--concurrency", "2", "--requests", 4, "--rounds", 1, "--warmup", 0, "--max-tokens", 4,
              "--prompt-tokens", 37, "--chat", "--json", out)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["prompts"]["unit"] == "words" and result["prompts"]["exact"] == 0
    assert "prompt ~37 words (the server has no /tokenize)" in r.stdout
    # 37 words in one user message: the double's chat template adds 7 tokens, and usage says so.
    assert result["levels"][0]["prompt_tokens_mean"] == 37 + 7


def test_the_doubles_tokenize_agrees_with_its_usage(double):
    d = double(0.001)
    text = "one two three four five"
    for chat, body in ((False, {"prompt": text}), (True, {"messages": [{"role": "user", "content": text}]})):
        answer = http().post(d.url + "/tokenize", json={"model": "fake", **body}, timeout=10)
        assert answer.status_code == 200, answer.text
        tokenized = answer.json()
        assert set(tokenized) == {"count", "max_model_len", "tokens"}
        assert tokenized["count"] == len(tokenized["tokens"]) and isinstance(tokenized["max_model_len"], int)
        done = http().post(d.url + ("/v1/chat/completions" if chat else "/v1/completions"), json={"model": "fake", "max_tokens": 2, **body}, timeout=10)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["prompt_tokens"] == tokenized["count"]
    bad = http().post(d.url + "/tokenize", json={"model": "fake", "prompt": 7}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    unknown = http().post(d.url + "/tokenize", json={"model": "nope", "prompt": text}, timeout=10)
    assert unknown.status_code == 404 and "does not exist" in unknown.json()["error"]["message"]
    assert http().get(d.url + "/tokenize", timeout=10).status_code == 405


def test_256_streams_from_one_process_keep_up_with_the_engine(double):
    """The double steps every `delay`; 256 streams must receive 256 tokens per step, as fast as it makes them."""
    delay, streams, tokens = 0.1, 256, 100
    d = double(delay, "--max-num-seqs", str(streams))
    target = loadgen.Target(url=d.url, model="fake", max_tokens=tokens)
    sum0, count0 = server_itl(d.url, "fake")

    async def run():
        async with loadgen.make_client(streams + 8) as client:
            return await loadgen.run_round(client, target, [prompts.word_prompt(i, 16, seed=3090) for i in range(streams)], streams)

    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    results, wall = asyncio.run(run())
    cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    sum1, count1 = server_itl(d.url, "fake")
    ok = [r for r in results if r.ok]
    assert len(ok) == streams, [r.error for r in results if not r.ok][:5]
    assert all(r.output_tokens == tokens for r in ok)
    # Steady state: from the moment every stream has its first token until the first one ends.
    lo = max(r.arrivals[0][0] for r in ok)
    hi = min(r.arrivals[-1][0] for r in ok)
    received = sum(k for r in ok for t, k in r.arrivals if lo <= t <= hi)
    client_rate = received / (hi - lo)
    configured_rate = streams / delay
    engine_itl = (sum1 - sum0) / (count1 - count0)  # the double's own mean gap, as its API server saw it
    engine_rate = streams / engine_itl
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    print(
        f"\n{streams} streams: steady window {hi - lo:.2f} s, client received {client_rate:.0f} tok/s; "
        f"configured {configured_rate:.0f} tok/s, engine delivered {engine_rate:.0f} tok/s (its ITL {engine_itl * 1000:.1f} ms); "
        f"client CPU {cpu:.2f} s over {wall1 - wall0:.2f} s wall ({100 * cpu / (wall1 - wall0):.0f}% of one core), "
        f"{1e3 * cpu / (streams * tokens):.3f} ms per token"
    )
    assert hi - lo > 0.5 * tokens * delay  # a real overlap, not a ramp
    assert client_rate == pytest.approx(engine_rate, rel=0.05)  # whatever the engine makes, the client takes
    assert client_rate >= 0.9 * configured_rate  # and that is the configured rate, less the double's own step cost
    assert cpu < 0.8 * (wall1 - wall0)  # the client never saturates its core


def test_api_key_from_the_environment(double):
    d = double(0.01, env={"VLLM_API_KEY": "sk-bench-test"})
    r = bench("--url", d.url, "--concurrency", "2", "--requests", 4, "--rounds", 1, "--warmup", 0, "--max-tokens", 8, env={"BENCH_KEY": "sk-bench-test"}, )
    assert r.returncode == 64, r.stdout + r.stderr  # OPENAI_API_KEY is not set: refused
    assert "API key" in r.stderr and "Traceback" not in r.stderr
    r = bench("--url", d.url, "--api-key-env", "BENCH_KEY", "--concurrency", "2", "--requests", 4, "--rounds", 1, "--warmup", 0, "--max-tokens", 8, env={"BENCH_KEY": "sk-bench-test"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sk-bench-test" not in r.stdout + r.stderr


def test_bad_targets_exit_cleanly(double):
    d = double(0.01)
    r = bench("--url", d.url, "--model", "no-such-model", "--concurrency", "1")
    assert r.returncode == 64 and "'no-such-model' is not served" in r.stderr and "fake" in r.stderr
    d.kill_all()
    r = bench("--url", d.url, "--concurrency", "1")
    assert r.returncode == 69 and "cannot reach" in r.stderr
    for out in (r.stderr,):
        assert "Traceback" not in out


def test_engine_death_mid_run_is_counted_not_raised(double, tmp_path):
    d = double(0.05)
    core_pid = d.state()["engine_core_pid"]
    given_up = threading.Event()

    def kill_once_streaming():
        # Once both of the run's streams are in flight (each lasts 5 s), however slowly bench
        # started; its single test request beforehand must get through.
        client = engine_client()
        while not given_up.is_set():
            sample = server_sample(d.url, "fake", client)
            if sample is not None and (sample.running or 0) >= 2:
                os.kill(core_pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_once_streaming, daemon=True)
    killer.start()
    try:
        out = tmp_path / "b.json"
        r = bench("--url", d.url, "--concurrency", "2", "--requests", 6, "--rounds", 1, "--warmup", 0, "--max-tokens", 100, "--json", out, timeout=120)
    finally:
        given_up.set()
        killer.join(10)
    assert r.returncode == 1, r.stdout + r.stderr
    level = json.loads(out.read_text())["levels"][0]
    assert level["failed"] == 6 and level["completed"] == 0
    assert any(reason.startswith("error in stream") for reason in level["failures_by_reason"]), level["failures_by_reason"]
    assert "failed:" in r.stdout and "Traceback" not in r.stderr


def test_sweep_plot(double, tmp_path):
    pytest.importorskip("matplotlib")
    d = double(0.02)
    png = tmp_path / "sweep.png"
    r = bench("--url", d.url, "--concurrency", "1,2", "--requests", 4, "--rounds", 1, "--warmup", 0, "--max-tokens", 10, "--plot", png, "--chat")
    assert r.returncode == 0, r.stdout + r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib_says_so(tmp_path):
    # Only the import is taken away; everything else is the real command.
    code = "import sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()"
    r = subprocess.run([sys.executable, "-c", code, "bench", "--plot", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 64
    assert "matplotlib" in r.stderr and "r3090d[plot]" in r.stderr and "Traceback" not in r.stderr
