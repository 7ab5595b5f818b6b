"""The router over real HTTP: real router processes in front of vLLM doubles, and a link server the test drives.

The link server stands in for the daemon (a real unix socket: the test sends the
tables and reads the demand the router reports). Everything else is real: the
router is started as the daemon starts it (`python -m r3090d.router`), the
engines are vLLM doubles, and the clients speak HTTP on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from r3090d.router.link import Demand, EngineState, ModelEntry, ModelKind, Table, decode, encode_table
from tests.fakevllm.harness import FakeVllm, free_port, http, sse_events
from tests.waiting import wait_until

pytestmark = pytest.mark.component

UPSTREAM_KEY = "engine-key-for-coder"
PUBLIC_KEY = "public-router-key"
MAX_BODY = 64 * 1024


# ----------------------------------------------------------------- the daemon's side of the link


class LinkServer:
    """The daemon's end of the link: a unix socket the router connects to; the test sends tables and reads demand."""

    def __init__(self, path: Path):
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.lock = threading.Lock()
        self.conn: socket.socket | None = None
        self.connections = 0
        self.table: Table | None = None
        self.demands: list[tuple[float, Demand]] = []
        self.bad_lines: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.conn = conn
                self.connections += 1
                if self.table is not None:
                    conn.sendall(encode_table(self.table))
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            self._read_lines(conn)
        except OSError:
            pass  # the router went away (a test killed it)

    def _read_lines(self, conn: socket.socket) -> None:
        for line in conn.makefile("rb"):
            try:
                message = decode(line)
            except ValueError:
                self.bad_lines.append(line)
                continue
            with self.lock:
                self.demands.append((time.monotonic(), message))

    def send(self, *models: ModelEntry) -> Table:
        with self.lock:
            self.table = Table(seq=(self.table.seq + 1 if self.table else 1), models=tuple(models))
            if self.conn is not None:
                self.conn.sendall(encode_table(self.table))
            return self.table

    def send_raw(self, data: bytes) -> None:
        with self.lock:
            self.conn.sendall(data)

    def drop(self) -> None:
        """The daemon goes away: the connection is closed (the listener stays for the next daemon)."""
        with self.lock:
            if self.conn is not None:
                self.conn.shutdown(socket.SHUT_RDWR)
                self.conn.close()
                self.conn = None

    def latest(self, name: str):
        with self.lock:
            for _, demand in reversed(self.demands):
                if name in demand.models:
                    return demand.models[name]
        return None

    def wait_demand(self, name: str, timeout: float = 5.0, check=lambda d: True, **want):
        """Waits for the latest demand for `name` to have the fields in `want` and pass `check`; returns it."""

        def match():
            d = self.latest(name)
            return (
                d if d is not None and all(getattr(d, k) == v for k, v in want.items()) and check(d) else None
            )

        return wait_until(
            match, timeout, what=f"a demand for {name} with {want}", details=lambda: repr(self.demands[-5:])
        )

    def close(self) -> None:
        """The daemon exits: no more connections (shutdown wakes the blocked accept), then the link drops."""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.drop()


# ----------------------------------------------------------------- a router process


