"""Every prompt of a `bench` run, fitted to the token count through the server's POST /tokenize.

vLLM's /tokenize takes the completions body's `prompt` (or the chat body's
`messages`) and answers `{"count", "max_model_len", "tokens"}`; its count is the
prompt_tokens the completions endpoint reports for the same body, special
tokens and chat template included. A server without the route (404, 405) gets
prompts counted in words instead. This runs before the first timed request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from r3090d.measure import prompts
from r3090d.measure.loadgen import (
    EX_UNAVAILABLE,
    EX_USAGE,
    BenchError,
    BenchPlan,
    Target,
    error_text,
    make_client,
    transport_error,
)
from r3090d.measure.prompts import FittedPrompt, PromptSet, PromptStats

TOKENIZE_PATH = "/tokenize"
IN_FLIGHT = 16  # /tokenize requests at once: each is a tokenizer call, cheap for the server


class NoTokenizeEndpoint(BenchError):
    """The server answered 404 or 405 to POST /tokenize."""

    def __init__(self, url: str):
        super().__init__(f"{url}{TOKENIZE_PATH} is not served", EX_UNAVAILABLE)


def tokenize_body(target: Target, text: str) -> dict:
    """The /tokenize body for `text` sent as `target` sends it: a prompt, or one user message."""
    if target.chat:
        return {"model": target.model, "messages": [{"role": "user", "content": text}]}
    return {"model": target.model, "prompt": text}


async def count_tokens(client, target: Target, text: str) -> int:
    """The server's token count for `text` as `target` would send it. Raises BenchError."""
    import httpx

    url = target.url + TOKENIZE_PATH
    headers = {**target.headers(), "Accept": "application/json"}
    try:
        response = await client.post(url, json=tokenize_body(target, text), headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        raise BenchError(f"{url}: {transport_error(exc)}", EX_UNAVAILABLE) from None
    if response.status_code in (404, 405):
        raise NoTokenizeEndpoint(target.url)
    if response.status_code != 200:
        code = EX_USAGE if response.status_code in (401, 403) else EX_UNAVAILABLE
        raise BenchError(f"{url}: {error_text(response.status_code, response.content)}", code)
    try:
        count = response.json()["count"]
    except (ValueError, KeyError, TypeError):
        count = None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise BenchError(f"{url} did not answer with a token count", EX_UNAVAILABLE)
    return count


async def fit_prompt(client, target: Target, index: int, wanted: int, seed: int) -> FittedPrompt:
    """`prompts.fit_steps` driven by the server's counts."""
    steps = prompts.fit_steps(index, wanted, seed)
    text = next(steps)
    while True:
        count = await count_tokens(client, target, text)
        try:
            text = steps.send(count)
        except StopIteration as done:
            return done.value


async def prepare_prompts(
    target: Target, plan: BenchPlan, on_prompt: Callable[[], None] | None = None
) -> PromptSet:
    """Every prompt of `plan`, `plan.prompt_tokens` tokens long by the server's count where it can say.

    `on_prompt()` is called as each prompt is done. Raises BenchError if /tokenize fails
    other than by being absent.
    """
    total = plan.total_requests()
    wanted = plan.prompt_tokens
    fitted: list[FittedPrompt | None] = [None] * total
    async with make_client(IN_FLIGHT + 2) as client:
        try:
            fitted[0] = await fit_prompt(client, target, 0, wanted, plan.seed)
        except NoTokenizeEndpoint:
            texts = [prompts.word_prompt(i, wanted, plan.seed) for i in range(total)]
            return PromptSet.split(
                texts, plan.warmup, plan.round_sizes(), PromptStats.of_words(wanted, total)
            )
        if on_prompt is not None:
            on_prompt()
        todo = iter(range(1, total))

        async def worker() -> None:
            for index in todo:  # one iterator shared by the workers: each index is fitted once
                fitted[index] = await fit_prompt(client, target, index, wanted, plan.seed)
                if on_prompt is not None:
                    on_prompt()

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(IN_FLIGHT, total - 1)):
                    group.create_task(worker())
        except ExceptionGroup as failed:
            # The first reason is the one to give; the other workers were cancelled after it.
            raise failed.exceptions[0] from None
    done = [f for f in fitted if f is not None]
    assert len(done) == total
    return PromptSet.split(
        [f.text for f in done], plan.warmup, plan.round_sizes(), PromptStats.of_fitted(wanted, done)
    )
