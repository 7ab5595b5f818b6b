"""The router as vLLM's clients see it, over real HTTP: the official `openai` client, vLLM's key check and its
401, a request that names no model, a model that has given up; and one deadline per request, across a crash.

The router processes, the link server standing in for the daemon and the vLLM doubles are those of
test_router.py.
"""

from __future__ import annotations

import dataclasses
import time

import httpx
import openai
import pytest

from r3090d.router.link import EngineState, ModelKind
from tests import openai_client
from tests.component import test_router as harness
from tests.component.test_router import (
    PUBLIC_KEY,
    UPSTREAM_KEY,
    all_ready,
    complete,
    entry,
    in_thread,
    paths_logged,
)
from tests.fakevllm.harness import free_port, http
from tests.waiting import wait_until


def ask(router, model: str, timeout: float) -> httpx.Response:
    """A completion for `model` that may wait in the router's queue for up to `timeout` s."""
    body = {"model": model, "prompt": "hello there", "max_tokens": 4}
    return http().post(router.url + "/v1/completions", json=body, timeout=timeout)


pytestmark = pytest.mark.component

# The fixtures of test_router.py, by the names the tests ask for.
doubles, short_dir, link, start_router = (
    harness.doubles,
    harness.short_dir,
    harness.link,
    harness.start_router,
)


# ----------------------------------------------------------------- the official client


def test_the_openai_client_is_served_through_the_router(start_router, link, doubles):
    link.send(*all_ready(doubles))
    r = start_router(api_key=PUBLIC_KEY)
    wait_until(lambda: http().get(r.url + "/healthz").status_code == 200, 10, what="the router linked")
    openai_client.exercise(r.url + "/v1", PUBLIC_KEY, chat="chat", coder="coder", embed="search", listed=["chat", "coder", "search"])


def test_the_openai_clients_own_retry_rides_out_a_swap(start_router, link, doubles):
    """A client whose timeout is shorter than the swap: the SDK gives its first try up and sends it again. The router
    forgets the wait the client left, and serves the retry once the model is routable."""
    link.send(entry("chat", doubles["chat"], routable=False, state=EngineState.STARTING), entry("coder", doubles["coder"], key=UPSTREAM_KEY))
    r = start_router(api_key=PUBLIC_KEY)
    link.wait_demand("chat", waiting=0)
    client = openai.OpenAI(base_url=r.url + "/v1", api_key=PUBLIC_KEY, max_retries=4, timeout=1.0)
    thread, result = in_thread(client.completions.create, model="chat", prompt="hello there", max_tokens=3)
    first = link.wait_demand("chat", waiting=1, timeout=10)
    # The first try left at its timeout; the one waiting now came after it: the SDK's retry, and only it.
    link.wait_demand("chat", waiting=1, timeout=20, check=lambda d: d.oldest_waiting_at > first.oldest_waiting_at)
    assert thread.is_alive() and not result
    link.send(entry("chat", doubles["chat"], state=EngineState.READY), entry("coder", doubles["coder"], key=UPSTREAM_KEY))
    thread.join(30)
    assert "error" not in result, result.get("error")
    assert result["value"].model == "chat" and result["value"].choices[0].text
    link.wait_demand("chat", waiting=0, inflight=0)


# ----------------------------------------------------------------- the API key, as vLLM checks it


def test_the_key_scheme_is_any_case_and_a_401_is_vllms(start_router, link, doubles):
    link.send(*all_ready(doubles))
    r = start_router(api_key=PUBLIC_KEY)
    wait_until(lambda: http().get(r.url + "/healthz").status_code == 200, 10, what="the router linked")
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert complete(r, "chat", headers={"Authorization": f"{scheme} {PUBLIC_KEY}"}).status_code == 200, (
            scheme
        )
    for wrong in (f"Basic {PUBLIC_KEY}", f"Bearer  {PUBLIC_KEY}", f"Bearer{PUBLIC_KEY}", "Bearer"):
        denied = complete(r, "chat", headers={"Authorization": wrong})
        assert denied.status_code == 401, wrong
        assert denied.json() == {"error": "Unauthorized"}  # vLLM's body, word for word
    assert http().get(r.url + "/v1/models").json() == {"error": "Unauthorized"}


# ----------------------------------------------------------------- a request that names no model


