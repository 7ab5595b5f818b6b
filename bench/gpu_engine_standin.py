"""The engine bench/gpu_idle.py gives the daemon: the vLLM double for HTTP, plus a GPU worker in its process group.

The daemon runs `<engine.python> -m vllm.entrypoints.openai.api_server ARGS`;
engine.python is a two-line shell script (written by gpu_idle.py) that runs
this file with the real python. Invoked that way, it

  1. starts the worker (`this file --worker`), its own child, so it shares the
     engine's process group, which is how the daemon tells the engine's GPU
     processes from anyone else's;
  2. execs the double (tests/fakevllm, through its vllm shim) in its place, so
     the daemon's engine pid is the double's API server, as with vLLM.

Any other invocation is the daemon's version probe (`python -I -c CODE`): the
code runs without site-packages and with only the shim on the path, so it
reports the double's version even where a real vLLM is installed.

The worker (GPU_IDLE_WORKER in the environment):
  torch  a decode-like loop on cuda:0: 28 chained bf16 GEMVs over
         GPU_IDLE_WEIGHT_GIB GiB of weights, one synchronize per step, for ever;
  cpu    a light CPU loop, for a dry run on a host without a GPU.
It writes GPU_IDLE_STATUS_DIR/worker-<pid>.json (steps so far) about twice a
second, and dies with its parent (PR_SET_PDEATHSIG), even when stopped.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "fakevllm" / "shim"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LAYERS = 28  # GEMVs per step, one per "layer"
STATUS_EVERY_S = 0.5
PR_SET_PDEATHSIG = 1


def worker_status_path(status_dir: str | Path, pid: int) -> Path:
    return Path(status_dir) / f"worker-{pid}.json"


def write_status(status_dir: str, **fields) -> None:
    path = worker_status_path(status_dir, os.getpid())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "t": time.time(), **fields}))
    os.replace(tmp, path)  # atomic: the bench never reads half a file


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent goes, which reaches a SIGSTOPped worker too."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it went before prctl took effect
        os._exit(1)


def torch_worker(status_dir: str, weight_gib: float) -> None:
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # LAYERS square d x d bf16 matrices, d a multiple of 128, about weight_gib GiB in all.
    d = max(128, int(math.sqrt(weight_gib * 2**30 / LAYERS / 2)) // 128 * 128)
    weights = torch.empty((LAYERS, d, d), dtype=torch.bfloat16, device=dev)
    weights.normal_(0.0, d**-0.5)  # keeps |W h| close to |h| down the chain
    h = torch.randn(d, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    name = torch.cuda.get_device_name(dev)
    print(f"gpu-idle worker {os.getpid()}: {LAYERS} GEMVs of {d}x{d} bf16 ({weights.numel() * 2 / 2**30:.2f} GiB) on {name}", flush=True)
    steps, last, t0 = 0, 0.0, time.monotonic()
    while True:
        x = h
        for i in range(LAYERS):
            x = torch.mv(weights[i], x)
        h = x * (d**0.5 / (x.float().norm() + 1e-3)).to(torch.bfloat16)
        torch.cuda.synchronize()  # one host sync per step, as a decode step has
        steps += 1
        now = time.monotonic()
        if now - last >= STATUS_EVERY_S:
            last = now
            write_status(status_dir, kind="torch", steps=steps, step_ms=(now - t0) * 1e3 / steps, dim=d, device=name)


def cpu_worker(status_dir: str) -> None:
    print(f"gpu-idle worker {os.getpid()}: CPU stand-in (dry run)", flush=True)
    steps, last, x = 0, 0.0, 1.0
    while True:
        for _ in range(2000):
            x = (x * 1.000001) % 7.0
        steps += 1
        time.sleep(0.005)  # light: the dry-run host is shared
        now = time.monotonic()
        if now - last >= STATUS_EVERY_S:
            last = now
            write_status(status_dir, kind="cpu", steps=steps)


def worker_main() -> int:
    die_with_parent(int(os.environ["GPU_IDLE_PARENT"]))
    status_dir = os.environ["GPU_IDLE_STATUS_DIR"]
    if os.environ.get("GPU_IDLE_WORKER") == "cpu":
        cpu_worker(status_dir)
    else:
        torch_worker(status_dir, float(os.environ.get("GPU_IDLE_WEIGHT_GIB", "2")))
    return 0


def engine_main(args: list[str]) -> int:
    env = {**os.environ, "GPU_IDLE_PARENT": str(os.getpid())}
    subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env, stdin=subprocess.DEVNULL)
    # The double is stdlib-only: -S keeps a real vLLM in site-packages out of its way.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_IDLE_")}
    env["PYTHONPATH"] = str(SHIM)
    os.execve(sys.executable, [sys.executable, "-S", *args], env)
    return 127  # not reached


def probe_main(args: list[str]) -> int:
    """`-I -c CODE` and the like: run CODE with only the shim (and the stdlib) on the path."""
    if "-c" not in args or args.index("-c") + 1 >= len(args):
        print(f"gpu_engine_standin: unsupported invocation {args!r}", file=sys.stderr)
        return 2
    code = args[args.index("-c") + 1]
    prelude = f"import sys; sys.path.insert(0, {str(SHIM)!r})\n"
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", prelude + code])
    return 127  # not reached


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return worker_main()
    if argv[:2] == ["-m", API_SERVER_MODULE]:
        return engine_main(argv)
    return probe_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
