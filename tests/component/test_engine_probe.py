"""The engine probe against real HTTP servers on 127.0.0.1: answers, errors, hangs, floods."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from r3090d.core.probetime import learned_probe_timeout
from r3090d.core.snapshot import HealthStatus
from r3090d.probes import inference, offloop
from r3090d.probes.engine import EngineProbe, fetch_metrics, probe_health
from r3090d.probes.http import engine_client
from r3090d.probes.inference import InferenceProber
from tests.canned_reply_server import CannedReplyServer
from tests.waiting import wait_until

pytestmark = pytest.mark.component

DATA = Path(__file__).resolve().parent.parent / "data"
KV_FULL = (DATA / "vllm-0.32-metrics-kv-full.txt").read_text()
IDLE = (DATA / "vllm-0.32-metrics-idle.txt").read_text()
MODEL = "tiny"

Route = Callable[[http.server.BaseHTTPRequestHandler, threading.Event], None]


def send(
    handler, status: int, body: bytes = b"", content_type: str = "text/plain; version=0.0.4; charset=utf-8"
):
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def answer(status: int, body: str | bytes = b"") -> Route:
    data = body.encode() if isinstance(body, str) else body
    return lambda handler, stop: send(handler, status, data)


def stream_without_length(total: int) -> Route:
    """A body with no Content-Length, ended by closing the connection."""

    def route(handler, stop):
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        handler.send_header("Connection", "close")
        handler.end_headers()
        line = b"# filler " + b"x" * 1000 + b"\n"
        sent = 0
        try:
            while sent < total and not stop.is_set():
                handler.wfile.write(line)
                sent += len(line)
        except OSError:
            pass  # the client hung up, as it should past the cap
        handler.close_connection = True

    return route


def trickle(interval: float, limit_s: float) -> Route:
    """Headers at once, then one byte per interval: a server that is alive but never done."""

    def route(handler, stop):
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        handler.send_header("Content-Length", str(len(KV_FULL)))
        handler.end_headers()
        deadline = time.monotonic() + limit_s
        try:
            for byte in KV_FULL.encode():
                if stop.is_set() or time.monotonic() > deadline:
                    break
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(interval)
        except OSError:
            pass
        handler.close_connection = True

    return route


def short_body(route_body: bytes, declared: int) -> Route:
    """Declares more bytes than it sends, then closes: a server that died mid-answer."""

    def route(handler, stop):
        handler.send_response(200)
        handler.send_header("Content-Length", str(declared))
        handler.end_headers()
        handler.wfile.write(route_body)
        handler.close_connection = True

    return route


class FakeEngine:
    """A real threaded HTTP server on an ephemeral loopback port, driven by a route table."""

    def __init__(self, routes: dict[str, Route]):
        self.routes = routes
        self.stop = threading.Event()
        self.requests: list[tuple[str, dict[str, str]]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 - http.server's naming
                self.record_and_route()

            def do_POST(self):  # noqa: N802
                # The body is read whole but unused: a keep-alive connection must not find it as the next request.
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.record_and_route()

            def record_and_route(self):
                outer.requests.append((self.path, dict(self.headers)))
                route = outer.routes.get(self.path)
                if route is None:
                    send(self, 404, b"not found\n")
                else:
                    route(self, outer.stop)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def serve() -> Iterator[Callable[[dict[str, Route]], FakeEngine]]:
    started: list[FakeEngine] = []

    def start(routes: dict[str, Route]) -> FakeEngine:
        server = FakeEngine(routes)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def silent_url() -> Iterator[str]:
    """Accepts connections (the kernel completes the handshake) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.fixture
def closed_url() -> str:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    holder.close()
    return f"http://127.0.0.1:{port}"


# -------------------------------------------------------------------- health


def test_health_ok(serve):
    engine = serve({"/health": answer(200)})
    with EngineProbe(engine.url, MODEL, health_timeout=2, metrics_timeout=2) as probe:
        sample = probe.health()
    assert sample.status is HealthStatus.OK
    assert sample.http_status == 200
    assert sample.latency_s is not None and 0 <= sample.latency_s < 2


