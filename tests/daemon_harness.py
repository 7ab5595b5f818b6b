"""Run the real daemon as a subprocess against a real (or double) engine.

Tests observe it the way an operator would: its state file, its log, the
process table. Nothing inside the daemon knows it is under test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from tests import waiting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int) -> int:
    """The first of n consecutive free ports on 127.0.0.1 (swap mode's engines take a block)."""
    for _ in range(50):
        base = free_port()
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def write_config(path: Path, sections: dict) -> Path:
    """sections: {"": {top-level keys}, "engine": {...}, "engine.env": {...}, ...}"""
    lines = []
    for key, value in sections.get("", {}).items():
        lines.append(f"{key} = {toml_value(value)}")
    for name, table in sections.items():
        if name == "":
            continue
        lines.append(f"\n[{name}]")
        for key, value in table.items():
            lines.append(f"{key} = {toml_value(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def engine_config(tmp_path: Path, engine_python: str, *, extra_args=(), engine=None, watchdog=None, alerts=None, daemon=None, top=None, env=None) -> dict:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    sections = {
        "": {"profile": "none", **(top or {})},
        "engine": {
            "python": engine_python,
            "model": str(model),
            "served_model_name": "fake-model",
            "port": free_port(),
            "shutdown_timeout": 5,
            "startup_timeout": 60,
            "extra_args": list(extra_args),
            **(engine or {}),
        },
        "gpu": {"required": False},
        "watchdog": {"poll_interval": 0.2, "health_timeout": 1.0, "metrics_timeout": 1.0, **(watchdog or {})},
        "alerts": {**(alerts or {})},
        "alerts.syslog": {"enabled": False},
        "daemon": {
            "state_dir": str(tmp_path / "state"),
            "runtime_dir": str(tmp_path / "run"),
            "exporter_enabled": False,
            **(daemon or {}),
        },
    }
    if env:
        sections["engine.env"] = env
    return sections


def ctrl_c_reaches_it() -> None:
    """preexec_fn for a child a test stops with SIGINT: the default disposition, as under a terminal.

    A test run started in the background of a shell ignores SIGINT, children inherit
    an ignored signal, and Python then never raises KeyboardInterrupt in them.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_state_file(path: Path, engine_groups: set[int] | None = None) -> dict | None:
    """A daemon's state document as JSON, or None while it is missing or half written. The engine's
    pid goes into `engine_groups` when given: a harness that kills what is left kills those groups."""
    try:
        st = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    pid = (st.get("engine") or {}).get("pid") if isinstance(st, dict) else None
    if pid and engine_groups is not None:
        engine_groups.add(pid)
    return st


def state_check(read_state, predicate, proc, what: str, log_tail, error: type[Exception] = AssertionError):
    """For wait_until: `predicate` of a daemon's state document; a part not there yet is "not yet",
    and the daemon's exit ends the wait at once with `error` and its log's tail."""

    def check():
        # Asked before the read: a state written just before the exit still counts.
        exited = proc.poll() is not None
        st = read_state()
        try:
            value = st is not None and predicate(st)
        except (KeyError, TypeError):  # a state without that part (yet)
            value = None
        if not value and exited:
            raise error(f"the daemon exited {proc.returncode} while waiting for {what}\n{log_tail()}")
        return value

    return check


class DaemonProcess:
    def __init__(self, config_path: Path, log_path: Path, *args: str):
        self.config_path = config_path
        self.log_path = log_path
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.state_path = None

    def start(self) -> DaemonProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "r3090d", "--config", str(self.config_path), *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "R3090D_CONFIG", "R3090D_INSTANCE")},
        )
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def state(self) -> dict | None:
        import tomllib

        cfg = tomllib.loads(self.config_path.read_text())
        return read_state_file(Path(cfg["daemon"]["state_dir"]) / "state.json")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.02):
        """Until `predicate(state)` is truthy; fails at once if the daemon exits first."""

        check = state_check(self.state, predicate, self.proc, what, lambda: self.log()[-4000:])
        return waiting.wait_until(
            check,
            timeout,
            what=what,
            interval=interval,
            details=lambda: f"state: {self.state()}\n{self.log()[-4000:]}",
        )

    def wait_ready(self, timeout: float = 30.0, generation_pid: int | None = None) -> dict:
        def ready(st):
            e = st["engine"]
            return st if e["phase"] == "ready" and e["pid"] and e["pid"] != generation_pid else None

        return self.wait_for(ready, timeout, "engine ready")

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def cleanup(self) -> None:
        """Teardown: stop the daemon, then kill anything it left behind (and fail loudly about it elsewhere)."""
        self.stop()
        self._log.close()


def group_members(pgid: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def api_server_pid(engine_pid: int) -> int:
    """vLLM's API server (or the double's): the one child of the engine's launcher, whose pid is the engine's."""
    (api,) = psutil.Process(engine_pid).children()
    return api.pid


def bind_unix_dgram(path: Path, timeout: float = 5.0) -> socket.socket:
    """A listening syslog-style socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(timeout)
    return sock
