"""The swap on a GPU: three stand-in engines of 15 GiB behind the router, swapped in turn on one card.

For a host with an NVIDIA GPU, driver 570 or newer (process checkpointing),
nvidia-ml-py, aiohttp and torch with CUDA; elsewhere it says so in one line and
exits 69. Not run by `make bench` (which runs bench/bench_*.py only). From the
repository root:

    python3 bench/gpu_swap.py [--weight-gib 15] [--swaps 8] [--pattern ABACBAC] [--gpu 0] [--json]
    python3 bench/gpu_swap.py --cpu-standin     # dry run of the plumbing, no GPU needed

The daemon (`python3 -m r3090d --skip-preflight`) runs in swap mode, in a
temporary directory: three [[models]] (generative) A, B and C, each engine
bench/gpu_swap_engine.py (gpu_engine_standin's: the vLLM double for HTTP plus a
torch worker holding --weight-gib GiB of bf16 weights, its own seed and status
directory, the double's greedy answers tied to the weights' checksum so the
canary means something; and a coupler that stops the double's token stream
while the worker is locked, as a checkpointed vLLM EngineCore makes no tokens);
the router (`python -m r3090d.router`) on the public port; gpu.required = true,
gpu.card = "any", swap.max_resident = 1, swap.min_residency = 2 s,
swap.drain_timeout = 3 s, a host-memory budget for three parked engines, the
canary on, the exporter on, syslog off.

A ballast process (torch, on the same GPU) takes all but weight + 6 GiB of the
card's free memory before the daemon starts, so one engine fits and two do not
(141 GB would hold all three). It is a foreign holder to the daemon's room
checks, as a desktop or another job would be. Each engine's
--gpu-memory-utilization is its weights plus 2 GiB of the card, so the room
check passes for one.

Warm-up: C, B, A are each asked for once (cold starts, nothing to resume yet),
each engine's canary baseline taken. Then --swaps swaps, the models asked for in
the order --pattern repeats (A, B, A, C, B, A, C, A, B for 8), each swap one
request through the router: a 16-token stream to the next model, sent while the
resident one is ready (past its minimum residency, so the wait measures the
swap, not the policy). What the resident model is doing then (`overlap`):
  frozen   a stream to it is still running when the next model is asked for, and
           outlasts the drain deadline: it is frozen with the parked engine. Used
           where the sequence comes straight back (A, B, A), so the return is the
           next swap of the sequence;
  return   the swap that brings a frozen engine back: the arbiter starts it by
           itself (frozen requests are pending work) once the other model is
           idle; the bench asks for the model too, and waits for the frozen
           stream to finish after its engine is back;
  drained  a stream to it is running when the next model is asked for and ends
           about 1 s later, inside the drain: drained, not frozen;
  none     nothing runs on it: nothing to drain.

For each swap: the client's time to first token of the request after it (from
sending it), the daemon's own breakdown (`swap.last` of the state document,
read after each swap; a step that did not happen is "-"): drain, checkpoint,
restore, canary, routing, the whole swap, and what r3090d adds beyond the
driver's checkpoint and restore (total - checkpoint - restore; and that less the
drain, which waits for the user's own requests). Then median and max per
column, over all swaps and over those with nothing to drain (the issue's goal:
added <= 1 s), and the cold starts of the warm-up apart. Also: requests sent,
completed and failed (lost), frozen streams that finished after their engine
returned, host RAM held by parked engines (the document's host_bytes and psutil's
RSS of the parked engines' processes), restarts (must stay 0), the router's
restarts, `r3090ctl status --json`'s exit code and /healthz.

--cpu-standin: the workers are CPU loops, NVML is tests/fakenvml (the card lists
the ballast and the workers, less those the fake driver holds checkpointed) and
the checkpoint calls are tests/fakecuda (lock SIGSTOPs the worker): the whole
sequence runs on a host without a GPU. Its times say nothing about a GPU.

One run on an H200 (driver 580.159.04, torch 2.11, 2026-12-02; the defaults):
8 swaps, every one ok; the client's TTFT median 13.4 s (max 18.1 s: a frozen
swap, its 3 s drain included); the driver's checkpoint 7.7-11.1 s and restore
3.1-3.8 s per 15.6 GiB engine; r3090d added 0.61-0.73 s (median 0.70 s) where
there was nothing to drain, 0.30-0.43 s less the drain on every swap; 15
requests, none lost; both frozen streams paused 25-27 s and finished 2.3 s after
their engine returned; two parked engines held 33.1 GiB of RSS (the document:
35.2 GiB, its base RSS an estimate); no restart.

Progress goes to stderr, the tables to stdout (--json: one JSON document
instead). Exit 0 when every swap went to the model asked for and ended ok, no
request was lost, every frozen stream finished after its engine returned and no
engine restarted; 1 otherwise; 69 when this host cannot run it.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # r3090d and bench/ from this checkout, installed or not

from bench import gpu_idle as gi  # noqa: E402
from bench import gpu_suspend_daemon as gsd  # noqa: E402
from r3090d.units import GIB, MIB  # noqa: E402
from tests.daemon_harness import free_port_block  # noqa: E402

ENGINE = ROOT / "bench" / "gpu_swap_engine.py"
FAKE_CUDA_DIR = ROOT / "tests" / "fakecuda"
MODELS = {"A": "swap-a", "B": "swap-b", "C": "swap-c"}  # the letters of --pattern and their served names
SEEDS = {"A": 3090, "B": 3091, "C": 3092}  # each engine's weights (and so its canary answers) its own
WARM_UP = ("C", "B", "A")  # A resident at the end, B and C parked
ANSWER_TOKENS = 16  # the request after a swap
MIN_RESIDENCY_S = 2.0
DRAIN_TIMEOUT_S = 3.0
QUEUE_TIMEOUT_S = 300.0  # a cold start of 15 GiB must never meet the router's 503
WATCHDOG_POLL_S = 0.5
CANARY_INTERVAL_S = 600.0  # a canary after each resume; no periodic one during the run
FROZEN_LEFT_S = 3.0  # a frozen stream's generation left at the drain deadline
DRAINED_LEFT_S = 1.0  # a drained stream ends this long after the next model is asked for: inside the drain
BALLAST_SPARE_GIB = 6.0  # free beside one engine's weights
ENGINE_SLACK_GIB = 2.0  # each engine's --gpu-memory-utilization: its weights plus this
HOST_BUDGET_SLACK_GIB = (
    3.0  # per engine, over its weights, in swap.host_memory_budget_mib (the daemon counts 2 GiB base RSS)
)
POLL_S = 0.05
SWAP_WAIT_S = 240.0
REQUEST_WAIT_S = 120.0
BASELINE_WAIT_S = 60.0
RESIDENCY_MARGIN_S = 0.3
ROUTING_SETTLE_S = 1.0  # routing_s is written a tick after the swap's end
DRY_TOTAL_MIB = 143771  # gpu_idle.FakeCard's card
DRY_CHECKPOINT_DELAYS = {
    "checkpoint": 0.5,
    "restore": 0.3,
}  # the dry run's driver: some time, so the stages show

BALLAST = r"""
import ctypes, json, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: it goes when the bench goes
import torch
keep = int(float(sys.argv[1]) * 2**30)
free, total = torch.cuda.mem_get_info()  # after this process's own context
held = max(0, free - keep)
block = torch.empty(held, dtype=torch.uint8, device="cuda") if held else None
torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid(), "held": held, "free": torch.cuda.mem_get_info()[0], "total": total}), flush=True)
sys.stdin.read()  # until the bench closes its end
"""


class Overlap(enum.StrEnum):
    """What the resident model is doing when the next one is asked for."""

    COLD = "cold"  # warm-up: a cold start
    NONE = "none"
    DRAINED = "drained"
    FROZEN = "frozen"
    RETURN = "return"


NOTHING_TO_DRAIN = (Overlap.NONE, Overlap.RETURN)


def sequence(pattern: str, swaps: int) -> list[str]:
    """The models asked for, the resident one first: the pattern repeated to swaps + 1 letters."""
    return list((pattern * math.ceil((swaps + 1) / len(pattern)))[: swaps + 1])


def overlaps(seq: list[str]) -> list[Overlap]:
    """Each swap's overlap: frozen where the sequence comes straight back (its return is the next swap),
    else none and drained in turn."""
    out: list[Overlap] = []
    for i in range(1, len(seq)):
        if out and out[-1] is Overlap.FROZEN:
            out.append(Overlap.RETURN)
        elif i + 1 < len(seq) and seq[i + 1] == seq[i - 1]:
            out.append(Overlap.FROZEN)
        else:
            plain = sum(o in (Overlap.NONE, Overlap.DRAINED) for o in out)
            out.append(Overlap.NONE if plain % 2 == 0 else Overlap.DRAINED)
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ------------------------------------------------------------------ requests


class Request:
    """One streaming completion through the router, in a thread: when it was sent, its chunks, how it ended."""

    def __init__(self, url: str, model: str, tokens: int, label: str):
        self.url, self.model, self.tokens, self.label = url, model, tokens, label
        self.sent_at: float | None = None
        self.chunks: list[float] = []
        self.status: int | None = None
        self.finish: str | None = None
        self.done = False  # data: [DONE] seen
        self.error: str | None = None
        self.ended_at: float | None = None
        self.ended_wall: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"request {label}", daemon=True)

    def start(self) -> Request:
        self.sent_at = time.monotonic()
        self.thread.start()
        return self

    def _run(self) -> None:
        import httpx

        body = {
            "model": self.model,
            "prompt": f"the swap bench, {self.label}",
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            # trust_env=False: loopback, never through a proxy; no read timeout: a frozen stream waits for its engine
            with httpx.Client(trust_env=False, timeout=httpx.Timeout(None, connect=10.0)) as client, \
                    client.stream("POST", self.url + "/v1/completions", json=body) as r:  # fmt: skip
                self.status = r.status_code
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks.append(time.monotonic())
                        try:
                            choice = json.loads(line[6:])["choices"][0]
                        except (ValueError, KeyError, IndexError, TypeError):
                            self.error = f"not a completion chunk: {line[:200]}"
                            continue
                        self.finish = choice.get("finish_reason") or self.finish
        except Exception as exc:  # any way the request failed is the finding: it is reported, not raised
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_wall = time.time()
            self.ended_at = time.monotonic()

    @property
    def finished(self) -> bool:
        return self.ended_at is not None

    @property
    def ok(self) -> bool:
        return (
            self.finished
            and self.status == 200
            and self.done
            and self.error is None
            and self.finish in ("length", "stop")
        )

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent_at if self.chunks and self.sent_at is not None else None

    @property
    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)), default=0.0)

    def why_not(self) -> str:
        if not self.finished:
            return "still open"
        return (
            self.error
            or f"status {self.status}, finish {self.finish}, [DONE] {'seen' if self.done else 'missing'}"
        )

    def wait(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return self.finished

    def wait_first_chunk(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.chunks:
            if self.finished or time.monotonic() > deadline:
                raise RuntimeError(
                    f"request {self.label} to {self.model} gave no token within {timeout:.0f} s: {self.why_not()}"
                )
            time.sleep(0.01)


# ------------------------------------------------------------------ the ballast


class Ballast:
    """A torch process holding all but `keep_gib` of the card's free memory, until the bench ends."""

    def __init__(self, gpu: int, keep_gib: float, log: Path):
        self.log_path = log
        self.log = open(log, "ab")  # noqa: SIM115 (closed by stop)
        env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu)}
        self.proc = subprocess.Popen([sys.executable, "-c", BALLAST, f"{keep_gib:g}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True)  # fmt: skip

    def ready(self, timeout: float) -> dict:
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if readable else ""
        if not line:
            state = (
                f"exited {self.proc.poll()}"
                if self.proc.poll() is not None
                else f"did not report within {timeout:.0f} s"
            )
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"the ballast {state}: {' | '.join(tail)}")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


class DryCard(gi.FakeCard):
    """The dry run's card: the ballast (a process entry), and every model's live workers less those the fake
    driver holds checkpointed."""

    def __init__(self, path: Path, status_dirs: list[Path], states: Path, ballast_mib: int):
        self.status_dirs, self.states, self.ballast_mib = status_dirs, states, ballast_mib
        super().__init__(path, status_dirs[0])

    def write(self) -> None:
        try:
            states = json.loads(self.states.read_text())
        except (OSError, ValueError):
            states = {}
        off = {int(pid) for pid, e in states.items() if e.get("state") == "CHECKPOINTED"}
        live = [
            (w.pid, (gi.proc_stat(w.pid) or ("Z", 0))[0])
            for d in self.status_dirs
            for w in gi.workers(d)
            if w.pid not in off
        ]
        procs = [[os.getpid(), self.ballast_mib]] + [[pid, self.WORKER_MIB] for pid, _ in live]
        card = {
            "name": "NVIDIA H200 (fake, dry run)", "memory_total_mib": DRY_TOTAL_MIB, "memory_reserved_mib": 500,
            "driver": "580.65.06", "cuda": 13000, "cc": [9, 0], "persistence": True,
            "util": 100 if any(state != "T" for _, state in live) else 0,
            "processes": procs, "memory_used_mib": sum(mib for _, mib in procs),
        }  # fmt: skip
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(card))
        os.replace(tmp, self.path)


