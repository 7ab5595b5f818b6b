"""The engine probe: vLLM's /health and /metrics over HTTP, and a pure parse of /metrics.

`parse` is pure and is the boundary for untrusted text: whatever it is given, it
returns an MetricsSample and never raises. The fetchers are thin I/O around
httpx; an expected failure (refused, timeout, HTTP error, oversized body) is a
field or an error string, never an exception.

Why the parse looks the way it does: a real /metrics payload is about 50 KB and
over 600 lines, of which we need about ten. prometheus_client parses character by
character, so a full parse costs tens of milliseconds. We pick out the wanted
sample lines first (one compiled pattern anchored on a line start: a label value
cannot hold a raw newline, so a line is always a whole sample). Each line's label
block, the only part where quoting and escaping matter, is parsed by
prometheus_client; label blocks repeat from poll to poll (the 1 KB
vllm:cache_config_info one never changes), so that parse is memoized on the exact
block text. The value after the block is a plain float.
"""

from __future__ import annotations

import functools
import math
import re
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from r3090d.core.snapshot import HealthSample, HealthStatus, MetricsSample
from r3090d.probes.http import engine_client

MAX_METRICS_BYTES = 8 * 1024 * 1024
# parse() refuses text longer than the fetcher could ever return.
MAX_TEXT_CHARS = MAX_METRICS_BYTES
# A wanted line longer than this is skipped, that series alone. The longest real
# one, vllm:cache_config_info, is about 1 KB. prometheus_client's label parse
# takes time that grows with the square of a block's length when it holds escapes
# (a 1 MB block: seconds; 7 MB: minutes), and the memo below keeps the blocks.
MAX_LINE_CHARS = 16 * 1024

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # before vLLM 0.12
CACHE_CONFIG = "vllm:cache_config_info"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
# The finish reasons of a request the engine completed: it served. "abort" (the
# client went away) and "error" do not say the engine works.
SERVED_REASONS = ("stop", "length", "repetition")
ITL = "vllm:inter_token_latency_seconds"
ITL_OLD = "vllm:time_per_output_token_seconds"  # the same histogram's former name

# Sample names as they appear on a line. Counters keep their _total here: we read
# sample names, never family names, so prometheus_client's stripping of _total
# from a counter family's name does not concern us.
WANTED_SAMPLES = (
    KV_USAGE,
    KV_USAGE_OLD,
    CACHE_CONFIG,
    RUNNING,
    WAITING,
    PREEMPTIONS,
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    ITL + "_sum",
    ITL + "_count",
    ITL_OLD + "_sum",
    ITL_OLD + "_count",
)

# A wanted line starts right after a newline with a wanted name followed by the
# label block or the value separator; `vllm:num_requests_waiting_by_reason` must
# not match `vllm:num_requests_waiting`. The literal "\nvllm:" prefix lets the
# regex engine skip ahead between candidate lines, so this is one fast scan.
# HELP and TYPE lines are left out on purpose: they carry nothing we read and are
# the costliest lines for prometheus_client's parser.
_WANTED_SAMPLE = (
    r"(vllm:(?:" + "|".join(re.escape(name[len("vllm:") :]) for name in WANTED_SAMPLES) + r"))([{ \t][^\n]*)"
)
_WANTED_LINE = re.compile(r"\n" + _WANTED_SAMPLE)
_WANTED_FIRST_LINE = re.compile(_WANTED_SAMPLE)  # the first line has no newline before it

_MAX_DETAIL = 200

# A series' labels, sorted by name: the key that tells two series of one name apart.
Labels = tuple[tuple[str, str], ...]
Series = dict[str, dict[Labels, float]]  # sample name -> labels -> value


def _short(text: str, limit: int = _MAX_DETAIL) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------- parse


def parse(text: str, model_name: str) -> MetricsSample:
    """Read the served model's KV cache, queue and token counters from /metrics text.

    Only series whose `model_name` label equals `model_name` count; with an empty
    `model_name`, the single model on the endpoint is taken. Series of several
    engines of that model (data parallel, told apart by the `engine` label) are
    summed, except the KV cache: engines may differ in size, so each one's free
    blocks come from its own usage and its own cache_config_info, and the engine
    with the fewest is reported (its block figures with it); `kv_usage` is the
    highest usage of any engine. A series given twice (same name and labels)
    counts once: the last line wins, as on a Prometheus scrape. A line longer
    than MAX_LINE_CHARS is skipped, that series alone.

    `error` is set when the text is unusable (empty, truncated, oversized,
    malformed, not vLLM, or no series for the model) and then every field is
    None; it is also set, with the other fields filled, when the KV-cache usage
    gauge alone is missing, because the KV rules are blind then.
    """
    try:
        return _parse(text, model_name)
    except Exception as exc:  # noqa: BLE001 - the boundary for untrusted text: never raise
        return MetricsSample(error=_short(f"metrics parse failed: {type(exc).__name__}: {exc}"))


