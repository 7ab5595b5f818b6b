"""The known-answer canary's request and its parser, off the loop.

One greedy completion with every sampling parameter pinned: vLLM applies a
model's generation_config.json defaults (Qwen2.5-Instruct: repetition penalty
1.05, top_k 20, top_p 0.8) unless the request sets them. `ignore_eos` and a fixed
`max_tokens` give every answer the same length; `logprobs: 2` gives the top-2
log-probabilities of each generated token, whose difference is the position's
margin; `return_tokens_as_token_ids` names tokens by id, so the comparison never
depends on how a tokenizer renders bytes; a fresh random `cache_salt` keeps the
prefix cache from serving the prompt, so each canary runs its full forward pass.

The loop reads the latest result (`sample()`); the parser is pure and tested
against a response captured from the real vLLM.
"""

from __future__ import annotations

import json
import math
import secrets
import time

import httpx

from r3090d.config.schema import CanaryConfig
from r3090d.core.snapshot import CanaryAnswer, CanarySample
from r3090d.core.vocabulary import CanaryPurpose
from r3090d.probes.http import engine_client
from r3090d.probes.offloop import Exchange, OffLoop

_MAX_DETAIL = 200
_TOKEN_PREFIX = "token_id:"
# The answer is read whole; a canary's body is small (16 tokens and their top-2), so bound it.
_MAX_BODY = 1 << 20


class CanaryError(ValueError):
    """The engine's answer is not a canary answer (shape, length, values)."""


def request_body(cc: CanaryConfig, model: str, salt: str) -> dict:
    return {
        "model": model,
        "prompt": cc.prompt,
        "max_tokens": cc.max_tokens,
        "temperature": 0,
        "top_p": 1,
        "top_k": -1,
        "min_p": 0,
        "repetition_penalty": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "seed": cc.seed,
        "ignore_eos": True,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        "cache_salt": salt,
        "stream": False,
    }


def _token_id(token: object) -> int:
    if not isinstance(token, str) or not token.startswith(_TOKEN_PREFIX):
        raise CanaryError(f"a token is not named by id: {str(token)[:40]!r}")
    try:
        return int(token[len(_TOKEN_PREFIX) :])
    except ValueError:
        raise CanaryError(f"a token id is not a number: {token[:40]!r}") from None


