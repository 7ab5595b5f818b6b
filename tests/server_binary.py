"""A real server binary (Prometheus, Alertmanager) started for one test on 127.0.0.1.

Its output goes to a log file in the test's working folder, it is ready when GET
/-/ready answers 200, and a wait on it shows the log's tail when it times out.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Self, TypeVar

import httpx

from tests.daemon_harness import free_port
from tests.waiting import wait_until

T = TypeVar("T")

LOG_TAIL_CHARS = 3000  # of the server's log, in a failure's message
STOP_GRACE_S = 10.0  # after SIGTERM, before SIGKILL


class ServerBinary:
    """One server process on a free port of 127.0.0.1; a subclass says how to run it (argv)."""

    def __init__(self, name: str, workdir: Path):
        self.name = name
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name.lower()}.log"
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=self.url, trust_env=False, timeout=5.0)

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> Self:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        self.wait(self._ready, timeout, f"{self.name} ready")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(
                f"{self.name} exited {self.proc.returncode}:\n{self.log()[-LOG_TAIL_CHARS:]}"
            )
        try:
            return self.client.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
        """wait_until, with the server's own log in a timeout's message."""
        return wait_until(
            predicate, timeout, what=what, interval=interval, details=lambda: self.log()[-LOG_TAIL_CHARS:]
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()
