"""A vLLM test double: vLLM's HTTP surface, process tree and shutdown, in the stdlib.

Launched exactly as vLLM is (`python -m vllm.entrypoints.openai.api_server
--model M --host H --port P ...`, through the shim package in shim/), or
directly as `python tests/fakevllm/server.py ...`. Flags starting with
`--fake-` (and the shell-split words of $FAKEVLLM_ARGS) switch on the failure
modes; POST /fake/control changes them while it runs. See README.md.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import queue
import select
import shlex
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ENGINE_CORE = HERE / "engine_core.py"
ENV_EXTRA_ARGS = "FAKEVLLM_ARGS"
DEFAULT_VERSION = "0.32.0"
DEFAULT_NUM_GPU_BLOCKS = 5306  # what vLLM reports for Qwen2.5-7B bf16 on an RTX 3090 at 0.90
MODEL_MAX_LEN = 32768  # Qwen2.5-7B's own context length
MAX_BODY = 16 * 1024 * 1024
REQUEST_LOG_CAP = 20000
METRICS_SHAPES = ("live", "idle", "leak", "load", "garbage", "file")
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs", "home")
VOCAB = len(WORDS) * 10000  # token ids: a multiple of len(WORDS), so no runner-up shares its top-1's text
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
DEFAULT_MARGIN = 3.0  # nats between top-1 and top-2, unless canary_margins says otherwise
MAX_MARGIN = 100.0
EMBEDDING_DIMENSIONS = 16  # small: the double's vectors only need to be deterministic and tell inputs apart
LOGGED_PROMPT_CHARS = 200
# A directory of worker-*.json status files (bench/gpu_engine_standin.py): when set, greedy answers also
# depend on the "checksum" in the newest one, so they change when the worker's weights do.
ENV_ANSWER_SALT_DIR = "FAKE_VLLM_ANSWER_SALT_DIR"


def _load_sibling(name: str):
    """Imports a module next to this file whatever way we were started (package, script, shim)."""
    module_name = f"_fakevllm_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


prom = _load_sibling("metrics")
sleepmode = _load_sibling("sleep")


def vllm_version() -> str:
    try:
        import importlib.metadata as md

        return md.version("vllm")
    except Exception:
        pass
    try:
        from vllm._version import __version__  # the shim's

        return __version__
    except ImportError:
        return DEFAULT_VERSION


_print_lock = threading.Lock()


def log(message: str, level: str = "INFO", where: str = "api_server.py") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    with _print_lock:
        print(f"(APIServer pid={os.getpid()}) {level} {stamp} [{where}] {message}", flush=True)


def uvicorn_log(message: str) -> None:
    with _print_lock:
        print(f"INFO:     {message}", flush=True)


# ----------------------------------------------------------------- command line


class UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm.entrypoints.openai.api_server", allow_abbrev=False)
    p.add_argument("--model", default="Qwen/Qwen2.5-7B-Instruct")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uds", default=None)  # a unix socket path: --host and --port are then ignored, as vLLM does
    p.add_argument("--shutdown-timeout", type=int, default=0)
    p.add_argument("--disable-access-log-for-endpoints")  # vLLM >= 0.16: the daemon passes /health,/metrics
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--block-size", type=int)
    f = p.add_argument_group("test double")
    f.add_argument("--fake-startup-delay", type=float, default=0.0, metavar="S")
    f.add_argument("--fake-exit-during-start", type=int, metavar="CODE")
    f.add_argument("--fake-fail-start-unless", metavar="PATH", help="fail every start while PATH does not exist (a mount that comes back)")
    f.add_argument("--fake-exit-after", nargs="+", metavar="S [CODE]")
    f.add_argument("--fake-exit-code", type=int, default=0, metavar="CODE")
    f.add_argument("--fake-dead-exit-delay", type=float, default=0.5, metavar="S")
    f.add_argument("--fake-hang-after", type=float, metavar="S")
    f.add_argument("--fake-health-503-after", type=float, metavar="S")
    f.add_argument("--fake-garbage-metrics", action="store_true")
    f.add_argument("--fake-metrics-file", metavar="PATH")
    f.add_argument("--fake-metrics-shape", choices=METRICS_SHAPES[:4], default="live")
    f.add_argument("--fake-kv-usage", type=float, default=0.95, metavar="F")
    f.add_argument("--fake-token-delay", type=float, default=0.005, metavar="S")
    f.add_argument("--fake-eos-after", type=int, metavar="N")
    f.add_argument("--fake-num-gpu-blocks", type=int, default=DEFAULT_NUM_GPU_BLOCKS, metavar="N")
    f.add_argument("--fake-grandchild-ignores-sigterm", action="store_true")
    f.add_argument("--fake-ignore-sigterm", action="store_true")
    f.add_argument("--fake-core-shutdown-wait", type=float, default=5.0, metavar="S")
    f.add_argument("--fake-orphan-linger", type=float, default=120.0, metavar="S")
    f.add_argument("--fake-no-tokenize", action="store_true", help="answer POST /tokenize as an unknown route (404)")
    sleepmode.add_flags(p)
    return p


def parse_args(argv: list[str], environ: dict[str, str]) -> tuple[argparse.Namespace, list[str]]:
    """The options and the unrecognised words. Raises UsageError; argparse itself exits 2."""
    argv = list(argv) + shlex.split(environ.get(ENV_EXTRA_ARGS, ""))
    for arg in argv:
        if arg == "--api-key" or arg.startswith("--api-key="):
            # vLLM accepts it; the double refuses it so a key leaking into argv fails loudly.
            raise UsageError("--api-key on the command line puts the secret in argv; pass VLLM_API_KEY in the environment")
    opts, unknown = build_parser().parse_known_args(argv)
    opts.fake_exit_after_s = None
    if opts.fake_exit_after:
        if len(opts.fake_exit_after) > 2:
            raise UsageError("--fake-exit-after takes S or S CODE")
        try:
            opts.fake_exit_after_s = float(opts.fake_exit_after[0])
            if len(opts.fake_exit_after) == 2:
                opts.fake_exit_code = int(opts.fake_exit_after[1])
        except ValueError:
            raise UsageError(f"--fake-exit-after: expected S [CODE], got {' '.join(opts.fake_exit_after)}") from None
    if not 0 <= opts.port <= 65535:
        raise UsageError(f"--port {opts.port} is out of range")
    for name in ("block_size", "num_gpu_blocks_override", "max_num_seqs", "max_model_len"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if opts.fake_num_gpu_blocks < 2:
        raise UsageError("--fake-num-gpu-blocks must be at least 2 (one is the null block)")
    if opts.fake_token_delay < 0:
        raise UsageError("--fake-token-delay must not be negative")
    opts.served_names = opts.served_model_name or [opts.model]
    opts.num_gpu_blocks = opts.num_gpu_blocks_override or opts.fake_num_gpu_blocks
    opts.user_block_size = opts.block_size is not None
    opts.block_size = opts.block_size or 16
    capacity = (opts.num_gpu_blocks - 1) * opts.block_size
    opts.kv_capacity_tokens = capacity
    if opts.max_model_len is None:
        opts.max_model_len = min(MODEL_MAX_LEN, capacity)
    return opts, unknown


# ----------------------------------------------------------------- the engine, as the API server sees it


class Generation:
    def __init__(self, prompt_tokens: int, max_tokens: int):
        self.id = os.urandom(16).hex()
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.started = time.monotonic()
        self.last_token_at: float | None = None
        self.generated = 0


class Engine:
    """Talks to the fake-EngineCore child over its stdin/stdout, and keeps the statistics."""

    def __init__(self, opts: argparse.Namespace, events: queue.SimpleQueue):
        self.opts = opts
        self.events = events
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.worker_pid: int | None = None
        self.ready = threading.Event()
        self.dead = False
        self.generations: dict[str, Generation] = {}
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = {"running": 0, "waiting": 0, "kv_cache_usage_perc": 0.0, "generation_tokens": 0, "prompt_tokens": 0, "preemptions": 0}
        self.success: dict[str, int] = {}
        self.ttft = prom.Histogram(prom.TTFT_BUCKETS)
        self.itl = prom.Histogram(prom.ITL_BUCKETS)
        self.e2e = prom.Histogram(prom.E2E_BUCKETS)

    def start(self) -> None:
        o = self.opts
        # Stdlib only: -I -S skips site-packages, which costs a third of a second per start.
        argv = [sys.executable, "-I", "-S", str(ENGINE_CORE), "fake-EngineCore", "--num-gpu-blocks", str(o.num_gpu_blocks),
                "--block-size", str(o.block_size), "--max-num-seqs", str(o.max_num_seqs),
                "--token-delay", str(o.fake_token_delay), "--orphan-linger", str(o.fake_orphan_linger)]  # fmt: skip
        if o.fake_grandchild_ignores_sigterm:
            argv.append("--ignore-sigterm")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        threading.Thread(target=self._read_loop, name="core-reader", daemon=True).start()
        threading.Thread(target=self._write_loop, name="core-writer", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, message: dict) -> None:
        # Through a queue: a stopped core must stall generation, never an HTTP handler's write.
        self.outbox.put(message)

    def _write_loop(self) -> None:
        while True:
            message = self.outbox.get()
            try:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                return

    def _read_loop(self) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            kind = message.get("t")
            if kind == "ready":
                self.worker_pid = message.get("worker_pid")
                self.ready.set()
            if "stats" in message:
                with self.lock:
                    self.stats = message["stats"]
            if kind == "step":
                self._deliver(message["out"])
        with self.lock:
            self.dead = True
            pending = list(self.generations.values())
            self.generations.clear()
        for gen in pending:
            gen.events.put(("error", "EngineCore encountered an issue. See stack trace (above) for the root cause."))
        self.events.put(("engine_dead",))

    def _deliver(self, out: list) -> None:
        now = time.monotonic()
        for gen_id, generated, finish in out:
            with self.lock:
                gen = self.generations.get(gen_id)
                if gen is None:
                    continue
                if gen.last_token_at is None:
                    self.ttft.observe(now - gen.started)
                else:
                    self.itl.observe(now - gen.last_token_at)
                gen.last_token_at = now
                gen.generated = generated
                if finish:
                    self.e2e.observe(now - gen.started)
                    self.success[finish] = self.success.get(finish, 0) + 1
                    del self.generations[gen_id]
            gen.events.put(("token", generated, finish))

    def submit(self, prompt_tokens: int, max_tokens: int, eos_after: int | None) -> Generation:
        gen = Generation(prompt_tokens, max_tokens)
        with self.lock:
            if self.dead:
                gen.events.put(("error", "EngineCore is dead"))
                return gen
            self.generations[gen.id] = gen
        self.send({"op": "add", "id": gen.id, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "eos_after": eos_after})
        return gen

    def abort(self, gen: Generation) -> None:
        with self.lock:
            if self.generations.pop(gen.id, None) is None:
                return
            self.success["abort"] = self.success.get("abort", 0) + 1
        self.send({"op": "abort", "id": gen.id})

    def signal_core(self, signum: int) -> bool:
        if not self.alive():
            return False
        try:
            os.kill(self.proc.pid, signum)
            return True
        except ProcessLookupError:
            return False

    def core_state(self) -> str | None:
        """The kernel's one-letter state of the core (R, S, T, Z...), or None once it is gone."""
        if self.proc is None:
            return None
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return None
        return stat.rsplit(")", 1)[1].split()[0]

    def stop(self, wait: float) -> None:
        """SIGTERM the core as vLLM's API server does; SIGKILL it after `wait` s (never if wait < 0)."""
        if not self.signal_core(signal.SIGTERM):
            return
        try:
            self.proc.wait(wait if wait >= 0 else 1.0)
            return
        except subprocess.TimeoutExpired:
            pass
        if wait >= 0:
            log(f"EngineCore pid={self.proc.pid} did not exit within {wait:g} s of SIGTERM; killing it", "WARNING", "utils.py")
            self.signal_core(signal.SIGKILL)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        else:
            log(f"EngineCore pid={self.proc.pid} ignored SIGTERM; leaving it", "WARNING", "utils.py")


