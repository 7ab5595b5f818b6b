"""Time from a frozen engine to the daemon's `gpu_idle` restart, on a real NVIDIA GPU.

For a host with an NVIDIA GPU, nvidia-ml-py and torch with CUDA; elsewhere it
says so in one line and exits 69. Not run by `make bench` (which runs
bench/bench_*.py only). From the repository root:

    python3 bench/gpu_idle.py [--rounds 3] [--polls 2,0.5] [--weight-gib 2] [--gpu 0]
    python3 bench/gpu_idle.py --cpu-standin     # dry run of the plumbing, no GPU needed

The engine (bench/gpu_engine_standin.py) is the vLLM double (tests/fakevllm)
for HTTP, plus a torch worker in the same process group running a decode-like
loop on the GPU: 28 bf16 GEMVs over --weight-gib GiB per step, one synchronize
per step. The daemon (`python3 -m r3090d --skip-preflight`) runs it with
gpu.required = true, gpu.card = "any", the shipped watchdog settings except
poll_interval, exporter and syslog off, in a temporary directory. A fresh
daemon per --polls value, and again after start_failures - 1 rounds: each
round's restart comes within min_uptime of ready, a start failure to it.

Each round: wait for the engine ready, its worker computing, --streams long
streaming completions running (`vllm:num_requests_running` > 0) and the daemon
using the GPU signal (state file `watch.gpu_signal_off` empty while NVML reads
the GPU busy); then SIGSTOP the worker. Measured from the SIGSTOP:
  NVML 0% after  the first utilization reading of 0, polling NVML every 50 ms here;
  detection      the state file's restarts.last_at (the snapshot time of the
                 tick that decided the restart), with restarts.last_reason.
The daemon then restarts the engine, which starts a fresh worker: next round.

If the daemon does not take up the GPU signal (another process on the GPU,
NVML listing pids from another PID namespace, memory used outside the engine),
it prints the daemon's reason, measures only the NVML side, and exits 69.

--cpu-standin: the worker is a light CPU loop and NVML is tests/fakenvml,
driven from here (utilization 100 % unless the worker is stopped, the workers
listed as the GPU's processes), so the whole path up to the restart can be
checked on a host without a GPU. Its NVML figures say nothing about a GPU.

r3090d imports sdnotify; where it is not installed, the daemon gets a no-op
stub module on its PYTHONPATH (it is never called: NOTIFY_SOCKET is unset).

Progress goes to stderr, the table to stdout. Exit 0 when every round ended in
a gpu_idle restart, 1 when one did not, 69 when this host cannot run it.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # r3090d from this checkout, installed or not
from r3090d import procstat  # noqa: E402
from tests.daemon_harness import read_state_file, state_check, toml_value  # noqa: E402
from tests.waiting import WaitTimeout, wait_until  # noqa: E402

STANDIN = ROOT / "bench" / "gpu_engine_standin.py"
FAKE_NVML_DIR = ROOT / "tests" / "fakenvml"
EX_UNAVAILABLE = 69
NVML_POLL_S = 0.05
MODEL_NAME = "gpu-idle"
TOKEN_DELAY_S = 0.05  # the double's step: slow enough that 3 streams neither load the CPU nor fill the KV cache
STREAM_TOKENS = 30000  # under the double's max_model_len: a stream outlives any round
POLL_ACCESS = re.compile(r'"GET /(health|metrics) HTTP')
DAEMON_DEPS = ("click", "psutil", "httpx", "prometheus_client")
SDNOTIFY_STUB = '''"""No-op stand-in for sdnotify, written by bench/gpu_idle.py: NOTIFY_SOCKET is unset, so r3090d never calls it."""


class SystemdNotifier:
    def notify(self, state):
        return None
'''


class Unavailable(Exception):
    """This host cannot run the benchmark: one line, exit 69."""


class OutOfTime(Exception):
    """The overall time budget ran out."""


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Budget:
    """One deadline for the whole run: every wait is bounded by it."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cap(self, timeout: float) -> float:
        left = self.left()
        if left <= 0:
            raise OutOfTime("the time budget (--budget) ran out")
        return min(timeout, left)