# ------------------------------------------------------------------ the daemon


def write_engine_python(base: Path, args) -> Path:
    from shlex import quote

    env = {
        "GPU_IDLE_WORKER": "cpu" if args.cpu_standin else "torch",
        "GPU_IDLE_WEIGHT_GIB": f"{args.weight_gib:g}",
        "GPU_IDLE_CANARY": "1",
    }
    exports = " ".join(f"{k}={quote(v)}" for k, v in env.items())
    path = base / "engine-python"
    path.write_text(f"#!/bin/sh\n# The engine python r3090d launches for every model: see bench/gpu_swap_engine.py.\n"
                    f"exec env {exports} {quote(sys.executable)} {quote(str(ENGINE))} \"$@\"\n")  # fmt: skip
    path.chmod(0o755)
    return path


class SwapRun(gi.DaemonRun):
    """gpu_idle's daemon run, in swap mode: three models, the router on the public port, the exporter on."""

    def __init__(
        self,
        base: Path,
        args,
        env: dict[str, str],
        engine_python: Path,
        status_dirs: dict[str, Path],
        total_mib: int,
        overrides: dict[str, dict] | None = None,
        model_args: dict[str, list[str]] | None = None,
    ):
        """`overrides`: config tables merged over this bench's (a bench of faults sets the watchdog's give-up);
        `model_args`: more extra_args for a model, by letter."""
        self.dir = base / "daemon"
        self.dir.mkdir(mode=0o700)
        self.poll = WATCHDOG_POLL_S
        self.status_dir = base / "workers"  # gpu_idle's; each model has its own below
        self.status_dirs = status_dirs
        self.port = gi.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exporter_port = gi.free_port()
        self.exporter_url = f"http://127.0.0.1:{exporter_port}"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.engine_groups: set[int] = set()
        self.state_path = self.dir / "state" / "state.json"
        self.log_path = self.dir / "daemon.log"
        weight_mib = gi.FakeCard.WORKER_MIB if args.cpu_standin else args.weight_gib * 1024
        self.gpu_memory_utilization = (
            math.ceil((weight_mib + ENGINE_SLACK_GIB * 1024) / total_mib * 1e4) / 1e4
        )
        self.host_budget_mib = int(len(MODELS) * (weight_mib + HOST_BUDGET_SLACK_GIB * 1024))
        q = gi.toml_value
        lines = ['profile = "none"', "", "[engine]", f"python = {q(str(engine_python))}", 'host = "127.0.0.1"', f"port = {self.port}",
                 "shutdown_timeout = 5", "startup_timeout = 300"]  # fmt: skip
        for letter, name in MODELS.items():
            model = self.dir / f"model-{letter}"
            model.mkdir()
            (model / "config.json").write_text("{}")
            extra = [
                "--fake-token-delay",
                f"{args.token_delay:g}",
                "--gpu-memory-utilization",
                f"{self.gpu_memory_utilization:g}",
                *(model_args or {}).get(letter, []),
            ]
            env_table = {"GPU_IDLE_STATUS_DIR": str(status_dirs[letter]), "GPU_IDLE_SEED": str(SEEDS[letter])}
            lines += ["", "[[models]]", f"name = {q(name)}", f"model = {q(str(model))}", f"extra_args = {q(extra)}",
                      "env = { " + ", ".join(f"{k} = {q(v)}" for k, v in env_table.items()) + " }"]  # fmt: skip
        sections = {
            "swap": {"max_resident": 1, "min_residency": MIN_RESIDENCY_S, "drain_timeout": DRAIN_TIMEOUT_S, "queue_timeout": QUEUE_TIMEOUT_S,
                     "engine_port_base": free_port_block(len(MODELS)), "host_memory_budget_mib": self.host_budget_mib},
            "gpu": {"required": True, "index": args.gpu, "card": "any"},
            "watchdog": {"poll_interval": WATCHDOG_POLL_S},
            "canary": {"enabled": True, "interval": CANARY_INTERVAL_S},
            "alerts.syslog": {"enabled": False},
            "daemon": {"state_dir": str(self.dir / "state"), "runtime_dir": str(self.dir / "run"), "exporter_enabled": True,
                       "exporter_host": "127.0.0.1", "exporter_port": exporter_port},
        }  # fmt: skip
        for name, values in (overrides or {}).items():
            sections[name] = {**sections.get(name, {}), **values}
        for name, values in sections.items():
            lines += ["", f"[{name}]", *(f"{k} = {q(v)}" for k, v in values.items())]
        self.config = self.dir / "r3090d.toml"
        self.config.write_text("\n".join(lines) + "\n")
        from r3090d import config as configmod

        self.cfg = configmod.load(
            self.config, check_files=False
        )  # a bad config fails here, before the daemon starts

    def ctl(self, *args: str, timeout: float) -> gsd.CtlRun:
        return gsd.SuspendDaemon.ctl(self, *args, timeout=timeout)

    def healthz(self) -> tuple[int | None, str]:
        return gsd.SuspendDaemon.healthz(self)


