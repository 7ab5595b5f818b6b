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
second, and dies with its parent (PR_SET_PDEATHSIG), even when stopped. Its
weights are drawn from GPU_IDLE_SEED (default 3090): every worker holds the same.

GPU_IDLE_CANARY=1 (bench/gpu_canary.py) ties the double's answers to the weights:
  - the worker writes a `checksum` of y = W.x (all of W as one matrix, x a fixed
    vector of +-1 from the seed; the CPU worker: a hash of its weight bytes) with
    every status, and again at once after a flip;
  - a request file flip-<pid>.json in the status dir ({"count": N, "bit": B})
    makes the worker XOR bit B of N bf16 weights spread over the tensor (its own
    GPU memory: nobody else can write it), then it removes the file and reports
    `flips`, `flipped_at` (wall clock) and the new checksum;
  - a request file sleep-request.json in the status dir puts the weights to sleep and wakes them, as
    vLLM's sleep mode does (bench/gpu_sleep_worker.py; the double sends it: tests/fakevllm/sleep.py);
    after a wake the new checksum goes out at once, with the step's report under "sleep";
  - the launcher waits for the worker's first checksum (the weights are loaded),
    then starts the double with FAKE_VLLM_ANSWER_SALT_DIR naming the status dir:
    its greedy answers mix in the newest worker's checksum, so changed weights
    change the canary's answer, and a fresh worker gives the original answer back.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import random
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
DEFAULT_SEED = 3090
CPU_WEIGHT_BYTES = 4 << 20  # the CPU worker's "weights"
FIRST_CHECKSUM_WAIT_S = 300.0  # the launcher's bound on the worker's loading
ANSWER_SALT_ENV = "FAKE_VLLM_ANSWER_SALT_DIR"  # tests/fakevllm/server.py reads it


def worker_status_path(status_dir: str | Path, pid: int) -> Path:
    return Path(status_dir) / f"worker-{pid}.json"


def flip_request_path(status_dir: str | Path, pid: int) -> Path:
    return Path(status_dir) / f"flip-{pid}.json"


def take_flip_request(status_dir: str) -> dict | None:
    """The flip asked of this worker ({"count": N, "bit": B}), removed once read; None when none is asked."""
    path = flip_request_path(status_dir, os.getpid())
    try:
        req = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # being written: the next step reads it whole
    path.unlink(missing_ok=True)
    return {"count": max(1, int(req.get("count", 8))), "bit": int(req.get("bit", 14)) % 16}


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


def sleep_module():
    """bench/gpu_sleep_worker.py, whether this file runs as a script (bench/ first on the path) or as bench.*."""
    try:
        import gpu_sleep_worker
    except ImportError:
        from bench import gpu_sleep_worker
    return gpu_sleep_worker