# ------------------------------------------------------------------ processes


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a live process, None when it is gone."""
    st = procstat.read(pid)
    return (st.state, st.pgrp) if st is not None else None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def group_members(pgid: int) -> list[int]:
    from r3090d.effectors.child import group_members as members

    return list(members(pgid))


def ours(pid: int) -> bool:
    """A process of the engine this script runs (guards against a recycled pid)."""
    line = cmdline(pid)
    return any(mark in line for mark in ("gpu_engine_standin", "vllm.entrypoints.openai.api_server", "fake-EngineCore", "fake-Worker"))


@dataclass(frozen=True)
class Worker:
    pid: int
    status: dict


def workers(status_dir: Path) -> list[Worker]:
    """Live workers that have reported, newest status each."""
    out = []
    for path in status_dir.glob("worker-*.json"):
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        st = proc_stat(status["pid"])
        if st is not None and st[0] != "Z":
            out.append(Worker(status["pid"], status))
    return out


# ------------------------------------------------------------------ NVML


class NvmlPoller:
    """Utilization of one GPU every NVML_POLL_S, in a thread, with wall-clock stamps."""

    def __init__(self, nvml, index: int):
        self.nvml = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=20000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-poller", daemon=True)

    def start(self) -> NvmlPoller:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(NVML_POLL_S):
            try:
                util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
            except Exception:  # one failed reading is a gap in the samples, not the end of the poller
                continue
            self.samples.append((time.time(), int(util)))

    def first_zero_after(self, t0: float) -> float | None:
        return next((t - t0 for t, u in list(self.samples) if t >= t0 and u == 0), None)

    def first_busy_after(self, t0: float) -> float | None:
        return next((t - t0 for t, u in list(self.samples) if t >= t0 and u > 0), None)

    def latest(self) -> int | None:
        return self.samples[-1][1] if self.samples else None

    def processes(self) -> list[tuple[int, int | None]]:
        """(pid, MiB) of the GPU's compute and graphics processes, as NVML names them."""
        out = []
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs = getattr(self.nvml, fn + "_v3", None) or getattr(self.nvml, fn)
                for p in procs(self.handle):
                    used = getattr(p, "usedGpuMemory", None)
                    out.append((int(p.pid), None if used is None else used // 2**20))
            except (self.nvml.NVMLError, AttributeError):
                pass
        return out

    def memory_used_mib(self) -> int | None:
        try:
            return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used // 2**20
        except self.nvml.NVMLError:
            return None

    def stop(self) -> None:
        self._stop.set()


class FakeCard:
    """The dry run's GPU (tests/fakenvml): busy while a worker runs, 0 % once every worker is stopped."""

    WORKER_MIB = 2048

    def __init__(self, path: Path, status_dir: Path):
        self.path = path
        self.status_dir = status_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-card", daemon=True)
        self.write()

    def start(self) -> FakeCard:
        self._thread.start()
        return self

    def off_the_card(self) -> set[int]:
        """Workers the card does not list (a subclass's: those checkpointed by the fake driver)."""
        return set()

    def write(self) -> None:
        off = self.off_the_card()
        live = [(w.pid, (proc_stat(w.pid) or ("Z", 0))[0]) for w in workers(self.status_dir) if w.pid not in off]
        card = {
            "name": "NVIDIA H200 (fake, dry run)", "memory_total_mib": 143771, "memory_reserved_mib": 500,
            "driver": "580.65.06", "cuda": 13000, "cc": [9, 0], "persistence": True,
            "util": 100 if any(state != "T" for _, state in live) else 0,
            "processes": [[pid, self.WORKER_MIB] for pid, _ in live],
            "memory_used_mib": self.WORKER_MIB * len(live),
        }  # fmt: skip
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(card))
        os.replace(tmp, self.path)  # the daemon's reads never see half a card

    def _run(self) -> None:
        while not self._stop.wait(NVML_POLL_S):
            self.write()

    def stop(self) -> None:
        self._stop.set()


def load_nvml(dry_run: bool, card_path: Path | None):
    if dry_run:
        os.environ["R3090D_FAKE_NVML"] = str(card_path)
        sys.path.insert(0, str(FAKE_NVML_DIR))
    try:
        import pynvml
    except ImportError:
        raise Unavailable("pynvml (nvidia-ml-py) is not installed: this benchmark needs an NVIDIA GPU and its NVML") from None
    return pynvml


def check_host(args, nvml) -> str:
    """A one-line description of the GPU; raises Unavailable when this host cannot run the benchmark."""
    missing = [m for m in DAEMON_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        raise Unavailable(f"the daemon's dependencies are missing for {sys.executable}: {', '.join(missing)}")
    try:
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as exc:
        raise Unavailable(f"NVML cannot start ({exc}): no NVIDIA GPU or driver on this host") from None
    if args.gpu >= count:
        raise Unavailable(f"no GPU at NVML index {args.gpu} ({count} found); pick one with --gpu")
    name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(args.gpu))
    name = name.decode() if isinstance(name, bytes) else name
    if args.cpu_standin:
        return f"{name}, CPU stand-in worker"
    # In a child: this process must not become a CUDA user of the GPU itself.
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(args.gpu)}
    code = "import torch; print(torch.__version__, torch.cuda.is_available())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        raise Unavailable("`import torch` did not finish within 120 s") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise Unavailable(f"torch is not usable for {sys.executable}: {last}")
    version, available = out.stdout.split()[-2:]
    if available != "True":
        raise Unavailable(f"torch {version} sees no CUDA device (CUDA_VISIBLE_DEVICES={args.gpu})")
    return f"{name}, torch {version}"