def _parse(text: str, model_name: str) -> MetricsSample:
    if not isinstance(text, str):
        return MetricsSample(error=f"metrics text is {type(text).__name__}, not str")
    if len(text) > MAX_TEXT_CHARS:
        return MetricsSample(error=f"metrics text too large: {len(text)} chars (limit {MAX_TEXT_CHARS})")
    if not text.strip():
        return MetricsSample(error="metrics text is empty")
    # The exposition format ends every line, the last included, with a newline, so
    # a body without one was cut off mid-line.
    if not text.endswith("\n"):
        return MetricsSample(error="metrics text truncated: the last line has no newline")

    lines = _WANTED_LINE.findall(text)
    if first := _WANTED_FIRST_LINE.match(text):
        lines.insert(0, first.groups())
    if not lines:
        if "vllm:" not in text:
            return MetricsSample(
                error="no vllm: metrics in the text (not vLLM, or started with --disable-log-stats)"
            )
        return MetricsSample(error="none of the watched vllm: metrics are in the text")

    series: Series = {}
    configs: dict[Labels, None] = {}  # an ordered set: the first of each distinct block first
    try:
        for name, tail in lines:
            if len(name) + len(tail) > MAX_LINE_CHARS:
                continue  # this series alone is dropped; see MAX_LINE_CHARS
            labels, value = _read_sample_tail(tail)
            key = tuple(sorted(labels))
            if name == CACHE_CONFIG:
                configs.setdefault(key)
            else:
                # The same name and labels again: the last line wins, as on a Prometheus scrape.
                series.setdefault(name, {})[key] = value
    except ValueError as exc:
        return MetricsSample(error=_short(f"malformed metrics line: {exc}"))

    chosen = _series_of_model(series, model_name)
    if isinstance(chosen, str):
        return MetricsSample(error=chosen)
    return _build_sample(chosen, list(configs), model_name)


def _read_sample_tail(tail: str) -> tuple[Labels, float]:
    """(labels, value) from what follows a sample's name. Raises ValueError when malformed."""
    labels: Labels = ()
    rest = tail
    if tail.startswith("{"):
        # The value and timestamp after the block hold no "}", so the last one
        # closes the block even when a quoted label value contains "}".
        end = tail.rfind("}")
        if end < 0:
            raise ValueError(f"unclosed label block: {tail[:120]}")
        labels = _parse_label_block(tail[: end + 1])
        rest = tail[end + 1 :]
    tokens = rest.split()
    if not tokens or len(tokens) > 2:
        raise ValueError(f"expected a value and an optional timestamp, got {rest[:60]!r}")
    value_text = tokens[0]
    # Python's float() also takes "1_000" and non-ASCII digits; the format does not.
    if "_" in value_text or not value_text.isascii():
        raise ValueError(f"bad value {value_text[:60]!r}")
    if len(tokens) == 2 and not tokens[1].lstrip("-").isdigit():
        raise ValueError(f"bad timestamp {tokens[1][:60]!r}")
    return labels, float(value_text)


@functools.lru_cache(maxsize=64)
def _parse_label_block(block: str) -> Labels:
    """The labels of one {...} block, unescaped by prometheus_client. Raises ValueError."""
    families = list(text_string_to_metric_families("m" + block + " 0\n"))
    if len(families) != 1 or len(families[0].samples) != 1:
        raise ValueError(f"bad label block: {block[:120]}")
    return tuple(families[0].samples[0].labels.items())


def _label(labels: Labels, key: str, default: str | None = None) -> str | None:
    for name, value in labels:
        if name == key:
            return value
    return default


