"""The daemon's own share of an incident, against the vLLM double, under the shipped watchdog settings.

Run: python bench/bench_downtime.py [--rounds N]

Three intervals in which only the daemon works (median and p90 over N rounds, default 10):
  death -> spawn     SIGKILL of the API server -> the new engine process exists, at
                     backoff level 0 (a fresh daemon each round: its first restart;
                     timed by bench_respawn.time_respawn). Target <= 100 ms.
  health 200 -> READY  the first /health 200 (this script polls /health in a tight
                     loop from the spawn on) -> READY=1 on a NOTIFY_SOCKET this script
                     binds (a fresh daemon each round, as READY=1 goes out once), and
                     -> the state file's ready_since. The daemon polls /health every
                     0.1 s while the engine starts, so about 50 ms is expected.
  drained restart    `r3090ctl restart` (drained): the old API server's exit, and the
                     last process of its tree gone (both seen through pidfds) -> the new
                     engine process (a tight /proc scan). One daemon, N restarts (an
                     operator restart is not a failure: no backoff ever applies).
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from bench_respawn import time_respawn  # noqa: E402
from benchlib import ChildWatch, Daemon, ExitWatch, MomentWatch, fmt, median, p90, say  # noqa: E402

DEATH_TARGET_S = 0.100
STARTUP_DELAY = "1.0"  # the double's "model loading": /health refused for a second


class HealthPoller(MomentWatch):
    """GET /health as fast as the engine answers, until the first 200; `wait` returns when it arrived."""

    def __init__(self, port: int):
        self.port = port
        super().__init__("health-poller")

    def _watch(self) -> None:
        while not self._stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
            try:
                conn.request("GET", "/health")
                status = conn.getresponse().status
                now = time.time()
                if status == 200:
                    self.found = now
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.001)

    def _missed(self, timeout: float) -> str:
        return f"/health on port {self.port} never answered 200 within {timeout:.0f} s"


class NotifyListener:
    """A unix datagram socket standing in for systemd's notify socket; `ready_at` is when READY=1 arrived."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.ready_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="notify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            now = time.time()
            if self.ready_at is None and b"READY=1" in data.split(b"\n"):
                self.ready_at = now

    def close(self) -> None:
        self.sock.close()


def config(where: Path, python: str) -> Path:
    where.mkdir(parents=True)
    return benchlib.double_config(where, python, extra_args=["--fake-startup-delay", STARTUP_DELAY])


def death_rounds(rounds: int, tmp: Path, python: str) -> list[float]:
    out = []
    for i in range(rounds):
        d = Daemon(config(tmp / f"death{i}", python), tmp / f"death{i}.log").start()
        try:
            pid = d.wait_ready(60)["engine"]["pid"]
            latency, _ = time_respawn(psutil.Process(d.pid), pid)
            st = d.wait_for(lambda s: s["restarts"]["total"] >= 1 and s, 30, "the restart recorded")
            level, reason = st["restarts"]["backoff_level"], st["restarts"]["last_reason"]
            if level != 0:
                raise RuntimeError(f"round {i + 1}: the restart waited at backoff level {level}, not 0")
            out.append(latency)
            say(f"death -> spawn round {i + 1}: {latency * 1e3:.1f} ms ({reason}, backoff level {level})")
        finally:
            d.cleanup()
    return out


def ready_rounds(rounds: int, tmp: Path, python: str) -> tuple[list[float], list[float]]:
    to_ready1, to_ready_since = [], []
    for i in range(rounds):
        where = tmp / f"ready{i}"
        cfg = config(where, python)
        listener = NotifyListener(where / "notify.sock")
        d = Daemon(cfg, where / "daemon.log", notify_socket=str(listener.path))
        poller = HealthPoller(d.port)
        d.start()
        try:
            first_200 = poller.wait(60)
            st = d.wait_ready(30)
            deadline = time.monotonic() + 10
            while listener.ready_at is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if listener.ready_at is None:
                raise RuntimeError("no READY=1 on the notify socket")
            to_ready1.append(listener.ready_at - first_200)
            to_ready_since.append(st["engine"]["ready_since"] - first_200)
            say(f"health 200 -> READY round {i + 1}: READY=1 {to_ready1[-1] * 1e3:+.1f} ms, ready_since {to_ready_since[-1] * 1e3:+.1f} ms")
        finally:
            d.cleanup()
            listener.close()
    return to_ready1, to_ready_since