# ------------------------------------------------------------------ load


class Streams:
    """Long streaming completions, so that the engine reports requests running."""

    def __init__(self, url: str, n: int):
        self.url = url
        self.n = n
        self.stop_event = threading.Event()
        self.chunks = 0
        self.responses = []
        self.threads = [threading.Thread(target=self._one, name=f"stream-{i}", daemon=True) for i in range(n)]

    def start(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def _one(self) -> None:
        body = {"model": MODEL_NAME, "prompt": "the engine keeps generating", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
        import httpx

        try:
            # trust_env=False: loopback, never through a proxy
            with httpx.Client(trust_env=False, timeout=httpx.Timeout(60.0, connect=5.0)) as client, \
                    client.stream("POST", self.url + "/v1/completions", json=body) as r:  # fmt: skip
                self.responses.append(r)
                for line in r.iter_lines():
                    if self.stop_event.is_set():
                        return
                    if line.startswith("data: {"):
                        self.chunks += 1
        except Exception:  # the engine is killed under it: the stream's end is expected, not an error
            return

    def stop(self) -> None:
        self.stop_event.set()
        for r in list(self.responses):
            try:
                r.close()
            except Exception:
                pass


# ------------------------------------------------------------------ the daemon


class DaemonRun:
    """One `python3 -m r3090d` with its config, state file and log, in a directory of its own."""

    def __init__(self, base: Path, poll: float, serial: int, args, env: dict[str, str]):
        self.dir = base / f"poll-{poll:g}-{serial}"
        self.dir.mkdir(mode=0o700)
        self.poll = poll
        self.status_dir = base / "workers"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = self.dir / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        sections = {
            "": {"profile": "none"},
            "engine": {"python": str(base / "engine-python"), "model": str(model), "served_model_name": MODEL_NAME,
                       "host": "127.0.0.1", "port": self.port, "shutdown_timeout": 2, "startup_timeout": 120,
                       "extra_args": ["--fake-token-delay", str(TOKEN_DELAY_S)]},
            "gpu": {"required": True, "index": args.gpu, "card": "any"},
            "watchdog": {"poll_interval": poll},
            "alerts.syslog": {"enabled": False},
            "daemon": {"state_dir": str(self.dir / "state"), "runtime_dir": str(self.dir / "run"), "exporter_enabled": False},
        }  # fmt: skip
        lines = []
        for name, values in sections.items():
            if name:
                lines.append(f"\n[{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        self.config = self.dir / "r3090d.toml"
        self.config.write_text("\n".join(lines) + "\n")
        self.state_path = self.dir / "state" / "state.json"
        self.log_path = self.dir / "daemon.log"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.engine_groups: set[int] = set()

    def watchdog(self):
        from r3090d import config as configmod

        return configmod.load(self.config, check_files=False).watchdog

    def start(self) -> DaemonRun:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "r3090d", "--config", str(self.config), "--skip-preflight"],
                                         cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        return self

    def log_tail(self, n: int = 40) -> str:
        """The daemon's last lines, without the engine's access lines for the daemon's own polls."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join([line for line in lines if not POLL_ACCESS.search(line)][-n:])

    def state(self) -> dict | None:
        return read_state_file(self.state_path, self.engine_groups)

    def wait(self, predicate: Callable[[dict], object], timeout: float, what: str, budget: Budget):
        try:
            return wait_until(state_check(self.state, predicate, self.proc, what, self.log_tail, RuntimeError), budget.cap(timeout), what=what)
        except WaitTimeout:
            if budget.left() <= 0:
                raise OutOfTime(f"the time budget (--budget) ran out while waiting for {what}") from None
            raise RuntimeError(f"no {what} within {timeout:.0f} s; the daemon's log ends:\n{self.log_tail()}") from None

    def wait_ready(self, budget: Budget, not_pid: int | None) -> int:
        def ready(st):
            e = st["engine"]
            return e["pid"] if e["phase"] == "ready" and e["pid"] and e["pid"] != not_pid else None

        return self.wait(ready, 120, "engine ready", budget)

    def restart_line(self, after_total: int) -> str:
        """The daemon's `engine restart:` log line for the restart numbered after_total + 1."""
        found = re.findall(r"engine restart: (.*)", self.log_path.read_text(errors="replace"))
        return found[after_total] if len(found) > after_total else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(25)
            except subprocess.TimeoutExpired:
                say(f"daemon {self.proc.pid} did not stop within 25 s: SIGKILL")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for pgid in self.engine_groups:
            members = [p for p in group_members(pgid) if ours(p)]
            if members:
                say(f"engine group {pgid} outlived the daemon ({members}): SIGKILL")
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


# ------------------------------------------------------------------ rounds


@dataclass(frozen=True)
class Row:
    round: int
    poll: float
    offset_s: float | None  # SIGSTOP this long after a tick's state write
    nvml_zero_s: float | None
    detection_s: float | None
    reason: str


class SignalOff(Exception):
    """The daemon does not use the GPU's view on this host; str() is its reason."""


def wait_worker(run: DaemonRun, pgid: int, budget: Budget, timeout: float = 150.0) -> Worker:
    """The engine's worker, once it has reported two advancing step counts."""
    start = time.monotonic()
    deadline = start + budget.cap(timeout)
    seen: dict[int, int] = {}
    while time.monotonic() < deadline:
        # The stand-in starts the worker before it execs the double, so by ready it exists.
        if time.monotonic() - start > 5 and not any("--worker" in cmdline(p) for p in group_members(pgid)):
            raise RuntimeError(f"the engine's worker (group {pgid}) has exited; the daemon's log (with the engine's output) ends:\n{run.log_tail()}")
        for w in workers(run.status_dir):
            st = proc_stat(w.pid)
            if st is None or st[1] != pgid:
                continue
            steps = w.status.get("steps", 0)
            if w.pid in seen and steps > seen[w.pid]:
                return w
            seen.setdefault(w.pid, steps)
        if run.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited {run.proc.returncode}; its log ends:\n{run.log_tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"the engine's worker (group {pgid}) did not start computing within {timeout:.0f} s; "
                       f"the daemon's log (with the engine's output) ends:\n{run.log_tail()}")  # fmt: skip


def wait_signal_on(run: DaemonRun, pgid: int, budget: Budget) -> None:
    """Two ticks in a row with the GPU signal in use and NVML reading the GPU busy; SignalOff if it never is."""
    timeout = max(20.0, 8 * run.poll)
    deadline = time.monotonic() + budget.cap(timeout)
    good, last_written, why = 0, None, "no state written yet"
    while time.monotonic() < deadline:
        st = run.state()
        if st is not None and st["written_at"] != last_written and st["engine"]["pid"] == pgid:
            last_written = st["written_at"]
            why = st["watch"]["gpu_signal_off"]
            busy = (st["gpu"].get("utilization_gpu") or 0) > 0
            good = good + 1 if not why and busy else 0
            if why is None:
                why = "gpu.required is false"
            elif not why and not busy:
                why = f"NVML reads the GPU {st['gpu'].get('utilization_gpu')} % busy while the worker computes"
            if good >= 2:
                return
        time.sleep(0.02)
    raise SignalOff(why)


def one_round(run: DaemonRun, rnd: int, prev_pid: int | None, poller: NvmlPoller, args, budget: Budget) -> tuple[Row, int]:
    wd = run.watchdog()
    pgid = run.wait_ready(budget, prev_pid)
    worker = wait_worker(run, pgid, budget)
    extra = f", {worker.status['step_ms']:.2f} ms/step" if "step_ms" in worker.status else ""
    say(f"round {rnd}: engine {pgid} ready, worker {worker.pid} computing{extra}")
    streams = Streams(run.url, args.streams).start()
    try:
        run.wait(lambda st: st["engine"]["pid"] == pgid and (st["metrics"]["running"] or 0) > 0, 30, "requests running", budget)
        wait_signal_on(run, pgid, budget)
        st = run.state()
        before = st["restarts"]["total"]
        # Where in the daemon's tick the freeze lands decides up to a poll of the delay:
        # the rounds spread it evenly over the tick (wait_signal_on returns just after one).
        offset = (rnd - 0.5) / args.rounds * run.poll
        time.sleep(offset)
        say(f"round {rnd}: {st['metrics']['running']:.0f} running, GPU {st['gpu']['utilization_gpu']} % busy, signal in use: "
            f"SIGSTOP worker {worker.pid}, {offset:.2f} s after a tick")  # fmt: skip
        t_stop = time.time()
        os.kill(worker.pid, signal.SIGSTOP)
        timeout = wd.gpu_idle_stall_seconds + 4 * wd.poll_interval + 15
        try:
            st = run.wait(lambda s: s if s["restarts"]["total"] > before else None, timeout, "restart", budget)
        except RuntimeError as exc:
            try:
                os.kill(worker.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            last = run.state() or {}
            say(f"round {rnd}: {exc}\n  last state: running {last.get('metrics', {}).get('running')}, "
                f"gpu_signal_off {last.get('watch', {}).get('gpu_signal_off')!r}, "
                f"NVML {last.get('gpu', {}).get('utilization_gpu')} %")  # fmt: skip
            return Row(rnd, run.poll, offset, poller.first_zero_after(t_stop), None, "none"), pgid
        detection = st["restarts"]["last_at"] - t_stop
        reason = st["restarts"]["last_reason"]
        say(f"round {rnd}: restart {reason} after {detection:.2f} s: {run.restart_line(before)}")
        return Row(rnd, run.poll, offset, poller.first_zero_after(t_stop), detection, reason), pgid
    finally:
        streams.stop()


def nvml_only(run: DaemonRun, pgid: int, poller: NvmlPoller, args, budget: Budget) -> list[Row]:
    """The GPU signal is off: still measure how soon NVML reads 0 % after a SIGSTOP."""
    rows = []
    for rnd in range(1, args.rounds + 1):
        worker = wait_worker(run, pgid, budget)
        t_stop = time.time()
        os.kill(worker.pid, signal.SIGSTOP)
        deadline = time.monotonic() + budget.cap(5.0)
        while poller.first_zero_after(t_stop) is None and time.monotonic() < deadline:
            time.sleep(NVML_POLL_S)
        rows.append(Row(rnd, run.poll, None, poller.first_zero_after(t_stop), None, "n/a (signal off)"))
        t_cont = time.time()
        os.kill(worker.pid, signal.SIGCONT)
        deadline = time.monotonic() + budget.cap(5.0)
        while poller.first_busy_after(t_cont) is None and time.monotonic() < deadline:
            time.sleep(NVML_POLL_S)
    return rows


def diagnose(run: DaemonRun, poller: NvmlPoller) -> str:
    st = run.state() or {}
    pgid = st.get("engine", {}).get("pid")
    group = group_members(pgid) if pgid else []
    procs = poller.processes()
    lines = [f"  the engine's process group {pgid}: pids {group}",
             f"  NVML's processes on the GPU (pid, MiB): {procs or 'none'}; memory used {poller.memory_used_mib()} MiB",
             f"  the daemon's view: {st.get('gpu', {}).get('processes')}"]  # fmt: skip
    if procs and not {p for p, _ in procs} & set(group):
        lines.append("  none of NVML's pids is in the engine's group: NVML likely reports pids of another PID namespace (a container)")
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def sweep(base: Path) -> None:
    """SIGKILL whatever this run started and is still there: the daemons and engines (their command
    lines name `base`: the config, the model directory) by process group, and the workers."""
    mine = os.getpgid(0)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and str(base) in cmdline(int(entry.name)):
            st = proc_stat(int(entry.name))
            if st is not None and st[1] != mine:
                say(f"cleanup: process group {st[1]} ({cmdline(int(entry.name))[:80]}) is still there: SIGKILL")
                try:
                    os.killpg(st[1], signal.SIGKILL)
                except ProcessLookupError:
                    pass
    if (base / "workers").exists():
        for w in workers(base / "workers"):
            if ours(w.pid):
                os.kill(w.pid, signal.SIGKILL)


def write_engine_python(base: Path, args) -> Path:
    status_dir = base / "workers"
    status_dir.mkdir()
    env = {"GPU_IDLE_WORKER": "cpu" if args.cpu_standin else "torch", "GPU_IDLE_WEIGHT_GIB": str(args.weight_gib),
           "GPU_IDLE_STATUS_DIR": str(status_dir)}  # fmt: skip
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    path = base / "engine-python"
    path.write_text(f"#!/bin/sh\n# The engine python r3090d launches: see bench/gpu_engine_standin.py.\n"
                    f"exec env {exports} {shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} \"$@\"\n")  # fmt: skip
    path.chmod(0o755)
    return path


def daemon_env(base: Path, dry_run: bool) -> tuple[dict[str, str], list[str]]:
    notes = []
    # The caller's PYTHONPATH may carry r3090d's dependencies (where they cannot be
    # installed); never a fake NVML, which only a dry run puts first.
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "fakenvml" not in p]
    paths = [str(ROOT), *inherited]
    if importlib.util.find_spec("sdnotify") is None:
        stub = base / "stubs" / "sdnotify"
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text(SDNOTIFY_STUB)
        paths.insert(0, str(stub.parent))
        notes.append(f"sdnotify is not installed: the daemon imports a no-op stub from {stub.parent} (NOTIFY_SOCKET unset)")
    if dry_run:
        paths.insert(0, str(FAKE_NVML_DIR))
        notes.append("dry run: CPU worker, fake NVML (tests/fakenvml) driven from here; NVML figures say nothing about a GPU")
    drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "R3090D_CONFIG", "R3090D_INSTANCE", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env, notes


def report(rows: list[Row], wd_stall: float) -> str:
    out = [list(map(str, (r.round, f"{r.poll:g}", fmt(r.offset_s), fmt(r.nvml_zero_s), fmt(r.detection_s), r.reason))) for r in rows]
    for poll in dict.fromkeys(r.poll for r in rows):
        mine = [r for r in rows if r.poll == poll]
        zeros = [r.nvml_zero_s for r in mine if r.nvml_zero_s is not None]
        dets = [r.detection_s for r in mine if r.detection_s is not None]
        out.append(["median", f"{poll:g}", "", fmt(statistics.median(zeros) if zeros else None),
                    fmt(statistics.median(dets) if dets else None), ""])  # fmt: skip
    text = table(["round", "poll_interval (s)", "stop after tick (s)", "NVML 0% after (s)", "detection (s)", "reason"], out)
    notes = ["detection: SIGSTOP of the worker to the state file's restarts.last_at (the deciding tick's snapshot).",
             "stop after tick: the SIGSTOP's offset from the previous tick's state write (spread over the tick).",
             "Expected: the rule fires ceil(gpu_idle_stall_seconds / poll) polls after the first tick whose NVML sample",
             "reads 0 %; that tick comes up to two polls after the freeze (the daemon's NVML sampler runs on its own",
             "poll_interval period, so the sample a tick uses can be a poll old), plus NVML's own lag (NVML 0% after):"]  # fmt: skip
    for poll in dict.fromkeys(r.poll for r in rows):
        floor = math.ceil(wd_stall / poll - 1e-9) * poll
        notes.append(f"  poll_interval {poll:g} s: {floor:g} to {floor + 2 * poll:g} s, plus NVML's lag")
    return text + "\n\n" + "\n".join(notes)


def bench(args, base: Path, cleanup: list[Callable[[], None]]) -> int:
    card_path = base / "fake-nvml.json" if args.cpu_standin else None
    nvml = load_nvml(args.cpu_standin, card_path)
    write_engine_python(base, args)
    if args.cpu_standin:
        card = FakeCard(card_path, base / "workers").start()
        cleanup.append(card.stop)
    gpu = check_host(args, nvml)
    env, notes = daemon_env(base, args.cpu_standin)
    poller = NvmlPoller(nvml, args.gpu).start()
    cleanup.append(poller.stop)
    say(f"GPU {args.gpu}: {gpu}; worker weights {args.weight_gib:g} GiB; {args.streams} streams; budget {args.budget:.0f} s")
    for note in notes:
        say(note)
        print(f"note: {note}")
    foreign = poller.processes()
    if foreign and not args.cpu_standin:
        say(f"warning: the GPU already has processes {foreign}: the daemon will not use the GPU signal while they run")
    budget = Budget(args.budget)
    rows: list[Row] = []
    stall = 5.0
    failed = False
    try:
        for poll in args.polls:
            first, daemons = 1, 0
            while first <= args.rounds:
                daemons += 1
                run = DaemonRun(base, poll, daemons, args, env)
                cleanup.append(run.stop)
                wd = run.watchdog()
                stall = wd.gpu_idle_stall_seconds
                # Each round's restart comes within min_uptime of ready, so it is a start failure
                # to the daemon, which gives up at start_failures in a row: a fresh daemon before that.
                last = min(args.rounds, first + max(1, wd.start_failures - 1) - 1)
                say(f"daemon: poll_interval {wd.poll_interval:g} s, gpu_idle_stall_seconds {wd.gpu_idle_stall_seconds:g}, "
                    f"gpu_foreign_margin_mib {wd.gpu_foreign_margin_mib}, rounds {first}-{last} (config {run.config})")  # fmt: skip
                run.start()
                prev = None
                for rnd in range(first, last + 1):
                    try:
                        row, prev = one_round(run, rnd, prev, poller, args, budget)
                    except SignalOff as exc:
                        pgid = (run.state() or {}).get("engine", {}).get("pid")
                        print(f"the daemon does not use the GPU signal on this host: {exc}")
                        print(diagnose(run, poller))
                        say("measuring the NVML side only")
                        rows += nvml_only(run, pgid, poller, args, budget)
                        print(report(rows, stall))
                        print(f"gpu_idle: detection not measurable here: the daemon's watch.gpu_signal_off says {exc!s}")
                        return EX_UNAVAILABLE
                    rows.append(row)
                    if row.reason != "gpu_idle":
                        failed = True
                    if row.detection_s is None:
                        break  # the engine was never restarted: this daemon's rounds cannot go on
                run.stop()
                cleanup.remove(run.stop)
                if rows[-1].detection_s is None:
                    break
                first = last + 1
    except OutOfTime as exc:
        say(str(exc))
        failed = True
    except RuntimeError as exc:
        say(f"error: {exc}")
        failed = True
    if rows:
        print(report(rows, stall))
    print("result: " + ("every round ended in a gpu_idle restart" if not failed and rows else "NOT every round ended in a gpu_idle restart"))
    return 1 if failed or not rows else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="SIGSTOPs per poll interval (default 3)")
    parser.add_argument("--polls", default="2,0.5", help="watchdog.poll_interval values, one daemon each (default 2,0.5)")
    parser.add_argument("--weight-gib", type=float, default=2.0, help="GiB of bf16 weights the worker reads per step (default 2)")
    parser.add_argument("--streams", type=int, default=3, help="long streaming completions kept open (default 3)")
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU (default 0)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run (default 330)")
    parser.add_argument("--cpu-standin", action="store_true", help="dry run without a GPU: CPU worker, fake NVML")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (configs, logs)")
    args = parser.parse_args()
    try:
        args.polls = [float(p) for p in args.polls.split(",") if p.strip()]
    except ValueError:
        parser.error(f"--polls: {args.polls!r} is not a comma-separated list of seconds")
    if args.rounds < 1 or args.streams < 1 or args.weight_gib <= 0 or not args.polls:
        parser.error("--rounds, --streams, --weight-gib and --polls must be positive")

    return run_cleanly("gpu_idle", "r3090d-gpu-idle-", bench, args)


def run_cleanly(name: str, prefix: str, bench_fn: Callable, args) -> int:
    """`bench_fn(args, base, cleanup)` in a fresh temporary directory; whatever ends it, undo what it started.

    Ctrl-C, SIGTERM (`timeout`) and SIGHUP (SIGINT even where it came in ignored)
    end the run through the finally below, which runs the cleanup steps newest
    first, kills what is left of the run's processes and removes the directory
    (kept with --keep).
    """

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    base = Path(tempfile.mkdtemp(prefix=prefix))
    cleanup: list[Callable[[], None]] = []
    try:
        return bench_fn(args, base, cleanup)
    except Unavailable as exc:
        print(f"{name}: {exc}")
        return EX_UNAVAILABLE
    except KeyboardInterrupt:
        say("interrupted: stopping everything this run started")
        return 130
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        for step in reversed(cleanup):
            try:
                step()
            except Exception as exc:  # one failed step must not leave the others undone
                say(f"cleanup: {exc}")
        sweep(base)
        if args.keep:
            say(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
