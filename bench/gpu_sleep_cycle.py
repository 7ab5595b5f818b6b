"""Sleep and wake cycles of the stand-in worker's weights alone (bench/gpu_sleep_worker.py), without the daemon.

Prints one JSON line per step: the worker's report (timings; the first sleep's pinned allocation apart), the
device memory free before and after (torch.cuda.mem_get_info), and whether the weights came back intact
(a checksum over every weight). Level 1 cycles first, then a level-2 cycle with its reload, then one
corrupting wake, which must change the checksum.

    python bench/gpu_sleep_cycle.py [--weight-gib 2] [--cycles 3] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_sleep_worker as gsw  # noqa: E402

LAYERS = 28


def torch_weights(gib: float, seed: int):
    import torch

    d = max(128, int((gib * 2**30 / LAYERS / 2) ** 0.5) // 128 * 128)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    w = torch.empty((LAYERS, d, d), dtype=torch.bfloat16, device="cuda").normal_(0.0, d**-0.5, generator=gen)
    store = gsw.TorchWeights(w)

    def checksum() -> int:
        total = 0
        for i in range(LAYERS):  # a layer at a time: no int64 copy of the whole model
            layer = store.data[i].view(torch.int16).to(torch.int64)
            total += int((layer * torch.arange(1, layer.shape[1] + 1, device="cuda")).sum())
        return total

    def free_mib() -> int:
        return torch.cuda.mem_get_info()[0] >> 20

    return store, checksum, free_mib


def cpu_weights(gib: float, seed: int):
    import hashlib
    import random

    store = gsw.CpuWeights(bytearray(random.Random(seed).randbytes(int(gib * 2**30))))
    return store, lambda: hashlib.blake2b(store.data, digest_size=8).hexdigest(), lambda: None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weight-gib", type=float, default=2.0)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--seed", type=int, default=3090)
    p.add_argument("--cpu", action="store_true", help="bytearrays for the device: the dry run")
    args = p.parse_args()
    store, checksum, free_mib = (cpu_weights if args.cpu else torch_weights)(args.weight_gib, args.seed)
    with tempfile.TemporaryDirectory(prefix="gpu-sleep-cycle-") as status_dir:
        sleeper = gsw.Sleeper(store, status_dir, args.seed)
        original = checksum()
        seq = 0

        def step(op: str, **fields) -> dict:
            nonlocal seq
            seq += 1
            before = free_mib()
            sleeper.handle({"seq": seq, "op": op, **fields})
            line = {**sleeper.report, "free_mib_before": before, "free_mib_after": free_mib()}
            if not sleeper.asleep:
                line["intact"] = checksum() == original
            print(json.dumps(line), flush=True)
            return line

        ok = True
        for _ in range(args.cycles):
            step("sleep", level=1)
            ok &= step("wake")["intact"]
        step("sleep", level=2)
        ok &= not step("wake")["intact"]  # zeros until the reload
        ok &= step("reload")["intact"]
        step("sleep", level=1)
        ok &= not step("wake", corrupt=8)["intact"]
    print(json.dumps({"verdict": "ok" if ok else "FAILED", "gib": store.nbytes / 2**30}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