def model_doc(st: dict, name: str) -> dict:
    return next(m for m in st.get("models") or [] if m.get("name") == name)


def restarts_total(st: dict) -> int:
    return sum(((m.get("restarts") or {}).get("total") or 0) for m in st.get("models") or [])


@dataclass(frozen=True)
class ParkedMemory:
    models: tuple[str, ...]
    doc_bytes: (
        int  # the document's host_bytes of the parked models (GPU memory held plus an estimated base RSS)
    )
    rss_bytes: int  # psutil: RSS of every process of the parked engines
    checkpointed_rss_bytes: int  # psutil: RSS of the checkpointed processes alone


def parked_memory(st: dict) -> ParkedMemory:
    import psutil

    def rss(pid: int | None) -> int:
        try:
            return psutil.Process(pid).memory_info().rss if pid else 0
        except psutil.Error:
            return 0

    parked = [m for m in st.get("models") or [] if m.get("residency") == "parked"]
    return ParkedMemory(
        models=tuple(m["name"] for m in parked),
        doc_bytes=sum(m.get("host_bytes") or 0 for m in parked),
        rss_bytes=sum(rss(p) for m in parked for p in set((m.get("engine") or {}).get("tree_pids") or [])),
        checkpointed_rss_bytes=sum(rss((m.get("suspend") or {}).get("pid")) for m in parked),
    )


