"""The /tokenize client against a real HTTP server on 127.0.0.1 that answers each way a server may."""

from __future__ import annotations

import asyncio
import json

import pytest

from r3090d.measure import loadgen, tokenize_client
from r3090d.measure.prompts import PromptUnit
from tests.loopback_http import QuietHandler, base_url, serving

pytestmark = pytest.mark.component

TEMPLATE_TOKENS = 5  # what this server's chat template adds


class Handler(QuietHandler):
    mode = "count"  # set per test through the server
    seen: list[dict]

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append({"path": self.path, **request})
        mode = self.server.mode
        if self.path != "/tokenize" or mode == "absent":
            self.answer(404, b'{"detail": "Not Found"}')
        elif mode == "get_only":
            self.answer(405, b'{"detail": "Method Not Allowed"}')
        elif mode == "broken":
            self.answer(500, json.dumps({"error": {"message": "tokenizer crashed", "code": 500}}).encode())
        elif mode == "garbage":
            self.answer(200, b'{"tokens": []}')
        else:
            # Two tokens for every word of five letters or more, and a chat template.
            text = request["messages"][0]["content"] if "messages" in request else request["prompt"]
            count = sum(2 if len(w) >= 5 else 1 for w in text.split()) + (
                TEMPLATE_TOKENS if "messages" in request else 0
            )
            self.answer(
                200,
                json.dumps({"count": count, "max_model_len": 4096, "tokens": list(range(count))}).encode(),
            )


@pytest.fixture
def server():
    with serving(Handler) as httpd:
        httpd.mode, httpd.seen = "count", []
        yield httpd


PLAN = loadgen.BenchPlan(levels=(1, 3), requests=5, rounds=2, warmup=3, prompt_tokens=30)


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "messages"])
def test_every_prompt_of_the_plan_is_fitted_before_the_run(server, chat):
    done = []
    target = loadgen.Target(url=base_url(server), model="m", chat=chat)
    prompt_set = asyncio.run(tokenize_client.prepare_prompts(target, PLAN, on_prompt=lambda: done.append(1)))
    assert prompt_set.stats.unit is PromptUnit.TOKENS
    assert prompt_set.stats.exact == prompt_set.stats.prompts == PLAN.total_requests() == len(done) == 23
    assert len(prompt_set.warmup) == 3 and [len(r) for r in prompt_set.rounds] == [5, 5, 5, 5]
    texts = [*prompt_set.warmup, *(p for r in prompt_set.rounds for p in r)]
    assert len(set(texts)) == 23 and len({t.split()[0] for t in texts}) == 23  # each its own number first
    # The bodies were the ones the completions would get: a prompt, or one user message, and the model.
    body = server.seen[0]
    assert body["model"] == "m" and (
        body["messages"][0]["role"] == "user" if chat else isinstance(body["prompt"], str)
    )


@pytest.mark.parametrize("mode", ["absent", "get_only"])
def test_a_server_without_tokenize_gets_word_prompts(server, mode):
    server.mode = mode
    prompt_set = asyncio.run(
        tokenize_client.prepare_prompts(loadgen.Target(url=base_url(server), model="m"), PLAN)
    )
    assert prompt_set.stats.unit is PromptUnit.WORDS and prompt_set.stats.exact == 0
    assert all(len(p.split()) == 30 for p in prompt_set.warmup)
    assert len(server.seen) == 1  # asked once, then no more


@pytest.mark.parametrize(
    "mode, reason",
    [("broken", "HTTP 500: tokenizer crashed"), ("garbage", "did not answer with a token count")],
)
def test_a_failing_tokenize_stops_the_run_with_the_reason(server, mode, reason):
    server.mode = mode
    with pytest.raises(loadgen.BenchError) as failed:
        asyncio.run(tokenize_client.prepare_prompts(loadgen.Target(url=base_url(server), model="m"), PLAN))
    assert reason in str(failed.value) and "/tokenize" in str(failed.value)
    assert failed.value.exit_code == loadgen.EX_UNAVAILABLE


def test_an_unreachable_server_is_a_bench_error(server):
    address = base_url(server)
    server.shutdown()
    server.server_close()
    with pytest.raises(loadgen.BenchError) as failed:
        asyncio.run(tokenize_client.prepare_prompts(loadgen.Target(url=address, model="m"), PLAN))
    assert "connection refused" in str(failed.value)