def test_health_503_is_http_with_status(serve):
    engine = serve({"/health": answer(503, "engine dead\n")})
    sample = probe_health(engine_client(), engine.url, timeout=2)
    assert sample.status is HealthStatus.HTTP
    assert sample.http_status == 503


def test_health_refused(closed_url):
    sample = probe_health(engine_client(), closed_url, timeout=2)
    assert sample.status is HealthStatus.REFUSED
    assert sample.http_status is None


def test_health_timeout_is_bounded(silent_url):
    started = time.monotonic()
    sample = probe_health(engine_client(), silent_url, timeout=0.5)
    elapsed = time.monotonic() - started
    assert sample.status is HealthStatus.TIMEOUT
    assert 0.4 <= elapsed < 3.0
    assert "0.5 s" in sample.detail


def test_health_connection_dropped_is_error(serve):
    def hang_up(handler, stop):
        handler.close_connection = True  # close without writing a status line

    engine = serve({"/health": hang_up})
    sample = probe_health(engine_client(), engine.url, timeout=2)
    assert sample.status is HealthStatus.ERROR
    assert sample.detail


@pytest.mark.parametrize("base_url", ["not a url", "ftp://127.0.0.1:1", "http://[::1"])
def test_unusable_base_url_is_an_error_not_an_exception(base_url):
    assert probe_health(engine_client(), base_url, timeout=1).status is HealthStatus.ERROR
    text, error = fetch_metrics(engine_client(), base_url, timeout=1)
    assert text is None and error.startswith("/metrics failed")


def test_probe_ignores_proxy_settings_from_the_environment(serve, monkeypatch):
    # A proxy in the environment must not catch loopback probes.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    engine = serve({"/health": answer(200)})
    with EngineProbe(engine.url, MODEL, health_timeout=2, metrics_timeout=2) as probe:
        assert probe.health().status is HealthStatus.OK


# ------------------------------------------------------------------- metrics


@pytest.mark.parametrize(
    ("body", "kv_usage", "free_blocks"), [(KV_FULL, 1.0, 0), (IDLE, 0.0, 32767)], ids=["kv-full", "idle"]
)
def test_metrics_real_capture(serve, body, kv_usage, free_blocks):
    engine = serve({"/metrics": answer(200, body)})
    with EngineProbe(engine.url, MODEL, health_timeout=2, metrics_timeout=2) as probe:
        sample, raw = probe.metrics()
    assert raw == body
    assert sample.error is None
    assert sample.kv_usage == kv_usage and sample.free_blocks == free_blocks
    path, headers = engine.requests[-1]
    assert path == "/metrics"
    assert headers.get("Accept-Encoding") == "identity"


def test_metrics_503(serve):
    engine = serve({"/metrics": answer(503, "no\n")})
    text, error = fetch_metrics(engine_client(), engine.url, timeout=2)
    assert text is None and "HTTP 503" in error


def test_metrics_refused(closed_url):
    with EngineProbe(closed_url, MODEL, health_timeout=1, metrics_timeout=1) as probe:
        sample, raw = probe.metrics()
    assert raw is None
    assert sample.error is not None and "refused" in sample.error


def test_metrics_silent_server_times_out(silent_url):
    started = time.monotonic()
    text, error = fetch_metrics(engine_client(), silent_url, timeout=0.5)
    assert text is None and "timed out" in error
    assert time.monotonic() - started < 3.0


def test_metrics_over_the_cap_by_content_length(serve):
    engine = serve({"/metrics": answer(200, KV_FULL)})
    text, error = fetch_metrics(engine_client(), engine.url, timeout=2, max_bytes=len(KV_FULL) - 1)
    assert text is None and "cap" in error


def test_metrics_exactly_at_the_cap_is_read(serve):
    engine = serve({"/metrics": answer(200, KV_FULL)})
    text, error = fetch_metrics(engine_client(), engine.url, timeout=2, max_bytes=len(KV_FULL.encode()))
    assert error is None and text == KV_FULL


def test_metrics_over_the_cap_while_streaming(serve):
    # No Content-Length: the cap must stop the read itself, long before the 64 MB the server offers.
    engine = serve({"/metrics": stream_without_length(64 * 1024 * 1024)})
    started = time.monotonic()
    text, error = fetch_metrics(engine_client(), engine.url, timeout=5, max_bytes=1024 * 1024)
    assert text is None and "cap" in error
    assert time.monotonic() - started < 5