class Watcher:
    """The state document every POLL_S, in a thread: every swap's record as the daemon wrote it (by swap.total),
    the engines' process groups, the most restarts seen, the most host memory parked engines held."""

    def __init__(self, run: SwapRun):
        self.run = run
        self.lock = threading.Lock()
        self.records: dict[int, dict] = {}
        self.doc: dict | None = None
        self.pgids: set[int] = set()
        self.most_restarts = 0
        self.most_parked: ParkedMemory | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="state-watcher", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            st = self.run.state()
            if not isinstance(st, dict):
                continue
            swap = st.get("swap") or {}
            total, last = swap.get("total") or 0, swap.get("last")
            with self.lock:
                self.doc = st
                if total and isinstance(last, dict):
                    self.records[total] = last  # a later read of the same swap brings its routing_s
                self.pgids.update(
                    p for m in st.get("models") or [] if (p := (m.get("engine") or {}).get("pid"))
                )
                self.most_restarts = max(self.most_restarts, restarts_total(st))
                self.observe(st)

    def observe(self, st: dict) -> None:
        """Each document read, under the lock: a bench that follows more of it (phases, the router) adds it here."""

    def latest(self) -> dict:
        with self.lock:
            return self.doc or {}

    def count(self) -> int:
        with self.lock:
            return max(self.records, default=0)

    def sample_parked(self) -> ParkedMemory:
        now = parked_memory(self.latest())
        if self.most_parked is None or now.rss_bytes > self.most_parked.rss_bytes:
            self.most_parked = now
        return now

    def record(self, n: int, budget: gi.Budget, what: str) -> dict | None:
        """Swap number n's record once it has ended (None: it ended between two reads and a later one hid it)."""
        deadline = time.monotonic() + budget.cap(SWAP_WAIT_S)
        while True:
            with self.lock:
                rec, newest = self.records.get(n), max(self.records, default=0)
            if rec is not None or newest > n:
                break
            if self.run.proc.poll() is not None:
                raise RuntimeError(
                    f"the daemon exited {self.run.proc.returncode} while waiting for {what}; its log ends:\n{self.run.log_tail()}"
                )
            if time.monotonic() > deadline:
                if budget.left() <= 0:
                    raise gi.OutOfTime(f"the time budget (--budget) ran out while waiting for {what}")
                progress = (self.latest().get("swap") or {}).get("in_progress")
                raise RuntimeError(
                    f"no {what} within {SWAP_WAIT_S:.0f} s (in progress: {progress}); the daemon's log ends:\n{self.run.log_tail()}"
                )
            time.sleep(POLL_S)
        settle = time.monotonic() + ROUTING_SETTLE_S
        while (
            rec is not None and rec.get("ok") and rec.get("routing_s") is None and time.monotonic() < settle
        ):
            time.sleep(POLL_S)
            with self.lock:
                rec = self.records.get(n)
        return rec


# ------------------------------------------------------------------ rows


@dataclass(frozen=True)
class SwapRow:
    label: str
    from_model: str  # a letter, or "-" when nothing had to leave the GPU
    to_model: str
    overlap: Overlap
    ok: bool
    cold: bool
    ttft_s: float | None
    seconds: float | None
    drain_s: float | None
    checkpoint_s: float | None
    stop_s: float | None
    restore_s: float | None
    start_s: float | None
    canary_s: float | None
    routing_s: float | None
    frozen: int | None
    notes: str

    @property
    def added_s(self) -> float | None:
        """What r3090d adds beyond the driver's checkpoint and restore; none for a cold start."""
        if self.seconds is None or self.cold:
            return None
        return self.seconds - (self.checkpoint_s or 0.0) - (self.restore_s or 0.0)

    @property
    def added_less_drain_s(self) -> float | None:
        added = self.added_s
        return None if added is None else added - (self.drain_s or 0.0)

    def to_json(self) -> dict:
        out = {
            **asdict(self),
            "overlap": self.overlap.value,
            "added_s": self.added_s,
            "added_less_drain_s": self.added_less_drain_s,
        }
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


COLUMNS: list[tuple[str, Callable[[SwapRow], float | None]]] = [
    ("TTFT", lambda r: r.ttft_s), ("total", lambda r: r.seconds), ("drain", lambda r: r.drain_s),
    ("checkpoint", lambda r: r.checkpoint_s), ("restore", lambda r: r.restore_s), ("start", lambda r: r.start_s),
    ("canary", lambda r: r.canary_s), ("routing", lambda r: r.routing_s), ("added", lambda r: r.added_s),
    ("added-drain", lambda r: r.added_less_drain_s),
]  # fmt: skip
LETTER = {name: letter for letter, name in MODELS.items()}


