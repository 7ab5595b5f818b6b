"""The vLLM double itself, through real HTTP and real processes.

Daemon tests trust the double to behave as docs/cpu-vllm-notes.md says vLLM does; these
tests are what earns that trust.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from r3090d import config, procstat
from r3090d.argv import build_argv, engine_env, engine_version, parse_version
from tests.fakevllm.harness import FakeVllm, free_port, http, read_sse, sse_events
from tests.waiting import wait_until

pytestmark = pytest.mark.component

REFERENCE_SAMPLES = [Path(__file__).resolve().parents[1] / "data", Path("/work/shared/reference")]


def metric_samples(text: str) -> dict[str, list]:
    """name -> [(labels, value)] for every vllm: sample, through prometheus_client's own parser."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def metric(text: str, name: str, **labels) -> float:
    matches = [v for lab, v in metric_samples(text).get(name, []) if all(lab.get(k) == w for k, w in labels.items())]
    assert len(matches) == 1, f"{name}{labels}: {matches}"
    return matches[0]


def completion(double: FakeVllm, max_tokens: int, prompt: str = "hello there", timeout: float = 10.0, **extra) -> httpx.Response:
    body = {"model": double.served_model_name, "prompt": prompt, "max_tokens": max_tokens, **extra}
    return http().post(double.url + "/v1/completions", json=body, timeout=timeout)