class RouterProcess:
    def __init__(self, link: Path, log_path: Path, port: int | None = None, queue_timeout: float = 10.0,
                 api_key: str | None = None, extra: tuple[str, ...] = ()):  # fmt: skip
        self.port = port or free_port()
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "r3090d.router", "--host", "127.0.0.1", "--port", str(self.port), "--link", str(link),
                     "--queue-timeout", str(queue_timeout), "--max-body-bytes", str(MAX_BODY), *extra]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if k != "R3090D_ROUTER_API_KEY"}
        if api_key is not None:
            self.env["R3090D_ROUTER_API_KEY"] = api_key
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(
            self._listening,
            15,
            what=f"the router listening on {self.port}",
            ignoring=(httpx.TransportError,),
            details=self.output,
        )
        return self

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the router exited with {self.proc.returncode}:\n{self.output()}")
        return http().get(self.url + "/healthz", timeout=1.0).status_code in (200, 503)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def doubles(fake_engine_python, tmp_path_factory):
    """Three engines: chat, and coder (which wants an API key), generative; search, an embedding model.
    Shared by the module's tests; each test that changes one puts it back."""
    where = tmp_path_factory.mktemp("router-doubles")
    made = {
        "chat": FakeVllm(
            fake_engine_python,
            "--fake-token-delay",
            "0.002",
            served_model_name="chat",
            log_path=where / "chat.log",
        ),
        "coder": FakeVllm(
            fake_engine_python,
            "--fake-token-delay",
            "0.002",
            served_model_name="coder",
            log_path=where / "coder.log",
            env={"VLLM_API_KEY": UPSTREAM_KEY},
        ),  # fmt: skip
        "search": FakeVllm(fake_engine_python, served_model_name="search", log_path=where / "search.log"),
    }
    for double in made.values():
        double.start()
    try:
        for double in made.values():
            double.wait_healthy(20)
        yield made
    finally:
        for double in made.values():
            double.kill_all()


