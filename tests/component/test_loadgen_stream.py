"""The streaming client against a real HTTP server on 127.0.0.1 that misbehaves on request."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from r3090d.measure import loadgen
from tests.loopback_http import QuietHandler, base_url, serving

pytestmark = pytest.mark.component


def sse(obj) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {payload}\n\n".encode()


def chunk(text, usage=None, finish=None):
    event = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        event["usage"] = usage
    return sse(event)


class Handler(QuietHandler):
    def do_GET(self):
        self.answer(200, json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = request["prompt"]
        if mode == "http500":
            body = json.dumps({"error": {"message": "engine is on fire", "code": 500}}).encode()
            self.answer(500, body, content_type=None)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        events = {
            # 5 tokens, 20 ms apart, per-chunk usage (as vLLM with continuous_usage_stats)
            "good": [chunk("t", {"prompt_tokens": 7, "completion_tokens": i + 1}) for i in range(5)] + [sse("[DONE]")],
            # 6 tokens in 3 chunks, counted only by the final usage chunk
            "coalesced": [chunk("ab"), chunk("cd"), chunk("ef", finish="length"), sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}), sse("[DONE]")],
            "no_done": [chunk("a"), chunk("b")],
            "garbage": [chunk("a"), b"data: {not json\n\n"],
            "bad_shape": [chunk("a"), sse({"choices": "nope"})],
            "error_event": [chunk("a"), sse({"error": {"message": "EngineCore encountered an issue", "code": 500}}), sse("[DONE]")],
        }[mode]
        for event in events:
            self.wfile.write(event)
            self.wfile.flush()
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    with serving(Handler) as httpd:
        yield base_url(httpd)


def stream(url, prompt, **kw):
    async def go():
        async with loadgen.make_client(4) as client:
            return await loadgen.stream_request(client, loadgen.Target(url=url, model="m", **kw), prompt)

    return asyncio.run(go())


def test_a_good_stream_is_timed(server):
    r = stream(server, "good")
    assert r.ok and r.output_tokens == 5 and r.prompt_tokens == 7
    assert r.tpot_s == pytest.approx(0.02, abs=0.01)
    assert len(r.itl_s) == 4
    assert r.ttft_s < r.e2e_s


def test_tokens_counted_by_the_final_usage_chunk(server):
    r = stream(server, "coalesced", continuous_usage=False)
    assert r.ok and r.output_tokens == 6 and r.finish_reason == "length"
    # (last chunk - first chunk) over the 5 tokens after the first
    first, last = r.arrivals[0][0], r.arrivals[-1][0]
    assert r.tpot_s == pytest.approx((last - first) / 5)


@pytest.mark.parametrize(
    "mode, reason",
    [
        ("http500", "HTTP 500: engine is on fire"),
        ("no_done", "stream ended without [DONE]"),
        ("garbage", "malformed stream event"),
        ("bad_shape", "malformed stream event: choices is not a list of objects"),
        ("error_event", "error in stream: EngineCore encountered an issue"),
    ],
)
def test_failures_become_reasons(server, mode, reason):
    r = stream(server, mode)
    assert not r.ok
    assert r.error == reason


def test_refused_and_timeout():
    r = stream("http://127.0.0.1:9", "good")
    assert not r.ok and r.error == "connection refused"
    # A server that accepts and never answers: the per-request timeout ends it.
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        r = stream(f"http://127.0.0.1:{port}", "good", timeout_s=0.5)
    assert not r.ok and r.error.startswith("timeout")