def test_metrics_slow_trickle_is_cut_at_the_timeout(serve):
    engine = serve({"/metrics": trickle(interval=0.02, limit_s=20)})
    started = time.monotonic()
    text, error = fetch_metrics(engine_client(), engine.url, timeout=1.0)
    elapsed = time.monotonic() - started
    assert text is None and error is not None
    assert "timeout" in error or "timed out" in error
    # The whole exchange is bounded by the timeout, not each read.
    assert 0.9 <= elapsed < 3.0


def test_metrics_trickle_inside_each_read_timeout_is_cut_at_the_deadline(serve):
    # A byte every 0.9 s never trips a 1 s read timeout: only the whole-body deadline ends it,
    # at 1 s, not at the first byte after it (1.8 s).
    engine = serve({"/metrics": trickle(interval=0.9, limit_s=20)})
    started = time.monotonic()
    text, error = fetch_metrics(engine_client(), engine.url, timeout=1.0)
    elapsed = time.monotonic() - started
    assert text is None and error.startswith("/metrics body not complete within the timeout")
    assert 0.9 <= elapsed < 1.7


def test_metrics_short_body_is_an_error_not_a_truncated_text(serve):
    body = KV_FULL.encode()
    engine = serve({"/metrics": short_body(body[:1000], declared=len(body))})
    text, error = fetch_metrics(engine_client(), engine.url, timeout=2)
    assert text is None and error is not None


def test_metrics_garbage_body_is_a_parse_error_with_the_raw_text(serve):
    engine = serve({"/metrics": answer(200, "<html>proxy error</html>\n")})
    with EngineProbe(engine.url, MODEL, health_timeout=2, metrics_timeout=2) as probe:
        sample, raw = probe.metrics()
    assert raw == "<html>proxy error</html>\n"
    assert sample.error is not None and "no vllm: metrics" in sample.error


def test_probe_reuses_one_session_over_many_polls(serve):
    engine = serve({"/health": answer(200), "/metrics": answer(200, KV_FULL)})
    with EngineProbe(engine.url + "/", MODEL, health_timeout=2, metrics_timeout=2) as probe:
        for _ in range(20):
            assert probe.health().status is HealthStatus.OK
            sample, _ = probe.metrics()
            assert sample.preemptions_total == 2
    assert len(engine.requests) == 40
    assert {path for path, _ in engine.requests} == {"/health", "/metrics"}


# ------------------------------------------------------------ proxies and keys

API_KEY = "sk-engine-key-for-tests"
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def completion(handler, stop):
    send(handler, 200, b'{"choices":[{"text":"pong"}]}', content_type="application/json")


BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@pytest.fixture
def proxy_trap(monkeypatch) -> Iterator[CannedReplyServer]:
    """A stand-in for an HTTP proxy that answers 502 to all; `connections` and `received` show who came.

    Every proxy variable, both spellings, points at the trap; nothing is exempted by NO_PROXY.
    """
    trap = CannedReplyServer(socket.create_server(("127.0.0.1", 0)), BAD_GATEWAY)
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, f"http://127.0.0.1:{trap.listener.getsockname()[1]}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield trap
    trap.close()


def run_inference_probe(prober: InferenceProber, wake: threading.Event):
    wake.clear()
    prober.send()
    assert wake.wait(15), "the inference probe never reported"
    return prober.sample()