@pytest.fixture
def short_dir():
    """Unix socket paths hold 107 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="r3090d-router-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def link(short_dir):
    server = LinkServer(short_dir / "router.sock")
    yield server
    server.close()


@pytest.fixture
def start_router(link, tmp_path):
    started: list[RouterProcess] = []

    def start(**kwargs) -> RouterProcess:
        kwargs.setdefault("log_path", tmp_path / f"router-{len(started)}.log")
        router = RouterProcess(kwargs.pop("link_path", link.path), **kwargs)
        started.append(router)
        return router.start()

    yield start
    for router in started:
        router.kill()


def entry(name: str, double: FakeVllm | None = None, routable: bool = True, state: EngineState | None = None,
          kind: ModelKind = ModelKind.GENERATE, key: str = "", upstream: str | None = None) -> ModelEntry:  # fmt: skip
    state = state or (EngineState.READY if routable else EngineState.PARKED)
    return ModelEntry(name, kind, state, routable, upstream or double.url, key)


def all_ready(doubles) -> tuple[ModelEntry, ...]:
    return (
        entry("chat", doubles["chat"]),
        entry("coder", doubles["coder"], key=UPSTREAM_KEY),
        entry("search", doubles["search"], kind=ModelKind.EMBED),
    )


@pytest.fixture
def router(start_router, link, doubles):
    """A router linked to a table where every double is ready and routable."""
    link.send(*all_ready(doubles))
    r = start_router()
    wait_until(lambda: http().get(r.url + "/healthz").status_code == 200, 10, what="the router linked")
    return r


def complete(
    router: RouterProcess, model: str, prompt: str = "hello there", max_tokens: int = 4, headers=None, **extra
) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}
    return http().post(router.url + "/v1/completions", json=body, headers=headers, timeout=30.0)


def paths_logged(double: FakeVllm, since: float) -> list[tuple[str, str | None]]:
    return [(e["path"], (e.get("body") or {}).get("model")) for e in double.request_log() if e["t"] >= since]


def aborted(double: FakeVllm) -> float:
    text = http().get(double.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort":
                return s.value
    return 0.0


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args, **kwargs)
        except Exception as exc:  # the test looks at it
            result["error"] = exc
        result["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


# ----------------------------------------------------------------- routing


def test_routes_each_request_to_its_models_engine(router, doubles):
    since = time.time()
    chat = complete(router, "chat")
    coder = http().post(router.url + "/v1/chat/completions", json={"model": "coder", "messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 3}, timeout=30)  # fmt: skip
    search = http().post(
        router.url + "/v1/embeddings", json={"model": "search", "input": "find me"}, timeout=30
    )
    assert (chat.status_code, coder.status_code, search.status_code) == (200, 200, 200), (
        chat.text,
        coder.text,
        search.text,
    )
    assert chat.json()["model"] == "chat" and chat.json()["object"] == "text_completion"
    assert coder.json()["object"] == "chat.completion"
    assert (
        search.json()["data"][0]["object"] == "embedding" and len(search.json()["data"][0]["embedding"]) == 16
    )
    assert paths_logged(doubles["chat"], since) == [("/v1/completions", "chat")]
    assert paths_logged(doubles["coder"], since) == [("/v1/chat/completions", "coder")]
    assert paths_logged(doubles["search"], since) == [("/v1/embeddings", "search")]


def test_the_engines_key_is_sent_for_it_and_the_answer_passes_unchanged(router, doubles):
    direct = http().post(
        doubles["coder"].url + "/v1/completions", json={"model": "coder", "prompt": "x", "max_tokens": 2}
    )
    assert direct.status_code == 401  # this engine wants its key: the router's 200 below means it sent it
    through = complete(router, "coder", temperature=0)
    assert through.status_code == 200
    again = http().post(doubles["coder"].url + "/v1/completions", json={"model": "coder", "prompt": "hello there", "max_tokens": 4,
                                                                      "temperature": 0}, headers={"Authorization": f"Bearer {UPSTREAM_KEY}"})  # fmt: skip
    assert (
        through.json()["choices"] == again.json()["choices"]
    )  # the greedy answer, byte for byte the engine's
    assert through.headers["content-type"] == again.headers["content-type"]


def test_models_lists_every_model_whatever_its_state(start_router, link, doubles):
    link.send(entry("chat", doubles["chat"]), entry("coder", doubles["coder"], routable=False),
              entry("search", doubles["search"], routable=False, state=EngineState.COLD, kind=ModelKind.EMBED))  # fmt: skip
    r = start_router()
    listed = wait_until(lambda: http().get(r.url + "/v1/models").json()["data"], 10, what="models listed")
    assert [m["id"] for m in listed] == ["chat", "coder", "search"]
    assert {(m["object"], m["owned_by"]) for m in listed} == {("model", "r3090d")}
    assert http().get(r.url + "/v1/models").json()["object"] == "list"


def test_an_unknown_model_is_a_404_in_vllms_shape(router):
    r = complete(router, "gpt-17")
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "The model `gpt-17` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompt": "hi"}', "names no `model`"),
        (b'{"model": 7}', "non-empty string"),
        (b'{"model": ""}', "non-empty string"),
        (b"", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[" * 30000 + b"]" * 30000, "not valid JSON"),
    ],
)
def test_a_bad_body_is_a_400_and_the_router_goes_on(router, content, says):
    r = http().post(
        router.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert says in error["message"] and error["type"] == "BadRequestError" and error["code"] == 400
    assert complete(router, "chat").status_code == 200


def test_a_body_over_the_limit_is_a_413_declared_or_chunked(router):
    big = json.dumps({"model": "chat", "prompt": "x " * MAX_BODY}).encode()
    declared = http().post(
        router.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"}
    )
    chunked = http().post(
        router.url + "/v1/completions",
        content=iter([big[:1000], big[1000:]]),
        headers={"Content-Type": "application/json"},
    )
    for r in (declared, chunked):
        assert r.status_code == 413
        assert r.json()["error"]["code"] == 413
    assert complete(router, "chat").status_code == 200


def test_unknown_paths_and_hostile_headers_do_not_hurt_it(router):
    r = http().get(router.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        assert s.recv(100).split(b" ")[1] == b"400"  # aiohttp's header limits answer it
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01 this is not http\r\n\r\n")
        assert s.recv(100).split(b" ")[1] == b"400"
    assert complete(router, "chat").status_code == 200
    assert router.proc.poll() is None
    assert "Traceback" not in router.output()


# ----------------------------------------------------------------- the API key


def test_with_a_key_set_every_v1_request_needs_it(start_router, link, doubles):
    link.send(*all_ready(doubles))
    r = start_router(api_key=PUBLIC_KEY)
    wait_until(lambda: http().get(r.url + "/healthz").status_code == 200, 10, what="the router linked")
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": PUBLIC_KEY},
        {"Authorization": f"Bearer {PUBLIC_KEY}x"},
    ):
        denied = complete(r, "chat", headers=headers)
        assert denied.status_code == 401, headers
        assert denied.json() == {"error": "Unauthorized"}  # vLLM's body
        assert http().get(r.url + "/v1/models", headers=headers).status_code == 401
    right = {"Authorization": f"Bearer {PUBLIC_KEY}"}
    assert complete(r, "chat", headers=right).status_code == 200
    assert (
        complete(r, "coder", headers=right).status_code == 200
    )  # the engine's own key replaces the client's
    assert http().get(r.url + "/v1/models", headers=right).status_code == 200
    assert http().get(r.url + "/healthz").status_code == 200  # the load balancer's check needs no key


def test_the_key_file_is_read_and_a_missing_one_is_one_line_and_78(start_router, link, doubles, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(PUBLIC_KEY + "\n")
    link.send(*all_ready(doubles))
    r = start_router(extra=("--api-key-file", str(key_file)))
    assert complete(r, "chat").status_code == 401
    assert wait_until(
        lambda: complete(r, "chat", headers={"Authorization": f"Bearer {PUBLIC_KEY}"}).status_code == 200,
        10,
        what="200",
    )
    missing = subprocess.run(
        [*r.argv[:-2], "--api-key-file", str(tmp_path / "nope")], capture_output=True, text=True, timeout=30
    )
    assert missing.returncode == 78
    assert missing.stderr.count("\n") == 1 and "--api-key-file" in missing.stderr and "nope" in missing.stderr


@pytest.mark.parametrize(
    "argv",
    [
        [],
        [
            "--host",
            "127.0.0.1",
            "--port",
            "70000",
            "--link",
            "/x",
            "--queue-timeout",
            "1",
            "--max-body-bytes",
            "4096",
        ],
        [
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--link",
            "/x",
            "--queue-timeout",
            "-1",
            "--max-body-bytes",
            "4096",
        ],
        [
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--link",
            "/x",
            "--queue-timeout",
            "1",
            "--max-body-bytes",
            "lots",
        ],
        [
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--link",
            "/x",
            "--queue-timeout",
            "1",
            "--max-body-bytes",
            "4096",
            "--api-key",
            "k",
        ],
    ],
)
def test_bad_arguments_exit_64_with_one_line(argv):
    done = subprocess.run(
        [sys.executable, "-m", "r3090d.router", *argv], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 64
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("python -m r3090d.router: ")


# ----------------------------------------------------------------- streaming


def test_a_stream_passes_chunk_by_chunk_and_a_client_that_leaves_aborts_it(router, doubles):
    chat = doubles["chat"]
    chat.control(token_delay=0.05)  # 100 tokens: 5 s of stream
    try:
        before = aborted(chat)
        body = {"model": "chat", "prompt": "tell me", "max_tokens": 100, "stream": True, "ignore_eos": True}
        events = []
        with (
            httpx.Client(timeout=30, trust_env=False) as client,
            client.stream("POST", router.url + "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for _, payload in sse_events(r):
                events.append(payload)
                if len(events) == 1:
                    # The first token is here while the engine is still generating: nothing was held back.
                    state = chat.state()
                    assert state["active_streams"] == 1 and state["engine_stats"]["running"] == 1
                if len(events) == 3:
                    break
        left_at = time.monotonic()
        assert [e["choices"][0]["text"] for e in events] == [" the", " quick", " brown"]
        # The router closed its connection to the engine, and the engine aborted the request.
        wait_until(
            lambda: aborted(chat) == before + 1, 4, what="the engine's abort counter to count the request"
        )
        assert time.monotonic() - left_at < 4  # the 5 s stream did not run on
        assert chat.state()["engine_stats"]["running"] == 0
    finally:
        chat.control(token_delay=0.002)


def test_a_stream_runs_to_done_through_the_router(router):
    body = {
        "model": "chat",
        "prompt": "go",
        "max_tokens": 20,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with http().stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        events = [p for _, p in sse_events(r)]
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 20
    assert len([e for e in events[:-2] if e["choices"]]) == 20


def test_inflight_is_reported_while_a_stream_runs(router, link, doubles):
    chat = doubles["chat"]
    chat.control(token_delay=0.05)
    try:
        body = {"model": "chat", "prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True}
        with http().stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
            events = sse_events(r)
            assert next(events)[1]["choices"]
            running = link.wait_demand("chat", inflight=1)
            assert running.waiting == 0 and running.last_used_at is not None
            assert link.latest("coder").inflight == 0
            rest = [p for _, p in events]
        assert rest[-1] == "[DONE]"
        done = link.wait_demand("chat", inflight=0, check=lambda d: d.last_used_at > running.last_used_at)
        assert done.waiting == 0
    finally:
        chat.control(token_delay=0.002)


def test_an_engine_that_dies_mid_stream_cuts_the_clients_stream(start_router, link, doubles, fake_vllm):
    dying = fake_vllm("--fake-token-delay", "0.05", served_model_name="chat")
    dying.wait_healthy(20)
    link.send(entry("chat", dying))
    r = start_router()
    body = {"model": "chat", "prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}
    events = []
    with (
        pytest.raises(httpx.TransportError),
        http().stream("POST", r.url + "/v1/completions", json=body, timeout=30) as stream,
    ):
        for _, payload in sse_events(stream):
            events.append(payload)
            if len(events) == 2:
                dying.control(exit=0)  # the API server exits at once: its connections are cut
    assert 2 <= len(events) < 100 and "[DONE]" not in events  # a broken stream, not one that looks whole
    assert "broke off its answer" in r.output()
    link.send(*all_ready(doubles))
    assert wait_until(lambda: complete(r, "chat").status_code == 200, 10, what="the router serving on")


def not_http_engine(reply: bytes) -> tuple[str, socket.socket]:
    """An "engine" that reads a request and answers `reply`, then hangs up."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


