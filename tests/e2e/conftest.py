"""Fixtures for the real-systemd tests: a booted systemd, `make install`, locks, test files.

Test files live under TEST_ROOT (/var/lib/r3090d-test), never under /tmp: the
namespaced systemd has a private /tmp, and the hardened unit a private one again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.real_vllm import engine_python, vllm_config_writer  # noqa: F401  (fixtures for real-vLLM tests)
from tests.e2e.systemd_ns import NamespacedSystemd, unavailable_reason
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TEST_ROOT = Path("/var/lib/r3090d-test")
NS_SOURCE = TEST_ROOT / "src"  # a copy of the checkout that the namespace can see
LOG_DIR = TEST_ROOT / "log"
SYSTEMD_LOCK = "/var/lock/r3090d-systemd.lock"
VLLM_LOCK = "/var/lock/r3090d-vllm.lock"
DEBIAN_PYTHON = "/usr/bin/python3"
UNITDIR = "/usr/local/lib/systemd/system"
PREFIX = "/opt/r3090d"
DROPIN_ROOT = "/run/systemd/system"  # runtime drop-ins: they vanish with the namespace


def _lock(path: str, what: str):
    """An exclusive flock(2) on `path`, held until the returned file is closed."""
    f = open(path, "a")  # noqa: SIM115
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"waiting for {path} ({what})", file=sys.stderr)
        fcntl.flock(f, fcntl.LOCK_EX)
    return f


@pytest.fixture(scope="session")
def systemd_ns():
    """A real systemd as PID 1 in its own PID and mount namespace, powered off at the end."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(TEST_ROOT, 0o755)
    # Two booted systemds would share /var/lib, /etc and the network: one at a time.
    lock = _lock(SYSTEMD_LOCK, "another namespaced systemd is running")
    ns = NamespacedSystemd(LOG_DIR / "systemd-console.log")
    # systemd-tmpfiles empties /tmp at boot: this file proves it emptied the private one only.
    sentinel = Path(f"/tmp/r3090d-host-tmp-sentinel-{os.getpid()}")
    sentinel.write_text("the namespaced systemd must not see this\n")
    try:
        took = ns.boot()
        print(f"systemd booted in {took:.1f} s (host pid {ns.pid})")
        assert sentinel.exists(), "the host's /tmp was touched by the namespaced systemd's boot"
        yield ns
    finally:
        clean = ns.poweroff()
        lock.close()
        sentinel.unlink(missing_ok=True)
        if not clean:
            print("systemd did not power off in time and was killed", file=sys.stderr)


def copy_source() -> Path:
    """The checkout's files under TEST_ROOT, where the namespace and the service user see them.

    The checkout itself may be under /tmp or /var/tmp (private tmpfs in the
    namespace) or under /root or /home (hidden by ProtectHome=)."""
    if NS_SOURCE.exists():
        shutil.rmtree(NS_SOURCE)
    shutil.copytree(
        REPO,
        NS_SOURCE,
        symlinks=True,
        ignore=shutil.ignore_patterns(".git", "build", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "*.egg-info", "*.whl", ".venv*"),
    )
    subprocess.run(["chmod", "-R", "a+rX", str(NS_SOURCE)], check=True)
    return NS_SOURCE


def make_install(ns: NamespacedSystemd, source: Path) -> tuple[int, str]:
    """`make install` of `source`, run inside the namespace so that its daemon-reload reaches that systemd:
    its exit status and output."""
    out = ns.nsenter(["make", "-C", str(source), "install"], timeout=900, check=False)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="session")
def ns_source() -> Path:
    return copy_source()


@pytest.fixture(scope="session")
def installed(systemd_ns, ns_source):
    """`make install`, run inside the namespace so that its daemon-reload reaches our systemd."""
    start = time.monotonic()
    code, text = make_install(systemd_ns, ns_source)
    assert code == 0, f"make install failed:\n{text}"
    assert "install: systemctl daemon-reload" in text, text
    print(f"make install took {time.monotonic() - start:.1f} s")
    return text


@pytest.fixture(scope="module")
def vllm_lock():
    """Real vLLM runs one at a time on this machine (2 cores)."""
    lock = _lock(VLLM_LOCK, "another real vLLM is running")
    yield
    lock.close()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random-weight Qwen2, where the service user can read it."""
    path = TEST_ROOT / "tiny-qwen2"
    script = REPO / "scripts" / "make_tiny_model.py"
    config = path / "config.json"
    if not config.exists() or config.stat().st_mtime < script.stat().st_mtime:
        subprocess.run([sys.executable, str(script), str(path)], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(TEST_ROOT)], check=True)
    return path


def write_public(path: Path, text: str) -> Path:
    """A file the service user (r3090) can read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o644)
    return path


class Unit:
    """A unit under test: its drop-in, its output file, and the usual questions."""

    def __init__(self, ns: NamespacedSystemd, name: str, log_name: str):
        self.ns = ns
        self.name = name
        self.log = LOG_DIR / log_name
        self.dropin = f"{DROPIN_ROOT}/{name}.d/50-test.conf"

    def configure(self, config: Path | None, *extra_lines: str) -> None:
        """The test drop-in: where the output goes, which config, plus `extra_lines`.
        It never touches the shipped hardening."""
        self.log.unlink(missing_ok=True)
        lines = [
            "[Service]",
            # The journal cannot be relied on in the namespace: the output goes to a file
            # that PID 1 opens, so the hardened unit needs no write access to it.
            f"StandardOutput=append:{self.log}",
            "StandardError=inherit",
        ]
        if config is not None:
            lines.append(f"Environment=R3090D_CONFIG={config}")
        lines += list(extra_lines)
        self.ns.write_file(self.dropin, "\n".join(lines) + "\n")
        self.ns.ctl("daemon-reload")

    def reset(self) -> None:
        self.ns.ctl("stop", self.name, check=False, timeout=180)
        self.ns.ctl("reset-failed", self.name, check=False)

    def remove(self) -> None:
        self.reset()
        self.ns.remove_file(self.dropin)
        self.ns.ctl("daemon-reload")

    def show(self, *props: str) -> dict[str, str]:
        return self.ns.show(self.name, *props)

    def state(self) -> str:
        return self.show("ActiveState")["ActiveState"]

    def main_pid(self) -> int | None:
        """r3090d's host pid, or None."""
        ns_pid = int(self.show("MainPID")["MainPID"])
        return self.ns.host_pid(ns_pid) if ns_pid else None

    def pids(self) -> set[int]:
        return self.ns.unit_pids(self.name)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return "(no output file)"

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.25):
        """wait_until, with the unit's properties, journal and output in a timeout's message."""
        return wait_until(
            predicate, timeout, what=f"{self.name}: {what}", interval=interval, details=self.describe
        )

    def describe(self) -> str:
        props = self.show("ActiveState", "SubState", "Result", "ExecMainStatus", "NRestarts", "MainPID")
        return f"{props}\n--- journal ---\n{self.ns.journal(self.name)[-3000:]}\n--- output ---\n{self.output()[-6000:]}"


@pytest.fixture
def unit_factory(systemd_ns, installed):
    """unit(name, log_name) -> Unit; every unit is stopped and its drop-in removed at
    teardown, and its output and journal are printed (pytest shows them on failure)."""
    made: list[Unit] = []

    def make(name: str, log_name: str | None = None) -> Unit:
        unit = Unit(systemd_ns, name, log_name or f"{name}.log")
        made.append(unit)
        return unit

    yield make
    for unit in made:
        print(f"===== {unit.name}\n{unit.describe()}")
        unit.remove()