def test_the_proxy_trap_catches_a_client_that_trusts_the_environment(serve, proxy_trap):
    # Shows the next test can fail: a default httpx client does go to the trap, key and all.
    engine = serve({"/health": answer(200)})
    response = httpx.get(engine.url + "/health", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
    assert response.status_code == 502
    assert proxy_trap.connections == 1 and API_KEY.encode() in proxy_trap.received
    assert engine.requests == []


def test_no_probe_goes_through_a_proxy_from_the_environment(serve, proxy_trap):
    engine = serve({"/health": answer(200), "/metrics": answer(200, KV_FULL), "/v1/completions": completion})
    with EngineProbe(engine.url, MODEL, health_timeout=5, metrics_timeout=5) as probe:
        assert probe.health().status is HealthStatus.OK
        sample, _ = probe.metrics()
        assert sample.error is None and sample.kv_usage == 1.0
    wake = threading.Event()
    result = run_inference_probe(InferenceProber(engine.url, MODEL, API_KEY, timeout=5, wake=wake), wake)
    assert result.ok is True, result.detail
    assert proxy_trap.connections == 0
    assert [path for path, _ in engine.requests] == ["/health", "/metrics", "/v1/completions"]
    assert engine.requests[-1][1].get("Authorization") == f"Bearer {API_KEY}"


def test_an_unexpected_exception_fails_the_probe_and_frees_it(serve):
    # A key with a character outside Latin-1 (a typographic quote pasted along with
    # it) cannot go in a header: httpx raises UnicodeEncodeError, which is no
    # httpx exception.
    engine = serve({"/v1/completions": completion})
    wake = threading.Event()
    prober = InferenceProber(engine.url, MODEL, "sk-\u201ckey\u201d", timeout=5, wake=wake)
    first = run_inference_probe(prober, wake)
    assert first.ok is False and "UnicodeEncodeError" in first.detail
    assert first.finished_at is not None and first.sent_at is not None and first.finished_at >= first.sent_at
    assert first.consecutive_failures == 1
    # Not left in flight: the next send starts a new probe, and it fails again.
    second = run_inference_probe(prober, wake)
    assert second.ok is False and second.consecutive_failures == 2
    assert second.sent_at is not None and second.sent_at > first.sent_at


def test_an_exception_inside_the_client_fails_the_probe(serve, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("boom")

    engine = serve({"/v1/completions": completion})
    monkeypatch.setattr(httpx.Client, "send", explode)  # the client library's boundary
    wake = threading.Event()
    sample = run_inference_probe(InferenceProber(engine.url, MODEL, API_KEY, timeout=5, wake=wake), wake)
    assert sample.ok is False and "RuntimeError" in sample.detail and "boom" in sample.detail


def test_a_key_the_client_refuses_is_not_echoed_in_the_detail(serve):
    engine = serve({"/v1/completions": completion})
    wake = threading.Event()
    key = "sk-secret-value\r\nX-Injected: 1"
    sample = run_inference_probe(InferenceProber(engine.url, MODEL, key, timeout=5, wake=wake), wake)
    assert sample.ok is False and sample.detail
    assert "secret-value" not in sample.detail
    assert engine.requests == []


def test_a_probe_that_cannot_start_a_thread_is_a_failure_not_in_flight(monkeypatch):
    class NoThread:
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            raise RuntimeError("can't start new thread")

    wake = threading.Event()
    prober = InferenceProber("http://127.0.0.1:9", MODEL, "", timeout=5, wake=wake)
    monkeypatch.setattr(offloop.threading, "Thread", NoThread)
    prober.send()
    sample = prober.sample()
    assert sample.ok is False and "RuntimeError" in sample.detail
    assert wake.is_set()
    prober.send()  # not stuck in flight: it tries again, and fails again
    assert prober.sample().consecutive_failures == 2


def test_inference_probe_ok_and_http_error(serve):
    engine = serve({"/v1/completions": completion})
    wake = threading.Event()
    assert run_inference_probe(InferenceProber(engine.url, MODEL, "", timeout=5, wake=wake), wake).ok is True
    assert "Authorization" not in engine.requests[-1][1]
    broken = serve({"/v1/completions": answer(500, "no\n")})
    sample = run_inference_probe(InferenceProber(broken.url, MODEL, API_KEY, timeout=5, wake=wake), wake)
    assert sample.ok is False and sample.detail == "HTTP 500"
    assert not sample.timed_out  # an answer, if a wrong one: no load excuses it


def test_a_probe_with_no_answer_by_its_deadline_is_a_timed_out_failure(silent_url):
    wake = threading.Event()
    sample = run_inference_probe(InferenceProber(silent_url, MODEL, "", timeout=0.5, wake=wake), wake)
    assert sample.ok is False and sample.timed_out and sample.timeout_s == 0.5
    assert "no answer within 0.5 s" in sample.detail


def slow_completions(*delays: float) -> Route:
    """Completions answered after each of `delays` seconds in turn: an engine slow on a busy host, not a frozen one."""
    left = list(delays)

    def route(handler, stop):
        stop.wait(left.pop(0) if left else 0.0)
        completion(handler, stop)

    return route


def test_the_deadline_learns_from_the_engines_answers_and_a_new_engine_starts_afresh(serve):
    configured = 1.0
    # Half the configured timeout, then more than all of it: the second is answered only by a learned deadline.
    engine = serve({"/v1/completions": slow_completions(0.5, 1.1)})
    wake = threading.Event()
    prober = InferenceProber(engine.url, MODEL, "", timeout=configured, wake=wake)
    first = run_inference_probe(prober, wake)
    assert first.ok is True and first.timeout_s == configured, first
    answered_in = first.finished_at - first.sent_at
    second = run_inference_probe(prober, wake)
    assert second.timeout_s == pytest.approx(learned_probe_timeout(configured, [answered_in]))
    assert second.ok is True, second
    prober.reset()  # a new engine: the old one's answer times say nothing of it
    prober.send()
    assert prober.sample().timeout_s == configured


@pytest.mark.parametrize(
    "server, ok, unanswered",
    [
        ("completion", True, 0),  # vLLM completed it: its count holds the probe
        ("http_500", False, 1),  # an HTTP error: vLLM completed nothing
        ("refused", False, 1),
        ("silent", False, 1),  # no answer within the timeout: the client hangs up, vLLM aborts the request
    ],
)
def test_a_probe_is_counted_by_its_end(serve, closed_url, silent_url, server, ok, unanswered):
    """The policy subtracts the daemon's own requests from vLLM's completed ones: a probe that ended
    without an answer is not among them, so it no longer counts once it has ended."""
    urls = {"completion": lambda: serve({"/v1/completions": completion}).url,
            "http_500": lambda: serve({"/v1/completions": answer(500, "no\n")}).url,
            "refused": lambda: closed_url, "silent": lambda: silent_url}  # fmt: skip
    wake = threading.Event()
    prober = InferenceProber(urls[server](), MODEL, "", timeout=1, wake=wake)
    sample = run_inference_probe(prober, wake)
    assert (sample.ok, sample.sent_total, sample.unanswered_total) == (ok, 1, unanswered), sample.detail
    again = InferenceProber("http://127.0.0.1:9", MODEL, "", timeout=1, sent_before=prober.sent_total, unanswered_before=prober.unanswered_total)
    assert (again.sample().sent_total, again.sample().unanswered_total) == (1, unanswered)  # carried over a reload


def test_a_probe_stuck_past_its_timeout_is_failed_not_left_in_flight():
    """A server that accepts and never answers, with the client's timeout defeated (as a hung
    DNS lookup would): the sample still reports a failure once timeout + margin has passed."""
    import socket
    import threading


    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    hold = threading.Event()

    prober = inference.InferenceProber(f"http://127.0.0.1:{port}", "m", "", timeout=0.5)
    prober._request = lambda _exchange, _limit: (hold.wait(30), (True, ""))[1]  # the boundary: a request that ignores its timeout
    try:
        prober.send()
        assert prober.sample().ok is None  # in flight
        overdue_s = 0.5 + inference.OVERDUE_MARGIN_S + 5
        wait_until(
            lambda: prober.sample().ok is not None, overdue_s, what="the overdue probe judged", interval=0.05
        )
        s = prober.sample()
        assert s.ok is False and s.consecutive_failures == 1 and "outlived its timeout" in s.detail
        assert s.unanswered_total == 0  # its end is unknown: it stays counted as one vLLM may complete
        assert s.timed_out  # a missed deadline, which a starved host may excuse (core.probetime)
        hold.set()  # the late answer of the abandoned thread changes nothing
        for t in threading.enumerate():
            if t.name == "inference-probe":
                t.join(5)
        assert prober.sample().ok is False
        prober.send()  # and a new probe can be sent, and is answered
        wait_until(lambda: prober.sample().ok, 5, what="the new probe answered")
        assert prober.sample().ok is True and prober.sample().consecutive_failures == 0
    finally:
        hold.set()
        listener.close()