def ctl_argv() -> list[str]:
    found = shutil.which("r3090ctl", path=sysconfig.get_path("scripts"))  # beside this python, not first on PATH
    return [found] if found else [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]


def drained_rounds(rounds: int, tmp: Path, python: str) -> tuple[list[float], list[float], list[float]]:
    from_main, from_tree, ready_since = [], [], []
    cfg = config(tmp / "drained", python)
    d = Daemon(cfg, tmp / "drained.log").start()
    try:
        st = d.wait_ready(60)
        for i in range(rounds):
            pid = st["engine"]["pid"]
            tree = benchlib.group_members(pid)
            exits = [ExitWatch(p) for p in tree]
            main_exit = exits[tree.index(pid)]
            spawn = ChildWatch(d.pid)
            out = subprocess.run([*ctl_argv(), "restart", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise RuntimeError(f"r3090ctl restart failed ({out.returncode}): {out.stdout}{out.stderr}")
            new_pid, spawned = spawn.wait(60)
            poller = HealthPoller(d.port)
            main_at = main_exit.wait(10)
            tree_at = max(w.wait(10) for w in exits)
            from_main.append(spawned - main_at)
            from_tree.append(spawned - tree_at)
            first_200 = poller.wait(60)
            st = d.wait_ready(30, not_pid=pid)
            if st["engine"]["pid"] != new_pid:
                raise RuntimeError(f"the new engine is pid {st['engine']['pid']}, the scan saw {new_pid}")
            ready_since.append(st["engine"]["ready_since"] - first_200)
            say(
                f"drained restart round {i + 1}: exit -> spawn {from_main[-1] * 1e3:.1f} ms "
                f"(tree gone -> spawn {from_tree[-1] * 1e3:.1f} ms; {len(tree)} processes), ready_since {ready_since[-1] * 1e3:+.1f} ms"
            )
    finally:
        d.cleanup()
    return from_main, from_tree, ready_since


def row(name: str, values: list[float], target: float | None = None) -> list[str]:
    ms = [v * 1e3 for v in values]
    verdict = "-" if target is None else ("met" if median(values) <= target else "MISSED") + f" (median <= {target * 1e3:g} ms)"
    return [name, str(len(values)), fmt(median(ms), ".1f"), fmt(p90(ms), ".1f"), fmt(min(ms), ".1f"), fmt(max(ms), ".1f"), verdict]


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=10, help="rounds of each measurement (default 10)")
    args = cli.parse_args(argv)
    benchlib.exit_on_sigterm()

    from tests.fakevllm.harness import make_engine_python

    with tempfile.TemporaryDirectory(prefix="r3090d-down-") as tmp:
        tmp = Path(tmp)
        python = str(make_engine_python(tmp / "venv", "0.32.0"))
        wd = benchlib.watchdog_of(config(tmp / "wd", python))
        death = death_rounds(args.rounds, tmp, python)
        ready1, ready_since = ready_rounds(args.rounds, tmp, python)
        drained_main, drained_tree, drained_ready = drained_rounds(args.rounds, tmp, python)

    print(f"the daemon's share of an incident, against the double ({benchlib.describe_watchdog(wd)}), in ms:")
    print(benchlib.table(
        ["interval", "n", "median", "p90", "min", "max", "target"],
        [
            row("engine death -> new engine spawned (level 0)", death, DEATH_TARGET_S),
            row("first /health 200 -> READY=1", ready1),
            row("first /health 200 -> state ready_since", ready_since),
            row("drained: old API server exit -> spawn", drained_main),
            row("drained: old tree gone -> spawn", drained_tree),
            row("drained: first /health 200 -> ready_since", drained_ready),
        ],
    ))  # fmt: skip
    print("ready_since is the snapshot time of the tick that saw /health 200 (taken before its /health request), so it can precede the 200.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