def row_from(
    label: str,
    expect_from: str | None,
    expect_to: str,
    overlap: Overlap,
    rec: dict | None,
    q: Request,
    notes: list[str],
) -> SwapRow:
    if rec is None:
        return SwapRow(label, expect_from or "-", expect_to, overlap, ok=False, cold=False, ttft_s=q.ttft, seconds=None, drain_s=None,
                       checkpoint_s=None, stop_s=None, restore_s=None, start_s=None, canary_s=None, routing_s=None, frozen=None,
                       notes="; ".join(["the daemon's record of this swap was overwritten before it was read", *notes]))  # fmt: skip
    got_to, got_from = (
        LETTER.get(rec.get("to_model") or "", rec.get("to_model") or "?"),
        rec.get("from_model"),
    )
    got_from = LETTER.get(got_from, got_from) if got_from else "-"
    ok = bool(rec.get("ok")) and got_to == expect_to
    if got_to != expect_to:
        notes.insert(0, f"UNEXPECTED: the daemon swapped to {got_to}, not {expect_to}")
    if expect_from is not None and got_from != expect_from:
        notes.insert(0, f"from {got_from}, not {expect_from}")
    if rec.get("error"):
        notes.insert(0, f"error: {rec['error']}")
    if rec.get("stop_s") is not None:
        notes.append(f"drained stop {rec['stop_s']:.2f} s (not parked)")
    return SwapRow(label, got_from, got_to, overlap, ok, bool(rec.get("cold")), q.ttft, rec.get("seconds"), rec.get("drain_s"),
                   rec.get("checkpoint_s"), rec.get("stop_s"), rec.get("restore_s"), rec.get("start_s"), rec.get("canary_s"),
                   rec.get("routing_s"), rec.get("frozen_requests"), "; ".join(notes))  # fmt: skip


# ------------------------------------------------------------------ the run


class Bench:
    def __init__(self, args, run: SwapRun, watcher: Watcher, budget: gi.Budget):
        self.args, self.run, self.watcher, self.budget = args, run, watcher, budget
        self.requests: list[Request] = []
        self.rows: list[SwapRow] = []
        self.frozen: list[
            dict
        ] = []  # each frozen stream: its label, model, and how it ended after its engine returned

    def ask(self, letter: str, tokens: int, label: str) -> Request:
        req = Request(self.run.url, MODELS[letter], tokens, label).start()
        self.requests.append(req)
        return req

    def wait_request(self, req: Request, what: str) -> None:
        if not req.wait(self.budget.cap(REQUEST_WAIT_S)):
            raise RuntimeError(f"{what} ({req.label}) did not end within {REQUEST_WAIT_S:.0f} s")

    def wait_quiet(self) -> None:
        """Every request sent so far has ended."""
        for req in self.requests:
            self.wait_request(req, "a request")

    def wait_resident(self, letter: str, since_wall: float | None) -> None:
        """The model ready, and resident at least min_residency: the arbiter may take it off at once."""
        name = MODELS[letter]
        self.run.wait(
            lambda st: model_doc(st, name)["residency"] == "ready", 60, f"{name} ready", self.budget
        )
        if since_wall is not None:
            left = since_wall + MIN_RESIDENCY_S + RESIDENCY_MARGIN_S - time.time()
            if left > 0:
                time.sleep(self.budget.cap(left))

    def wait_baseline(self, letter: str) -> str:
        name = MODELS[letter]
        try:
            self.run.wait(lambda st: model_doc(st, name)["canary"]["baseline_tokens"] is not None, BASELINE_WAIT_S,
                          f"{name}'s canary baseline", self.budget)  # fmt: skip
        except RuntimeError:
            gi.say(
                f"warning: {name} has no canary baseline after {BASELINE_WAIT_S:.0f} s: its resumes are checked without one"
            )
            return "no canary baseline"
        return ""

    def warm_up(self) -> float | None:
        at = None
        for i, letter in enumerate(WARM_UP, start=1):
            n = self.watcher.count() + 1
            gi.say(f"warm-up {i}: {MODELS[letter]} cold")
            q = self.ask(letter, ANSWER_TOKENS, f"warm-up {letter}")
            rec = self.watcher.record(n, self.budget, f"the cold start of {MODELS[letter]}")
            self.wait_request(q, "the warm-up request")
            notes = [] if q.ok else [f"request {q.label} FAILED: {q.why_not()}"]
            missing = self.wait_baseline(letter)
            if missing:
                notes.append(missing)
            row = row_from(f"w{i}", None, letter, Overlap.COLD, rec, q, notes)
            self.rows.append(row)
            self.say_row(row)
            at = (rec or {}).get("at")
        return at

    def swaps(self, seq: list[str], kinds: list[Overlap], last_at: float | None) -> None:
        frozen_stream: Request | None = None
        for i, kind in enumerate(kinds, start=1):
            x, y = seq[i - 1], seq[i]
            notes: list[str] = []
            stream: Request | None = None
            if kind is not Overlap.RETURN:
                self.wait_quiet()
                self.wait_resident(x, last_at)
            if kind is Overlap.FROZEN:
                stream = self.ask(
                    x,
                    round((DRAIN_TIMEOUT_S + FROZEN_LEFT_S) / self.args.token_delay),
                    f"swap {i} frozen {x}",
                )
            elif kind is Overlap.DRAINED:
                stream = self.ask(
                    x, max(1, round(DRAINED_LEFT_S / self.args.token_delay)), f"swap {i} drained {x}"
                )
            if stream is not None:
                stream.wait_first_chunk(self.budget.cap(30.0))
            n = self.watcher.count() + 1
            gi.say(f"swap {i}: {MODELS[x]} -> {MODELS[y]} ({kind.value})")
            q = self.ask(y, ANSWER_TOKENS, f"swap {i} to {y}")
            rec = self.watcher.record(n, self.budget, f"swap {i} ({MODELS[x]} -> {MODELS[y]})")
            self.wait_request(q, "the request after the swap")
            if not q.ok:
                notes.append(f"request {q.label} FAILED: {q.why_not()}")
            if kind is Overlap.FROZEN:
                if rec is not None and not rec.get("frozen_requests"):
                    notes.append("NOT frozen: the daemon counted no frozen request")
                notes.append(f"{stream.tokens}-token stream frozen after {len(stream.chunks)} tokens")
                frozen_stream = stream
            elif kind is Overlap.DRAINED and stream is not None:
                self.wait_request(stream, "the drained stream")
                ended = stream.ended_at - q.sent_at
                if rec is not None and rec.get("frozen_requests"):
                    notes.append(
                        f"the daemon counts {rec['frozen_requests']} frozen: in flight at its decision"
                    )
                notes.append(
                    f"stream ended {ended:.2f} s after the ask{'' if stream.ok else ', FAILED: ' + stream.why_not()}"
                )
            elif kind is Overlap.RETURN and frozen_stream is not None:
                notes.append(self.frozen_returned(frozen_stream, rec))
                frozen_stream = None
            parked = self.watcher.sample_parked()
            notes.append(
                f"parked {', '.join(LETTER.get(m, m) for m in parked.models) or 'none'}: RSS {parked.rss_bytes / GIB:.1f} GiB"
            )
            row = row_from(str(i), x, y, kind, rec, q, notes)
            self.rows.append(row)
            self.say_row(row)
            last_at = (rec or {}).get("at")

    def frozen_returned(self, stream: Request, rec: dict | None) -> str:
        """The frozen stream, once its engine is back: it must end well, after the return began."""
        self.wait_request(stream, "the frozen stream")
        began = (
            rec["at"] - (rec.get("seconds") or 0.0) if rec and rec.get("at") else None
        )  # the return swap's decision
        after = began is not None and stream.ended_wall is not None and stream.ended_wall > began
        back = None if rec is None or stream.ended_wall is None else stream.ended_wall - rec["at"]
        ok = stream.ok and after
        self.frozen.append({"label": stream.label, "model": stream.model, "ok": ok, "ended_after_return_s": back,
                            "longest_pause_s": stream.longest_gap, "tokens": len(stream.chunks), "error": None if stream.ok else stream.why_not()})  # fmt: skip
        when = "-" if back is None else f"{back:+.2f} s"
        text = (
            f"frozen stream ended {when} from its engine's return, longest pause {stream.longest_gap:.1f} s"
        )
        return (
            text
            if ok
            else f"FROZEN STREAM NOT OK ({stream.why_not() if not stream.ok else 'ended before its engine returned'}): {text}"
        )

    def say_row(self, row: SwapRow) -> None:
        gi.say(f"  {row.from_model} -> {row.to_model}: {'ok' if row.ok else 'FAILED'}, TTFT {gi.fmt(row.ttft_s)} s, total {gi.fmt(row.seconds)} s "
               f"(drain {gi.fmt(row.drain_s)}, checkpoint {gi.fmt(row.checkpoint_s)}, restore {gi.fmt(row.restore_s)}, start {gi.fmt(row.start_s)}, "
               f"canary {gi.fmt(row.canary_s)}, routing {gi.fmt(row.routing_s)}), added {gi.fmt(row.added_s)} s; {row.notes}")  # fmt: skip


