"""Fault-to-restart latencies of the watchdog, against the vLLM double with a 1 s poll.

- KV leak: the double's metrics turn leak-shaped; target <= kv_low_polls x poll + 1 s.
- Hang: SIGSTOP of the API server (/health times out); target <= hang_timeout + 1 poll
  (+ the health timeout, since the first timed-out probe only ends then).
- Frozen engine: SIGSTOP of EngineCore (/health stays 200); detected by the active
  probe: probe_idle_seconds + probe_failures x probe_timeout + 1 poll.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.daemon_harness import DaemonProcess, api_server_pid, engine_config, write_config  # noqa: E402
from tests.fakevllm.harness import FakeVllm, make_engine_python  # noqa: E402

POLL = 1.0
TRIALS = 3
WATCHDOG = {
    "poll_interval": POLL,
    "health_timeout": 1.0,
    "metrics_timeout": 1.0,
    "min_free_blocks": 1000,
    "kv_low_polls": 5,
    "kv_cooldown": 0.0,
    "hang_timeout": 10.0,
    "probe_idle_seconds": 5.0,
    "probe_timeout": 3.0,
    "probe_failures": 2,
    "stall_seconds": 600.0,
    "backoff_initial": 0.0,
    "backoff_max": 0.0,
    "give_up_restarts": 1000,
}


def fault_kv(d, fake, pid):
    fake.control(metrics="leak", kv_usage=0.99)


def fault_hang(d, fake, pid):
    os.kill(api_server_pid(pid), signal.SIGSTOP)  # `pid` is the engine's launcher


def fault_frozen(d, fake, pid):
    os.kill(fake.state()["engine_core_pid"], signal.SIGSTOP)


CASES = [
    ("kv leak", fault_kv, "kv", WATCHDOG["kv_low_polls"] * POLL + 1.0),
    ("hang (SIGSTOP API server)", fault_hang, "hung", WATCHDOG["hang_timeout"] + WATCHDOG["health_timeout"] + POLL),
    (
        "frozen EngineCore",
        fault_frozen,
        "probe_failed",
        WATCHDOG["probe_idle_seconds"] + WATCHDOG["probe_failures"] * WATCHDOG["probe_timeout"] + POLL,
    ),
]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="r3090d-bench-") as tmp:
        tmp = Path(tmp)
        python = str(make_engine_python(tmp / "venv", "0.32.0"))
        d = DaemonProcess(write_config(tmp / "r3090d.toml", engine_config(tmp, python, watchdog=WATCHDOG)), tmp / "daemon.log").start()
        port = tomllib.loads((tmp / "r3090d.toml").read_text())["engine"]["port"]
        results = {}
        try:
            st = d.wait_ready(timeout=60)
            for name, inject, reason, target in CASES:
                lat, ready = [], []
                for _ in range(TRIALS):
                    pid, before = st["engine"]["pid"], st["restarts"]["total"]
                    time.sleep(2 * POLL)  # let the new engine settle past a poll or two
                    fake = FakeVllm(python, port=port)
                    t0 = time.time()
                    inject(d, fake, pid)
                    st = d.wait_for(lambda s, b=before: s["restarts"]["total"] > b and s, 120, name)
                    assert st["restarts"]["last_reason"] == reason, st["restarts"]
                    lat.append(st["restarts"]["last_at"] - t0)
                    st = d.wait_ready(timeout=60, generation_pid=pid)
                    ready.append(st["engine"]["ready_since"] - st["restarts"]["last_at"])
                results[name] = (lat, ready, target)
                print(f"{name}: detection {', '.join(f'{x:.2f}' for x in lat)} s", file=sys.stderr)
        finally:
            d.cleanup()
    print(f"watchdog fault-to-restart against the double, poll {POLL:.0f} s, {TRIALS} trials each:")
    for name, (lat, ready, target) in results.items():
        verdict = "met" if max(lat) <= target else "MISSED"
        print(
            f"  {name:28s} detection median {statistics.median(lat):5.2f} s, max {max(lat):5.2f} s "
            f"(target <= {target:.1f} s: {verdict}); restart to ready median {statistics.median(ready):.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