def _logprob(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value > 1e-6:
        raise CanaryError(f"a log-probability is not a number <= 0: {str(value)[:40]!r}")
    return float(value)


def parse(body: object, max_tokens: int) -> CanaryAnswer:
    """vLLM's completions answer (logprobs 2, tokens as ids) -> the canary's answer; CanaryError if it is not one."""
    try:
        choice = body["choices"][0]
        lp = choice["logprobs"]
        tokens, top = lp["tokens"], lp["top_logprobs"]
        text = choice.get("text") or ""
    except (KeyError, IndexError, TypeError):
        raise CanaryError("the answer has no choices[0].logprobs with tokens and top_logprobs") from None
    if not isinstance(tokens, list) or not isinstance(top, list) or len(tokens) != len(top):
        raise CanaryError("logprobs.tokens and logprobs.top_logprobs are not lists of one length")
    if len(tokens) != max_tokens:
        raise CanaryError(f"{len(tokens)} token(s) came back, not {max_tokens} (is ignore_eos honoured?)")
    ids, margins, runners = [], [], []
    for token, alternatives in zip(tokens, top, strict=True):
        chosen = _token_id(token)
        if not isinstance(alternatives, dict) or not alternatives:
            raise CanaryError("a position has no top log-probabilities")
        ranked = sorted(((_logprob(v), _token_id(k)) for k, v in alternatives.items()), key=lambda p: (-p[0], p[1]))
        best = ranked[0][0]
        # Greedy: the chosen token is the top-1 (ties by id). The runner-up is the best other token.
        others = [(lp_, tid) for lp_, tid in ranked if tid != chosen]
        chosen_lp = next((lp_ for lp_, tid in ranked if tid == chosen), best)
        second = others[0] if others else None
        ids.append(chosen)
        runners.append(second[1] if second else None)
        margins.append(max(0.0, chosen_lp - second[0]) if second else math.inf)
    return CanaryAnswer(token_ids=tuple(ids), margins=tuple(margins), runner_up=tuple(runners), text=str(text))


class CanaryProber(OffLoop[CanarySample]):
    """Sends one canary at a time in its own thread; the loop reads the latest result."""

    def __init__(self, base_url: str, model: str, api_key: str, cc: CanaryConfig, wake=None, *, sent_before: int = 0,
                 unanswered_before: int = 0, persisted: CanaryAnswer | None = None, uds: str = ""):  # fmt: skip
        super().__init__(CanarySample(), wake, sent_before, unanswered_before)
        self._uds = uds
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._model = model
        self._api_key = api_key
        self._cfg = cc
        self._persisted = persisted

    def reset(self, persisted: CanaryAnswer | None = None) -> None:
        """A new engine: forget the old one's answer; `persisted` is an earlier engine's baseline with its dependencies."""
        self._reset(CanarySample())
        self._persisted = persisted

    def send(self, purpose: CanaryPurpose) -> None:
        def not_started(generation: int, exc: Exception) -> None:
            self._finish(generation, None, f"canary not started: {type(exc).__name__}", unanswered=True)

        self._begin(lambda _prev: CanarySample(sent_at=time.monotonic()), self._run, f"canary-{purpose.value}", not_started)

    def _run(self, generation: int) -> None:
        answer, error = None, "the canary ended without an answer"
        exchange = Exchange()
        unanswered = False  # unknown (a BaseException): counted as answered, as while in flight
        try:
            answer, error = self._attempt(exchange)
            unanswered = not exchange.answered
        finally:
            self._finish(generation, answer, error, unanswered=unanswered)

    def _attempt(self, exchange: Exchange) -> tuple[CanaryAnswer | None, str]:
        """The answer, or what kept the canary from one."""
        try:
            return self._request(exchange), ""
        except CanaryError as exc:
            return None, _short(f"not a canary answer: {exc}")
        except httpx.TimeoutException:
            return None, f"no answer within {self._cfg.timeout:.0f} s"
        except httpx.HTTPError as exc:
            return None, type(exc).__name__  # its message can quote the request's headers
        except Exception as exc:  # noqa: BLE001 - any failure is an error, never a stuck canary
            message = f"{type(exc).__name__}: {exc}"
            return None, _short(message.replace(self._api_key, "<api key>") if self._api_key else message)

    def _request(self, exchange: Exchange) -> CanaryAnswer:
        headers = {"Connection": "close"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        body = request_body(self._cfg, self._model, secrets.token_hex(16))
        timeout = httpx.Timeout(self._cfg.timeout, connect=min(5.0, self._cfg.timeout))
        with engine_client(timeout, self._uds) as client:
            with client.stream("POST", self._url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    raise CanaryError(f"HTTP {resp.status_code}")
                exchange.answered = True
                raw = b""
                for chunk in resp.iter_bytes():
                    raw += chunk
                    if len(raw) > _MAX_BODY:
                        raise CanaryError(f"the answer is larger than {_MAX_BODY} bytes")
        try:
            doc = json.loads(raw)
        except ValueError:
            raise CanaryError("the answer is not JSON") from None
        return parse(doc, self._cfg.max_tokens)

    def _finish(self, generation: int, answer: CanaryAnswer | None, error: str, *, unanswered: bool) -> None:
        self._end(generation, lambda prev: CanarySample(sent_at=prev.sent_at, finished_at=time.monotonic(), answer=answer, error=error),
                  unanswered=unanswered)  # fmt: skip

    @property
    def persisted(self) -> CanaryAnswer | None:
        return self._persisted

    def sample(self) -> CanarySample:
        with self._lock:
            s = self._sample
            return CanarySample(sent_at=s.sent_at, finished_at=s.finished_at, answer=s.answer, error=s.error,
                                sent_total=self._sent_total, unanswered_total=self._unanswered_total, persisted=self._persisted)  # fmt: skip


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_DETAIL else text[: _MAX_DETAIL - 3] + "..."
