"""What the incident benchmarks share: the daemon as `python -m r3090d`, under the shipped watchdog settings.

Not a benchmark itself (`make bench` runs bench/bench_*.py only). The benchmarks
observe the daemon as an operator would: its state file, its log (each line
stamped to the millisecond), the process table and the engine's own HTTP
answers. The configs they write leave [watchdog] out entirely, so every
threshold is the shipped default; only paths, ports, the engine and
gpu.required (false: there is no GPU here) are set.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_idle import state_check  # noqa: E402
from r3090d import config as configmod  # noqa: E402
from r3090d import procstat  # noqa: E402
from r3090d.effectors import child as engine_child  # noqa: E402
from tests.daemon_harness import engine_config, read_state_file, write_config  # noqa: E402
from tests.waiting import WaitTimeout, wait_until  # noqa: E402

SHIPPED_CONFIG = ROOT / "etc" / "r3090d.toml"
TINY_MODEL = ROOT / "build" / "tiny-qwen2"
# The lock the real-vLLM tests hold (tests/e2e/conftest.py, VLLM_LOCK): one real vLLM at a time.
VLLM_LOCK = "/var/lock/r3090d-vllm.lock"
LONG_ENV = "R3090D_BENCH_LONG"  # "1": run the benchmarks that take minutes or need the real engine
ENGINE_NAMES = ("VLLM::EngineCore", "fake-EngineCore")  # vLLM's core process, and the double's


_LIVE: set[Daemon] = set()  # started and not yet cleaned up
_KILL_ON_EXIT: list[Callable[[], None]] = []  # what else exit_on_sigterm kills (an engine started directly)


def kill_on_exit(kill: Callable[[], None]) -> None:
    """Have exit_on_sigterm call `kill` (idempotent, quick) before it exits."""
    _KILL_ON_EXIT.append(kill)


def exit_on_sigterm() -> None:
    """On SIGTERM (a `timeout`, a CI cancel) kill every daemon and engine this process started, then exit.

    Scenario threads may be mid-trial, so nothing waits for them."""

    def handler(signum, frame):
        for d in list(_LIVE):
            d.kill_now()
        for kill in _KILL_ON_EXIT:
            kill()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def long_enabled() -> bool:
    return os.environ.get(LONG_ENV) == "1"


def say(text: str) -> None:
    """Progress, on stderr: stdout carries only the tables."""
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ configs


def watchdog_of(config_path: Path) -> configmod.WatchdogConfig:
    """The watchdog settings the daemon will run with, read the way it reads them."""
    return configmod.load(config_path, check_files=False).watchdog


def shipped_drift(config_path: Path) -> list[str]:
    """Keys whose value in etc/r3090d.toml's [watchdog] differs from what the daemon runs with."""
    shipped = tomllib.loads(SHIPPED_CONFIG.read_text())["watchdog"]
    effective = watchdog_of(config_path)
    return [f"{k}: etc/r3090d.toml {v!r}, daemon {getattr(effective, k)!r}" for k, v in shipped.items() if getattr(effective, k) != v]


def describe_watchdog(wd: configmod.WatchdogConfig) -> str:
    keys = ("poll_interval", "health_timeout", "metrics_timeout", "hang_timeout", "stall_seconds",
            "probe_idle_seconds", "probe_timeout", "probe_failures", "min_uptime")  # fmt: skip
    return ", ".join(f"{k} {getattr(wd, k):g}" for k in keys)


def double_config(tmp: Path, python: str, *, extra_args: Sequence[str] = (), engine: dict | None = None, daemon: dict | None = None,
                  watchdog: dict | None = None, gpu: dict | None = None) -> Path:
    """A daemon config for the vLLM double with the shipped [watchdog]: engine_config's fast test polls are dropped.

    `watchdog`: the only keys a benchmark shortens (it says so in its output); `gpu` replaces [gpu]."""
    sections = engine_config(tmp, python, extra_args=list(extra_args), engine=engine, daemon=daemon)
    del sections["watchdog"]
    if watchdog:
        sections["watchdog"] = dict(watchdog)
    if gpu is not None:
        sections["gpu"] = dict(gpu)
    return write_config(tmp / "r3090d.toml", sections)


# ------------------------------------------------------------------ the daemon

_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) ([\w.]+): (.*)$")


@dataclass(frozen=True)
class LogEvent:
    at: float  # wall clock
    level: str
    logger: str
    message: str


def log_events(text: str) -> list[LogEvent]:
    """The daemon's own lines in its output (not vLLM's, which it relays), with their wall-clock times."""
    out = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m and not m.group(3).startswith("r3090d.engine.vllm"):
            at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append(LogEvent(at, m.group(2), m.group(3), m.group(4)))
    return out


