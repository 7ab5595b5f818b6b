"""Helpers for tests that use the vLLM double: an engine python that "has vLLM", and a launcher.

`make_engine_python()` builds a private venv (no pip, and no system
site-packages: the double needs only the stdlib, and starts faster without
them) whose site-packages holds a .pth putting shim/ first on sys.path and a
`vllm-<version>.dist-info`. Its python then runs the double for
`-m vllm.entrypoints.openai.api_server` and answers r3090d.argv's version
probe (`python -I -c ...`: -I ignores PYTHONPATH but still reads .pth files).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from r3090d import procstat
from tests.waiting import wait_until

SHIM_DIR = Path(__file__).resolve().parent / "shim"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def make_engine_python(dest: Path, version: str = "0.32.0", base_python: str = sys.executable) -> Path:
    """A venv at `dest` whose python runs the double as vLLM `version`; returns that python.

    `base_python` matters under a hardened unit, which cannot see a python under /root.
    """
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(dest)], check=True, capture_output=True)
    python = dest / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True
    ).stdout.strip()
    site = Path(purelib)
    # First on sys.path, so a real vllm elsewhere on the system can never shadow the double.
    (site / "fakevllm_shim.pth").write_text(f"import sys; sys.path.insert(0, {str(SHIM_DIR)!r})\n")
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (dist / "INSTALLER").write_text("fakevllm\n")
    return python


_client: httpx.Client | None = None


def http() -> httpx.Client:
    """One pooled client for the whole test run: building an httpx client costs a third of a second here."""
    global _client
    if _client is None:
        _client = httpx.Client(timeout=5.0, trust_env=False)
    return _client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeVllm:
    """One double, launched with vLLM's argv in a session of its own (as a supervisor would)."""

    def __init__(self, python: str | Path, *extra_args: str, model: str = "/models/fake", served_model_name: str = "fake",
                 host: str = "127.0.0.1", port: int | None = None, shutdown_timeout: int | None = None,
                 env: dict[str, str] | None = None, log_path: Path | None = None):  # fmt: skip
        self.port = port or free_port()
        self.host = host
        self.served_model_name = served_model_name
        self.argv = [str(python), "-m", API_SERVER_MODULE, "--model", model, "--served-model-name", served_model_name,
                     "--host", host, "--port", str(self.port)]  # fmt: skip
        if shutdown_timeout is not None:
            self.argv += ["--shutdown-timeout", str(shutdown_timeout)]
        self.argv += list(extra_args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    # -- process
    def start(self) -> FakeVllm:
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def group_pids(self) -> set[int]:
        """Every live process in the double's process group, reparented orphans included."""
        return {p.pid for p in procstat.scan() if p.pgrp == self.proc.pid and p.live}

    def kill_all(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()

    # -- HTTP
    def wait_healthy(self, timeout: float = 10.0) -> float:
        """Seconds until /health answered 200; fails at once, with the double's output, if the double exits first."""
        start = time.monotonic()
        wait_until(
            self._healthy,
            timeout,
            what=f"/health 200 from {self.url}",
            ignoring=(httpx.TransportError,),
            details=self.output,
        )
        return time.monotonic() - start

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the double exited with {self.proc.returncode}:\n{self.output()}")
        return http().get(self.url + "/health", timeout=1.0).status_code == 200

    def control(self, **changes) -> dict:
        r = http().post(self.url + "/fake/control", json=changes)
        r.raise_for_status()
        return r.json()

    def state(self) -> dict:
        return http().get(self.url + "/fake/state").json()

    def request_log(self) -> list[dict]:
        return http().get(self.url + "/fake/requests").json()["requests"]


def sse_events(response: httpx.Response):
    """Yields (arrival time, payload) for each `data:` line of a stream; payloads JSON-decoded except "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield time.monotonic(), (payload if payload == "[DONE]" else json.loads(payload))


def read_sse(response: httpx.Response) -> list:
    return [payload for _, payload in sse_events(response)]
