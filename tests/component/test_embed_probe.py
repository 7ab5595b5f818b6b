"""The inference probe of an embedding engine: a 1-input /v1/embeddings request, never a completion.

Over real HTTP against the vLLM double (its /v1/embeddings goes through its engine core, so a frozen
core stalls it as it stalls a completion), and against servers whose one answer the test fixes.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from r3090d.config import EngineKind
from r3090d.probes import inference
from r3090d.probes.inference import InferenceProber, judge_embedding

pytestmark = pytest.mark.component

SERVED = "emb"
KEY = "sk-embed-test"
# Room for a loaded 2-core machine: the double answers an embedding in milliseconds.
PROBE_TIMEOUT_S = 5.0
REPORT_WITHIN_S = PROBE_TIMEOUT_S + inference.OVERDUE_MARGIN_S + 10


def probe_once(prober: InferenceProber, wake: threading.Event):
    """Send one probe and wait for its result (the prober sets `wake` when it has one)."""
    wake.clear()
    prober.send()
    assert wake.wait(REPORT_WITHIN_S), "the probe never reported"
    return prober.sample()


def prober_for(url: str, kind: EngineKind, *, key: str = "", timeout: float = PROBE_TIMEOUT_S) -> tuple[InferenceProber, threading.Event]:
    wake = threading.Event()
    return InferenceProber(url, SERVED, key, timeout, wake=wake, kind=kind), wake


def probe_paths(double) -> list[str]:
    return [r["path"] for r in double.request_log() if r["path"].startswith("/v1/")]


@pytest.fixture
def embed_double(fake_vllm):
    double = fake_vllm(served_model_name=SERVED, env={"VLLM_API_KEY": KEY})
    double.wait_healthy(30)
    return double


# ------------------------------------------------------------ the vLLM double


def test_an_embedding_engine_is_probed_with_one_embedding_and_never_a_completion(embed_double):
    prober, wake = prober_for(embed_double.url, EngineKind.EMBED, key=KEY)
    first = probe_once(prober, wake)
    assert first.ok is True, first.detail
    second = probe_once(prober, wake)
    assert second.ok is True and second.consecutive_failures == 0 and second.sent_total == 2
    log = [r for r in embed_double.request_log() if r["path"].startswith("/v1/")]
    assert [r["path"] for r in log] == ["/v1/embeddings", "/v1/embeddings"]
    assert all(r["status"] == 200 for r in log)
    assert log[0]["body"]["model"] == SERVED and log[0]["body"]["input"] == "ping"


def test_the_kind_chooses_the_request(embed_double):
    """The same class against the same engine: a generative engine's probe is the 1-token completion."""
    prober, wake = prober_for(embed_double.url, EngineKind.GENERATE, key=KEY)
    assert probe_once(prober, wake).ok is True
    assert probe_paths(embed_double) == ["/v1/completions"]


def test_a_frozen_core_fails_the_embedding_probe_and_a_thawed_one_passes(embed_double):
    prober, wake = prober_for(embed_double.url, EngineKind.EMBED, key=KEY, timeout=1.0)
    assert probe_once(prober, wake).ok is True
    embed_double.control(freeze=True)  # SIGSTOP of the core: /health stays 200, an embedding never finishes
    try:
        frozen = probe_once(prober, wake)
        assert frozen.ok is False and "no answer within" in frozen.detail, frozen.detail
        assert frozen.consecutive_failures == 1
    finally:
        embed_double.control(freeze=False)
    thawed = probe_once(prober, wake)
    assert thawed.ok is True and thawed.consecutive_failures == 0, thawed.detail


def test_a_wrong_key_is_an_http_failure_with_the_status(embed_double):
    prober, wake = prober_for(embed_double.url, EngineKind.EMBED, key="sk-wrong")
    sample = probe_once(prober, wake)
    assert sample.ok is False and sample.detail == "HTTP 401"
    assert "sk-wrong" not in sample.detail