def _series_of_model(series: Series, model_name: str) -> Series | str:
    """Keep the series of the wanted model, or say why there are none."""
    names_seen = sorted(
        {_label(labels, "model_name", "") or "" for rows in series.values() for labels in rows}
    )
    if not series:
        # Only cache_config_info was found, and it names no model.
        return "no per-model vllm: series in the text (only vllm:cache_config_info)"
    if not model_name:
        if len(names_seen) != 1:
            shown = ", ".join(repr(name) for name in names_seen)
            return f"several models on this endpoint ({shown}); configure which one to watch"
        model_name = names_seen[0]
    chosen = {
        name: kept
        for name, rows in series.items()
        if (
            kept := {
                labels: value
                for labels, value in rows.items()
                if _label(labels, "model_name", "") == model_name
            }
        )
    }
    if not chosen:
        if names_seen == [""]:
            return f"no vllm: series carries a model_name label; expected model_name={model_name!r}"
        shown = ", ".join(repr(name) for name in names_seen if name)
        return (
            f"no vllm: series for model_name={model_name!r}; /metrics names {shown}"
            " (check engine.served_model_name)"
        )
    return chosen


@dataclass(frozen=True)
class _CacheConfigs:
    """vllm:cache_config_info of the model's engines: one block per engine label, in
    the versions seen, and no model_name label (one that names another model is left out)."""

    own: dict[str | None, Labels]  # by engine label; None: a block without one
    shared: Labels  # for an engine without a block of its own

    @staticmethod
    def of(configs: list[Labels], engines: set[str | None], model_name: str) -> _CacheConfigs:
        candidates = (
            [c for c in configs if _label(c, "model_name", model_name) == model_name]
            if model_name
            else configs
        )
        own: dict[str | None, Labels] = {}
        for config in candidates:
            own.setdefault(_label(config, "engine"), config)  # the first one, should an engine have two
        # A block without an engine label, else the first of an engine of this model,
        # else the first there is: a guess, but the only block-count figure on hand.
        shared = own.get(None) or next((c for e, c in own.items() if e in engines), ())
        return _CacheConfigs(own=own, shared=shared or (candidates[0] if candidates else ()))

    def of_engine(self, engine: str | None) -> Labels:
        return self.own.get(engine, self.shared)


@dataclass(frozen=True)
class _EngineKv:
    """One data-parallel engine's KV cache, as its own gauge and cache_config_info give it."""

    engine: str | None
    usage: float
    config: Labels
    free_blocks: float | None  # None when its cache_config_info gives no block count


def _engine_kv(engine: str | None, usage: float, config: Labels) -> _EngineKv:
    num_gpu_blocks = _int_label(config, "num_gpu_blocks")
    free_blocks = None
    if num_gpu_blocks is not None:
        # vLLM reports usage as 1 - free / (num_gpu_blocks - 1): one block is the null block.
        used_fraction = min(max(usage, 0.0), 1.0)
        free_blocks = max(0.0, (num_gpu_blocks - 1) * (1.0 - used_fraction))
    return _EngineKv(engine, usage, config, free_blocks)


def _usage_by_engine(chosen: Series) -> dict[str | None, float]:
    """Each engine's KV usage, from the current gauge name if any engine exports it, else the former."""
    for name in (KV_USAGE, KV_USAGE_OLD):
        usage: dict[str | None, float] = {}
        for labels, value in chosen.get(name, {}).items():
            if math.isfinite(value):
                engine = _label(labels, "engine")
                usage[engine] = max(value, usage.get(engine, value))
        if usage:
            return usage
    return {}


def _tightest(engines: list[_EngineKv]) -> _EngineKv | None:
    """The engine that runs out first: the fewest free blocks, else (no block counts) the fullest."""
    counted = [e for e in engines if e.free_blocks is not None]
    if counted:
        return min(counted, key=lambda e: (e.free_blocks, -e.usage, e.engine or ""))
    return max(engines, key=lambda e: (e.usage, e.engine or ""), default=None)


def _finite(rows: Iterable[float]) -> list[float]:
    return [value for value in rows if math.isfinite(value)]


def _total(chosen: Series, *names: str) -> float | None:
    """Sum over engines of the first name present (the current name before the former)."""
    for name in names:
        values = _finite(chosen.get(name, {}).values())
        if values:
            return float(sum(values))
    return None


def _served(chosen: Series) -> float | None:
    """Completed requests summed over engines, of the finish reasons that mean the engine served."""
    rows = chosen.get(REQUEST_SUCCESS, {})
    values = _finite(value for labels, value in rows.items() if _label(labels, "finished_reason") in SERVED_REASONS)
    return float(sum(values)) if values else None


