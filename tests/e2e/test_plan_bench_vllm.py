"""`r3090ctl plan` and `r3090ctl bench` against a REAL vLLM on CPU serving the tiny model.

- plan: the predicted KV token count equals what vLLM reports in
  vllm:cache_config_info, exactly, at two KV sizes (VLLM_CPU_KVCACHE_SPACE, and
  --kv-cache-memory-bytes with a size that is not a whole number of blocks and a
  max_model_len that is not a whole number of blocks).
- bench: its mean TPOT agrees within 5% with the server's own
  vllm:inter_token_latency_seconds over the same rounds, on the engine-bound
  variant of the tiny model.

vLLM runs one at a time on this machine: the vllm_lock fixture holds the flock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.real_vllm import (
    CPU_BLOCK_SIZE,
    CPU_DTYPE,
    CPU_EXTRA_ARGS,
    ENGINE_BOUND_ARGS,
    OFFLINE_ENV,
    VllmProcess,
    free_port,
)

pytestmark = pytest.mark.vllm

CTL = [
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()",
]
KV_BYTES_PER_TOKEN = 1024  # the tiny model: 2 x 2 layers x 1 KV head x 64 x 4 B (float32)
LOAD_TIMEOUT = 420


def start_vllm(engine_python, model, log_path, *args: str, env: dict[str, str] | None = None) -> VllmProcess:
    """vLLM on the tiny model with these extra args; the KV size comes from args or env only."""
    port = free_port()
    argv = [engine_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
            *CPU_EXTRA_ARGS, "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    return VllmProcess(argv, {**base, **OFFLINE_ENV, **(env or {})}, f"http://127.0.0.1:{port}", log_path, LOAD_TIMEOUT)


@pytest.fixture(scope="module")
def servers(engine_python, tiny_model, vllm_lock, tmp_path_factory):
    """get(name, *args, env=...) -> a ready vLLM; starting one stops the other first (one vLLM at a time)."""
    running: dict[str, VllmProcess] = {}
    logs = tmp_path_factory.mktemp("vllm")

    def get(name: str, *args: str, env: dict[str, str] | None = None) -> VllmProcess:
        if name in running:
            return running[name]
        for other in list(running):
            running.pop(other).stop()
        server = start_vllm(engine_python, tiny_model, logs / f"vllm-{name}.log", *args, env=env)
        running[name] = server
        print(f"vLLM {name} ready in {server.wait_ready():.0f} s")
        return server

    yield get
    for server in running.values():
        server.stop()


@pytest.fixture
def vllm_1gib(servers):
    """KV space from VLLM_CPU_KVCACHE_SPACE=1 (GiB), max_model_len 1024."""
    return servers("1gib", "--max-model-len", "1024", env={"VLLM_CPU_KVCACHE_SPACE": "1"})


def ctl(*args, timeout=600, prefix=()):
    r = subprocess.run([*prefix, *CTL, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def plan_against(server, kv_bytes: int, max_model_len: int) -> dict:
    # plan takes a float32 checkpoint to run in 16 bits, as vLLM's --dtype auto does on a GPU;
    # the CPU engine runs --dtype float32, and its KV cache in that dtype.
    r = ctl("plan", "--model", server_model(server), "--kv-cache-memory-bytes", kv_bytes, "--block-size", CPU_BLOCK_SIZE,
            "--max-model-len", max_model_len, "--kv-cache-dtype", CPU_DTYPE, "--bandwidth-gbs", 20, "--url", server.url,
            "--json")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def server_model(server: VllmProcess) -> str:
    return server.argv[server.argv.index("--model") + 1]


def check_exact(data: dict, kv_bytes: int, max_model_len: int) -> None:
    eng = data["engine"]["engine"]
    print(
        f"KV {kv_bytes} B, max_model_len {max_model_len}: predicted {data['primary']['num_blocks']} blocks / "
        f"{data['engine']['predicted_tokens']} tokens; vLLM num_gpu_blocks {eng['num_gpu_blocks']}, block_size {eng['block_size']}, "
        f"kv_cache_size_tokens {eng['kv_cache_size_tokens']}, kv_cache_memory_bytes {eng['kv_cache_memory_bytes']}"
    )
    assert data["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN
    assert eng["kv_cache_memory_bytes"] == kv_bytes
    assert eng["block_size"] == CPU_BLOCK_SIZE
    assert data["primary"]["num_blocks"] == eng["num_gpu_blocks"]
    assert data["primary"]["tokens"] == eng["num_gpu_blocks"] * eng["block_size"]
    assert data["engine"]["predicted_tokens"] == eng["kv_cache_size_tokens"]
    assert (data["engine"]["block_difference"], data["engine"]["token_difference"]) == (0, 0)
    assert data["engine"]["notes"] == []


def test_plan_matches_vllm_with_kvcache_space(vllm_1gib):
    data = plan_against(vllm_1gib, 1 << 30, 1024)
    check_exact(data, 1 << 30, 1024)
    assert data["engine"]["engine"]["num_gpu_blocks"] == (1 << 30) // (CPU_BLOCK_SIZE * KV_BYTES_PER_TOKEN)


def test_bench_tpot_agrees_with_the_servers_itl(servers, tmp_path):
    out = tmp_path / "bench.json"
    # vLLM's ITL comes from engine-core timestamps, the client's from arrival. With the tiny model
    # on 2 cores the delivery path (API server and client) is the bottleneck, and the API server,
    # runnable, was seen getting no CPU for up to 2.5 s: a request whose first tokens wait out such
    # a stall receives them in a burst, and its client span is short. The engine-bound model makes
    # the engine the bottleneck, as on a GPU, so that the comparison is about the two clocks. The
    # delivery path also runs at a higher priority where that is allowed; the median of rounds, as
    # bench reports it, keeps one stalled round out.
    server = servers("engine-bound", *ENGINE_BOUND_ARGS, "--max-model-len", "1024", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        os.setpriority(os.PRIO_PROCESS, server.proc.pid, -10)
        nice = ["nice", "-n", "-10"]
    except PermissionError:
        nice = []
    tokens = 256
    r = ctl("bench", "--url", server.url, "--concurrency", "1,4", "--requests", 4, "--rounds", 3, "--warmup", 1,
            "--max-tokens", tokens, "--prompt-tokens", 64, "--json", out, prefix=nice)  # fmt: skip
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    # --prompt-tokens went through vLLM's /tokenize; usage reports the same count.
    assert result["prompts"]["unit"] == "tokens" and result["prompts"]["exact"] == result["prompts"]["prompts"]
    for level in result["levels"]:
        assert level["failed"] == 0 and level["output_tokens_mean"] == tokens
        assert level["prompt_tokens_mean"] == 64
        for i, rnd in enumerate(level["rounds"]):
            # The server's deltas cover exactly this round's requests: tokens - 1 gaps each.
            assert rnd["server_itl_count"] == rnd["completed"] * (tokens - 1)
            print(f"c={level['max_concurrency']} round {i + 1}: bench mean TPOT {rnd['mean_tpot_ms']:.2f} ms, "
                  f"vLLM mean ITL {rnd['server_itl_mean_ms']:.2f} ms ({100 * (rnd['mean_tpot_ms'] / rnd['server_itl_mean_ms'] - 1):+.1f}%), "
                  f"TTFT p99 {rnd['p99_ttft_ms']:.0f} ms")  # fmt: skip
        client, server = level["mean_tpot_ms"], level["server_itl_mean_ms"]
        print(f"c={level['max_concurrency']} median of rounds: bench {client:.2f} ms, vLLM {server:.2f} ms ({100 * (client / server - 1):+.1f}%)")
        assert client == pytest.approx(server, rel=0.05)


def test_plan_matches_vllm_with_kv_cache_memory_bytes(servers):
    # Not a whole number of blocks (floor), and a context that is not a whole number of blocks.
    kv_bytes, max_model_len = 300_000_000, 1000
    server = servers("bytes", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_bytes))
    data = plan_against(server, kv_bytes, max_model_len)
    check_exact(data, kv_bytes, max_model_len)
    assert (
        data["engine"]["engine"]["num_gpu_blocks"]
        == kv_bytes // (CPU_BLOCK_SIZE * KV_BYTES_PER_TOKEN)
        == 2288
    )
    # 2288 blocks / 8 blocks per 1000-token request x 1000 tokens: not 2288 x 128.
    assert data["engine"]["engine"]["kv_cache_size_tokens"] == 286_000