def test_a_request_without_a_model_goes_to_the_one_resident_model(start_router, link, doubles):
    link.send(entry("chat", doubles["chat"]), entry("coder", doubles["coder"], routable=False, key=UPSTREAM_KEY),
              entry("search", doubles["search"], routable=False, state=EngineState.COLD, kind=ModelKind.EMBED))  # fmt: skip
    r = start_router()
    since = time.time()
    text = http().post(r.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    chat = http().post(r.url + "/v1/chat/completions", json={"model": None, "messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2}, timeout=30)  # fmt: skip
    assert (text.status_code, chat.status_code) == (200, 200), (text.text, chat.text)
    assert text.json()["model"] == "chat" and chat.json()["model"] == "chat"
    assert [path for path, _ in paths_logged(doubles["chat"], since)] == [
        "/v1/completions",
        "/v1/chat/completions",
    ]


def test_a_request_without_a_model_is_a_400_naming_them_when_not_exactly_one_is_resident(
    start_router, link, doubles
):
    link.send(entry("chat", doubles["chat"]), entry("coder", doubles["coder"], key=UPSTREAM_KEY),
              entry("search", doubles["search"], routable=False, state=EngineState.PARKED, kind=ModelKind.EMBED))  # fmt: skip
    r = start_router()
    wait_until(lambda: http().get(r.url + "/healthz").status_code == 200, 10, what="the router linked")
    two = http().post(r.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert two.status_code == 400
    error = two.json()["error"]
    assert error["param"] == "model" and error["type"] == "BadRequestError"
    assert all(name in error["message"] for name in ("chat", "coder", "search"))
    link.send(
        entry("chat", doubles["chat"], routable=False), entry("coder", doubles["coder"], routable=False)
    )
    wait_until(
        lambda: "search" not in link.demands[-1][1].models, 10, what="the table without search applied"
    )
    none = http().post(r.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
    assert none.status_code == 400 and "chat" in none.json()["error"]["message"]


# ----------------------------------------------------------------- a model that has given up


def test_a_model_that_gave_up_is_a_503_at_once_with_its_reason(start_router, link, doubles):
    link.send(
        entry("chat", doubles["chat"], routable=False), entry("coder", doubles["coder"], key=UPSTREAM_KEY)
    )
    r = start_router(queue_timeout=60)
    thread, waiting = in_thread(ask, r, "chat", timeout=10)
    link.wait_demand("chat", waiting=1)
    gave_up = entry("chat", doubles["chat"], routable=False, state=EngineState.FAILED)
    link.send(
        dataclasses.replace(gave_up, reason="5 restarts in 600 s"),
        entry("coder", doubles["coder"], key=UPSTREAM_KEY),
    )
    thread.join(20)
    arriving = ask(r, "chat", timeout=10)
    for answer in (waiting["value"], arriving):
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and error["param"] == "model"
        assert "gave up" in error["message"] and "5 restarts in 600 s" in error["message"]
    link.wait_demand("chat", waiting=0)


# ----------------------------------------------------------------- one deadline per request


def test_a_requeued_request_keeps_its_one_deadline(start_router, link, doubles):
    link.send(entry("chat", doubles["chat"], routable=False))
    r = start_router(queue_timeout=4)
    sent_at = time.monotonic()
    thread, result = in_thread(ask, r, "chat", timeout=30)
    link.wait_demand("chat", waiting=1)
    wait_until(lambda: time.monotonic() >= sent_at + 3, 5, what="3 s of the 4 s deadline gone")
    # Routable, but nobody listens: the request is refused and queued again, with 1 s of its 4 s left.
    link.send(entry("chat", upstream=f"http://127.0.0.1:{free_port()}"))
    thread.join(30)
    answered = result["at"] - sent_at
    assert result["value"].status_code == 503
    assert 3.9 <= answered < 6.5  # a fresh 4 s from the re-queue would make it 7 s at the least
    assert "did not answer" in r.output()


def test_an_engine_that_crashes_before_answering_is_waited_for_within_the_deadline(
    start_router, link, doubles, fake_vllm
):
    crashing = fake_vllm(served_model_name="chat")
    crashing.wait_healthy(20)
    crashing.control(hang=True)  # it reads the request and never answers: the crash comes first
    link.send(entry("chat", crashing))
    r = start_router(queue_timeout=30)
    thread, result = in_thread(ask, r, "chat", timeout=60)
    link.wait_demand("chat", inflight=1)
    crashing.kill_all()  # the engine's process dies: the router's connection to it drops, nothing was answered
    link.wait_demand("chat", waiting=1, inflight=0)  # queued again for the engine to come back, not a 502
    assert thread.is_alive()
    link.send(entry("chat", doubles["chat"]))  # it is back
    thread.join(30)
    assert result["value"].status_code == 200, result["value"].text
    assert result["value"].json()["model"] == "chat"
