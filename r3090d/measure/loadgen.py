"""A streaming load generator for an OpenAI-compatible vLLM server.

The measurement method follows the source articles: warm up, stream every
request and time each token as it arrives, leave the first token out of TPOT,
repeat the run in rounds and report the median round.

Per request:
- TTFT: send -> first token;
- TPOT: (t_last - t_first) / (n - 1), n output tokens (the first token left out);
- ITL: the gaps between successive chunks that carried tokens.

Per concurrency level and round: mean, standard deviation (population, as
numpy's default) and p50/p90/p99 (linear interpolation between closest ranks,
numpy's default) of each, tokens/s and requests/s over the round's wall time,
failures by reason. Across rounds: the median of each figure.

The prompts are made before the first timed request (`prompts`, `tokenize_client`).

The pure half (percentiles, per-request and per-round arithmetic) is at the top;
the asyncio + httpx client is below it.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from r3090d.measure.prompts import PromptSet

# ------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between closest ranks; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class Dist:
    """Summary of one latency's samples, in seconds."""

    n: int = 0
    mean: float | None = None
    std: float | None = None  # population standard deviation (numpy's np.std)
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not values:
            return cls()
        return cls(
            n=len(values),
            mean=math.fsum(values) / len(values),
            std=statistics.pstdev(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
        )


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_dist(dists: Sequence[Dist]) -> Dist:
    """Field-by-field median over rounds (each round's percentile, then the median of those)."""
    if not dists:
        return Dist()
    return Dist(
        n=int(statistics.median(d.n for d in dists)),
        mean=_median([d.mean for d in dists]),
        std=_median([d.std for d in dists]),
        p50=_median([d.p50 for d in dists]),
        p90=_median([d.p90 for d in dists]),
        p99=_median([d.p99 for d in dists]),
    )


# --------------------------------------------------------------- one request


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    error: str | None = None
    started: float = 0.0  # perf_counter at send
    finished: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: tuple[float, ...] = ()
    finish_reason: str | None = None
    arrivals: tuple[tuple[float, int], ...] = field(default=(), repr=False)  # (perf_counter, tokens) per chunk

    @property
    def e2e_s(self) -> float:
        return self.finished - self.started


def token_timing(started: float, arrivals: Sequence[tuple[float, int]]) -> tuple[float | None, float | None, tuple[float, ...], int]:
    """(TTFT, TPOT, ITLs, tokens) from (arrival time, tokens in that chunk) pairs.

    TPOT spreads the time from the first to the last token over the tokens
    after the first, so a chunk that carries several tokens counts them all.
    """
    arrivals = [(t, k) for t, k in arrivals if k > 0]
    if not arrivals:
        return None, None, (), 0
    n = sum(k for _, k in arrivals)
    first, last = arrivals[0][0], arrivals[-1][0]
    ttft = first - started
    tpot = (last - first) / (n - 1) if n > 1 else None
    itl = tuple(b[0] - a[0] for a, b in zip(arrivals, arrivals[1:], strict=False))
    return ttft, tpot, itl, n


# ------------------------------------------------------------------ one round


@dataclass(frozen=True)
class RoundSummary:
    concurrency: int
    requests: int
    completed: int
    failed: int
    failures: dict[str, int]
    wall_s: float
    output_tokens: int
    prompt_tokens: int  # summed from the usage of the requests that reported it
    output_tokens_mean: float | None
    prompt_tokens_mean: float | None
    output_tok_s: float
    total_tok_s: float  # prompt and output tokens
    requests_s: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    server_itl_mean_s: float | None = None  # vLLM's own inter-token latency over the round
    server_itl_count: float | None = None


def summarize_round(
    results: Sequence[RequestResult],
    concurrency: int,
    wall_s: float,
    server_itl: tuple[float, float] | None = None,
) -> RoundSummary:
    """`server_itl`: (delta sum, delta count) of vllm:inter_token_latency_seconds over the round."""
    ok = [r for r in results if r.ok]
    failures = Counter(r.error or "unknown" for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    itl_all = [gap for r in ok for gap in r.itl_s]
    server_mean = server_count = None
    if server_itl is not None and server_itl[1] > 0:
        server_mean, server_count = server_itl[0] / server_itl[1], server_itl[1]
    return RoundSummary(
        concurrency=concurrency,
        requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        failures=dict(failures.most_common()),
        wall_s=wall_s,
        output_tokens=out_tokens,
        prompt_tokens=sum(prompt),
        output_tokens_mean=(out_tokens / len(ok)) if ok else None,
        prompt_tokens_mean=(sum(prompt) / len(prompt)) if prompt else None,
        output_tok_s=out_tokens / wall_s if wall_s > 0 else 0.0,
        total_tok_s=(sum(prompt) + out_tokens) / wall_s if wall_s > 0 else 0.0,
        requests_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft=Dist.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Dist.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=Dist.of(itl_all),
        e2e=Dist.of([r.e2e_s for r in ok]),
        server_itl_mean_s=server_mean,
        server_itl_count=server_count,
    )


@dataclass(frozen=True)
class LevelSummary:
    """One concurrency level: the median over its rounds, and every round."""

    concurrency: int
    rounds: tuple[RoundSummary, ...]
    completed: int  # summed over rounds
    failed: int
    failures: dict[str, int]
    wall_s: float  # summed over rounds
    prompt_tokens: int  # summed over rounds
    output_tokens: int  # summed over rounds
    output_tok_s: float
    total_tok_s: float
    requests_s: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    output_tokens_mean: float | None
    prompt_tokens_mean: float | None
    server_itl_mean_s: float | None
    mbu: float | None = None  # TPOT floor / median p50 TPOT


def summarize_level(rounds: Sequence[RoundSummary], tpot_floor_s: float | None = None) -> LevelSummary:
    if not rounds:
        raise ValueError("a level needs at least one round")
    failures: Counter[str] = Counter()
    for r in rounds:
        failures.update(r.failures)
    tpot = median_dist([r.tpot for r in rounds])
    return LevelSummary(
        concurrency=rounds[0].concurrency,
        rounds=tuple(rounds),
        completed=sum(r.completed for r in rounds),
        failed=sum(r.failed for r in rounds),
        failures=dict(failures.most_common()),
        wall_s=math.fsum(r.wall_s for r in rounds),
        prompt_tokens=sum(r.prompt_tokens for r in rounds),
        output_tokens=sum(r.output_tokens for r in rounds),
        output_tok_s=statistics.median(r.output_tok_s for r in rounds),
        total_tok_s=statistics.median(r.total_tok_s for r in rounds),
        requests_s=statistics.median(r.requests_s for r in rounds),
        ttft=median_dist([r.ttft for r in rounds]),
        tpot=tpot,
        itl=median_dist([r.itl for r in rounds]),
        e2e=median_dist([r.e2e for r in rounds]),
        output_tokens_mean=_median([r.output_tokens_mean for r in rounds]),
        prompt_tokens_mean=_median([r.prompt_tokens_mean for r in rounds]),
        server_itl_mean_s=_median([r.server_itl_mean_s for r in rounds]),
        mbu=mbu(tpot_floor_s, tpot.p50),
    )


def mbu(tpot_floor_s: float | None, tpot_s: float | None) -> float | None:
    """Memory-bandwidth utilization: the weight-read floor over the measured TPOT."""
    if not tpot_floor_s or not tpot_s:
        return None
    return tpot_floor_s / tpot_s


def parse_levels(text: str) -> tuple[int, ...]:
    """'1,4,8' -> (1, 4, 8). Raises ValueError with the reason."""
    levels = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"concurrency {part!r} is not a positive integer")
        levels.append(int(part))
    if not levels:
        raise ValueError("no concurrency level given")
    return tuple(levels)


# --------------------------------------------------------------- the client


class BenchError(Exception):
    """The run cannot start or continue; `exit_code` says why (64 input, 69 engine unavailable)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


EX_USAGE = 64
EX_UNAVAILABLE = 69


@dataclass(frozen=True)
class Target:
    url: str  # http://host:port, no /v1
    model: str
    api_key: str = field(default="", repr=False)
    chat: bool = False
    max_tokens: int = 128
    ignore_eos: bool = True
    continuous_usage: bool = True  # per-chunk usage: exact token counts per chunk
    timeout_s: float = 300.0

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def body(self, prompt: str, max_tokens: int | None = None) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": max_tokens or self.max_tokens,
            "stream": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True, **({"continuous_usage_stats": True} if self.continuous_usage else {})},
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM: every request runs to max_tokens, so lengths are fixed
        return body


def error_text(status: int, raw: bytes) -> str:
    try:
        data = json.loads(raw)
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message") if isinstance(err, dict) else None
        message = message or (data.get("detail") if isinstance(data, dict) else None) or str(err)
    except (ValueError, AttributeError):
        message = raw.decode("utf-8", "replace")
    message = " ".join(str(message).split())
    return f"HTTP {status}: {message[:160]}" if message else f"HTTP {status}"


def transport_error(exc: BaseException) -> str:
    import httpx

    if isinstance(exc, httpx.ConnectError):
        seen, todo = set(), [exc]
        while todo:
            e = todo.pop()
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            if isinstance(e, ConnectionRefusedError) or "refused" in str(e).lower():
                return "connection refused"
            todo += [e.__cause__, e.__context__]
        return f"cannot connect ({exc or 'nothing listening, or the host is unreachable'})"
    if isinstance(exc, httpx.TimeoutException):
        return f"timeout ({type(exc).__name__})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection closed mid-stream"
    return f"{type(exc).__name__}: {exc}"[:160]


async def stream_request(client, target: Target, prompt: str, max_tokens: int | None = None) -> RequestResult:
    """One streamed request, timed chunk by chunk. Never raises for server or network trouble."""
    import httpx

    arrivals: list[tuple[float, int]] = []
    prompt_tokens = None
    finish = None
    counted = 0
    done: float | None = None  # arrival time of [DONE]
    started = time.perf_counter()
    try:
        async with client.stream("POST", target.url + target.endpoint, json=target.body(prompt, max_tokens), headers=target.headers(), timeout=target.timeout_s) as response:
            if response.status_code != 200:
                raw = await response.aread()
                return RequestResult(False, error_text(response.status_code, raw), started, time.perf_counter())
            buffer = b""
            async for chunk in response.aiter_raw():
                now = time.perf_counter()
                buffer += chunk
                while done is None and b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = now
                        break
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        return RequestResult(False, "malformed stream event", started, now)
                    if not isinstance(event, dict):
                        continue
                    if "error" in event:
                        err = event["error"]
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        return RequestResult(False, f"error in stream: {' '.join(str(msg).split())[:160]}", started, now)
                    usage = event.get("usage")
                    usage = usage if isinstance(usage, dict) else None
                    choices = event.get("choices")
                    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
                        return RequestResult(False, "malformed stream event: choices is not a list of objects", started, now)
                    tokens = 0
                    if usage and isinstance(usage.get("completion_tokens"), int):
                        # Cumulative with continuous usage stats; total in the final chunk otherwise.
                        tokens = usage["completion_tokens"] - counted
                        if isinstance(usage.get("prompt_tokens"), int):
                            prompt_tokens = usage["prompt_tokens"]
                    elif choices:
                        # No usage in the chunk: one chunk carries one token (vLLM's streaming unit);
                        # the final usage chunk corrects the count if that was wrong.
                        c = choices[0]
                        delta = c.get("delta")
                        text = c.get("text") if "text" in c else (delta.get("content") if isinstance(delta, dict) else None)
                        tokens = 1 if text else 0
                    for c in choices:
                        if c.get("finish_reason"):
                            finish = c["finish_reason"]
                    if tokens > 0:
                        counted += tokens
                        if choices or not arrivals:
                            arrivals.append((now, tokens))
                        else:
                            # A usage-only final chunk: tokens the content chunks carried uncounted.
                            t, k = arrivals[-1]
                            arrivals[-1] = (t, k + tokens)
                if done is not None:
                    # [DONE] ends the answer. Leaving now closes the connection instead of
                    # returning it to the pool: with hundreds of streams, httpx took seconds
                    # to see the end of a chunked body that had already arrived.
                    break
    except (httpx.HTTPError, OSError) as exc:
        return RequestResult(False, transport_error(exc), started, time.perf_counter())
    if done is None:
        return RequestResult(False, "stream ended without [DONE]", started, time.perf_counter())
    finished = done
    ttft, tpot, itl, n = token_timing(started, arrivals)
    if n == 0:
        return RequestResult(False, "no tokens in the stream", started, finished)
    return RequestResult(True, None, started, finished, prompt_tokens, n, ttft, tpot, itl, finish, tuple(arrivals))


async def run_round(
    client,
    target: Target,
    prompts: Sequence[str],
    concurrency: int,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` workers send `prompts` one after another. (results, wall seconds)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []

    async def worker() -> None:
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            result = await stream_request(client, target, prompt)
            results.append(result)
            if on_done is not None:
                on_done(result)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return results, time.perf_counter() - started


def make_client(max_connections: int):
    import httpx

    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        timeout=httpx.Timeout(30.0),
        trust_env=False,
    )


@dataclass(frozen=True)
class BenchPlan:
    levels: tuple[int, ...]
    requests: int | None  # per round; None: 4 x concurrency, at least 8
    rounds: int = 5
    warmup: int = 10
    prompt_tokens: int = 128
    seed: int = 3090

    def requests_for(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else max(4 * concurrency, 8)

    def round_sizes(self) -> list[int]:
        """Requests in each measured round, in the order the rounds run."""
        return [self.requests_for(c) for c in self.levels for _ in range(self.rounds)]

    def total_requests(self) -> int:
        return self.warmup + sum(self.round_sizes())


async def run_bench(
    target: Target,
    plan: BenchPlan,
    prompt_set: PromptSet,
    *,
    server_itl: Callable[[], tuple[float, float] | None] | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    on_level: Callable[[int, int], None] | None = None,
    tpot_floor_s: float | None = None,
) -> list[LevelSummary]:
    """Warm up, then each level for `rounds` rounds. `server_itl()` reads vLLM's ITL (sum, count).

    `prompt_set` holds every prompt, made beforehand so that no round waits on it.
    """
    if [len(p) for p in prompt_set.rounds] != plan.round_sizes() or len(prompt_set.warmup) != plan.warmup:
        raise ValueError("the prompt set was made for another plan")
    levels: list[LevelSummary] = []
    round_prompts = iter(prompt_set.rounds)
    async with make_client(max(plan.levels) + 8) as client:
        if plan.warmup:
            await run_round(client, target, prompt_set.warmup, min(plan.warmup, max(plan.levels)), on_done)
        for concurrency in plan.levels:
            rounds = []
            for r in range(plan.rounds):
                if on_level is not None:
                    on_level(concurrency, r)
                prompts = next(round_prompts)
                before = await asyncio.to_thread(server_itl) if server_itl else None
                results, wall = await run_round(client, target, prompts, concurrency, on_done)
                after = await asyncio.to_thread(server_itl) if server_itl else None
                delta = (after[0] - before[0], after[1] - before[1]) if before and after else None
                rounds.append(summarize_round(results, concurrency, wall, delta))
            levels.append(summarize_level(rounds, tpot_floor_s))
    return levels


async def check_target(target: Target) -> Target:
    """Resolve the model and prove the endpoint streams, or raise BenchError with the reason."""
    import httpx

    async with make_client(2) as client:
        try:
            response = await client.get(target.url + "/v1/models", headers=target.headers(), timeout=10.0)
        except httpx.HTTPError as exc:
            raise BenchError(f"cannot reach {target.url}: {transport_error(exc)}", EX_UNAVAILABLE) from None
        if response.status_code in (401, 403):
            raise BenchError(f"{target.url} refused the API key ({error_text(response.status_code, response.content)}): set it in the environment variable named by --api-key-env", EX_USAGE)
        if response.status_code != 200:
            raise BenchError(f"{target.url}/v1/models: {error_text(response.status_code, response.content)}", EX_UNAVAILABLE)
        try:
            served = [m["id"] for m in response.json().get("data", []) if isinstance(m, dict) and "id" in m]
        except (ValueError, AttributeError, TypeError):
            raise BenchError(f"{target.url}/v1/models did not answer with an OpenAI model list", EX_UNAVAILABLE) from None
        if not target.model:
            if not served:
                raise BenchError(f"{target.url} serves no model", EX_UNAVAILABLE)
            target = _replace(target, model=served[0])
        elif target.model not in served:
            raise BenchError(f"model {target.model!r} is not served at {target.url} (served: {', '.join(served) or 'none'})", EX_USAGE)
        probe = await stream_request(client, target, "hello", max_tokens=2)
        if not probe.ok and target.continuous_usage and probe.error and probe.error.startswith("HTTP 400"):
            # Some servers refuse per-chunk usage; fall back to counting chunks.
            target = _replace(target, continuous_usage=False)
            probe = await stream_request(client, target, "hello", max_tokens=2)
        if not probe.ok:
            code = EX_USAGE if probe.error and probe.error.startswith("HTTP 4") else EX_UNAVAILABLE
            raise BenchError(f"a test request to {target.url}{target.endpoint} failed: {probe.error}", code)
    return target


def _replace(target: Target, **changes) -> Target:
    from dataclasses import replace

    return replace(target, **changes)