# ------------------------------------------------------ answers fixed in advance


class FixedAnswer(http.server.BaseHTTPRequestHandler):
    """Reads the request whole (a peer that closes on unread bytes resets the connection), then gives the server's answer."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, body = self.server.answer
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the probe hung up, as it should past its cap
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def canned() -> Iterator:
    """reply(status, body) -> the URL of an HTTP server that answers every request with them."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def reply(status: int, body: bytes) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FixedAnswer)
        server.daemon_threads = True
        server.answer = (status, body)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield reply
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_500_fails_the_probe_with_its_status(canned):
    url = canned(500, b'{"error": {"message": "engine dead", "code": 500}}')
    prober, wake = prober_for(url, EngineKind.EMBED)
    sample = probe_once(prober, wake)
    assert sample.ok is False and sample.detail == "HTTP 500"


@pytest.mark.parametrize(
    "body, detail",
    [
        (b'{"object": "list", "data": []}', "no data[0].embedding"),
        (b'{"data": [{"index": 0, "embedding": []}]}', "is empty"),
        (b'{"data": [{"index": 0, "embedding": [0.5, NaN]}]}', "not a finite number"),
        (b"<html>proxy error</html>", "not JSON"),
    ],
)
def test_a_200_without_a_usable_vector_fails_the_probe(canned, body, detail):
    prober, wake = prober_for(canned(200, body), EngineKind.EMBED)
    sample = probe_once(prober, wake)
    assert sample.ok is False and detail in sample.detail, sample.detail


def test_a_200_with_a_vector_passes_over_http(canned):
    """The canned server's shape is enough: the judge reads data[0].embedding, nothing else."""
    body = json.dumps({"data": [{"index": 0, "object": "embedding", "embedding": [0.25, -1, 0.5]}]}).encode()
    prober, wake = prober_for(canned(200, body), EngineKind.EMBED)
    assert probe_once(prober, wake).ok is True


def test_an_answer_over_the_cap_fails_without_being_kept(canned):
    size = inference.MAX_EMBEDDING_ANSWER + 1024
    body = b'{"data": [{"embedding": [' + b"0," * (size // 2) + b"0]}]}"
    prober, wake = prober_for(canned(200, body), EngineKind.EMBED)
    sample = probe_once(prober, wake)
    assert sample.ok is False and "over 4 MiB" in sample.detail, sample.detail


# ------------------------------------------------------------------ the judge


@pytest.mark.parametrize(
    "answer, wrong",
    [
        ({"data": [{"embedding": [0.1, 0.2]}]}, None),
        ({"data": [{"embedding": [1, 0]}]}, None),  # integers are numbers
        ({"data": [{"embedding": [0.1]}, {"embedding": "x"}]}, None),  # only the first input's vector is judged
        ({"data": [{"embedding": "AAAAPw=="}]}, "no data[0].embedding list"),  # base64: not what the probe asked for
        ({"data": [{"embedding": [0.1, True]}]}, "not a finite number"),
        ({"data": [{"embedding": [0.1, "0.2"]}]}, "not a finite number"),
        ({"data": [{"embedding": [0.1, None]}]}, "not a finite number"),
        ({"data": [{}]}, "no data[0].embedding list"),
        ({"data": {"embedding": [0.1]}}, "no data[0].embedding list"),
        ({"error": {"message": "boom"}}, "no data[0].embedding list"),
        ([0.1, 0.2], "no data[0].embedding list"),
    ],
)
def test_the_embedding_judge(answer, wrong):
    got = judge_embedding(json.dumps(answer).encode())
    assert got is None if wrong is None else (got is not None and wrong in got), got


def test_infinity_and_bytes_that_are_not_utf8_are_refused():
    assert "not a finite number" in judge_embedding(b'{"data": [{"embedding": [Infinity]}]}')
    assert judge_embedding(b"\xff\xfe") == "the answer is not JSON"