def _int_label(config: Labels, key: str) -> int | None:
    raw = _label(config, key)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        number = float(raw)  # "None" and other words fall through to None
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def _build_sample(chosen: Series, configs: list[Labels], model_name: str) -> MetricsSample:
    engine_labels = {_label(labels, "engine") for rows in chosen.values() for labels in rows}
    cache_configs = _CacheConfigs.of(configs, engine_labels, model_name)
    per_engine = [
        _engine_kv(engine, usage, cache_configs.of_engine(engine))
        for engine, usage in _usage_by_engine(chosen).items()
    ]
    kv_usage = max((e.usage for e in per_engine), default=None)
    tightest = _tightest(per_engine)
    # The block figures all describe one engine, the one whose free blocks are shown.
    cache_config = tightest.config if tightest is not None else cache_configs.shared

    itl_sum, itl_count = _total(chosen, ITL + "_sum"), _total(chosen, ITL + "_count")
    if itl_sum is None and itl_count is None:
        itl_sum, itl_count = _total(chosen, ITL_OLD + "_sum"), _total(chosen, ITL_OLD + "_count")

    error = None
    if kv_usage is None:
        error = f"no KV-cache usage gauge ({KV_USAGE} or {KV_USAGE_OLD}) for model_name={model_name!r}"
    return MetricsSample(
        error=error,
        kv_usage=kv_usage,
        num_gpu_blocks=_int_label(cache_config, "num_gpu_blocks"),
        block_size=_int_label(cache_config, "block_size"),
        free_blocks=tightest.free_blocks if tightest is not None else None,
        engines=len(engine_labels),
        running=_total(chosen, RUNNING),
        waiting=_total(chosen, WAITING),
        preemptions_total=_total(chosen, PREEMPTIONS),
        generation_tokens_total=_total(chosen, GENERATION_TOKENS),
        prompt_tokens_total=_total(chosen, PROMPT_TOKENS),
        served_total=_served(chosen),
        kv_cache_size_tokens=_int_label(cache_config, "kv_cache_size_tokens"),
        cache_config=cache_config,
        itl_sum=itl_sum,
        itl_count=itl_count,
    )


# ------------------------------------------------------------------------ fetch

# Each probe opens a fresh connection: a pooled keep-alive connection that the
# server closes between polls would show up as a spurious failure, and loopback
# connects cost next to nothing. "Connection: close" makes the client close the
# socket once the answer is read, whether or not the server does. Identity
# encoding keeps the size cap on real bytes.
_PROBE_HEADERS = {"Connection": "close", "Accept-Encoding": "identity"}