def test_an_engine_answering_garbage_is_a_502_and_a_short_body_a_cut_stream(start_router, link, doubles):
    garbage, first = not_http_engine(b"this is not http\r\n\r\n")
    short, second = not_http_engine(
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"id"'
    )
    try:
        link.send(
            entry("chat", upstream=garbage),
            entry("coder", upstream=short),
            entry("search", doubles["search"]),
        )
        r = start_router()
        bad = wait_until(lambda: complete(r, "chat"), 10, what="an answer")
        assert bad.status_code == 502 and bad.json()["error"]["type"] == "BadGatewayError"
        with pytest.raises(httpx.TransportError):  # the client sees an incomplete body, not a complete one
            complete(r, "coder")
        assert (
            http().post(r.url + "/v1/embeddings", json={"model": "search", "input": "x"}).status_code == 200
        )
        assert "Traceback" not in r.output()
    finally:
        first.close()
        second.close()


# ----------------------------------------------------------------- waiting for a model


def test_a_request_for_a_parked_model_waits_then_runs_when_it_is_routable(start_router, link, doubles):
    link.send(
        entry("chat", doubles["chat"], routable=False), entry("coder", doubles["coder"], key=UPSTREAM_KEY)
    )
    r = start_router()
    link.wait_demand("chat", waiting=0)
    sent_at = time.monotonic()
    thread, result = in_thread(complete, r, "chat")
    waiting = link.wait_demand("chat", waiting=1)
    assert (
        sent_at <= waiting.oldest_waiting_at <= time.monotonic()
    )  # CLOCK_MONOTONIC, shared across processes
    assert waiting.inflight == 0
    assert complete(r, "coder").status_code == 200  # another model is not held up
    assert thread.is_alive() and "value" not in result
    link.send(
        entry("chat", doubles["chat"], state=EngineState.READY),
        entry("coder", doubles["coder"], key=UPSTREAM_KEY),
    )
    thread.join(10)
    assert result["value"].status_code == 200 and result["value"].json()["model"] == "chat"
    link.wait_demand(
        "chat", waiting=0, inflight=0, oldest_waiting_at=None, check=lambda d: d.last_used_at is not None
    )


