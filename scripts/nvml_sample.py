#!/usr/bin/env python3
"""Print one NVML reading of a GPU as r3090d sees it (JSON), with what it cost.

    python3 scripts/nvml_sample.py [--index N] [--polls K]

The JSON is the GpuSample r3090d's probe produced; tests/data holds such
captures from real cards, fed through preflight by the unit tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from r3090d.probes.nvml import NvmlMonitor, sample_to_dict  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--polls", type=int, default=20, help="extra polls to time (0 = just one reading)")
    args = parser.parse_args()
    monitor = NvmlMonitor(args.index, hung_after_s=10.0)
    t0 = time.perf_counter()
    first = monitor.wait_sample(30.0)
    first_s = time.perf_counter() - t0
    times = []
    sample = first
    for _ in range(args.polls):
        t = time.perf_counter()
        sample = monitor.wait_sample(30.0)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(1000):
        monitor.latest(time.monotonic())
    latest_us = (time.perf_counter() - t) / 1000 * 1e6
    monitor.close(join_s=5.0)
    out = sample_to_dict(sample)
    out["xid_errors"] = list(first.xid_errors) + list(out["xid_errors"])
    timing = {
        "first_reading_ms": round(first_s * 1000, 3),
        "poll_ms_median": round(sorted(times)[len(times) // 2] * 1000, 3) if times else None,
        "poll_ms_max": round(max(times) * 1000, 3) if times else None,
        "latest_call_us": round(latest_us, 2),
    }
    json.dump({"sample": out, "timing": timing}, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0 if sample.usable else 2


if __name__ == "__main__":
    sys.exit(main())