def kill_engines(base: Path, watcher: Watcher, status_dirs: dict[str, Path]) -> None:
    """Engine process groups and workers of this run that outlived the daemon."""
    for pgid in sorted(watcher.pgids):
        members = gi.group_members(pgid)
        if members and any(str(base) in gi.cmdline(p) or ENGINE.name in gi.cmdline(p) for p in members):
            gi.say(f"cleanup: engine group {pgid} outlived the daemon ({members}): SIGKILL")
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for d in status_dirs.values():
        for w in gi.workers(d):
            if ENGINE.name in gi.cmdline(w.pid):
                os.kill(w.pid, signal.SIGKILL)


def check_deps() -> None:
    missing = [m for m in ("aiohttp", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        raise gi.Unavailable(
            f"the router's and the bench's dependencies are missing for {sys.executable}: {', '.join(missing)}"
        )


@dataclass(frozen=True)
class Rig:
    """What a swap-mode bench runs on: the daemon (not started yet), its watcher, the time budget, and the measures
    of the host (card, driver, ballast, engines) for the report."""

    run: SwapRun
    watcher: Watcher
    budget: gi.Budget
    measures: dict[str, str]
    status_dirs: dict[str, Path]

    def start(self) -> None:
        """The daemon, until its router is linked; then the watcher."""
        self.run.start()
        self.run.wait(
            lambda st: (st.get("swap") or {}).get("router", {}).get("linked"),
            120,
            "the router, linked",
            self.budget,
        )
        self.watcher.start()


def prepare(args, base: Path, cleanup: list[Callable[[], None]], plan: str, *, overrides: dict[str, dict] | None = None,
            model_args: dict[str, list[str]] | None = None, watcher: type[Watcher] = Watcher) -> Rig:  # fmt: skip
    """The card (the fake one with --cpu-standin), the ballast, the engine python and the daemon's config: a rig whose
    daemon is not started yet. Raises gi.Unavailable when this host cannot run it. `plan`: the run, in words, for the
    first progress line; `overrides`, `model_args`: see SwapRun; `watcher`: Watcher or a subclass."""
    dry = args.cpu_standin
    status_dirs = {letter: base / f"workers-{letter}" for letter in MODELS}
    for d in status_dirs.values():
        d.mkdir()
    card_path = base / "fake-nvml.json" if dry else None
    control = base / "fake-cuda.json"
    if dry:
        control.write_text(json.dumps({"delay_s": DRY_CHECKPOINT_DELAYS}))
        ballast_mib = DRY_TOTAL_MIB - gi.FakeCard.WORKER_MIB - int(BALLAST_SPARE_GIB * 1024)
        card = DryCard(card_path, list(status_dirs.values()), Path(f"{control}.states.json"), ballast_mib)
        cleanup.append(card.stop)
    nvml = gi.load_nvml(dry, card_path)
    check_deps()
    gpu = gi.check_host(args, nvml)
    if dry:
        card.start()
        driver = "fake CUDA checkpoint driver (tests/fakecuda)"
    else:
        from r3090d.effectors.checkpoint import available

        ok, driver = available()
        if not ok:
            raise gi.Unavailable(f"the driver cannot checkpoint processes (needs 570 or newer): {driver}")
    env, notes = gi.daemon_env(base, dry)
    if dry:
        from r3090d.effectors.checkpoint import FAKE_ENV

        env["PYTHONPATH"] = os.pathsep.join([str(FAKE_CUDA_DIR), env["PYTHONPATH"]])
        env[FAKE_ENV] = str(control)
    poller = gi.NvmlPoller(nvml, args.gpu)  # readings on demand
    total_mib = nvml.nvmlDeviceGetMemoryInfo(poller.handle).total // MIB
    budget = gi.Budget(args.budget)
    gi.say(f"GPU {args.gpu}: {gpu}, {total_mib} MiB; {driver}; weights {args.weight_gib:g} GiB per engine; "
           f"{plan}; budget {args.budget:.0f} s")  # fmt: skip
    for note in notes:
        gi.say(note)
    foreign = poller.processes()
    if foreign and not dry:
        gi.say(f"warning: the GPU already has processes (pid, MiB) {foreign}")
    measures: dict[str, str] = {"card": f"{gpu}, {total_mib} MiB", "driver": driver}

    keep_gib = args.weight_gib + BALLAST_SPARE_GIB
    if dry:
        measures["ballast"] = f"a fake process of {ballast_mib} MiB on the fake card"
    else:
        ballast = Ballast(args.gpu, keep_gib, base / "ballast.log")
        cleanup.append(ballast.stop)
        got = ballast.ready(budget.cap(180.0))
        measures["ballast"] = (
            f"pid {got['pid']} holds {got['held'] / GIB:.1f} GiB; {got['free'] / GIB:.1f} GiB free beside it (asked {keep_gib:g})"
        )
        gi.say(f"ballast: {measures['ballast']}")

    engine_python = write_engine_python(base, args)
    run = SwapRun(base, args, env, engine_python, status_dirs, total_mib, overrides, model_args)
    watching = watcher(run)
    cleanup.append(lambda: kill_engines(base, watching, status_dirs))
    cleanup.append(run.stop)
    cleanup.append(watching.stop)
    worker = (
        "CPU workers (dry run)"
        if dry
        else f"{args.weight_gib:g} GiB each (--gpu-memory-utilization {run.gpu_memory_utilization:g})"
    )
    measures["engines"] = (
        f"3: {worker}; token delay {args.token_delay:g} s; swap.host_memory_budget_mib {run.host_budget_mib}"
    )
    gi.say(f"daemon: config {run.config}, router {run.url}, exporter {run.exporter_url}")
    return Rig(run, watching, budget, measures, status_dirs)


def bench(args, base: Path, cleanup: list[Callable[[], None]]) -> int:
    seq = sequence(args.pattern, args.swaps)
    kinds = overlaps(seq)
    rig = prepare(args, base, cleanup, f"sequence {', '.join(seq)}")
    b = Bench(args, rig.run, rig.watcher, rig.budget)
    failure = ""
    try:
        rig.start()
        last_at = b.warm_up()
        b.swaps(seq, kinds, last_at)
        b.wait_quiet()
    except gi.OutOfTime as exc:
        gi.say(str(exc))
        failure = str(exc)
    except RuntimeError as exc:
        gi.say(f"error: {exc}")
        failure = str(exc).splitlines()[0]
    return finish(args, b, rig.measures, failure)


def finish(args, b: Bench, measures: dict[str, str], failure: str) -> int:
    for req in b.requests:  # a last chance for streams still open (bounded: a stuck one is lost)
        req.wait(max(0.0, min(10.0, b.budget.left())))
    st = b.watcher.latest() or (b.run.state() or {})
    lost = [r for r in b.requests if not r.ok]
    measures["requests"] = (
        f"sent {len(b.requests)}, completed {len(b.requests) - len(lost)}, failed {len(lost)}"
    )
    if lost:
        measures["requests lost"] = "; ".join(f"{r.label}: {r.why_not()}" for r in lost)[:400]
    frozen_ok = sum(f["ok"] for f in b.frozen)
    measures["frozen streams"] = (f"{frozen_ok}/{len(b.frozen)} finished after their engine returned"
                                  + "".join(f"; {f['label']}: {'-' if f['ended_after_return_s'] is None else format(f['ended_after_return_s'], '+.2f')} s "
                                            f"from the return, paused {f['longest_pause_s']:.1f} s" for f in b.frozen))  # fmt: skip
    if st:
        end = parked_memory(st)
        most = b.watcher.most_parked or end
        swap = st.get("swap") or {}
        measures["host RAM, parked (end)"] = (f"{', '.join(end.models) or 'none'}: document {end.doc_bytes / GIB:.1f} GiB "
                                              f"(swap.host_parked_bytes {(swap.get('host_parked_bytes') or 0) / GIB:.1f}); RSS {end.rss_bytes / GIB:.1f} GiB, "
                                              f"of which checkpointed processes {end.checkpointed_rss_bytes / GIB:.1f} GiB")  # fmt: skip
        measures["host RAM, parked (most)"] = (
            f"{', '.join(most.models) or 'none'}: RSS {most.rss_bytes / GIB:.1f} GiB, document {most.doc_bytes / GIB:.1f} GiB"
        )
        measures["host budget"] = f"{(swap.get('host_budget_bytes') or 0) / MIB:.0f} MiB"
        measures["swaps (daemon)"] = f"total {swap.get('total')}, failed {swap.get('failed')}"
        router = swap.get("router") or {}
        measures["router restarts"] = str(router.get("restarts"))
        per_model = ", ".join(f"{LETTER.get(m['name'], m['name'])} {m.get('residency')} in {m.get('swaps_in')} restarts "
                              f"{(m.get('restarts') or {}).get('total')}" for m in st.get("models") or [])  # fmt: skip
        measures["models (end)"] = per_model
    restarts = max(b.watcher.most_restarts, restarts_total(st) if st else 0)
    measures["restarts"] = f"{restarts} (every model's restarts.total, the most seen)"
    if b.run.proc is not None and b.run.proc.poll() is None:
        status = b.run.ctl("status", "--json", timeout=60)
        doc = status.doc.get("state") or {}
        last = (doc.get("swap") or {}).get("last") or {}
        measures["r3090ctl status --json"] = (
            f"exit {status.rc} ({status.doc.get('verdict')}: {'; '.join(status.doc.get('reasons') or []) or 'no reasons'}); "
            f"swap.last {last.get('from_model')} -> {last.get('to_model')}, ok {last.get('ok')}"
        )
        hz = b.run.healthz()
        measures["/healthz"] = f"{hz[0]} {hz[1][:60]}"
    swaps = [r for r in b.rows if r.overlap is not Overlap.COLD]
    calm = [r for r in swaps if r.overlap in NOTHING_TO_DRAIN]
    added = [r.added_s for r in calm if r.added_s is not None]
    measures["goal: added <= 1 s, nothing to drain"] = (f"median {gi.fmt(median(added))} s, max {gi.fmt(max(added, default=None))} s over "
                                                        f"{len(added)} swap(s): {'met' if added and max(added) <= 1.0 else 'NOT met'}")  # fmt: skip
    expected = len(b.rows) == args.swaps + len(WARM_UP)
    good = (
        not failure
        and expected
        and all(r.ok for r in b.rows)
        and not lost
        and restarts == 0
        and frozen_ok == len(b.frozen)
    )
    problems = [p for p, bad in (
        (failure, bool(failure)), (f"{len(b.rows)} of {args.swaps + len(WARM_UP)} swaps done", not expected),
        (f"swaps not ok: {', '.join(r.label for r in b.rows if not r.ok)}", not all(r.ok for r in b.rows)),
        (f"{len(lost)} request(s) lost", bool(lost)), (f"{restarts} restart(s)", restarts > 0),
        (f"{len(b.frozen) - frozen_ok} frozen stream(s) not finished after their engine returned", frozen_ok != len(b.frozen)),
    ) if bad]  # fmt: skip
    result = (
        "every swap ok, no request lost, frozen streams finished after their engine returned, no restart"
        if good
        else "FAILED: " + "; ".join(problems)
    )
    summary = summarize(b.rows)
    if args.json:
        print(json.dumps({"swaps": [r.to_json() for r in b.rows], "summary": summary, "measures": measures, "frozen": b.frozen,
                          "sequence": sequence(args.pattern, args.swaps), "result": result, "ok": good}, indent=2))  # fmt: skip
    else:
        print(gi.table(["#", "swap", "overlap", "ok", *(name for name, _ in COLUMNS), "frozen", "notes"],
                       [[r.label, f"{r.from_model} -> {r.to_model}", r.overlap.value, "yes" if r.ok else "NO",
                         *(gi.fmt(get(r)) for _, get in COLUMNS), "-" if r.frozen is None else str(r.frozen), r.notes] for r in b.rows]))  # fmt: skip
        print()
        print(gi.table(["summary", "n", *(name for name, _ in COLUMNS)],
                       [[s["summary"], str(s["n"]), *(gi.fmt(s[name]) for name, _ in COLUMNS)] for s in summary]))  # fmt: skip
        print()
        print(gi.table(["measure", "value"], [[k, v] for k, v in measures.items()]))
        print("\nSeconds throughout. TTFT: the client's, from sending the request after the swap to its first token. total: the daemon's "
              "swap, from its decision\nuntil the router has the target routable; drain ... routing: where that time went (swap.last). "
              "added: total - checkpoint - restore,\nwhat r3090d adds beyond the driver's own calls; added-drain: that less the drain, "
              "which waits for the user's own requests.")  # fmt: skip
        print(f"result: {result}")
    return 0 if good else 1


def summarize(rows: list[SwapRow]) -> list[dict]:
    swaps = [r for r in rows if r.overlap is not Overlap.COLD]
    groups = [("all swaps", swaps), ("nothing to drain", [r for r in swaps if r.overlap in NOTHING_TO_DRAIN]),
              ("cold starts", [r for r in rows if r.overlap is Overlap.COLD])]  # fmt: skip
    out = []
    for name, group in groups:
        if not group:
            continue
        for how, fn in (("median", median), ("max", lambda v: max(v, default=None))):
            entry: dict = {"summary": f"{how}, {name}", "n": len(group)}
            for col, get in COLUMNS:
                value = fn([v for r in group if (v := get(r)) is not None])
                entry[col] = None if value is None else round(value, 4)
            out.append(entry)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--weight-gib",
        type=float,
        default=15.0,
        help="GiB of bf16 weights each engine's worker holds (default 15)",
    )
    parser.add_argument("--swaps", type=int, default=8, help="swaps after the warm-up (default 8)")
    parser.add_argument(
        "--pattern",
        default="ABACBAC",
        help="the models asked for, repeated (default ABACBAC: A, B, A, C, B, A, C, A, ...)",
    )
    parser.add_argument(
        "--token-delay", type=float, default=0.01, help="the double's seconds per token (default 0.01)"
    )
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU (default 0)")
    parser.add_argument("--budget", type=float, default=520.0, help="seconds for the whole run (default 520)")
    parser.add_argument("--json", action="store_true", help="print the tables as one JSON document")
    parser.add_argument(
        "--cpu-standin",
        action="store_true",
        help="dry run without a GPU: CPU workers, fake NVML and checkpoint driver",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (config, logs)")
    args = parser.parse_args()
    pattern = args.pattern.upper()
    if (
        set(pattern) - set(MODELS)
        or len(pattern) < 2
        or any(a == b for a, b in zip(pattern, pattern[1:] + pattern[0], strict=True))
    ):
        parser.error(
            "--pattern: letters A, B and C, no letter twice in a row (the last one followed by the first again)"
        )
    if args.swaps < 1 or args.weight_gib <= 0 or args.token_delay <= 0:
        parser.error("--swaps, --weight-gib and --token-delay must be positive")
    args.pattern = pattern
    return gi.run_cleanly("gpu_swap", "r3090d-gpu-swap-", bench, args)


if __name__ == "__main__":
    sys.exit(main())
