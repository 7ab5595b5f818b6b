"""Crash-to-respawn latency: SIGKILL the engine's API server, time until the new engine process exists.

Runs the real daemon against the vLLM double (its engine-core grandchild is
orphaned by the kill, so every trial includes killing the orphan first) with no
backoff due. Prints the median and max over 20 trials.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.daemon_harness import DaemonProcess, api_server_pid, engine_config, write_config  # noqa: E402
from tests.fakevllm.harness import make_engine_python  # noqa: E402

TRIALS = 20


def time_respawn(daemon: psutil.Process, pid: int, timeout: float = 30.0) -> tuple[float, int]:
    """SIGKILL the engine's API server `pid`; seconds until the daemon's new engine process exists, and its pid."""
    t0 = time.perf_counter()
    os.kill(api_server_pid(pid), signal.SIGKILL)  # `pid` is the engine's launcher, the API server its child
    while time.perf_counter() - t0 < timeout:
        for child in daemon.children():
            if child.pid != pid and child.status() != psutil.STATUS_ZOMBIE:
                return time.perf_counter() - t0, child.pid
        time.sleep(0.0005)
    raise RuntimeError(f"no new engine within {timeout:.0f} s of killing pid {pid} (did the daemon give up? see its state file)")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="r3090d-bench-") as tmp:
        tmp = Path(tmp)
        python = str(make_engine_python(tmp / "venv", "0.32.0"))
        sections = engine_config(
            tmp,
            python,
            # No backoff is due: every restart is the first after a stable period. min_uptime 0
            # makes every engine count as stable at once; else each kill would be a start
            # failure, and two in a row with the same root-cause line give up.
            watchdog={"backoff_initial": 0.0, "backoff_max": 0.0, "give_up_restarts": 1000, "poll_interval": 2.0, "min_uptime": 0.0},
        )
        d = DaemonProcess(write_config(tmp / "r3090d.toml", sections), tmp / "daemon.log").start()
        daemon = psutil.Process(d.pid)
        latencies = []
        try:
            pid = d.wait_ready(timeout=60)["engine"]["pid"]
            for trial in range(TRIALS):
                latency, new = time_respawn(daemon, pid)
                latencies.append(latency)
                pid = d.wait_ready(timeout=60, generation_pid=pid)["engine"]["pid"]
                assert pid == new, (pid, new)
                print(f"trial {trial + 1:2d}: {latencies[-1] * 1000:7.1f} ms", file=sys.stderr)
        finally:
            d.cleanup()
    print(f"crash-to-respawn over {TRIALS} trials (poll interval 2 s, no backoff due):")
    print(f"  median {statistics.median(latencies) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms, min {min(latencies) * 1000:.1f} ms")
    print(f"  target: median <= 100 ms: {'met' if statistics.median(latencies) <= 0.1 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