def _chain(exc: BaseException) -> Iterable[BaseException]:
    """The exception and everything it wraps (cause, context, args)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        linked = [current.__cause__, current.__context__]
        linked += [arg for arg in getattr(current, "args", ()) if isinstance(arg, BaseException)]
        todo.extend(item for item in linked if isinstance(item, BaseException))


def _is_timeout(exc: BaseException) -> bool:
    # httpx.ConnectTimeout, ReadTimeout, WriteTimeout and PoolTimeout; TimeoutError is socket.timeout.
    return isinstance(exc, httpx.TimeoutException | TimeoutError)


def _classify(exc: BaseException, timeout: float) -> tuple[HealthStatus, str]:
    chain = list(_chain(exc))
    # httpx.ConnectError carries the OSError of the connect as its cause.
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return HealthStatus.REFUSED, "connection refused"
    # A unix socket not there (yet): nobody listens, as a refused port says.
    if any(isinstance(e, FileNotFoundError) for e in chain):
        return HealthStatus.REFUSED, "no socket"
    if any(_is_timeout(e) for e in chain):
        return HealthStatus.TIMEOUT, f"no answer within {timeout:g} s"
    return HealthStatus.ERROR, _short(f"{type(exc).__name__}: {exc}")


def _url(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + path


def _get(client: httpx.Client, base_url: str, path: str, timeout: float) -> httpx.Response:
    """The answer's status line and headers, the body left unread. Connecting, sending
    and each read of the headers get `timeout` alone (no pool: every probe connects)."""
    request = client.build_request("GET", _url(base_url, path), headers=_PROBE_HEADERS, timeout=timeout)
    return client.send(request, stream=True)


def probe_health(client: httpx.Client, base_url: str, timeout: float) -> HealthSample:
    """GET /health: ok on 200; refused, timeout, http (with the status) or error otherwise."""
    started = time.monotonic()
    try:
        response = _get(client, base_url, "/health", timeout)
    except Exception as exc:  # noqa: BLE001 - every transport failure is a classified sample
        status, detail = _classify(exc, timeout)
        return HealthSample(status=status, latency_s=time.monotonic() - started, detail=detail)
    latency = time.monotonic() - started
    code = response.status_code
    _discard(response)
    if code == 200:
        return HealthSample(status=HealthStatus.OK, http_status=code, latency_s=latency)
    return HealthSample(status=HealthStatus.HTTP, http_status=code, latency_s=latency, detail=f"HTTP {code}")


def fetch_metrics(
    client: httpx.Client, base_url: str, timeout: float, max_bytes: int = MAX_METRICS_BYTES
) -> tuple[str | None, str | None]:
    """GET /metrics as (text, None), or (None, why). Never raises.

    Connecting and waiting for the headers each get `timeout`; the body must then
    be complete by `timeout` after the request began, so a server that trickles
    its answer cannot hold the caller. A body over `max_bytes` is refused.
    """
    started = time.monotonic()
    deadline = started + timeout
    try:
        response = _get(client, base_url, "/metrics", timeout)
    except Exception as exc:  # noqa: BLE001
        return None, _fetch_failure(exc, timeout)
    try:
        if response.status_code != 200:
            return None, f"/metrics answered HTTP {response.status_code}"
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            return None, f"/metrics body of {int(declared)} bytes exceeds the {max_bytes}-byte cap"
        body = _read_body(response, deadline, max_bytes)
        if isinstance(body, str):
            return None, body
        return body.decode("utf-8", errors="replace"), None
    except Exception as exc:  # noqa: BLE001
        return None, _fetch_failure(exc, timeout)
    finally:
        _discard(response)


def _fetch_failure(exc: BaseException, timeout: float) -> str:
    status, detail = _classify(exc, timeout)
    if status is HealthStatus.TIMEOUT:
        return f"/metrics timed out: {detail}"
    return f"/metrics failed: {detail}"


def _discard(response: httpx.Response) -> None:
    """Close the response, and with it (the request said "Connection: close") its connection."""
    try:
        response.close()
    except Exception:  # noqa: BLE001 - closing what we are done with cannot change the answer
        pass


class _BodyDeadline:
    """Ends the body's reading at `deadline` by shutting its socket down.

    httpx bounds each read by the read timeout, not the whole body: a server
    sending a byte just inside each read timeout would hold the poll for ever.
    A shut-down socket ends the read in progress at once.
    """

    def __init__(self, response: httpx.Response, deadline: float):
        self.deadline = deadline
        self._passed = threading.Event()
        self._timer: threading.Timer | None = None
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if isinstance(sock, socket.socket):
            self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._cut, args=(sock,))
            self._timer.daemon = True
            self._timer.name = "metrics-deadline"
            self._timer.start()

    def _cut(self, sock: socket.socket) -> None:
        self._passed.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed: the read is over anyway

    @property
    def passed(self) -> bool:
        return self._passed.is_set() or time.monotonic() >= self.deadline

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _read_body(response: httpx.Response, deadline: float, max_bytes: int) -> bytes | str:
    """The body as bytes, or a string saying why not."""
    parts: list[bytes] = []
    size = 0
    cutoff = _BodyDeadline(response, deadline)
    try:
        for chunk in response.iter_raw():  # each chunk as it arrives: the cap stops the read itself
            size += len(chunk)
            if size > max_bytes:
                return f"/metrics body exceeds the {max_bytes}-byte cap"
            parts.append(chunk)
            if cutoff.passed:
                break
    except httpx.TransportError:
        if not cutoff.passed:
            raise
    finally:
        cutoff.cancel()
    # A body without Content-Length ends where the socket does, the shut-down one too.
    if cutoff.passed:
        return f"/metrics body not complete within the timeout ({size} bytes read)"
    return b"".join(parts)


class EngineProbe:
    """Health and metrics of one vLLM endpoint, with its own HTTP client."""

    def __init__(
        self,
        base_url: str,
        model_name: str,
        health_timeout: float,
        metrics_timeout: float,
        max_bytes: int = MAX_METRICS_BYTES,
        uds: str = "",
    ):
        self.base_url = base_url
        self.model_name = model_name
        self.health_timeout = health_timeout
        self.metrics_timeout = metrics_timeout
        self.max_bytes = max_bytes
        self._client = engine_client(uds=uds)

    def health(self) -> HealthSample:
        return probe_health(self._client, self.base_url, self.health_timeout)

    def metrics(self) -> tuple[MetricsSample, str | None]:
        """The parsed sample and the raw text (None when the fetch failed)."""
        text, error = fetch_metrics(self._client, self.base_url, self.metrics_timeout, self.max_bytes)
        if text is None:
            return MetricsSample(error=error), None
        return parse(text, self.model_name), text

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> EngineProbe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
