"""Five recoverable faults in a row against a real vLLM on CPU, with the shipped watchdog defaults.

Each fault comes once the engine has been ready for longer than min_uptime, so
none is a start failure: each must be restarted at once (backoff level 0), and
the daemon must never give up. Prints, per fault: the reason the daemon gave,
fault -> restart decided, fault -> ready again. About 5 minutes on 2 cores.

Opt-in (it takes minutes): R3090D_BENCH_LONG=1. Skipped with a message when the
CPU engine is not installed (make engine).
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.daemon_harness import DaemonProcess, api_server_pid  # noqa: E402
from tests.e2e.real_vllm import engine_python_path, engine_tree, write_vllm_config  # noqa: E402

MIN_UPTIME = 10.0
READY_TIMEOUT = 420.0


FAULTS = [
    ("SIGKILL of the API server", lambda main: os.kill(api_server_pid(main), signal.SIGKILL)),
    ("SIGKILL of EngineCore", lambda main: os.kill(engine_tree(main)["VLLM::EngineCore"], signal.SIGKILL)),
    ("SIGSTOP of EngineCore (frozen, idle)", lambda main: os.kill(engine_tree(main)["VLLM::EngineCore"], signal.SIGSTOP)),
    ("SIGSTOP of the API server (hung)", lambda main: os.kill(api_server_pid(main), signal.SIGSTOP)),
    ("SIGKILL of the Worker", lambda main: os.kill(engine_tree(main)["VLLM::Worker"], signal.SIGKILL)),
]


def main() -> int:
    if os.environ.get("R3090D_BENCH_LONG") != "1":
        print("skipped: five faults against a real vLLM take about 5 minutes; set R3090D_BENCH_LONG=1")
        return 0
    python = engine_python_path()
    model = REPO / "build" / "tiny-qwen2"
    if not Path(python).exists() or not (model / "config.json").exists():
        print(f"skipped: needs the CPU engine ({python}) and the tiny model ({model}): make engine tiny-model")
        return 0
    work = Path(tempfile.mkdtemp(prefix="r3090d-faults-"))
    cfg = write_vllm_config(work / "r3090d.toml", engine_python=python, model=model,
                            overrides={"watchdog": {"min_uptime": MIN_UPTIME}})  # fmt: skip
    d = DaemonProcess(cfg, work / "daemon.log").start()
    rows = []
    try:
        st = d.wait_ready(timeout=READY_TIMEOUT)
        for name, inject in FAULTS:
            while time.time() - st["engine"]["ready_since"] < MIN_UPTIME + 1:
                time.sleep(0.2)
            main = st["engine"]["pid"]
            t_fault = time.time()
            inject(main)
            restarted = d.wait_for(lambda s, t=t_fault: s if (s["restarts"]["last_at"] or 0) > t else None, 120, "a restart")
            st = d.wait_ready(timeout=READY_TIMEOUT, generation_pid=main)
            rows.append((name, restarted["restarts"]["last_reason"], restarted["restarts"]["last_at"] - t_fault,
                         st["engine"]["ready_since"] - t_fault, restarted["restarts"]["backoff_level"]))  # fmt: skip
        gave_up = st["give_up_reason"]
    finally:
        d.cleanup()
    print(f"{'fault':40} {'reason':10} {'restart after':>14} {'ready after':>12} {'backoff':>8}")
    for name, reason, detect, ready, level in rows:
        print(f"{name:40} {reason:10} {detect:12.1f} s {ready:10.1f} s {level:8d}")
    print(f"median fault -> restart decided: {statistics.median(r[2] for r in rows):.1f} s; "
          f"fault -> ready again: {statistics.median(r[3] for r in rows):.1f} s; give-up: {gave_up or 'none'}")  # fmt: skip
    return 0 if len(rows) == len(FAULTS) and not gave_up and all(r[4] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