# ----------------------------------------------------------------- behaviour switches


class Behaviour:
    """What the double does now: set by flags at start and by POST /fake/control while running."""

    CONTROL_KEYS = {"metrics", "kv_usage", "load_running", "load_tokens_per_s", "metrics_file", "metrics_values",
                    "freeze", "health", "hang", "token_delay", "kill_engine_core", "exit", "clear_requests",
                    "canary_margins", "canary_fault"}  # fmt: skip
    VALUE_KEYS = {"running", "waiting", "kv_cache_usage_perc", "preemptions", "prompt_tokens", "generation_tokens"}

    def __init__(self, opts: argparse.Namespace):
        self.lock = threading.Lock()
        self.health_503 = False
        self.hang = False
        self.frozen = False
        self.token_delay = opts.fake_token_delay
        self.shape = "live"
        self.metrics_file = opts.fake_metrics_file
        self.kv_usage = opts.fake_kv_usage
        self.load_running = 4
        self.load_tokens_per_s = 200.0
        self.values_override: dict[str, float] = {}
        self.flat: prom.EngineValues | None = None
        self.synth_generation = 0
        self.synth_prompt = 0
        self.load_clock = time.monotonic()
        self.load_credit = 0.0
        self.canary_margins: list[float] = []
        self.canary_fault: dict | None = None
        if opts.fake_garbage_metrics:
            self.shape = "garbage"
        elif opts.fake_metrics_file:
            self.shape = "file"
        elif opts.fake_metrics_shape != "live":
            self.shape = opts.fake_metrics_shape

    def _live(self, engine: Engine) -> prom.EngineValues:
        with engine.lock:
            s = dict(engine.stats)
        return prom.EngineValues(
            running=s["running"],
            waiting=s["waiting"],
            kv_cache_usage_perc=s["kv_cache_usage_perc"],
            preemptions=s["preemptions"],
            prompt_tokens=s["prompt_tokens"] + self.synth_prompt,
            generation_tokens=s["generation_tokens"] + self.synth_generation,
        )

    def _run_load(self, engine: Engine) -> None:
        """In the load shape, synthetic traffic really adds to the counters, so they stay monotonic."""
        now = time.monotonic()
        if self.shape == "load":
            self.load_credit += self.load_tokens_per_s * (now - self.load_clock)
            tokens = int(self.load_credit)
            self.load_credit -= tokens
            self.synth_generation += tokens
            self.synth_prompt += tokens // 4
            if tokens:
                with engine.lock:
                    engine.itl.observe(0.02, tokens)
        self.load_clock = now

    def values(self, engine: Engine) -> prom.EngineValues:
        with self.lock:
            self._run_load(engine)
            v = self._live(engine)
            if self.shape in ("idle", "leak"):
                if self.flat is None:
                    self.flat = v
                v = self.flat
                v = prom.EngineValues(0, 0, 0.0 if self.shape == "idle" else self.kv_usage, v.preemptions, v.prompt_tokens, v.generation_tokens)
            elif self.shape == "load":
                v = prom.EngineValues(self.load_running, 0, self.kv_usage, v.preemptions, v.prompt_tokens, v.generation_tokens)
            if self.values_override:
                fields = {**v.__dict__, **self.values_override}
                v = prom.EngineValues(int(fields["running"]), int(fields["waiting"]), float(fields["kv_cache_usage_perc"]),
                                      int(fields["preemptions"]), int(fields["prompt_tokens"]), int(fields["generation_tokens"]))  # fmt: skip
            return v

    def set_shape(self, shape: str, engine: Engine) -> None:
        with self.lock:
            self._run_load(engine)
            if shape in ("idle", "leak") and self.shape not in ("idle", "leak"):
                self.flat = self._live(engine)
            self.shape = shape


