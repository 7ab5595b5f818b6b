"""The CPU engine that `make demo` and the real-vLLM tests stand on, started from
the argv and environment r3090d builds for a config written by vllm_config_writer.

It checks the facts in docs/cpu-vllm-notes.md that other tests and the vLLM test
double rely on: the KV arithmetic, the process tree and its process group, the
frozen-EngineCore hang that /health does not see, and the orphans a SIGKILL of
the API server leaves. One engine serves the whole module; the last test kills it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import psutil
import pytest

from r3090d import argv as argvmod
from r3090d import config as configmod
from tests.e2e.real_vllm import CPU_BLOCK_SIZE, VllmProcess, predicted_kv, write_vllm_config
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

KV_SPACE_GIB = 1


class Engine(VllmProcess):
    def __init__(self, cfg: configmod.Config, log_path):
        self.cfg = cfg
        argv = argvmod.build_argv(cfg, argvmod.engine_version(cfg.engine.python))
        super().__init__(argv, argvmod.engine_env(cfg, dict(os.environ)), cfg.engine_url, log_path, cfg.engine.startup_timeout)

    def descendants(self) -> dict[str, psutil.Process]:
        return {p.name(): p for p in psutil.Process(self.proc.pid).children(recursive=True)}


@pytest.fixture(scope="module")
def engine(engine_python, tiny_model, vllm_lock, tmp_path_factory):
    directory = tmp_path_factory.mktemp("real-vllm")
    path = write_vllm_config(directory / "r3090d.toml", engine_python=engine_python, model=tiny_model, kv_space_gib=KV_SPACE_GIB)
    eng = Engine(configmod.load(path), directory / "vllm.log")
    try:
        print(f"vLLM ready in {eng.wait_ready():.1f} s: {' '.join(eng.argv)}")
        yield eng
    finally:
        eng.kill_group()


def complete(url: str, model: str, max_tokens: int, timeout: float) -> dict:
    body = {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def cache_config_info(url: str) -> dict[str, str]:
    text = httpx.get(url + "/metrics", timeout=5).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def test_kv_cache_size_is_the_explicit_space_over_the_bytes_per_token(engine, tiny_model):
    info = cache_config_info(engine.url)
    blocks, tokens = predicted_kv(KV_SPACE_GIB << 30, tiny_model)
    assert int(info["block_size"]) == CPU_BLOCK_SIZE
    assert int(info["kv_cache_memory_bytes"]) == KV_SPACE_GIB << 30
    assert (int(info["num_gpu_blocks"]), int(info["kv_cache_size_tokens"])) == (blocks, tokens)
    max_model_len = engine.cfg.active_profile.max_model_len
    assert float(info["kv_cache_max_concurrency"]) == pytest.approx(tokens / max_model_len)


def test_streamed_completion_ends_on_length_then_done(engine):
    body = {"model": engine.cfg.model_name, "prompt": "hello", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events = []
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    assert finishes == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 24


def test_tree_is_api_server_engine_core_worker_in_one_group(engine):
    main = psutil.Process(engine.proc.pid)
    kids = engine.descendants()
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(kids)
    assert kids["VLLM::EngineCore"].ppid() == main.pid
    assert kids["VLLM::Worker"].ppid() == kids["VLLM::EngineCore"].pid
    # vLLM never calls setsid: every process stays in the group the launcher made.
    assert {os.getpgid(p.pid) for p in kids.values()} == {main.pid}


@pytest.mark.parametrize("frozen", ["VLLM::EngineCore", "VLLM::Worker"])
def test_sigstop_freezes_generation_while_health_answers(engine, frozen):
    target = engine.descendants()[frozen]
    target.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: target.status() == psutil.STATUS_STOPPED, 5, what=f"{frozen} stopped")
        with httpx.Client(timeout=2) as client:  # built first: building one is slow on a busy machine
            started = time.monotonic()
            assert client.get(engine.url + "/health").status_code == 200
            assert time.monotonic() - started < 1.0
        with pytest.raises(httpx.TimeoutException):
            complete(engine.url, engine.cfg.model_name, 4, timeout=5)
    finally:
        target.send_signal(signal.SIGCONT)
    assert complete(engine.url, engine.cfg.model_name, 4, timeout=60)["choices"][0]["finish_reason"] == "length"


def test_sigkill_of_the_api_server_orphans_engine_core_and_worker(engine):
    """Destroys the module's engine: keep it last."""
    kids = engine.descendants()
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait(10)
    time.sleep(3)  # time passing on purpose: the orphans outlive the API server
    for name in ("VLLM::EngineCore", "VLLM::Worker"):
        proc = kids[name]
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE, f"{name} exited"
        assert os.getpgid(proc.pid) == engine.proc.pid  # so killpg of the old group still reaches it
    assert kids["VLLM::EngineCore"].ppid() != engine.proc.pid