class Daemon:
    """`python -m r3090d --config F` in a subprocess, logging to a file.

    Every engine process group it is seen to own is remembered, so that cleanup
    leaves nothing behind even when the daemon itself has to be killed."""

    def __init__(self, config_path: Path, log_path: Path, notify_socket: str | None = None, args: Sequence[str] = ()):
        self.config_path = config_path
        self.args = tuple(args)  # more of the daemon's command line (--skip-preflight)
        self.log_path = log_path
        self.notify_socket = notify_socket
        cfg = tomllib.loads(config_path.read_text())
        self.state_path = Path(cfg["daemon"]["state_dir"]) / "state.json"
        self.port = cfg["engine"]["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = cfg["engine"].get("served_model_name") or cfg["engine"]["model"]
        self.proc: subprocess.Popen | None = None
        self.engine_groups: set[int] = set()
        self._log = None

    def start(self) -> Daemon:
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "R3090D_CONFIG", "R3090D_INSTANCE")}
        if self.notify_socket:
            env["NOTIFY_SOCKET"] = self.notify_socket
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed by cleanup)
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "r3090d", "--config", str(self.config_path), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        _LIVE.add(self)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def state(self) -> dict | None:
        return read_state_file(self.state_path, self.engine_groups)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[LogEvent]:
        """The daemon's own log lines (not vLLM's, which it relays), with their wall-clock times."""
        return log_events(self.log_text())

    def first_event(self, prefix: str, after: float = 0.0) -> LogEvent | None:
        # Log stamps are whole milliseconds: allow one below `after`.
        return next((e for e in self.events() if e.message.startswith(prefix) and e.at >= after - 0.001), None)

    def wait_for(self, predicate: Callable[[dict], object], timeout: float, what: str, interval: float = 0.02):
        check = state_check(self.state, predicate, self.proc, what, lambda: self.log_text()[-3000:], RuntimeError)
        try:
            return wait_until(check, timeout, what=what, interval=interval)
        except WaitTimeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.log_text()[-3000:]}") from None

    def wait_ready(self, timeout: float, not_pid: int | None = None) -> dict:
        def ready(st):
            e = st["engine"]
            return st if e["phase"] == "ready" and e["pid"] and e["pid"] != not_pid else None

        return self.wait_for(ready, timeout, "engine ready")

    def wait_event(self, prefix: str, after: float, timeout: float) -> LogEvent:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            event = self.first_event(prefix, after)
            if event is not None:
                return event
            time.sleep(0.05)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for the log line {prefix!r}\n{self.log_text()[-3000:]}")

    def stop(self, timeout: float = 40.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                say(f"daemon {self.proc.pid} did not stop within {timeout:.0f} s: SIGKILL")
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        self.state()
        self.engine_groups |= set(children_of(self.pid))
        self.stop()
        self._kill_engine_groups(quiet=False)
        _LIVE.discard(self)
        if self._log is not None:
            self._log.close()

    def kill_now(self) -> None:
        """SIGKILL the daemon and every engine group it was seen to own (its engine runs in a session of its own)."""
        self.engine_groups |= set(children_of(self.pid))
        if self.proc.poll() is None:
            self.proc.kill()
        self._kill_engine_groups(quiet=True)

    def _kill_engine_groups(self, quiet: bool) -> None:
        for pgid in self.engine_groups:
            if group_members(pgid):
                if not quiet:
                    say(f"killing engine group {pgid}, left behind")
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def group_members(pgid: int) -> list[int]:
    return list(engine_child.group_members(pgid))


def children_of(parent: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(parent).children()]
    except psutil.NoSuchProcess:
        return []


def engine_core_pid(api_pid: int) -> int:
    """The engine-core process under an API server: VLLM::EngineCore, or the double's fake-EngineCore."""
    import psutil

    for child in psutil.Process(api_pid).children(recursive=True):
        try:
            if child.name() in ENGINE_NAMES:
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError(f"no {' or '.join(ENGINE_NAMES)} under pid {api_pid}")


class MomentWatch:
    """A thread that watches for one moment; `wait` returns what it saw (`found`), or raises saying what was missed."""

    def __init__(self, name: str):
        self.found = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        raise NotImplementedError

    def _missed(self, timeout: float) -> str:
        raise NotImplementedError

    def wait(self, timeout: float):
        self._thread.join(timeout)
        self._stop.set()
        if self.found is None:
            raise RuntimeError(self._missed(timeout))
        return self.found


class ChildWatch(MomentWatch):
    """Times the first new child of `parent` to appear, by a tight scan of /proc in a thread.

    Cheaper than psutil's children() (which reads every process's stat each time):
    only pids not seen before are read."""

    def __init__(self, parent: int, interval: float = 0.0005):
        self.parent = parent
        self.interval = interval
        self.seen: set[str] = set(os.listdir("/proc"))
        super().__init__("child-watch")  # found: (pid, when)

    def _watch(self) -> None:
        while not self._stop.is_set():
            names = os.listdir("/proc")
            now = time.time()
            for name in names:
                if name in self.seen or not name.isdigit():
                    continue
                self.seen.add(name)
                st = procstat.read(int(name))
                if st is not None and st.ppid == self.parent:
                    self.found = (int(name), now)
                    return
            time.sleep(self.interval)

    def _missed(self, timeout: float) -> str:
        return f"no new child of pid {self.parent} within {timeout:.0f} s"


class ExitWatch:
    """The moment a process ends (not when it is reaped), through a pidfd: works for any process."""

    def __init__(self, pid: int):
        import select

        self.pid = pid
        self.at: float | None = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.at = time.time()
            return

        def run():
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll()
            self.at = time.time()
            os.close(fd)

        self._thread = threading.Thread(target=run, name=f"exit-watch-{pid}", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> float:
        if self.at is None:
            self._thread.join(timeout)
        if self.at is None:
            raise RuntimeError(f"pid {self.pid} still running after {timeout:.0f} s")
        return self.at


# ------------------------------------------------------------------ load


class Streams:
    """n concurrent streaming completions, each re-sent when it ends, until stop()."""

    def __init__(self, url: str, model: str, n: int, *, max_tokens: int, prompt: str | list[int] = "hello", repeat: bool = True):
        self.url, self.model, self.n, self.max_tokens, self.prompt, self.repeat = url, model, n, max_tokens, prompt, repeat
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"stream-{i}", daemon=True) for i in range(n)]
        self.started = self.finished = self.failed = 0
        self.last_error = ""
        self._lock = threading.Lock()

    def start(self) -> Streams:
        for t in self._threads:
            t.start()
        return self

    def _run(self) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.8}
        with httpx.Client(timeout=httpx.Timeout(10.0, read=120.0), trust_env=False) as client:
            while not self._stop.is_set():
                with self._lock:
                    self.started += 1
                ok = False
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            self.last_error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                        for line in resp.iter_lines():
                            if self._stop.is_set():
                                break
                            if line == "data: [DONE]":
                                ok = resp.status_code == 200
                except httpx.HTTPError as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if ok:
                        self.finished += 1
                    else:
                        self.failed += 1
                if not self.repeat:
                    return
                if not ok:
                    self._stop.wait(0.5)  # the engine is down or restarting: no busy loop

    def stop(self, join: float = 0.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(join)


# ------------------------------------------------------------------ numbers


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def p90(values: Sequence[float]) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------ the real engine


def real_engine_missing(python: str | None = None, model: Path | None = None) -> str | None:
    """Why the real CPU vLLM (`python`, default $R3090D_ENGINE_PYTHON or the installed engine) cannot run
    the tiny model (`model`, default build/tiny-qwen2) here, or None."""
    from tests.e2e.real_vllm import ENGINE_PYTHON_ENV, engine_python_path

    python = python or engine_python_path()
    model = model or TINY_MODEL
    if not os.access(python, os.X_OK):
        return f"no CPU vLLM engine: {python} is not an executable (run `make engine`, or set {ENGINE_PYTHON_ENV})"
    if not (model / "config.json").exists():
        return f"no tiny model at {model} (run `make tiny-model`)"
    return None


def skipped_long_real(name: str, what: str) -> bool:
    """True, having said why, when a long benchmark on the real engine (`what`: its runs and length)
    does not run here: it is opt-in, and needs the CPU vLLM."""
    if not long_enabled():
        print(f"{name} skipped: {what}; set {LONG_ENV}=1 to run it")
        return True
    missing = real_engine_missing()
    if missing:
        print(f"{name} skipped: {missing}")
    return missing is not None


class VllmLock:
    """flock on the e2e tests' lock file, so two real vLLMs never share the 2 cores."""

    def __enter__(self):
        self._f = open(VLLM_LOCK, "a")  # noqa: SIM115
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for {VLLM_LOCK}: another real vLLM is running")
            fcntl.flock(self._f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self._f.close()


def real_config(tmp: Path, *, extra_args: Sequence[str] = (), kv_space_gib: int | None = 1, overrides: dict | None = None,
                engine_python: str | None = None, model: Path | None = None) -> Path:
    """A daemon config for the engine-bound tiny model on the real CPU vLLM, shipped [watchdog].

    engine_python and model default to $R3090D_ENGINE_PYTHON (else the installed engine) and build/tiny-qwen2."""
    from tests.e2e.real_vllm import CPU_EXTRA_ARGS, ENGINE_BOUND_ARGS, engine_python_path, write_vllm_config

    over = {"engine": {"extra_args": [*CPU_EXTRA_ARGS, *ENGINE_BOUND_ARGS, *extra_args]}}
    for key, value in (overrides or {}).items():
        over[key] = {**over.get(key, {}), **value}
    return write_vllm_config(
        tmp / "r3090d.toml", engine_python=engine_python or engine_python_path(), model=model or TINY_MODEL, directory=tmp,
        kv_space_gib=kv_space_gib, overrides=over,
    )  # fmt: skip


def scrape(url: str, timeout: float = 5.0) -> str:
    return httpx.get(url + "/metrics", timeout=timeout, trust_env=False).text


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
