"""The engine bench/gpu_swap.py gives each model: gpu_engine_standin's, with its token stream tied to its GPU worker.

gpu_engine_standin's engine is the vLLM double for HTTP plus a torch worker in
its process group, the worker being the process the daemon checkpoints. The
double's fake-EngineCore generates the tokens, and holds no GPU memory, so a
checkpoint would not stop its streams: a request "frozen" with a parked engine
would go on and finish while the engine is parked. In vLLM the process on the
GPU is the EngineCore itself, and a locked one makes no tokens.

This engine keeps that property with a coupler, a small process of the engine's
group that never touches CUDA:

  - the worker (gpu_engine_standin's own, unchanged) counts its steps in a
    heartbeat file: each step ends in torch.cuda.synchronize(), wrapped here to
    bump an 8-byte counter in a shared mapping (the CPU worker of a dry run: its
    per-step sleep);
  - the coupler reads the counter every COUPLER_POLL_S; once it has not moved for
    STALL_S (the driver's lock has stopped the worker) it SIGSTOPs the double's
    fake-EngineCore, and SIGCONTs it as soon as the counter moves again (the
    worker is restored and unlocked). The double's /health and /metrics are
    answered by its API server and keep answering, as vLLM's do with its core
    locked.

So streams stop when the worker is locked and go on within about COUPLER_POLL_S
of its unlock, as they would in vLLM; the resumed engine's canary (the double's
greedy answers mix in the worker's weights checksum, FAKE_VLLM_ANSWER_SALT_DIR)
goes through the same core. The coupler's freezes and thaws are one line each
in the engine's output (the daemon's log).

Sleep mode, as vLLM's: started with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (in the model's
extra_args and env), the double's /sleep, /wake_up and /collective_rpc reload_weights are passed to the
worker (FAKE_VLLM_SLEEP_WORKER_DIR: the status dir), which moves its real weights to pinned host memory
and back, or drops them and reloads them from a file (bench/gpu_sleep_worker.py); the double answers once
the worker has. The double's --fake-wake-corrupts and --fake-sleep-residual-growth-mib reach the worker
(flipped weights after the copy back; MiB kept on the device per sleep). While asleep the worker polls
for the wake and keeps the heartbeat, so the coupler leaves the core running.

Invoked by the engine python gpu_swap.py writes, as gpu_engine_standin.py is:
`-m vllm.entrypoints.openai.api_server ARGS` starts the engine; `--worker` and
`--coupler PID` are its children; anything else is the daemon's version probe.
The model's own GPU_IDLE_STATUS_DIR and GPU_IDLE_SEED come from its [[models]]
env, so each engine's double reads its own worker's checksum.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # r3090d and bench/ from this checkout

from bench import gpu_engine_standin as standin  # noqa: E402
from r3090d import procstat  # noqa: E402

COUPLER_POLL_S = 0.005
STALL_S = 0.25  # a 15 GiB step takes about 4 ms on an H200; a quarter second without one is a lock
CORE_COMM = "fake-EngineCore"
SLEEP_WORKER_ENV = "FAKE_VLLM_SLEEP_WORKER_DIR"  # tests/fakevllm/sleep.py reads it
_COUNTER = struct.Struct("<Q")


def heartbeat_path(status_dir: str | Path, worker_pid: int) -> Path:
    return Path(status_dir) / f"heartbeat-{worker_pid}"


class Heartbeat:
    """A step counter in a shared 8-byte mapping: the worker writes it, the coupler reads it."""

    def __init__(self, path: Path, *, create: bool):
        if create:
            path.write_bytes(bytes(_COUNTER.size))
        with open(path, "r+b") as fh:
            self.map = mmap.mmap(fh.fileno(), _COUNTER.size)
        self.count = 0

    def tick(self) -> None:
        self.count += 1
        _COUNTER.pack_into(self.map, 0, self.count)

    def read(self) -> int:
        return _COUNTER.unpack_from(self.map, 0)[0]


def say(text: str) -> None:
    print(f"gpu_swap_engine {os.getpid()}: {text}", flush=True)


# ------------------------------------------------------------------ the worker


def worker_main() -> int:
    standin.die_with_parent(int(os.environ["GPU_IDLE_PARENT"]))
    status_dir = os.environ["GPU_IDLE_STATUS_DIR"]
    seed = int(os.environ.get("GPU_IDLE_SEED", standin.DEFAULT_SEED))
    beat = Heartbeat(heartbeat_path(status_dir, os.getpid()), create=True)
    if os.environ.get("GPU_IDLE_WORKER") == "cpu":
        # The dry run's worker sleeps once a step: that sleep is its heartbeat.
        sleep = time.sleep

        def stepped_sleep(seconds: float) -> None:
            sleep(seconds)
            beat.tick()

        time.sleep = stepped_sleep
        standin.cpu_worker(status_dir, seed, canary=True)
        return 0
    import torch

    synchronize = torch.cuda.synchronize

    def stepped(device=None) -> None:
        synchronize(device)
        beat.tick()  # one synchronize per decode step: the step is done

    torch.cuda.synchronize = stepped
    standin.torch_worker(status_dir, float(os.environ.get("GPU_IDLE_WEIGHT_GIB", "2")), seed, canary=True)
    return 0


# ------------------------------------------------------------------ the coupler


def find_core(parent: int) -> int | None:
    """The double's fake-EngineCore: the API server's (our parent's) child of that name."""
    for st in procstat.scan():
        if st.ppid == parent and st.comm == CORE_COMM and st.live:
            return st.pid
    return None


def signal_core(core: int | None, signum: int) -> bool:
    if core is None:
        return False
    try:
        os.kill(core, signum)
    except ProcessLookupError:
        return False
    return True


def coupler_main(worker_pid: int) -> int:
    parent = int(os.environ["GPU_IDLE_PARENT"])
    standin.die_with_parent(parent)
    beat = Heartbeat(heartbeat_path(os.environ["GPU_IDLE_STATUS_DIR"], worker_pid), create=False)
    core: int | None = None
    stopped = False
    last, changed = beat.read(), time.monotonic()
    while True:
        time.sleep(COUPLER_POLL_S)
        worker = procstat.read(worker_pid)
        if worker is None or not worker.live:
            if stopped:
                signal_core(core, signal.SIGCONT)  # the engine ends without its worker: let the core end too
            return 0
        now, count = time.monotonic(), beat.read()
        if count != last:
            if stopped:
                signal_core(core, signal.SIGCONT)
                stopped = False
                say(f"worker {worker_pid} steps again after {now - changed:.2f} s: core {core} continued")
            last, changed = count, now
        elif not stopped and now - changed >= STALL_S:
            known = procstat.read(core) if core is not None else None
            if known is None or not known.live:
                core = find_core(parent)
            if signal_core(core, signal.SIGSTOP):
                stopped = True
                say(
                    f"worker {worker_pid} has not stepped for {now - changed:.2f} s (locked): core {core} stopped"
                )


# ------------------------------------------------------------------ the engine


def engine_main(args: list[str]) -> int:
    env = {**os.environ, "GPU_IDLE_PARENT": str(os.getpid())}
    status_dir = os.environ["GPU_IDLE_STATUS_DIR"]
    me = str(Path(__file__).resolve())
    worker = subprocess.Popen([sys.executable, me, "--worker"], env=env, stdin=subprocess.DEVNULL)
    # Answers tied to the weights: the double listens once they are loaded, as vLLM does.
    if not standin.wait_first_checksum(worker, status_dir):
        print(f"gpu_swap_engine: the worker {worker.pid} exited (code {worker.poll()}) or gave no checksum "
              f"within {standin.FIRST_CHECKSUM_WAIT_S:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    subprocess.Popen([sys.executable, me, "--coupler", str(worker.pid)], env=env, stdin=subprocess.DEVNULL)
    # The double is stdlib-only: -S keeps a real vLLM in site-packages out of its way.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_IDLE_")}
    env[standin.ANSWER_SALT_ENV] = status_dir
    env[SLEEP_WORKER_ENV] = status_dir  # /sleep and /wake_up move the worker's weights (gpu_sleep_worker)
    env["PYTHONPATH"] = str(standin.SHIM)
    os.execve(sys.executable, [sys.executable, "-S", *args], env)
    return 127  # not reached


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return worker_main()
    if argv[:1] == ["--coupler"] and len(argv) == 2:
        return coupler_main(int(argv[1]))
    if argv[:2] == ["-m", standin.API_SERVER_MODULE]:
        return engine_main(argv)
    return standin.probe_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
