"""bench/gpu_swap_faults.py's dry run (--cpu-standin): swap mode under faults, with CPU workers, the fake NVML and
the fake checkpoint driver, end to end through the real daemon, router and HTTP clients. The GPU run is the same
script on a GPU host; this keeps its plumbing (every phase, its checks, its verdict) working between those runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.component

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "gpu_swap_faults.py"
BOUND_S = 420  # about a minute here; three engines, a router and five clients on a loaded 2-core machine


def test_the_swap_faults_bench_passes_its_dry_run():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, str(BENCH), "--cpu-standin"],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env=env,
        cwd=ROOT,
    )
    verdicts = [line for line in r.stdout.splitlines() if line.startswith("verdict:")]
    shown = (
        f"stdout:\n{r.stdout[-6000:]}\nstderr (no engine lines):\n"
        + "\n".join(line for line in r.stderr.splitlines()[-400:] if "[vllm]" not in line)[-6000:]
    )
    assert len(verdicts) == 1 and verdicts[0].startswith("verdict: passed"), shown
    assert r.returncode == 0, shown
    for phase in ("parked engine killed", "router killed during a swap", "gives up, then its retry", "load"):
        assert any(
            line.startswith("phase ") and phase in line and line.endswith(": ok")
            for line in r.stdout.splitlines()
        ), shown