def stream_in_thread(double: FakeVllm, max_tokens: int, prompt: str = "hello there", **extra) -> tuple[threading.Thread, dict]:
    """Streams a completion in the background; result holds events, error and first_token (an Event)."""
    result: dict = {"events": [], "error": None, "first_token": threading.Event()}

    def run():
        body = {"model": double.served_model_name, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **extra}
        try:
            with http().stream("POST", double.url + "/v1/completions", json=body, timeout=20.0) as r:
                result["status"] = r.status_code
                for _, payload in sse_events(r):
                    result["events"].append(payload)
                    result["first_token"].set()
        except httpx.HTTPError as e:
            result["error"] = e
        result["first_token"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return False
    except (ConnectionRefusedError, ConnectionResetError):  # reset: it was in the backlog when the listener closed
        return True


def port_bound(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return False
        except OSError as e:
            return e.errno == errno.EADDRINUSE


def alive(pid: int) -> bool:
    st = procstat.read(pid)
    return st is not None and st.live


def ppid_of(pid: int) -> int:
    st = procstat.read(pid)
    assert st is not None, f"pid {pid} is gone"
    return st.ppid


@pytest.fixture(scope="module")
def surface(fake_engine_python, tmp_path_factory):
    """One double shared by the tests of the HTTP surface; each test leaves its behaviour as it found it."""
    double = FakeVllm(fake_engine_python, "--fake-token-delay", "0.001", "--fake-eos-after", "5", "--max-model-len", "64",
                      "--num-gpu-blocks-override", "64", "--block-size", "16", "--gpu-memory-utilization", "0.92",
                      log_path=tmp_path_factory.mktemp("surface") / "log")  # fmt: skip
    double.start()
    double.wait_healthy()
    yield double
    double.kill_all()


# ----------------------------------------------------------------- launching as the daemon does


def test_version_probe_sees_the_double_as_vllm(fake_engine_python, make_fake_engine_python):
    assert str(engine_version(fake_engine_python)) == "0.32.0"
    assert engine_version(make_fake_engine_python("0.17.1")).parts == (0, 17, 1)


def test_starts_from_the_daemons_own_argv_and_env(fake_engine_python, tmp_path):
    port = free_port()
    cfg = config.from_dict(
        {"engine": {"python": fake_engine_python, "model": str(tmp_path), "served_model_name": "tiny", "port": port,
                    "shutdown_timeout": 5, "extra_args": ["--fake-token-delay", "0.001"]}},  # fmt: skip
        check_files=False,
    )
    double = FakeVllm(fake_engine_python, port=port, log_path=tmp_path / "log")
    double.argv = build_argv(cfg, parse_version("0.32.0"))
    double.env = engine_env(cfg, dict(os.environ))
    double.served_model_name = "tiny"
    try:
        double.start()
        double.wait_healthy()
        state = double.state()
        assert state["unrecognised_args"] == []  # every flag the daemon passes is one the double knows
        assert state["served_model_name"] == "tiny"
        assert completion(double, 3).json()["usage"]["completion_tokens"] == 3
        assert f"Starting vLLM server on http://127.0.0.1:{port}" in double.output()
        assert "Application startup complete." in double.output()
    finally:
        double.kill_all()


def test_startup_delay_binds_the_port_but_refuses_until_loaded(fake_vllm):
    started = time.monotonic()
    # The delay starts once the port is bound, so a slow interpreter start cannot eat into it.
    double = fake_vllm("--fake-startup-delay", "3.0")
    wait_until(lambda: port_bound(double.port), 10, what="the port bound while loading")
    assert refused(double.port)
    double.wait_healthy()
    assert time.monotonic() - started >= 3.0
    assert double.output().index("init engine") < double.output().index("Application startup complete.")


def test_exit_during_start_never_listens(fake_vllm):
    double = fake_vllm("--fake-startup-delay", "0.2", "--fake-exit-during-start", "3")
    assert double.wait(5) == 3
    assert "Application startup complete." not in double.output()
    wait_until(lambda: not double.group_pids(), 2.0, what="the whole group gone")


def test_api_key_in_argv_is_refused_without_echoing_it(fake_vllm):
    double = fake_vllm("--api-key", "hunter2")
    assert double.wait(5) == 2
    assert "VLLM_API_KEY" in double.output()
    assert "hunter2" not in double.output()


def test_extra_args_from_the_environment(fake_vllm):
    double = fake_vllm(env={"FAKEVLLM_ARGS": "--fake-metrics-shape leak --fake-kv-usage 0.97"})
    double.wait_healthy()
    assert metric(http().get(double.url + "/metrics").text, "vllm:kv_cache_usage_perc") == 0.97


# ----------------------------------------------------------------- the OpenAI surface


def test_stream_paces_tokens_and_ends_with_length_then_done(surface):
    double = surface
    double.control(token_delay=0.03)
    try:
        body = {"model": "fake", "prompt": "one two three", "max_tokens": 15, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with http().stream("POST", double.url + "/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            timed = list(sse_events(r))
    finally:
        double.control(token_delay=0.001)
    payloads = [p for _, p in timed]
    assert payloads[-1] == "[DONE]"
    usage_chunk = payloads[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 15, "total_tokens": 18}
    token_chunks = payloads[:-2]
    assert len(token_chunks) == 15
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 14 + ["length"]
    gaps = [b - a for (a, _), (b, _) in zip(timed[:14], timed[1:15], strict=True)]
    assert 0.025 <= statistics.median(gaps) <= 0.06, gaps
    text = "".join(c["choices"][0]["text"] for c in token_chunks)
    assert completion(double, 15, prompt="one two three", ignore_eos=True).json()["choices"][0]["text"] == text


def test_chat_completions_stream_and_plain(surface):
    double = surface
    body = {"model": "fake", "messages": [{"role": "user", "content": "say something"}], "max_tokens": 4}
    with http().stream("POST", double.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10) as r:
        events = read_sse(r)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in events[1:-1]] == [None, None, None, "length"]
    assert events[-1] == "[DONE]"
    plain = http().post(double.url + "/v1/chat/completions", json=body, timeout=10).json()
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["message"]["content"] == "".join(e["choices"][0]["delta"]["content"] for e in events[1:-1])
    assert plain["usage"]["completion_tokens"] == 4
    assert plain["usage"]["total_tokens"] == plain["usage"]["prompt_tokens"] + 4


def test_eos_ends_early_unless_ignored(surface):
    early = completion(surface, 10).json()  # the surface double stops at 5 tokens
    assert (early["choices"][0]["finish_reason"], early["usage"]["completion_tokens"]) == ("stop", 5)
    full = completion(surface, 10, ignore_eos=True).json()
    assert (full["choices"][0]["finish_reason"], full["usage"]["completion_tokens"]) == ("length", 10)


def test_bad_requests_get_vllm_style_errors(surface):
    url = surface.url
    bad_json = http().post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "BadRequestError"
    wrong_model = http().post(url + "/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 1})
    assert wrong_model.status_code == 404 and "`other` does not exist" in wrong_model.json()["error"]["message"]
    assert completion(surface, 0).status_code == 400
    assert completion(surface, 2, prompt=["two", "prompts"]).status_code == 400
    too_long = completion(surface, 100)
    assert too_long.status_code == 400 and "maximum context length is 64" in too_long.json()["error"]["message"]
    assert http().get(url + "/v1/completions").status_code == 405
    assert http().get(url + "/nope").status_code == 404
    assert http().get(url + "/v1/models").json()["data"][0]["max_model_len"] == 64
    assert http().get(url + "/version").json() == {"version": "0.32.0"}


def test_request_log_records_path_and_status(surface):
    before = time.time()
    http().get(surface.url + "/v1/models")
    http().get(surface.url + "/nope")
    recent = [(e["method"], e["path"], e["status"]) for e in surface.request_log() if e["t"] >= before]
    assert recent == [("GET", "/v1/models", 200), ("GET", "/nope", 404)]


# ----------------------------------------------------------------- the known-answer canary

CANARY_PROMPT = "The capital of France is"
CANARY_SAMPLING = {"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1, "presence_penalty": 0,
                   "frequency_penalty": 0, "seed": 3090, "ignore_eos": True}  # fmt: skip


def canary(double: FakeVllm, prompt: str = CANARY_PROMPT, **extra) -> dict:
    """choices[0] of a canary completion: 16 greedy tokens with their top-2 log-probabilities, as token ids."""
    body = {**CANARY_SAMPLING, "logprobs": 2, "return_tokens_as_token_ids": True, "cache_salt": "ab12cd34", **extra}
    r = completion(double, 16, prompt=prompt, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def token_ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def ranked_top(choice: dict) -> list[list[tuple[str, float]]]:
    """Each position's top log-probabilities, best first."""
    return [sorted(top.items(), key=lambda kv: -kv[1]) for top in choice["logprobs"]["top_logprobs"]]


def margins(choice: dict) -> list[float]:
    return [first[1] - second[1] for first, second, *_ in ranked_top(choice)]


def test_logprobs_in_vllms_completion_shape(surface):
    choice = canary(surface)
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert all(len(v) == 16 for v in lp.values())
    assert len(set(token_ids(choice))) > 1  # every token is "token_id:N", N an int
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], ranked_top(choice), strict=True):
        assert len(top) == 2 and top[0] == (token, logprob)  # the generated token is the greedy top-1
        assert top[1][0].startswith("token_id:") and top[1][0] != token
        assert 0 > top[0][1] > top[1][1]
        assert sum(math.exp(v) for _, v in top) < 1
    assert margins(choice) == pytest.approx([3.0] * 16)
    # vLLM advances text_offset by the reported token's length, "token_id:N" included.
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(16)]

    as_text = canary(surface, return_tokens_as_token_ids=False, logprobs=3)
    lp = as_text["logprobs"]
    assert as_text["text"] == choice["text"] == "".join(lp["tokens"])
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(16)]
    assert all(len(top) == 3 and next(iter(top)) == token for top, token in zip(lp["top_logprobs"], lp["tokens"], strict=True))
    assert margins(as_text) == margins(choice)

    assert completion(surface, 3, ignore_eos=True).json()["choices"][0]["logprobs"] is None
    for bad in (21, -1, "2", True):
        r = completion(surface, 3, logprobs=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", bad


def test_greedy_answers_depend_on_the_prompt_only(surface):
    first = canary(surface)
    surface.control(token_delay=0.02)
    try:
        # Another greedy stream shares every engine step; the canary needs 16 of them, the stream 40.
        thread, result = stream_in_thread(surface, 40, "a long story about a dog", temperature=0, ignore_eos=True)
        assert result["first_token"].wait(5)
        during = canary(surface)
        assert thread.is_alive()
    finally:
        surface.control(token_delay=0.001)
    thread.join(10)
    assert during == first
    assert canary(surface) == first
    other = canary(surface, "Another prompt")
    assert token_ids(other) != token_ids(first)
    # The same greedy answer without logprobs (a liveness probe), and streamed.
    plain = completion(surface, 16, prompt=CANARY_PROMPT, **CANARY_SAMPLING).json()["choices"][0]
    assert plain["text"] == first["text"] and plain["logprobs"] is None
    with_text = canary(surface, return_tokens_as_token_ids=False)
    body = {"model": "fake", "prompt": CANARY_PROMPT, "max_tokens": 16, "stream": True, "logprobs": 2, **CANARY_SAMPLING}
    with http().stream("POST", surface.url + "/v1/completions", json=body, timeout=10) as r:
        chunks = [e["choices"][0] for e in read_sse(r)[:-1]]
    assert "".join(c["text"] for c in chunks) == first["text"]
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        assert [x for c in chunks for x in c["logprobs"][key]] == with_text["logprobs"][key], key


def test_canary_margins_set_the_unfaulted_margins(surface):
    baseline = canary(surface)
    state = surface.control(canary_margins=[5, 0.2, 0.05])
    try:
        assert state["canary_margins"] == [5.0, 0.2, 0.05]
        answer = canary(surface)
        assert margins(answer) == pytest.approx([5, 0.2, 0.05] + [3.0] * 13)
        assert token_ids(answer) == token_ids(baseline)  # the margins move, the tokens do not
    finally:
        surface.control(canary_margins=[])
    assert margins(canary(surface)) == pytest.approx([3.0] * 16)


def test_canary_fault_answers_the_runner_up_from_a_position_on(surface):
    baseline = canary(surface)
    baseline_top = ranked_top(baseline)
    plain_before = completion(surface, 16, prompt=CANARY_PROMPT, **CANARY_SAMPLING).json()["choices"][0]["text"]
    state = surface.control(canary_fault={"from": 5, "margin": 0.25})
    try:
        assert state["canary_fault"] == {"from": 5, "margin": 0.25}
        faulted = canary(surface)
        assert token_ids(faulted)[:5] == token_ids(baseline)[:5]
        assert all(a != b for a, b in zip(token_ids(faulted)[5:], token_ids(baseline)[5:], strict=True))
        assert margins(faulted) == pytest.approx([3.0] * 5 + [0.25] * 11)
        for pos, top in enumerate(ranked_top(faulted)[5:], start=5):
            # The old runner-up leads, the old top-1 is now the runner-up.
            assert [token for token, _ in top] == [baseline_top[pos][1][0], baseline_top[pos][0][0]]
        assert faulted["text"] != baseline["text"]
        # Liveness probes and load (no logprobs) are not faulted.
        assert completion(surface, 16, prompt=CANARY_PROMPT, **CANARY_SAMPLING).json()["choices"][0]["text"] == plain_before

        surface.control(canary_fault={"from": 0, "margin": 20})
        corrupt = canary(surface)
        assert all(a != b for a, b in zip(token_ids(corrupt), token_ids(baseline), strict=True))
        assert margins(corrupt) == pytest.approx([20.0] * 16)
    finally:
        state = surface.control(canary_fault=None)
    assert state["canary_fault"] is None
    assert canary(surface) == baseline


@pytest.mark.parametrize(
    "body",
    [
        {"canary_margins": 0.5},
        {"canary_margins": [1, "2"]},
        {"canary_margins": [-0.1]},
        {"canary_margins": [True]},
        {"canary_margins": [1e9]},
        {"canary_fault": {"from": 3}},
        {"canary_fault": {"from": 3, "margin": 1, "to": 9}},
        {"canary_fault": {"from": -1, "margin": 1}},
        {"canary_fault": {"from": 1.5, "margin": 1}},
        {"canary_fault": {"from": 2, "margin": -1}},
        {"canary_fault": {"from": 2, "margin": "big"}},
        {"canary_fault": [2, 1.0]},
        {"canary_fault": False},
    ],
)
def test_canary_control_rejects_bad_bodies(surface, body):
    r = http().post(surface.url + "/fake/control", json=body)
    assert r.status_code == 400 and next(iter(body)) in r.json()["error"]["message"]
    assert (surface.state()["canary_margins"], surface.state()["canary_fault"]) == ([], None)


def test_request_log_keeps_the_request_fields(surface):
    before = time.time()
    canary(surface)
    completion(surface, 2, prompt=" ".join(["w"] * 40))
    http().post(surface.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    logged = [e for e in surface.request_log() if e["t"] >= before]
    assert [e["path"] for e in logged] == ["/v1/completions", "/v1/completions", "/v1/chat/completions"]
    assert logged[0]["body"] == {"model": "fake", "prompt": CANARY_PROMPT, "max_tokens": 16, **CANARY_SAMPLING, "logprobs": 2,
                                 "return_tokens_as_token_ids": True, "cache_salt": "ab12cd34"}  # fmt: skip
    assert logged[1]["body"]["prompt"] == " ".join(["w"] * 40)[:200]  # prompts are cut short
    assert logged[2]["body"] == {"max_tokens": 2}  # messages are left out


def test_api_key_guards_v1_only(fake_vllm):
    double = fake_vllm(env={"VLLM_API_KEY": "s3cret-key"})
    double.wait_healthy()
    before = time.time()
    assert http().get(double.url + "/v1/models").status_code == 401
    assert http().get(double.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": "Bearer s3cret-key"}
    assert http().get(double.url + "/v1/models", headers=auth).status_code == 200
    assert http().post(double.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth).status_code == 200
    assert http().get(double.url + "/health").status_code == 200
    assert http().get(double.url + "/metrics").status_code == 200
    assert double.state()["api_key_required"] is True
    assert [e["status"] for e in double.request_log() if e["t"] >= before] == [401, 401, 200, 200, 200, 200]
    assert "s3cret-key" not in double.output()


# ----------------------------------------------------------------- /metrics


def test_metrics_count_real_tokens_and_parse_with_prometheus_client(surface):
    double = surface
    before = http().get(double.url + "/metrics").text
    r = completion(double, 7, prompt="a b c", ignore_eos=True).json()
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10, "prompt_tokens_details": None}
    after = http().get(double.url + "/metrics").text
    for name, delta in [("vllm:generation_tokens_total", 7), ("vllm:prompt_tokens_total", 3),
                        ("vllm:time_to_first_token_seconds_count", 1), ("vllm:inter_token_latency_seconds_count", 6),
                        ("vllm:e2e_request_latency_seconds_count", 1)]:  # fmt: skip
        assert metric(after, name) - metric(before, name) == delta, name
    success = ("vllm:request_success_total", {"finished_reason": "length"})
    assert metric(after, success[0], **success[1]) - metric(before, success[0], **success[1]) == 1
    samples = metric_samples(after)
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total"):
        assert samples[name] == [({"engine": "0", "model_name": "fake"}, 0.0)]
    (cache_labels, one), = samples["vllm:cache_config_info"]  # fmt: skip
    assert one == 1.0
    assert (cache_labels["num_gpu_blocks"], cache_labels["block_size"], cache_labels["gpu_memory_utilization"]) == ("64", "16", "0.92")
    assert cache_labels["kv_cache_size_tokens"] == "1024"


def test_kv_usage_follows_in_flight_streams(fake_vllm):
    # 65 blocks of 16 tokens: 64 usable after the null block. 20 tokens at 0.2 s: all three
    # streams are still running when /metrics is read, however slowly the threads start.
    double = fake_vllm("--fake-token-delay", "0.2", "--num-gpu-blocks-override", "65", "--block-size", "16")
    double.wait_healthy()
    prompt = " ".join(["w"] * 20)
    threads = [stream_in_thread(double, 20, prompt) for _ in range(3)]
    for _, result in threads:
        assert result["first_token"].wait(5)
    text = http().get(double.url + "/metrics").text
    assert metric(text, "vllm:num_requests_running") == 3
    used_blocks = metric(text, "vllm:kv_cache_usage_perc") * 64
    # Each request holds ceil((20 prompt + generated) / 16) blocks: 2 or 3 while it runs.
    assert 6 <= round(used_blocks) <= 9 and abs(used_blocks - round(used_blocks)) < 1e-9
    for thread, result in threads:
        thread.join(10)
        assert result["events"][-2]["choices"][0]["finish_reason"] == "length"
    text = http().get(double.url + "/metrics").text
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(text, "vllm:num_requests_running") == 0


def test_kv_exhaustion_fills_the_cache_and_preempts(fake_vllm):
    # 4 usable blocks of 16 tokens; three requests of 10 + 25 tokens cannot all fit. 50 ms a
    # step keeps the cache full for long enough that a sampler on a loaded machine sees it.
    double = fake_vllm("--fake-token-delay", "0.05", "--num-gpu-blocks-override", "5", "--block-size", "16", "--max-model-len", "64")
    double.wait_healthy()
    results = []
    threads = [threading.Thread(target=lambda: results.append(completion(double, 25, " ".join(["w"] * 10)).json())) for _ in range(3)]
    for t in threads:
        t.start()
    peak_usage = peak_waiting = 0.0
    while any(t.is_alive() for t in threads):
        text = http().get(double.url + "/metrics").text
        peak_usage = max(peak_usage, metric(text, "vllm:kv_cache_usage_perc"))
        peak_waiting = max(peak_waiting, metric(text, "vllm:num_requests_waiting"))
        time.sleep(0.01)
    assert peak_usage == 1.0
    assert peak_waiting >= 1
    assert metric(http().get(double.url + "/metrics").text, "vllm:num_preemptions_total") >= 1
    assert [(r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) for r in results] == [("length", 25)] * 3


def test_metrics_shapes_from_the_control_endpoint(fake_vllm):
    double = fake_vllm("--fake-token-delay", "0.001")
    double.wait_healthy()
    completion(double, 5)
    gen = lambda: metric(http().get(double.url + "/metrics").text, "vllm:generation_tokens_total")  # noqa: E731
    assert gen() == 5

    double.control(metrics="leak", kv_usage=0.93)
    completion(double, 5)  # real traffic, hidden by the flat shape
    text = http().get(double.url + "/metrics").text
    assert (metric(text, "vllm:kv_cache_usage_perc"), metric(text, "vllm:num_requests_running")) == (0.93, 0)
    assert gen() == 5

    double.control(metrics="load", kv_usage=0.9, load_running=6, load_tokens_per_s=500)
    first = gen()
    # The load shape's counter advances on its own.
    wait_until(lambda: gen() - first >= 100, 10, what="100 generated tokens")
    text = http().get(double.url + "/metrics").text
    assert metric(text, "vllm:num_requests_running") == 6 and metric(text, "vllm:kv_cache_usage_perc") == 0.9
    assert metric(text, "vllm:generation_tokens_total") - first >= 100

    double.control(metrics="idle")
    idle = http().get(double.url + "/metrics").text
    assert metric(idle, "vllm:kv_cache_usage_perc") == 0.0 and metric(idle, "vllm:num_requests_running") == 0
    flat = gen()
    time.sleep(0.1)  # time passing on purpose: the idle shape's counter stays where it is
    assert gen() == flat

    double.control(metrics="live", metrics_values={"waiting": 5, "preemptions": 9})
    live = http().get(double.url + "/metrics").text
    assert metric(live, "vllm:generation_tokens_total") >= flat  # counters never go backwards
    assert (metric(live, "vllm:num_requests_waiting"), metric(live, "vllm:num_preemptions_total")) == (5, 9)

    double.control(metrics="garbage")
    with pytest.raises(ValueError):
        metric_samples(http().get(double.url + "/metrics").text)

    bad = http().post(double.url + "/fake/control", json={"metrics": "sideways"})
    assert bad.status_code == 400 and "metrics must be one of" in bad.json()["error"]["message"]
    assert http().post(double.url + "/fake/control", json={"frobnicate": 1}).status_code == 400


def test_metrics_file_serves_a_real_capture(fake_vllm):
    samples = [d / "vllm-0.32-metrics-kv-full.txt" for d in REFERENCE_SAMPLES if (d / "vllm-0.32-metrics-kv-full.txt").exists()]
    if not samples:
        pytest.skip("no real vLLM /metrics capture present")
    sample = samples[0]
    double = fake_vllm("--fake-metrics-file", str(sample))
    double.wait_healthy()
    assert http().get(double.url + "/metrics").text == sample.read_text()


# ----------------------------------------------------------------- health, hangs, deaths


def test_health_503_after_and_hang_from_control(fake_vllm):
    double = fake_vllm("--fake-health-503-after", "0.3")
    double.wait_healthy()
    wait_until(lambda: http().get(double.url + "/health").status_code == 503, 2.0, what="/health 503")
    double.control(health="ok", hang=True)
    hung_result = {}
    hung = threading.Thread(target=lambda: hung_result.update(r=http().get(double.url + "/health", timeout=5)))
    hung.start()
    with pytest.raises(httpx.ReadTimeout):
        http().get(double.url + "/health", timeout=0.5)
    assert double.request_log()[-1]["status"] is None  # accepted, never answered
    double.control(hang=False)
    hung.join(5)
    assert hung_result["r"].status_code == 200


def test_hang_after(fake_vllm):
    double = fake_vllm("--fake-hang-after", "0.2")
    double.wait_healthy()
    wait_until(lambda: double.state()["hang"], 2.0, what="the hang")  # the double's own endpoints still answer
    with pytest.raises(httpx.ReadTimeout):
        http().get(double.url + "/health", timeout=0.3)


def test_frozen_engine_core_stalls_generation_but_not_health(fake_vllm):
    double = fake_vllm("--fake-token-delay", "0.001")
    double.wait_healthy()
    completion(double, 4)
    core = double.state()["engine_core_pid"]
    os.kill(core, signal.SIGSTOP)
    try:
        wait_until(lambda: double.state()["engine_core_state"] == "T", 2.0, what="the EngineCore stopped")
        started = time.monotonic()
        assert http().get(double.url + "/health").status_code == 200
        assert time.monotonic() - started < 1.0
        before = http().get(double.url + "/metrics").text
        with pytest.raises(httpx.ReadTimeout):
            completion(double, 2, timeout=2.0)
        after = http().get(double.url + "/metrics").text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            assert metric(after, name) == 0
        assert metric(after, "vllm:generation_tokens_total") == metric(before, "vllm:generation_tokens_total") == 4
    finally:
        os.kill(core, signal.SIGCONT)
    assert completion(double, 3).json()["usage"]["completion_tokens"] == 3

    double.control(freeze=True)
    assert double.state()["engine_core_state"] == "T"
    with pytest.raises(httpx.ReadTimeout):
        completion(double, 2, timeout=0.3)
    double.control(freeze=False)
    assert completion(double, 2).status_code == 200


def test_engine_core_death_errors_streams_then_the_server_exits(fake_vllm):
    double = fake_vllm("--fake-token-delay", "0.05", "--fake-dead-exit-delay", "3")
    double.wait_healthy()
    thread, result = stream_in_thread(double, 100)
    assert result["first_token"].wait(5)
    state = double.state()
    os.kill(state["engine_core_pid"], signal.SIGKILL)
    wait_until(lambda: http().get(double.url + "/health").status_code == 503, 2.0, what="/health 503")
    thread.join(5)
    assert result["events"][-2]["error"]["code"] == 500 and result["events"][-1] == "[DONE]"
    assert double.wait(5) == 0  # vLLM may exit 0 after its engine died (issue 48966)
    wait_until(lambda: not alive(state["worker_pid"]), 2.0, what="the worker gone")


def test_exit_after_with_code(fake_vllm):
    double = fake_vllm("--fake-exit-after", "0.3", "7", "--fake-dead-exit-delay", "0.1")
    double.wait_healthy()
    started = time.monotonic()
    assert double.wait(5) == 7
    assert 0.15 <= time.monotonic() - started < 3


# ----------------------------------------------------------------- signals and the process tree


def test_process_tree_has_three_levels_in_one_group(fake_vllm):
    double = fake_vllm()
    double.wait_healthy()
    state = double.state()
    assert state["pid"] == double.pid
    assert ppid_of(state["engine_core_pid"]) == double.pid
    assert ppid_of(state["worker_pid"]) == state["engine_core_pid"]
    assert double.group_pids() == {double.pid, state["engine_core_pid"], state["worker_pid"]}
    assert Path(f"/proc/{state['engine_core_pid']}/comm").read_text().strip() == "fake-EngineCore"
    assert b"fake-EngineCore" in Path(f"/proc/{state['engine_core_pid']}/cmdline").read_bytes()


def test_sigterm_with_shutdown_timeout_drains_streams(fake_vllm):
    double = fake_vllm("--fake-token-delay", "0.03", shutdown_timeout=10)
    double.wait_healthy()
    thread, result = stream_in_thread(double, 150)  # 4.5 s: the drain is still on after the port check
    assert result["first_token"].wait(5)
    double.signal(signal.SIGTERM)
    wait_until(lambda: refused(double.port), 2.0, what="no new connections while draining")
    assert double.proc.poll() is None
    thread.join(15)
    assert result["error"] is None
    tokens = [e for e in result["events"] if e != "[DONE]"]
    assert len(tokens) == 150 and tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert result["events"][-1] == "[DONE]"
    assert double.wait(5) == 0
    wait_until(lambda: not double.group_pids(), 2.0, what="the whole group gone")


def test_sigterm_to_the_whole_group_kills_the_core_and_errors_streams(fake_vllm):
    # docs/cpu-vllm-notes.md: a group SIGTERM kills EngineCore at once; streams get a 500 chunk, then [DONE].
    double = fake_vllm("--fake-token-delay", "0.03", shutdown_timeout=10)
    double.wait_healthy()
    thread, result = stream_in_thread(double, 100)
    assert result["first_token"].wait(5)
    started = time.monotonic()
    os.killpg(double.pid, signal.SIGTERM)
    thread.join(5)
    assert result["events"][-2]["error"]["code"] == 500 and result["events"][-1] == "[DONE]"
    assert len(result["events"]) < 50
    assert double.wait(5) == 0
    assert time.monotonic() - started < 3


def test_sigterm_without_shutdown_timeout_cuts_streams(fake_vllm):
    double = fake_vllm("--fake-token-delay", "0.03")
    double.wait_healthy()
    thread, result = stream_in_thread(double, 1000)  # 30 s if it were drained
    assert result["first_token"].wait(5)
    started = time.monotonic()
    double.signal(signal.SIGTERM)
    assert double.wait(10) == 0
    assert time.monotonic() - started < 5.0
    thread.join(5)
    assert "[DONE]" not in result["events"]
    assert len(result["events"]) < 1000


def test_engine_core_that_ignores_sigterm_is_left_running(fake_vllm):
    double = fake_vllm("--fake-grandchild-ignores-sigterm", "--fake-core-shutdown-wait", "-1")
    double.wait_healthy()
    core = double.state()["engine_core_pid"]
    double.signal(signal.SIGTERM)
    assert double.wait(5) == 0
    time.sleep(0.2)  # time passing on purpose: nothing kills the core that ignored SIGTERM
    assert alive(core) and ppid_of(core) != double.pid
    assert core in double.group_pids()  # still in the group, so a group SIGKILL reaches it


def test_engine_core_that_ignores_sigterm_is_killed_after_the_wait(fake_vllm):
    double = fake_vllm("--fake-grandchild-ignores-sigterm", "--fake-core-shutdown-wait", "0.5")
    double.wait_healthy()
    started = time.monotonic()
    double.signal(signal.SIGTERM)
    assert double.wait(5) == 0
    assert time.monotonic() - started >= 0.5
    wait_until(lambda: not double.group_pids(), 2.0, what="the whole group gone")


def test_sigkill_of_the_server_orphans_core_and_worker(fake_vllm):
    double = fake_vllm()
    double.wait_healthy()
    state = double.state()
    double.signal(signal.SIGKILL)
    double.wait(5)
    time.sleep(0.3)  # time passing on purpose: the orphans outlive the server
    assert alive(state["engine_core_pid"]) and alive(state["worker_pid"])
    assert double.group_pids() == {state["engine_core_pid"], state["worker_pid"]}


def test_control_exit_leaves_the_core_behind(fake_vllm):
    double = fake_vllm()
    double.wait_healthy()
    core = double.state()["engine_core_pid"]
    double.control(exit=4)
    assert double.wait(5) == 4
    assert alive(core)


def test_port_in_use_fails_fast(fake_vllm):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        double = fake_vllm(port=s.getsockname()[1])
        assert double.wait(5) == 1
    assert "Address already in use" in double.output()


def test_runs_as_a_plain_script(tmp_path):
    port = free_port()
    script = Path(__file__).resolve().parents[1] / "fakevllm" / "server.py"
    proc = subprocess.Popen([os.sys.executable, str(script), "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: not refused(port), 5.0, what="the port accepting")
        assert http().get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
