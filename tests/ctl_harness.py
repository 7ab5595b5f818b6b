"""Helpers for control-plane tests: a real daemon with the vLLM double, driven through r3090ctl.

`r3090ctl` runs as its own process, exactly as an operator or a monitoring
plugin runs it; the daemon runs as `python -m r3090d`. Unix socket paths are
limited to 107 bytes, so runtime directories live in short /tmp names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import DaemonProcess, engine_config, free_port, write_config

CTL = [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]


def ctl(config: Path, *args: str, timeout: float = 60.0, user: str | None = None) -> subprocess.CompletedProcess:
    argv = [*CTL, *args, "--config", str(config)]
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def ctl_json(config: Path, *args: str) -> tuple[int, dict]:
    out = ctl(config, *args, "--json")
    try:
        return out.returncode, json.loads(out.stdout)
    except ValueError:
        raise AssertionError(f"r3090ctl {' '.join(args)} --json printed no JSON (rc {out.returncode}):\n{out.stdout}\n{out.stderr}") from None


class Daemon:
    """One daemon under test: its config, process, exporter URL and the engine port."""

    def __init__(self, tmp: Path, engine_python: str, *, name: str = "d", extra_args=(), watchdog=None, engine=None, daemon=None, exporter=True, args=()):
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="r3090d-", dir="/tmp"))
        self.exporter_port = free_port() if exporter else None
        sections = engine_config(
            self.dir,
            engine_python,
            extra_args=extra_args,
            engine=engine,
            watchdog=watchdog,
            daemon={
                "runtime_dir": str(self.runtime_dir),
                "exporter_enabled": exporter,
                **({"exporter_port": self.exporter_port} if exporter else {}),
                **(daemon or {}),
            },
        )
        self.sections = sections
        self.engine_port = sections["engine"]["port"]
        self.config = write_config(self.dir / "r3090d.toml", sections)
        self.proc = DaemonProcess(self.config, self.dir / "daemon.log", *args)

    def start(self, prefix: list[str] | None = None) -> Daemon:
        """Start the daemon; `prefix` runs it under a wrapper (setpriv, say)."""
        if not prefix:
            self.proc.start()
            return self
        self.proc._log = open(self.proc.log_path, "ab")  # noqa: SIM115  (closed by DaemonProcess.cleanup)
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "R3090D_CONFIG", "R3090D_INSTANCE")}
        argv = [*prefix, sys.executable, "-m", "r3090d", "--config", str(self.config), *self.proc.args]
        self.proc.proc = subprocess.Popen(argv, stdout=self.proc._log, stderr=subprocess.STDOUT, env=env)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exporter_url(self) -> str:
        return f"http://127.0.0.1:{self.exporter_port}"

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    def rewrite(self, **section_changes) -> None:
        """Rewrite the config file with some sections' keys changed: rewrite(watchdog={...})."""
        for name, changes in section_changes.items():
            self.sections[name] = {**self.sections.get(name, {}), **changes}
        write_config(self.config, self.sections)

    def log(self) -> str:
        return self.proc.log()

    def state(self) -> dict | None:
        return self.proc.state()

    def wait_ready(self, timeout: float = 30.0, old_pid: int | None = None) -> dict:
        return self.proc.wait_ready(timeout=timeout, generation_pid=old_pid)

    def wait_phase(self, phase: str, timeout: float = 30.0) -> dict:
        return self.proc.wait_for(lambda st: st if st["engine"]["phase"] == phase else None, timeout, f"phase {phase}", interval=0.01)

    def fake(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.engine_url + path, timeout=5.0, trust_env=False, **kw)

    def healthz(self) -> tuple[int, str]:
        r = httpx.get(self.exporter_url + "/healthz", timeout=2.0, trust_env=False)
        return r.status_code, r.text.strip()

    def cleanup(self) -> None:
        if self.proc.proc is not None:
            self.proc.cleanup()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


@pytest.fixture
def make_daemon(tmp_path, fake_engine_python):
    made: list[Daemon] = []

    def make(**kw) -> Daemon:
        kw.setdefault("name", f"d{len(made)}")
        d = Daemon(tmp_path, fake_engine_python, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()