def torch_worker(status_dir: str, weight_gib: float, seed: int, canary: bool) -> None:
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)  # the same weights in every worker: a fresh engine computes what the first one did
    # LAYERS square d x d bf16 matrices, d a multiple of 128, about weight_gib GiB in all.
    d = max(128, int(math.sqrt(weight_gib * 2**30 / LAYERS / 2)) // 128 * 128)
    weights = torch.empty((LAYERS, d, d), dtype=torch.bfloat16, device=dev)
    weights.normal_(0.0, d**-0.5, generator=gen)  # keeps |W h| close to |h| down the chain
    # The weights live in the store from here on: a sleep (gpu_sleep_worker) frees them and brings them back.
    store = sleep_module().TorchWeights(weights)
    sleeper = sleep_module().Sleeper(store, status_dir, seed)
    del weights
    h = torch.randn(d, dtype=torch.bfloat16, device=dev, generator=gen)
    probe = (torch.randint(0, 2, (d,), device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)  # the fixed x of y = W.x
    # Position weights of the checksum (a prime modulus keeps them nonzero): exact in int64, any changed y changes it.
    places = torch.arange(LAYERS * d, device=dev, dtype=torch.int64) % 65521 + 1

    def checksum() -> int:
        y = torch.mv(store.data.view(LAYERS * d, d), probe)  # every weight, one GEMV
        return int(((y.view(torch.int16).to(torch.int64) & 0xFFFF) * places).sum())

    def flip(count: int, bit: int) -> None:
        flat = store.data.view(-1).view(torch.int16)
        idx = torch.arange(count, device=dev, dtype=torch.int64) * (flat.numel() // count) + (flat.numel() // count) // 2
        flat[idx] = flat[idx] ^ ((1 << bit) if bit < 15 else -(1 << 15))
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    name = torch.cuda.get_device_name(dev)
    print(f"gpu-idle worker {os.getpid()}: {LAYERS} GEMVs of {d}x{d} bf16 ({store.nbytes / 2**30:.2f} GiB) on {name}", flush=True)
    extra: dict = {"seed": seed}
    if canary:
        extra.update(checksum=checksum(), flips=0)
        write_status(status_dir, kind="torch", steps=0, dim=d, device=name, **extra)
    steps, last, t0 = 0, 0.0, time.monotonic()
    while True:
        x = h
        for i in range(LAYERS):
            x = torch.mv(store.data[i], x)
        h = x * (d**0.5 / (x.float().norm() + 1e-3)).to(torch.bfloat16)
        torch.cuda.synchronize()  # one host sync per step, as a decode step has
        steps += 1
        now = time.monotonic()
        req = take_flip_request(status_dir) if canary else None
        if req is not None:
            flip(req["count"], req["bit"])
            extra.update(flips=extra["flips"] + 1, flipped_at=time.time(), flipped=req)
        # A sleep waits inside poll until the wake; the stream's synchronize keeps the heartbeat meanwhile.
        slept = canary and sleeper.poll(lambda: (time.sleep(0.005), torch.cuda.synchronize()))
        if now - last >= STATUS_EVERY_S or req is not None or slept:  # after a flip or a wake, the new checksum at once
            last = now
            if canary:
                extra.update(checksum=checksum(), sleep=sleeper.report)
            write_status(status_dir, kind="torch", steps=steps, step_ms=(now - t0) * 1e3 / steps, dim=d, device=name, **extra)


def cpu_worker(status_dir: str, seed: int, canary: bool) -> None:
    print(f"gpu-idle worker {os.getpid()}: CPU stand-in (dry run)", flush=True)
    store = sleep_module().CpuWeights(bytearray(random.Random(seed).randbytes(CPU_WEIGHT_BYTES) if canary else b""))
    sleeper = sleep_module().Sleeper(store, status_dir, seed)

    def checksum() -> int:
        return int.from_bytes(hashlib.blake2b(store.data, digest_size=8).digest(), "big")

    extra: dict = {"seed": seed}
    if canary:
        extra.update(checksum=checksum(), flips=0)
        write_status(status_dir, kind="cpu", steps=0, **extra)
    steps, last, x = 0, 0.0, 1.0
    while True:
        for _ in range(2000):
            x = (x * 1.000001) % 7.0
        steps += 1
        time.sleep(0.005)  # light: the dry-run host is shared
        now = time.monotonic()
        req = take_flip_request(status_dir) if canary else None
        if req is not None:
            stride = store.nbytes // req["count"]
            for i in range(req["count"]):
                store.data[i * stride + stride // 2] ^= 1 << (req["bit"] % 8)
            extra.update(flips=extra["flips"] + 1, flipped_at=time.time(), flipped=req)
        slept = canary and sleeper.poll(lambda: time.sleep(0.005))  # a sleep waits inside poll until the wake
        if now - last >= STATUS_EVERY_S or req is not None or slept:  # after a flip or a wake, the new checksum at once
            last = now
            if canary:
                extra.update(checksum=checksum(), sleep=sleeper.report)
            write_status(status_dir, kind="cpu", steps=steps, **extra)


def worker_main() -> int:
    die_with_parent(int(os.environ["GPU_IDLE_PARENT"]))
    status_dir = os.environ["GPU_IDLE_STATUS_DIR"]
    seed = int(os.environ.get("GPU_IDLE_SEED", DEFAULT_SEED))
    canary = os.environ.get("GPU_IDLE_CANARY") == "1"
    if os.environ.get("GPU_IDLE_WORKER") == "cpu":
        cpu_worker(status_dir, seed, canary)
    else:
        torch_worker(status_dir, float(os.environ.get("GPU_IDLE_WEIGHT_GIB", "2")), seed, canary)
    return 0


def wait_first_checksum(worker: subprocess.Popen, status_dir: str) -> bool:
    """Until the worker reports its checksum (its weights are loaded): True; False when it exits first."""
    path = worker_status_path(status_dir, worker.pid)
    deadline = time.monotonic() + FIRST_CHECKSUM_WAIT_S
    while time.monotonic() < deadline:
        try:
            if "checksum" in json.loads(path.read_text()):
                return True
        except (OSError, ValueError):
            pass
        if worker.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def engine_main(args: list[str]) -> int:
    env = {**os.environ, "GPU_IDLE_PARENT": str(os.getpid())}
    worker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env, stdin=subprocess.DEVNULL)
    status_dir = os.environ.get("GPU_IDLE_STATUS_DIR", "")
    canary = os.environ.get("GPU_IDLE_CANARY") == "1"
    # Answers tied to the weights: the double listens once they are loaded, as vLLM does.
    if canary and not wait_first_checksum(worker, status_dir):
        print(f"gpu_engine_standin: the worker {worker.pid} exited (code {worker.poll()}) or gave no checksum "
              f"within {FIRST_CHECKSUM_WAIT_S:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    # The double is stdlib-only: -S keeps a real vLLM in site-packages out of its way.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_IDLE_")}
    if canary:
        env[ANSWER_SALT_ENV] = status_dir
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