def test_every_waiting_request_goes_out_when_its_model_becomes_routable(start_router, link, doubles):
    """All of a model's waiters go together. Their order is the waitroom's (tests/unit/test_router_waitroom.py):
    here they leave the router in order within microseconds, and the engine's threads may log them in any."""
    link.send(entry("chat", doubles["chat"], routable=False))
    r = start_router()
    threads = []
    for i in range(3):
        threads.append(in_thread(complete, r, "chat", prompt=f"waiter {i}", temperature=0))
        link.wait_demand("chat", waiting=i + 1)
    since = time.time()
    flipped = time.monotonic()
    link.send(entry("chat", doubles["chat"]))
    for thread, result in threads:
        thread.join(10)
        assert result["value"].status_code == 200
        assert result["at"] >= flipped
    prompts = [
        e["body"]["prompt"]
        for e in doubles["chat"].request_log()
        if e["t"] >= since - 1 and "waiter" in e["body"].get("prompt", "")
    ]
    assert sorted(prompts) == ["waiter 0", "waiter 1", "waiter 2"]  # each sent once
    link.wait_demand("chat", waiting=0, inflight=0)


def test_past_the_queue_timeout_it_is_a_503_with_retry_after(start_router, link, doubles):
    link.send(entry("chat", doubles["chat"], routable=False))
    r = start_router(queue_timeout=1.5)
    started = time.monotonic()
    answer = complete(r, "chat")
    waited = time.monotonic() - started
    assert answer.status_code == 503
    assert (
        answer.json()["error"]["code"] == 503 and answer.json()["error"]["type"] == "ServiceUnavailableError"
    )
    assert int(answer.headers["Retry-After"]) >= 1
    assert 1.4 <= waited < 10
    link.wait_demand("chat", waiting=0)