def is_margin(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x <= MAX_MARGIN


def check_control(body: object) -> str | None:
    """None if `body` is a valid control request, else what is wrong with it."""
    if not isinstance(body, dict):
        return "expected a JSON object"
    unknown = set(body) - Behaviour.CONTROL_KEYS
    if unknown:
        return f"unknown keys {sorted(unknown)}; known: {sorted(Behaviour.CONTROL_KEYS)}"
    if "metrics" in body and body["metrics"] not in METRICS_SHAPES:
        return f"metrics must be one of {list(METRICS_SHAPES)}"
    if body.get("metrics") == "file" and not body.get("metrics_file"):
        return "metrics 'file' needs metrics_file"
    if "health" in body and body["health"] not in ("ok", "503"):
        return "health must be 'ok' or '503'"
    for key in ("freeze", "hang", "kill_engine_core", "clear_requests"):
        if key in body and not isinstance(body[key], bool):
            return f"{key} must be true or false"
    for key in ("kv_usage", "load_tokens_per_s", "token_delay"):
        if key in body and (not isinstance(body[key], int | float) or isinstance(body[key], bool) or body[key] < 0):
            return f"{key} must be a non-negative number"
    if "load_running" in body and (not isinstance(body["load_running"], int) or body["load_running"] < 0):
        return "load_running must be a non-negative integer"
    if "exit" in body and (not isinstance(body["exit"], int) or isinstance(body["exit"], bool) or not 0 <= body["exit"] <= 255):
        return "exit must be an integer 0..255"
    margins = body.get("canary_margins", [])
    if not isinstance(margins, list) or not all(map(is_margin, margins)):
        return f"canary_margins must be a list of numbers 0..{MAX_MARGIN:g}"
    fault = body.get("canary_fault")
    if fault is not None:
        if not isinstance(fault, dict) or set(fault) != {"from", "margin"}:
            return 'canary_fault must be null or {"from": P, "margin": M}'
        if not isinstance(fault["from"], int) or isinstance(fault["from"], bool) or fault["from"] < 0:
            return "canary_fault's from must be a non-negative integer"
        if not is_margin(fault["margin"]):
            return f"canary_fault's margin must be a number 0..{MAX_MARGIN:g}"
    if "metrics_values" in body:
        values = body["metrics_values"]
        if not isinstance(values, dict) or set(values) - Behaviour.VALUE_KEYS:
            return f"metrics_values must be an object with keys from {sorted(Behaviour.VALUE_KEYS)}"
        if any(not isinstance(x, int | float) or isinstance(x, bool) for x in values.values()):
            return "metrics_values must be numbers"
    return None


# ----------------------------------------------------------------- requests


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def count_words(text: str) -> int:
    return max(1, len(text.split()))


def prompt_token_count(body: dict, chat: bool) -> int:
    """A stand-in tokenizer: one token per word, plus the chat template's few per message."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        total = 0
        for message in messages:
            if not isinstance(message, dict):
                raise BadRequest("each message must be an object")
            content = message.get("content") or ""
            if isinstance(content, list):
                content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
            if not isinstance(content, str):
                raise BadRequest("message content must be a string or a list of parts")
            total += count_words(content) + 4
        return total + 3
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return count_words(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        inner = prompt[0]
        if isinstance(inner, str):
            return count_words(inner)
        if isinstance(inner, list) and inner and all(isinstance(t, int) for t in inner):
            return len(inner)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported by this test double")
    raise BadRequest("prompt must be a string or a list of token ids")


def embedding_inputs(value: object) -> list[str | list[int]]:
    """The inputs of an embeddings request as OpenAI takes them: a string, a list of strings, token ids, or lists of them."""

    def ids(x: object) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) or ids(x) for x in value):
        return list(value)
    raise BadRequest("input must be a string, a list of strings, a list of token ids, or a list of such lists")


def embedding_vector(item: str | list[int]) -> list[float]:
    """A unit vector that is a function of the input alone: the same text always embeds the same."""
    digest = hashlib.blake2b(json.dumps(item).encode(), digest_size=2 * EMBEDDING_DIMENSIONS).digest()
    raw = [int.from_bytes(digest[2 * i : 2 * i + 2], "big") / 32767.5 - 1.0 for i in range(EMBEDDING_DIMENSIONS)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def token_text(index: int) -> str:
    return " " + WORDS[index % len(WORDS)]


def ranked(first: int, second: int, k: int) -> list[int]:
    """The top-k token ids at a position: `first`, `second`, then others, of unused texts while any are left."""
    out = [first, second][:k]
    candidate = first
    while len(out) < k:
        candidate = (candidate + 1) % VOCAB
        texts = {token_text(t) for t in out}
        if candidate not in out and (token_text(candidate) not in texts or len(texts) == len(WORDS)):
            out.append(candidate)
    return out


def ranked_logprobs(margin: float, k: int) -> list[float]:
    """Log-probabilities of ranks 1..k: rank 2 `margin` nats below rank 1, each later one 1 nat lower (sum < 1)."""
    first = -math.log1p(1.6 * math.exp(-margin))
    return [first] + [first - margin - j for j in range(k - 1)]


def answer_salt() -> bytes:
    """The checksum of the newest worker-*.json in $FAKE_VLLM_ANSWER_SALT_DIR, as bytes; b"" when unset or unreadable."""
    where = os.environ.get(ENV_ANSWER_SALT_DIR)
    if not where:
        return b""
    newest = None
    for path in Path(where).glob("worker-*.json"):
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            continue  # replaced under us
        if newest is None or mtime > newest[0]:
            newest = (mtime, path)
    try:
        checksum = json.loads(newest[1].read_text()).get("checksum") if newest else None
    except (OSError, ValueError, AttributeError):
        return b""
    return b"" if checksum is None else str(checksum).encode()


def logged_body(body: dict) -> dict:
    """A request's fields as the request log keeps them: the prompt (or input) cut short, no messages or lists (they hold thousands)."""
    fields = {k: v for k, v in body.items() if k not in ("prompt", "messages", "input")}
    for key in ("prompt", "input"):  # an embeddings request's `input` is kept as a prompt is
        if isinstance(body.get(key), str):
            fields[key] = body[key][:LOGGED_PROMPT_CHARS]
    return fields


class Answer:
    """What one request generates: its tokens and, with logprobs, vLLM's completions logprobs for them.

    A greedy request (temperature 0) answers a function of its prompt and the position
    only, whatever else runs; each position also has a runner-up of another text. Other
    requests answer the word list in order (token id = position). Margins and the fault
    are read once, when the request arrives.
    """

    def __init__(self, body: dict, chat: bool, behaviour: Behaviour, weights_salt: bytes = b""):
        temperature = body.get("temperature")
        greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature < 1e-5
        prompt = body.get("messages") if chat else body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # ["text"] is the prompt "text"
        self.key = hashlib.blake2b(json.dumps(prompt, sort_keys=True).encode() + answer_salt() + weights_salt, digest_size=8).digest() if greedy else None
        self.k = None if chat else body.get("logprobs")
        self.as_ids = bool(body.get("return_tokens_as_token_ids"))
        with behaviour.lock:
            self.margins = list(behaviour.canary_margins)
            self.fault = behaviour.canary_fault if greedy and self.k is not None else None

    def step(self, pos: int) -> tuple[int, int, float]:
        """(the generated token, the runner-up, the margin between them) at position `pos`."""
        if self.key is None:
            top, alt = pos, pos + 1
        else:
            x = int.from_bytes(hashlib.blake2b(self.key + pos.to_bytes(4, "big"), digest_size=8).digest(), "big")
            top = x % VOCAB
            alt = (top + 1 + (x // VOCAB) % (len(WORDS) - 1)) % VOCAB
        if self.fault is not None and pos >= self.fault["from"]:
            return alt, top, float(self.fault["margin"])
        return top, alt, float(self.margins[pos]) if pos < len(self.margins) else DEFAULT_MARGIN

    def text(self, start: int, end: int) -> str:
        return "".join(token_text(self.step(pos)[0]) for pos in range(start, end))

    def name(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else token_text(token)

    def logprobs(self, start: int, end: int, offset: int) -> dict | None:
        """vLLM's completions logprobs for positions start..end-1; `offset`: the text's length before `start`."""
        if self.k is None:
            return None
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for pos in range(start, end):
            first, second, margin = self.step(pos)
            values = ranked_logprobs(margin, max(self.k, 1))  # logprobs 0: the generated token alone
            token = self.name(first)
            out["text_offset"].append(offset)
            out["token_logprobs"].append(values[0])
            out["tokens"].append(token)
            tokens = ranked(first, second, len(values))
            out["top_logprobs"].append({self.name(t): v for t, v in zip(tokens, values, strict=True)})
            offset += len(token)  # as vLLM does: the reported token's length, "token_id:N" included
        return out


class App:
    def __init__(self, opts: argparse.Namespace, unknown: list[str]):
        self.opts = opts
        self.unknown = unknown
        self.version = vllm_version()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.engine = Engine(opts, self.events)
        self.behaviour = Behaviour(opts)
        self.sleep = sleepmode.SleepMode(opts, self.engine, log)
        self.api_key = os.environ.get("VLLM_API_KEY") or None
        self.draining = False
        self.active_lock = threading.Lock()
        self.active_streams = 0
        self.requests: list[dict] = []
        self.requests_lock = threading.Lock()
        self.started_unix = time.time()
        self.created = time.time()
        self.httpd: ThreadingHTTPServer | None = None
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        self.port = opts.port
        self.cache_labels = prom.cache_config_labels(
            num_gpu_blocks=opts.num_gpu_blocks,
            block_size=opts.block_size,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            max_model_len=opts.max_model_len,
            enable_prefix_caching=opts.enable_prefix_caching,
            num_gpu_blocks_override=opts.num_gpu_blocks_override,
            user_specified_block_size=opts.user_block_size,
        )

    # -- request log
    def log_request(self, method: str, path: str) -> dict:
        entry = {"t": time.time(), "method": method, "path": path, "status": None}
        with self.requests_lock:
            self.requests.append(entry)
            del self.requests[:-REQUEST_LOG_CAP]
        return entry

    def request_log(self) -> list[dict]:
        with self.requests_lock:
            return [dict(e) for e in self.requests]

    def cut_connections(self) -> None:
        """Drops every client connection mid-response, as a server that exits at once does."""
        with self.connections_lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stream_started(self) -> None:
        with self.active_lock:
            self.active_streams += 1

    def stream_ended(self) -> None:
        with self.active_lock:
            self.active_streams -= 1

    def metrics_text(self) -> tuple[int, str]:
        b = self.behaviour
        if b.shape == "garbage":
            return 200, "this is not prometheus text {{{ vllm:kv_cache_usage_perc = lots\n\x00\xff garbage}\n"
        if b.shape == "file":
            try:
                return 200, Path(b.metrics_file).read_text()
            except OSError as e:
                return 500, f"cannot read {b.metrics_file}: {e.strerror}\n"
        values = b.values(self.engine)
        if self.sleep.held:  # held by a pause or a sleep: in vLLM they wait in the scheduler
            values = dataclasses.replace(values, waiting=values.waiting + self.sleep.held)
        with self.engine.lock:
            return 200, prom.render(
                model_name=self.opts.served_names[0],
                values=values,
                success=dict(self.engine.success),
                ttft=self.engine.ttft,
                itl=self.engine.itl,
                e2e=self.engine.e2e,
                cache_labels=self.cache_labels,
                created=self.created,
                process_start=self.started_unix,
            )

    def state(self) -> dict:
        b = self.behaviour
        with self.engine.lock:
            stats = dict(self.engine.stats)
        return {
            "pid": os.getpid(),
            "engine_core_pid": self.engine.pid,
            "engine_core_state": self.engine.core_state(),
            "worker_pid": self.engine.worker_pid,
            "version": self.version,
            "served_model_name": self.opts.served_names[0],
            "port": self.port,
            "ready": self.engine.ready.is_set(),
            "engine_dead": self.engine.dead,
            "draining": self.draining,
            "frozen": b.frozen,
            "hang": b.hang,
            "health": "503" if b.health_503 else "ok",
            "metrics": b.shape,
            "token_delay": b.token_delay,
            "canary_margins": list(b.canary_margins),
            "canary_fault": b.canary_fault,
            "active_streams": self.active_streams,
            "engine_stats": stats,
            "sleep": self.sleep.state(),
            "api_key_required": self.api_key is not None,
            "unrecognised_args": self.unknown,
        }

    def control(self, body: dict) -> None:
        b = self.behaviour
        e = self.engine
        with b.lock:
            if "kv_usage" in body:
                b.kv_usage = float(body["kv_usage"])
            if "load_running" in body:
                b.load_running = body["load_running"]
            if "load_tokens_per_s" in body:
                b.load_tokens_per_s = float(body["load_tokens_per_s"])
            if "metrics_file" in body:
                b.metrics_file = body["metrics_file"]
            if "metrics_values" in body:
                b.values_override = dict(body["metrics_values"])
            if "health" in body:
                b.health_503 = body["health"] == "503"
            if "hang" in body:
                b.hang = body["hang"]
            if "canary_margins" in body:
                b.canary_margins = [float(m) for m in body["canary_margins"]]
            if "canary_fault" in body:
                b.canary_fault = body["canary_fault"]
        if "metrics" in body or "metrics_file" in body:
            b.set_shape(body.get("metrics", "file"), e)
        if "token_delay" in body:
            b.token_delay = float(body["token_delay"])
            e.send({"op": "config", "token_delay": b.token_delay})
        if "freeze" in body:
            b.frozen = body["freeze"]
            e.signal_core(signal.SIGSTOP if b.frozen else signal.SIGCONT)
            # Signals land asynchronously; answer only once the core is really (un)stopped.
            deadline = time.monotonic() + 2.0
            while (e.core_state() == "T") != b.frozen and e.alive() and time.monotonic() < deadline:
                time.sleep(0.005)
        if body.get("clear_requests"):
            with self.requests_lock:
                self.requests.clear()
        if body.get("kill_engine_core"):
            e.signal_core(signal.SIGKILL)

    def hung(self) -> bool:
        return self.behaviour.hang

    def health_status(self) -> int:
        return 503 if (self.engine.dead or self.behaviour.health_503) else 200


# ----------------------------------------------------------------- HTTP


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, app: App, family: int):
        self.address_family = family
        self.app = app
        super().__init__(address, Handler, bind_and_activate=False)

    def server_bind(self):
        # HTTPServer.server_bind would resolve the host name (getfqdn), which can stall for seconds.
        if self.address_family == socket.AF_UNIX:
            # As vLLM's create_server_unix_socket: a plain bind, nothing removed first (a socket left there: EADDRINUSE).
            self.socket.bind(self.server_address)
            self.server_address = self.socket.getsockname()
            self.server_name, self.server_port = str(self.server_address), None
            return
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = self.server_address[1]


def error_body(message: str, kind: str, status: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server
    entry: dict | None = None

    def setup(self):
        super().setup()
        # As uvicorn's asyncio transports do: without it, Nagle holds each small SSE chunk until the
        # client's delayed ACK of the one before (about 40 ms on a keep-alive connection).
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.app.connections_lock:
            self.server.app.connections.add(self.connection)

    def finish(self):
        with self.server.app.connections_lock:
            self.server.app.connections.discard(self.connection)
        super().finish()

    def version_string(self) -> str:
        return "uvicorn"

    def log_message(self, format, *args):
        pass

    def send_response(self, code, message=None):
        super().send_response(code, message)
        if self.entry is not None:
            self.entry["status"] = code
        # A unix socket's client has no address (uvicorn then logs none either).
        peer = f"{self.client_address[0]}:{self.client_address[1]}" if isinstance(self.client_address, tuple) else "unix"
        phrase = self.responses.get(code, ("",))[0]
        uvicorn_log(f'{peer} - "{self.command} {self.path} {self.request_version}" {code} {phrase}')

    # -- plumbing
    def _json(self, status: int, obj, extra_headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode("utf-8", "surrogateescape")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _sse(self, obj) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self._chunk(f"data: {payload}\n\n".encode())

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def do_GET(self):
        self.dispatch()

    def do_POST(self):
        self.dispatch()

    def do_PUT(self):
        self.dispatch()

    def do_DELETE(self):
        self.dispatch()

    def do_HEAD(self):
        self.dispatch()

    # -- routing
    ROUTES = {
        "/health": {"GET": "health"},
        "/metrics": {"GET": "metrics"},
        "/version": {"GET": "version"},
        "/v1/models": {"GET": "models"},
        "/v1/completions": {"POST": "completions"},
        "/v1/chat/completions": {"POST": "chat_completions"},
        "/v1/embeddings": {"POST": "embeddings"},
        "/tokenize": {"POST": "tokenize"},
        "/invocations": {"POST": "invocations"},
        "/fake/state": {"GET": "fake_state"},
        "/fake/requests": {"GET": "fake_requests"},
        "/fake/control": {"POST": "fake_control"},
    }

    def dispatch(self):
        app = self.server.app
        path = urlsplit(self.path).path
        fake = path.startswith("/fake/")
        self.entry = None if fake else app.log_request(self.command, path)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            self._json(400, error_body("bad Content-Length", "BadRequestError", 400))
            return
        self.body = self.rfile.read(length) if length else b""
        if not fake:
            if app.draining:
                self.close_connection = True
                self._json(503, {"detail": "Server is shutting down"})
                return
            while app.hung():
                time.sleep(0.05)  # accept, read, and never answer while hung
        if sleepmode.handles(path, app.sleep):
            try:
                sleepmode.serve(self, path, urlsplit(self.path).query, app.sleep)
            except BadRequest as e:
                self._json(e.status, error_body(str(e), e.kind, e.status))
            except OSError:
                self.close_connection = True
            return
        route = self.ROUTES.get(path)
        if route is None:
            self._json(404, {"detail": "Not Found"})
            return
        name = route.get(self.command)
        if name is None:
            self._json(405, {"detail": "Method Not Allowed"})
            return
        if path.startswith("/v1/") and app.api_key is not None:
            if self.headers.get("Authorization", "") != f"Bearer {app.api_key}":
                self._json(401, {"error": "Unauthorized"})
                return
        try:
            getattr(self, "route_" + name)()
        except BadRequest as e:
            self._json(e.status, error_body(str(e), e.kind, e.status))
        except OSError:
            self.close_connection = True

    def _body_json(self) -> dict:
        try:
            body = json.loads(self.body or b"null")
        except ValueError as e:
            raise BadRequest(f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if self.entry is not None:
            self.entry["body"] = logged_body(body)
        return body

    # -- vLLM's endpoints
    def route_health(self):
        self._empty(self.server.app.health_status())

    def route_metrics(self):
        status, text = self.server.app.metrics_text()
        self._text(status, text, "text/plain; version=0.0.4; charset=utf-8")

    def route_version(self):
        self._json(200, {"version": self.server.app.version})

    def route_models(self):
        app = self.server.app
        data = [
            {"id": name, "object": "model", "created": int(app.started_unix), "owned_by": "vllm", "root": app.opts.model,
             "parent": None, "max_model_len": app.opts.max_model_len}  # fmt: skip
            for name in app.opts.served_names
        ]
        self._json(200, {"object": "list", "data": data})

    def route_completions(self):
        self._generate(chat=False)

    def route_chat_completions(self):
        self._generate(chat=True)

    def route_tokenize(self):
        app = self.server.app
        if app.opts.fake_no_tokenize:
            self._json(404, {"detail": "Not Found"})  # what a server without the route answers
            return
        body = self._body_json()
        model = body.get("model")
        if model is not None and model not in app.opts.served_names:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        chat = "messages" in body
        if not chat and not isinstance(body.get("prompt"), str):
            raise BadRequest("prompt must be a string")  # vLLM's /tokenize takes text, not token ids
        count = prompt_token_count(body, chat)  # the count usage reports for the same prompt
        # Stand-in ids: the double has no vocabulary, only a count.
        self._json(200, {"count": count, "max_model_len": app.opts.max_model_len, "tokens": list(range(count))})

    def route_invocations(self):
        """vLLM's /invocations (SageMaker's route), outside /v1 and so without the API key: a chat, an embedding
        or a completion, told apart by the body."""
        body = self._body_json()
        if "messages" in body:
            self._generate(chat=True)
        elif "input" in body:
            self.route_embeddings()
        else:
            self._generate(chat=False)

    def route_embeddings(self):
        app = self.server.app
        body = self._body_json()
        model = body.get("model")
        if model is not None and model not in app.opts.served_names:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        inputs = embedding_inputs(body.get("input"))
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise BadRequest(f"encoding_format must be 'float' or 'base64', got {encoding!r}.")
        prompt_tokens = sum(len(x) if isinstance(x, list) else count_words(x) for x in inputs)
        # Through the engine as one 1-token step: a frozen core stalls an embedding, a dead one fails it, as in vLLM.
        app.sleep.wait_admitted()
        app.stream_started()
        try:
            gen = app.engine.submit(prompt_tokens, 1, None)
            if self._finished(gen) is None:
                return
        finally:
            app.stream_ended()
        data = []
        for index, item in enumerate(inputs):
            vector = embedding_vector(item)
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if encoding == "base64" else vector
            data.append({"index": index, "object": "embedding", "embedding": value})
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0, "prompt_tokens_details": None}
        self._json(200, {"id": "embd-" + gen.id, "object": "list", "created": int(time.time()), "model": model or app.opts.served_names[0],
                         "data": data, "usage": usage})  # fmt: skip

    def _generate(self, chat: bool):
        app = self.server.app
        o = app.opts
        body = self._body_json()
        model = body.get("model")
        if model is not None and model not in o.served_names:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        prompt_tokens = prompt_token_count(body, chat)
        max_tokens = body.get("max_completion_tokens") if chat and body.get("max_tokens") is None else body.get("max_tokens")
        if max_tokens is None:
            max_tokens = o.max_model_len - prompt_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens!r}.")
        if prompt_tokens + max_tokens > o.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {o.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        if body.get("n", 1) != 1:
            raise BadRequest("n other than 1 is not supported by this test double")
        k = None if chat else body.get("logprobs")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise BadRequest(f"logprobs must be a non-negative integer, got {k!r}.")
        if k is not None and k > MAX_LOGPROBS:
            raise BadRequest(f"Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}")
        app.sleep.wait_admitted()  # a paused or sleeping engine holds new requests
        answer = Answer(body, chat, app.behaviour, app.sleep.answer_salt())
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        eos_after = None if body.get("ignore_eos") else o.fake_eos_after
        name = model or o.served_names[0]
        app.stream_started()
        try:
            gen = app.engine.submit(prompt_tokens, max_tokens, eos_after)
            if stream:
                self._stream(gen, answer, chat, name, include_usage)
            else:
                self._complete(gen, answer, chat, name)
        finally:
            app.stream_ended()

    def _finished(self, gen: Generation) -> tuple[int, str] | None:
        """Waits for the generation's last event: (tokens generated, finish reason); None when it ended otherwise
        (the client left: aborted; the engine failed: a 500 sent)."""
        app = self.server.app
        while True:
            try:
                event = gen.events.get(timeout=0.25)
            except queue.Empty:
                if self._client_gone():
                    app.engine.abort(gen)
                    self.close_connection = True
                    return None
                continue
            if event[0] == "error":
                self._json(500, error_body(event[1], "InternalServerError", 500))
                return None
            _, generated, finish = event
            if finish:
                return generated, finish

    def _complete(self, gen: Generation, answer: Answer, chat: bool, model: str):
        done = self._finished(gen)
        if done is None:
            return
        generated, finish = done
        text = answer.text(0, generated)
        usage = {"prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens + generated,
                 "completion_tokens": generated, "prompt_tokens_details": None}  # fmt: skip
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": finish, "stop_reason": None}  # fmt: skip
            obj = "chat.completion"
            prefix = "chatcmpl-"
        else:
            logprobs = answer.logprobs(0, generated, 0)
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
            obj = "text_completion"
            prefix = "cmpl-"
        self._json(200, {"id": prefix + gen.id, "object": obj, "created": int(time.time()), "model": model,
                         "choices": [choice], "usage": usage})  # fmt: skip

    def _stream(self, gen: Generation, answer: Answer, chat: bool, model: str, include_usage: bool):
        app = self.server.app
        created = int(time.time())
        ident = ("chatcmpl-" if chat else "cmpl-") + gen.id
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False, logprobs: dict | None = None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
            if finish:
                choice["stop_reason"] = None
            return {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = sent_chars = 0
        try:
            if chat:
                self._sse(chunk(None, None, first=True))
            while True:
                try:
                    event = gen.events.get(timeout=0.25)
                except queue.Empty:
                    if self._client_gone():
                        raise BrokenPipeError from None
                    continue
                if event[0] == "error":
                    self._sse(error_body(event[1], "InternalServerError", 500))
                    break
                _, generated, finish = event
                text = answer.text(sent, generated)
                logprobs = answer.logprobs(sent, generated, sent_chars)
                sent, sent_chars = generated, sent_chars + len(text)
                self._sse(chunk(text, finish, logprobs=logprobs))
                if finish:
                    if include_usage:
                        usage = {"prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens + sent, "completion_tokens": sent}
                        self._sse({"id": ident, "object": kind, "created": created, "model": model, "choices": [], "usage": usage})
                    break
            self._sse("[DONE]")
            self._chunk(b"")
        except OSError:  # the client went away, or shutdown cut the connection
            app.engine.abort(gen)
            self.close_connection = True

    # -- the double's own endpoints
    def route_fake_state(self):
        self._json(200, self.server.app.state())

    def route_fake_requests(self):
        self._json(200, {"requests": self.server.app.request_log()})

    def route_fake_control(self):
        body = self._body_json()
        problem = check_control(body)
        if problem:
            raise BadRequest(problem)
        self.server.app.control(body)
        self._json(200, self.server.app.state())
        if "exit" in body:
            self.wfile.flush()
            self.server.app.events.put(("exit_now", body["exit"]))


# ----------------------------------------------------------------- lifecycle


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Lifecycle:
    def __init__(self, app: App):
        self.app = app
        self.opts = app.opts

    def install_signals(self) -> None:
        # SimpleQueue.put is reentrant, so handlers can use it safely; all work happens in the main loop.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, _f: self.app.events.put(("signal", s)))

    def bind(self) -> None:
        if self.opts.uds:
            self.app.httpd = Server(self.opts.uds, self.app, socket.AF_UNIX)
            try:
                self.app.httpd.server_bind()
            except OSError as e:
                log(f"failed to bind {self.opts.uds}: [Errno {e.errno}] {e.strerror}", "ERROR")
                exit_now(1)
            self.app.port = None
            self.listen_address = f"unix:{self.opts.uds}"
            return
        host = self.opts.host or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.app.httpd = Server((host, self.opts.port), self.app, family)
        try:
            self.app.httpd.server_bind()
        except OSError as e:
            log(f"failed to bind {host}:{self.opts.port}: [Errno {e.errno}] {e.strerror}", "ERROR")
            exit_now(1)
        self.app.port = self.app.httpd.server_port
        self.listen_address = f"http://{host}:{self.app.port}"

    def fail_start(self, code: int, message: str) -> None:
        """As vLLM 0.32 fails a start: EngineCore prints the real exception, then the
        API server prints its own follow-on traceback, so the last lines name the symptom."""
        stamp = time.strftime("%m-%d %H:%M:%S")
        core = f"(EngineCore_DP0 pid={self.app.engine.pid})"
        with _print_lock:
            print(f"{core} ERROR {stamp} [core.py:708] EngineCore failed to start.", flush=True)
            print(f"{core} ERROR {stamp} [core.py:708] Traceback (most recent call last):", flush=True)
            print(f"{core} ERROR {stamp} [core.py:708] {message}", flush=True)
            print("Traceback (most recent call last):", flush=True)
            print('  File "<frozen runpy>", line 198, in _run_module_as_main', flush=True)
            print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}", flush=True)
        self.app.engine.stop(self.opts.fake_core_shutdown_wait)
        exit_now(code)

    def load(self) -> None:
        """Model loading: the port is bound but not listening, so connections are refused."""
        o = self.opts
        app = self.app
        deadline = time.monotonic() + o.fake_startup_delay
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and app.engine.ready.is_set():
                break
            try:
                event = app.events.get(timeout=max(0.01, min(remaining, 0.1)) if remaining > 0 else 0.05)
            except queue.Empty:
                if remaining <= -10:
                    self.fail_start(1, "RuntimeError: Engine core initialization failed: no ready message within 10 s")
                continue
            if event[0] == "signal":
                log("received a signal while loading; shutting down")
                app.engine.stop(o.fake_core_shutdown_wait)
                exit_now(0)
            if event[0] == "engine_dead":
                self.fail_start(1, "RuntimeError: Engine core initialization failed. See root cause above.")
        if o.fake_exit_during_start is not None:
            self.fail_start(o.fake_exit_during_start, "RuntimeError: the engine failed to start (--fake-exit-during-start)")
        if o.fake_fail_start_unless is not None and not os.path.exists(o.fake_fail_start_unless):
            self.fail_start(1, f"OSError: {o.fake_fail_start_unless} does not exist (--fake-fail-start-unless)")
        if o.max_model_len > o.kv_capacity_tokens:
            self.fail_start(1, f"ValueError: To serve at least one request with the models's max seq len ({o.max_model_len}), "
                               f"the KV cache needs {o.max_model_len} tokens, more than its {o.kv_capacity_tokens}.")  # fmt: skip
        log(f"GPU KV cache size: {o.num_gpu_blocks * o.block_size:,} tokens", where="kv_cache_utils.py")
        log(f"Maximum concurrency for {o.max_model_len:,} tokens per request: {o.num_gpu_blocks * o.block_size / o.max_model_len:.2f}x",
            where="kv_cache_utils.py")  # fmt: skip
        log(f"init engine (profile, create kv cache, warmup model) took {o.fake_startup_delay:.2f} seconds", where="core.py")

    def serve(self) -> None:
        app = self.app
        app.httpd.server_activate()
        threading.Thread(target=app.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="http", daemon=True).start()
        log(f"Starting vLLM server on {self.listen_address}")
        uvicorn_log(f"Started server process [{os.getpid()}]")
        uvicorn_log("Waiting for application startup.")
        uvicorn_log("Application startup complete.")
        o = self.opts
        timers = []
        if o.fake_hang_after is not None:
            timers.append(threading.Timer(o.fake_hang_after, self._set_hang))
        if o.fake_health_503_after is not None:
            timers.append(threading.Timer(o.fake_health_503_after, self._set_503))
        if o.fake_exit_after_s is not None:
            timers.append(threading.Timer(o.fake_exit_after_s, self._engine_dies))
        for timer in timers:
            timer.daemon = True
            timer.start()

    def _set_hang(self):
        log("(--fake-hang-after) the server stops answering", "WARNING")
        self.app.behaviour.hang = True

    def _set_503(self):
        log("(--fake-health-503-after) /health answers 503 from now on", "WARNING")
        self.app.behaviour.health_503 = True

    def _engine_dies(self):
        log("(--fake-exit-after) killing EngineCore", "WARNING")
        self.app.engine.signal_core(signal.SIGKILL)

    def run_until_exit(self) -> None:
        app = self.app
        while True:
            try:
                # A timed wait: a signal delivered to another thread does not wake a blocked get().
                event = app.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if event[0] == "signal":
                if self.opts.fake_ignore_sigterm:
                    log(f"(--fake-ignore-sigterm) ignoring signal {event[1]}", "WARNING")
                    continue
                self.shutdown()
            elif event[0] == "engine_dead":
                self.engine_died()
            elif event[0] == "exit_now":
                log(f"(control) exiting at once with code {event[1]}, leaving EngineCore as it is", "WARNING")
                exit_now(event[1])

    def engine_died(self) -> None:
        log("EngineCore encountered a fatal error.", "ERROR", "core_client.py")
        log("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
            "ERROR", "async_llm.py")  # fmt: skip
        # /health answers 503 for a moment (engine.dead), as vLLM does before its server goes down.
        time.sleep(self.opts.fake_dead_exit_delay)
        uvicorn_log("Shutting down")
        uvicorn_log(f"Finished server process [{os.getpid()}]")
        exit_now(self.opts.fake_exit_code)

    def shutdown(self) -> None:
        app = self.app
        timeout = self.opts.shutdown_timeout
        app.draining = True
        uvicorn_log("Shutting down")
        app.httpd.shutdown()
        app.httpd.socket.close()  # new connections are refused from here on
        if timeout > 0:
            log(f"draining {app.active_streams} in-flight request(s) for up to {timeout} s", where="launcher.py")
            deadline = time.monotonic() + timeout
            while app.active_streams > 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            if app.active_streams:
                log(f"shutdown timeout reached with {app.active_streams} request(s) still running", "WARNING", "launcher.py")
        app.cut_connections()
        uvicorn_log("Waiting for application shutdown.")
        app.engine.stop(self.opts.fake_core_shutdown_wait)
        uvicorn_log("Application shutdown complete.")
        uvicorn_log(f"Finished server process [{os.getpid()}]")
        exit_now(0)


def main(argv: list[str] | None = None) -> None:
    try:
        opts, unknown = parse_args(sys.argv[1:] if argv is None else argv, dict(os.environ))
    except UsageError as e:
        print(f"api_server: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    app = App(opts, unknown)
    life = Lifecycle(app)
    life.install_signals()
    log(f"vLLM API server version {app.version}")
    log(f"model={opts.model!r} served_model_name={opts.served_names} shutdown_timeout={opts.shutdown_timeout} "
        f"max_model_len={opts.max_model_len} max_num_seqs={opts.max_num_seqs} block_size={opts.block_size} "
        f"num_gpu_blocks={opts.num_gpu_blocks}", where="utils.py")  # fmt: skip
    if unknown:
        log(f"the test double ignores these arguments: {unknown}", "WARNING", where="utils.py")
    life.bind()
    app.engine.start()
    life.load()
    life.serve()
    life.run_until_exit()


if __name__ == "__main__":
    main()
