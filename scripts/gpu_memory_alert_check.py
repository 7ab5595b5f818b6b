"""On a machine with an NVIDIA GPU: the memory alert fires and resolves for real.

Runs the daemon (with the vLLM double as its engine, since no CPU vLLM is
needed for this) against the real GPU through NVML, allocates memory with
torch until NVML reads above the alert threshold, then frees it. Prints a
transcript: NVML's readings, the daemon's alert lines from a syslog socket it
writes to, and the daemon's state.

    python3 scripts/gpu_memory_alert_check.py [--margin-mib 4096]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from r3090d.probes.nvml import read_gpu  # noqa: E402
from r3090d.units import MIB  # noqa: E402
from tests.daemon_harness import DaemonProcess, engine_config, write_config  # noqa: E402
from tests.fakevllm.harness import make_engine_python  # noqa: E402

T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:7.2f} s] {text}", flush=True)


def used_mib() -> float:
    return read_gpu(0, 5.0).memory_used / MIB


def syslog_lines(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(65536).decode(errors="replace"))
        except (TimeoutError, BlockingIOError):
            return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--margin-mib", type=int, default=4096, help="threshold above the memory used at start")
    args = ap.parse_args()
    import torch

    base = used_mib()
    threshold = int(base + args.margin_mib)
    say(f"NVML: {read_gpu(0, 5.0).name}, memory used {base:.0f} MiB; alert threshold {threshold} MiB")
    with tempfile.TemporaryDirectory(prefix="r3090d-gpu-") as tmp:
        tmp = Path(tmp)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(tmp / "log.sock"))
        sock.settimeout(0.2)
        python = str(make_engine_python(tmp / "venv", "0.32.0"))
        sections = engine_config(
            tmp,
            python,
            watchdog={"poll_interval": 0.5, "gpu_memory_alert_mib": threshold, "probe_idle_seconds": 600},
            alerts={"hysteresis_polls": 2, "min_interval": 0.0},
        )
        sections["gpu"] = {"required": True, "card": "any", "index": 0}
        sections["alerts.syslog"] = {"enabled": True, "address": str(tmp / "log.sock")}
        d = DaemonProcess(write_config(tmp / "r3090d.toml", sections), tmp / "daemon.log", "--skip-preflight").start()
        try:
            st = d.wait_ready(timeout=60)
            say(f"daemon ready; its GPU sample: {st['gpu']['name']}, used {st['gpu']['memory_used'] / MIB:.0f} MiB")
            blocks = []
            while used_mib() <= threshold + 512:
                blocks.append(torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda"))
                torch.cuda.synchronize()
            say(f"allocated {len(blocks)} GiB with torch; NVML reads {used_mib():.0f} MiB")
            st = d.wait_for(lambda s: "gpu_memory" in s["alerts"]["firing"] and s, 30, "gpu_memory firing")
            say(f"state: gpu_memory FIRING: {st['alerts']['firing']['gpu_memory']['summary']}")
            for line in syslog_lines(sock):
                say(f"syslog: {line}")
            del blocks
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            say(f"freed; NVML reads {used_mib():.0f} MiB")
            st = d.wait_for(lambda s: "gpu_memory" not in s["alerts"]["firing"] and s, 30, "gpu_memory resolved")
            time.sleep(0.5)
            for line in syslog_lines(sock):
                say(f"syslog: {line}")
            say(f"state: firing alerts now {sorted(st['alerts']['firing'])}")
            import subprocess

            ctl = [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]
            out = subprocess.run([*ctl, "status", "--config", str(d.config_path)], capture_output=True, text=True, timeout=60)
            say(f"r3090ctl status exit {out.returncode}:\n{out.stdout}{out.stderr}")
            print(json.dumps({"threshold_mib": threshold, "base_mib": base}))
        finally:
            code = d.stop()
            say(f"daemon stopped, exit {code}")
            print("--- daemon log (alert lines) ---")
            for line in d.log().splitlines():
                if "alert" in line or "ready" in line:
                    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