def test_before_any_table_requests_wait_and_an_unknown_one_then_gets_404(start_router, link, doubles):
    r = start_router()
    assert http().get(r.url + "/healthz").status_code == 503
    known, known_result = in_thread(complete, r, "chat")
    unknown, unknown_result = in_thread(complete, r, "nobody")
    # A claim that nothing is answered has to give the router time to answer wrongly; a slow
    # machine only makes this window easier to pass, never a false failure.
    known.join(0.5)
    assert known.is_alive() and unknown.is_alive()
    table_sent = time.monotonic()
    link.send(entry("chat", doubles["chat"]))
    known.join(10)
    unknown.join(10)
    assert known_result["value"].status_code == 200
    assert unknown_result["value"].status_code == 404
    assert min(known_result["at"], unknown_result["at"]) >= table_sent


def test_a_refused_connection_while_routable_waits_for_the_next_table(start_router, link, doubles):
    gone = free_port()  # the table says routable, but the engine is not listening: a swap raced the table
    link.send(entry("chat", upstream=f"http://127.0.0.1:{gone}"))
    r = start_router()
    thread, result = in_thread(complete, r, "chat")
    link.wait_demand("chat", waiting=1)  # re-queued, not failed
    assert thread.is_alive()
    link.send(entry("chat", doubles["chat"]))
    thread.join(10)
    assert result["value"].status_code == 200
    assert "did not answer" in r.output()


# ----------------------------------------------------------------- the link and health


def test_health_follows_the_link_and_the_models(start_router, link, doubles):
    r = start_router()
    assert http().get(r.url + "/healthz").status_code == 503  # no table yet
    link.send(*all_ready(doubles))
    wait_until(
        lambda: http().get(r.url + "/healthz").status_code == 200, 10, what="healthy once a table came"
    )
    assert http().get(r.url + "/healthz").json() == {"status": "ok"}
    link.send(entry("chat", doubles["chat"], routable=False, state=EngineState.FAILED))
    wait_until(
        lambda: http().get(r.url + "/healthz").status_code == 503, 10, what="503 when every model failed"
    )
    link.send(entry("chat", doubles["chat"], routable=False, state=EngineState.PARKED))
    wait_until(
        lambda: http().get(r.url + "/healthz").status_code == 200,
        10,
        what="200 with a parked model: it can queue",
    )
    link.close()  # the daemon is gone, and no other listens yet
    wait_until(
        lambda: http().get(r.url + "/healthz").status_code == 503, 10, what="503 once the daemon is gone"
    )
    link.path.unlink()
    daemon = LinkServer(link.path)  # the daemon's restart
    try:
        daemon.send(*all_ready(doubles))
        wait_until(lambda: daemon.connections == 1, 10, what="the router reconnecting")
        wait_until(
            lambda: http().get(r.url + "/healthz").status_code == 200,
            10,
            what="healthy again after the reconnect",
        )
    finally:
        daemon.close()


