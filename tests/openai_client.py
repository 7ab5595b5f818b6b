"""One script of the official `openai` client against an OpenAI endpoint of r3090d's (the router): what a real
client does, run against the vLLM double (component tier) and against the real CPU vLLM (vllm tier) alike."""

from __future__ import annotations

import openai
import pytest


def exercise(base_url: str, key: str, *, chat: str, coder: str, embed: str | None, listed: list[str]) -> None:
    """Completions and chat, streaming and not, embeddings (where a model serves them), the model list, an unknown
    model (NotFoundError) and a wrong key (AuthenticationError), each parsed by the client itself."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    text = client.completions.create(model=chat, prompt="hello there", max_tokens=4)
    assert text.object == "text_completion" and text.model == chat and text.choices[0].text
    answer = client.chat.completions.create(model=coder, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert answer.object == "chat.completion" and answer.model == coder and answer.choices[0].message.content is not None
    streamed = client.completions.create(model=chat, prompt="go", max_tokens=5, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices)  # every chunk parsed, the stream ended
    chat_stream = client.chat.completions.create(model=coder, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                                 stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    deltas = [c.choices[0].delta.content for c in chat_stream if c.choices]
    assert "".join(d for d in deltas if d)
    if embed is not None:
        embedded = client.embeddings.create(model=embed, input=["find me", "and me"])
        assert len(embedded.data) == 2 and all(e.embedding for e in embedded.data)
    assert [m.id for m in client.models.list()] == listed

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x", max_tokens=1)
    wrong = openai.OpenAI(base_url=base_url, api_key="not-the-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=chat, prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
