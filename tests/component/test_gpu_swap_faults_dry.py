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


class Asked:
    """A request as longest_unserved reads it: sent, ended, served or not."""

    def __init__(self, sent_at: float, ended_at: float, ok: bool = True):
        self.sent_at, self.ended_at, self.ok, self.finished = sent_at, ended_at, ok, True


@pytest.mark.parametrize(
    ("requests", "longest"),
    [
        (
            [Asked(0, 3), Asked(1, 5), Asked(10, 12)],
            3.0,
        ),  # asked 0-5 (served at 3 and 5), then 10-12: the first wait
        (
            [Asked(0, 2), Asked(1, 40, ok=False), Asked(30, 41)],
            39.0,
        ),  # a failure serves nothing: from 2 to 41
        ([Asked(0, 70, ok=False)], 70.0),  # asked all along, never served
        ([Asked(0, 1), Asked(100, 101)], 1.0),  # not asked between: no starvation there
    ],  # fmt: skip
)
def test_the_longest_stretch_asked_without_one_served(requests, longest):
    from bench.gpu_swap_faults import longest_unserved

    assert longest_unserved(requests) == pytest.approx(longest)