def test_a_router_started_before_the_daemon_connects_when_it_comes(start_router, link, doubles, short_dir):
    later = short_dir / "later.sock"
    r = start_router(link_path=later)
    assert http().get(r.url + "/healthz").status_code == 503
    daemon = LinkServer(later)
    try:
        daemon.send(*all_ready(doubles))
        wait_until(
            lambda: http().get(r.url + "/healthz").status_code == 200,
            10,
            what="linked once the socket exists",
        )
        assert complete(r, "chat").status_code == 200
        assert r.output().count("cannot connect") == 1  # one line for the outage, not one per attempt
    finally:
        daemon.close()


def test_a_bad_link_message_is_logged_and_skipped(router, link, doubles):
    link.send_raw(b"this is not json\n")
    link.send_raw(b'{"type": "table", "seq": 9, "models": [{"name": "x"}]}\n')
    link.send(entry("chat", doubles["chat"]))  # still listening after them
    wait_until(lambda: complete(router, "coder").status_code == 404, 10, what="the new table applied")
    assert complete(router, "chat").status_code == 200
    assert "ignoring a bad message" in router.output()
    assert link.bad_lines == []  # and what the router sent was always valid


# ----------------------------------------------------------------- the router's own end


def test_a_router_killed_mid_stream_breaks_the_stream_and_a_new_one_serves_on_the_port(
    start_router, link, doubles
):
    link.send(*all_ready(doubles))
    r = start_router()
    wait_until(lambda: http().get(r.url + "/healthz").status_code == 200, 10, what="linked")
    chat = doubles["chat"]
    chat.control(token_delay=0.05)
    try:
        body = {"model": "chat", "prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}
        events = []
        with (
            pytest.raises(httpx.TransportError),
            http().stream("POST", r.url + "/v1/completions", json=body, timeout=30) as stream,
        ):
            for _, payload in sse_events(stream):
                events.append(payload)
                if len(events) == 2:
                    r.proc.send_signal(signal.SIGKILL)
        assert 2 <= len(events) < 100 and "[DONE]" not in events
    finally:
        chat.control(token_delay=0.002)
    r.proc.wait(5)
    again = start_router(port=r.port)
    wait_until(
        lambda: http().get(again.url + "/healthz").status_code == 200, 10, what="the new router linked"
    )
    assert complete(again, "chat").status_code == 200


def test_sigterm_lets_a_running_stream_finish_and_exits_0(start_router, link, doubles):
    link.send(*all_ready(doubles))
    r = start_router()
    wait_until(lambda: http().get(r.url + "/healthz").status_code == 200, 10, what="linked")
    chat = doubles["chat"]
    chat.control(token_delay=0.02)
    try:
        body = {"model": "chat", "prompt": "x", "max_tokens": 50, "stream": True, "ignore_eos": True}
        with http().stream("POST", r.url + "/v1/completions", json=body, timeout=30) as stream:
            events = sse_events(stream)
            next(events)
            r.proc.send_signal(signal.SIGTERM)
            rest = [p for _, p in events]
        assert rest[-1] == "[DONE]" and len(rest) == 50  # 49 more tokens, then [DONE]
    finally:
        chat.control(token_delay=0.002)
    assert r.proc.wait(10) == 0
    with pytest.raises(httpx.ConnectError):
        http().get(r.url + "/healthz")
