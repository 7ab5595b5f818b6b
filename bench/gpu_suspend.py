"""Suspend and resume a GPU process through the driver's process checkpoint: VRAM freed, times, self-check.

For a host with an NVIDIA GPU, driver 570 or newer and torch; elsewhere it says
so and exits 69. Not run by `make bench` (which runs bench/bench_*.py only).

    python3 bench/gpu_suspend.py [--gib 10] [--rounds 3] [--engine-python PY] [--gpu 0]

An engine stand-in, shaped like vLLM's: a torch "EngineCore" process holding
--gib GiB (a ballast with a known pattern, plus a GEMV weight), replaying a
CUDA graph of chained GEMVs whose result it checks against the first replay on
every step, on the GPU; and a tiny HTTP server (in this process, no CUDA) that
serves /metrics with `vllm:num_requests_running` and the core's step and
self-check counters, as the daemon would read them.

The daemon-side Suspender (real driver, the worker process) then:
  1. suspends and resumes it --rounds times: VRAM freed (NVML), host RSS taken
     on, lock/checkpoint/restore/unlock times, whether it serves again with the
     self-check and the ballast intact;
  2. tries to suspend while a kernel runs longer than the lock timeout: the lock
     times out and the engine keeps serving;
  3. suspends, lets another process take the GPU memory, and asks `can_resume`
     on a fresh NVML sample: refused, naming the holder; once it lets go, resumes.

Progress goes to stderr; the tables to stdout. Exit 0 when every case gave the
expected outcome, 1 when one did not, 69 when this host cannot run it.
"""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # r3090d and bench/ from this checkout, installed or not

from bench.gpu_idle import EX_UNAVAILABLE, say, table  # noqa: E402
from r3090d.units import GIB, MIB  # noqa: E402

ENGINE_VENV_PYTHON = "/opt/r3090d-engine/bin/python"
CHUNK = 64 * MIB  # ballast row: the unit of its checksum


def row_sums(ballast):
    """Each row's sum, one row at a time: summing the whole ballast at once into int64
    would take 8x its size in temporaries, and the caching allocator would keep them."""
    import torch

    sums = torch.stack([row.sum(dtype=torch.int64) for row in ballast])
    torch.cuda.empty_cache()
    return sums
GEMV_N = 4096
GEMV_CHAIN = 8


# =================================================================== the core
# Runs under the engine's python: stdlib and torch only, no r3090d.


def core_main(args) -> int:
    import torch

    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    out_lock = threading.Lock()

    def emit(**fields) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(fields) + "\n")
            sys.stdout.flush()

    # The ballast: rows of CHUNK bytes, row k = (i % 251 + k) mod 256, its row sums the reference.
    rows = max(1, int(args.gib * GIB) // CHUNK)
    ballast = torch.empty((rows, CHUNK), dtype=torch.uint8, device=dev)
    base = (torch.arange(CHUNK, device=dev, dtype=torch.int32) % 251).to(torch.uint8)
    for k in range(rows):
        torch.add(base, k % 256, out=ballast[k])
    del base
    ref_sums = row_sums(ballast)

    gen = torch.Generator(device=dev).manual_seed(1234)
    weight = torch.randn(GEMV_N, GEMV_N, device=dev, generator=gen)
    x = torch.randn(GEMV_N, device=dev, generator=gen)
    ref = torch.zeros(GEMV_N, device=dev)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    scale = GEMV_N**-0.5

    def chain():
        h = x
        for _ in range(GEMV_CHAIN):
            h = torch.tanh(torch.mv(weight, h) * scale)
        return h

    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
        bad.add_(((out - ref).abs() > 1e-4).any().to(torch.int64))  # the self-check, on every replay
    graph.replay()
    torch.cuda.synchronize()
    ref.copy_(out)
    bad.zero_()
    torch.cuda.synchronize()

    # cycles per ms for torch.cuda._sleep, so a "long kernel" runs for a known time
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    long_stream = torch.cuda.Stream(device=dev)

    def commands() -> None:
        for text in sys.stdin:
            cmd = json.loads(text)
            if cmd["cmd"] == "long":
                with torch.cuda.stream(long_stream):
                    torch.cuda._sleep(int(cmd["ms"] * cycles_per_ms))
                emit(long_launched=cmd["ms"])
            elif cmd["cmd"] == "verify":
                ok = bool(torch.equal(row_sums(ballast), ref_sums))
                emit(verify=ok)
        os._exit(0)  # the server closed our stdin: it is gone

    threading.Thread(target=commands, daemon=True).start()
    emit(ready=True, pid=os.getpid(), ballast_bytes=rows * CHUNK, cycles_per_ms=cycles_per_ms)
    steps, last_emit = 0, 0.0
    while True:
        for _ in range(50):
            graph.replay()
        failures = int(bad.item())  # waits for the replays
        steps += 50
        now = time.time()
        if now - last_emit >= 0.1:
            emit(steps=steps, failures=failures, at=now)
            last_emit = now


# ============================================================ the holder
# Takes GPU memory for case 3: allocates in 1 GiB pieces until --gib, then waits for stdin to close.


def hold_main(args) -> int:
    import torch

    dev = torch.device("cuda", args.device)
    pieces, held = [], 0
    while held + GIB <= args.gib * GIB:
        try:
            pieces.append(torch.empty(GIB, dtype=torch.uint8, device=dev))
        except torch.cuda.OutOfMemoryError:
            break
        held += GIB
    torch.cuda.synchronize()
    print(json.dumps({"held": held, "pid": os.getpid()}), flush=True)
    sys.stdin.read()
    return 0


# ============================================================ the bench


@dataclass
class CoreStatus:
    steps: int = 0
    failures: int = 0
    at: float = 0.0


class Engine:
    """The core process and the HTTP server reporting it, vLLM-style."""

    def __init__(self, python: str, gib: float, device: int):
        env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's index is NVML's index
        self.proc = subprocess.Popen([python, __file__, "core", "--gib", str(gib), "--device", str(device)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        self.status = CoreStatus()
        self.ready: dict | None = None
        self.replies: list[dict] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _read(self) -> None:
        for text in self.proc.stdout:
            msg = json.loads(text)
            with self.cond:
                if "steps" in msg:
                    self.status = CoreStatus(msg["steps"], msg["failures"], msg["at"])
                elif msg.get("ready"):
                    self.ready = msg
                else:
                    self.replies.append(msg)
                self.cond.notify_all()

    def _handler(self):
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                s = engine.status
                body = (
                    f'vllm:num_requests_running{{model_name="gpu-suspend"}} {1.0 if engine.ready else 0.0}\n'
                    f"gpu_suspend_steps_total {s.steps}\n"
                    f"gpu_suspend_selfcheck_failures_total {s.failures}\n"
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        return Handler

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line}

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"timed out waiting for {what}" + (f" (core exited {self.proc.returncode})" if self.proc.poll() is not None else ""))
                self.cond.wait(min(left, 0.5))

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, key: str, timeout: float):
        def found():
            for i, msg in enumerate(self.replies):
                if key in msg:
                    return self.replies.pop(i)
            return None

        return self.wait(found, timeout, f"the core's {key!r} reply")[key]

    def serving_after(self, steps: int, timeout: float) -> int:
        """Wait for the self-checked steps to pass `steps` (read through /metrics); the new count."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = int(self.metrics()["gpu_suspend_steps_total"])
            if now >= steps + 200:
                return now
            with self.cond:
                self.cond.wait(0.2)
        raise RuntimeError(f"the core made no progress in {timeout:.0f} s")

    def check_after_resume(self, steps: int) -> tuple[int, bool, int]:
        """Wait for the engine to serve again, then have it verify its ballast: (steps, ballast intact,
        GEMV mismatches seen by its self-check)."""
        steps = self.serving_after(steps, 120)
        self.send(cmd="verify")
        intact = self.reply("verify", 300)
        return steps, intact, int(self.metrics()["gpu_suspend_selfcheck_failures_total"])

    def close(self) -> None:
        self.server.shutdown()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def find_engine_python(given: str | None) -> str | None:
    if given:
        return given
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    return ENGINE_VENV_PYTHON if os.access(ENGINE_VENV_PYTHON, os.X_OK) else None


def bench_main(args) -> int:
    sys.path.insert(0, str(ROOT))
    from r3090d.core.suspend_types import Step
    from r3090d.effectors.checkpoint import FAKE_ENV, available

    ok, reason = available()
    if not ok:
        print(f"gpu_suspend: needs an NVIDIA GPU with driver 570 or newer: {reason}")
        return EX_UNAVAILABLE
    engine_python = find_engine_python(args.engine_python)
    if engine_python is None:
        print(f"gpu_suspend: needs torch: none in {sys.executable} and no {ENGINE_VENV_PYTHON}; pass --engine-python")
        return EX_UNAVAILABLE

    import psutil
    import pynvml

    from r3090d.core.suspend_types import Outcome
    from r3090d.core.suspension import RESUME_MARGIN_BYTES, can_resume, pick_target
    from r3090d.effectors.suspender import Suspender

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(args.gpu)

    @dataclass(frozen=True)
    class Proc:
        pid: int
        used_bytes: int | None

    def gpu_used() -> int:
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used

    def gpu_free() -> int:
        return pynvml.nvmlDeviceGetMemoryInfo(handle).free

    def gpu_procs() -> list[Proc]:
        return [Proc(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]

    env = {k: v for k, v in os.environ.items() if k != FAKE_ENV}  # the real driver, always
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    suspender = Suspender(env=env)
    say(f"driver: {reason}; GPU {args.gpu}: {pynvml.nvmlDeviceGetName(handle)}; engine python {engine_python}")

    def run(op: str, pid: int, lock_timeout_ms: int = 10_000):
        started = getattr(suspender, op)(pid, lock_timeout_ms) if op == "suspend" else getattr(suspender, op)(pid)
        assert started
        sample = suspender.wait(300)
        if sample.in_flight:
            raise RuntimeError(f"{op} still in flight after 300 s at step {sample.step}")
        return sample

    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f} ms"

    def sec(v):
        return "-" if v is None else f"{v:.2f} s"

    expected_all = True
    engine = Engine(engine_python, args.gib, args.gpu)
    holder: subprocess.Popen | None = None
    try:
        say(f"starting the core ({args.gib:g} GiB)")
        engine.wait(lambda: engine.ready, 600, "the core to fill its memory")
        pid = engine.ready["pid"]
        target, why = pick_target(gpu_procs(), [pid])
        if target is None:
            say(f"pick_target: {why} (NVML may list pids of another pid namespace); using the core's pid {pid}")
        steps = engine.serving_after(0, 60)

        rows = []
        for rnd in range(1, args.rounds + 1):
            used0, rss0 = gpu_used(), psutil.Process(pid).memory_info().rss
            s = run("suspend", pid)
            used1, rss1 = gpu_used(), psutil.Process(pid).memory_info().rss
            if s.outcome is not Outcome.SUSPENDED:
                rows.append([str(rnd), f"{used0 // MIB:,}", "-", "-", "-", ms(s.took(Step.LOCK)), sec(s.took(Step.CHECKPOINT)),
                             sec(s.duration_s), "-", "-", "-", f"suspend {s.outcome}: {s.error}"])  # fmt: skip
                expected_all = False
                break
            r = run("resume", pid)
            served = r.outcome is Outcome.RESUMED
            check = "-"
            if served:
                steps, intact, failures = engine.check_after_resume(steps)
                check = f"{'ok' if intact and failures == 0 else 'BROKEN'} (ballast {'intact' if intact else 'CHANGED'}, {failures} GEMV mismatches)"
                served = intact and failures == 0
            else:
                check = f"resume {r.outcome}: {r.error}"
            expected_all &= served
            rows.append([
                str(rnd), f"{used0 // MIB:,}", f"{used1 // MIB:,}", f"{(used0 - used1) // MIB:,}", f"+{(rss1 - rss0) // MIB:,}",
                ms(s.took(Step.LOCK)), sec(s.took(Step.CHECKPOINT)), sec(s.duration_s),
                sec(r.took(Step.RESTORE)), ms(r.took(Step.UNLOCK)), sec(r.duration_s), check,
            ])  # fmt: skip
            if not served:
                break
        print(table(["round", "GPU used MiB", "suspended", "freed MiB", "core RSS MiB", "lock", "checkpoint",
                     "suspend total", "restore", "unlock", "resume total", "self-check"], rows))  # fmt: skip
        print("(totals include starting the worker process and cuInit)\n")

        cases = []
        # Case: a kernel runs longer than the lock timeout.
        engine.send(cmd="long", ms=args.long_kernel_ms)
        engine.reply("long_launched", 60)
        s = run("suspend", pid, lock_timeout_ms=args.lock_timeout_ms)
        kept = s.outcome is Outcome.KEPT_RUNNING
        after = "-"
        if kept:
            steps = engine.serving_after(steps, 60 + args.long_kernel_ms / 1000)
            failures = int(engine.metrics()["gpu_suspend_selfcheck_failures_total"])
            after = f"serving (steps {steps:,}, {failures} mismatches), state {s.state.name if s.state else '?'}"
            kept = failures == 0
        elif s.outcome is Outcome.SUSPENDED:
            run("resume", pid)  # the lock did not time out: put it back for the next case
        expected_all &= kept
        cases.append([f"lock ({args.lock_timeout_ms} ms) vs a {args.long_kernel_ms} ms kernel", str(s.outcome),
                      s.error or "-", after, "yes" if kept else "NO (expected kept_running)"])  # fmt: skip

        # Case: another process takes the memory while the engine is suspended.
        used0 = gpu_used()
        s = run("suspend", pid)
        if s.outcome is not Outcome.SUSPENDED:
            cases.append(["suspend before the holder", str(s.outcome), s.error, "-", "NO"])
            expected_all = False
        else:
            needed = max(0, used0 - gpu_used())
            take = max(1, (gpu_free() - needed // 2) // GIB)
            holder = subprocess.Popen([engine_python, __file__, "hold", "--gib", str(take), "--device", str(args.gpu)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})  # fmt: skip
            held = json.loads(holder.stdout.readline())
            ok_now, why = can_resume(gpu_free(), needed, RESUME_MARGIN_BYTES, gpu_procs())
            refused = not ok_now
            cases.append([f"resume while pid {held['pid']} holds {held['held'] // GIB} GiB", "refused" if refused else "allowed",
                          why, "suspended, untouched", "yes" if refused else "NO (expected refused)"])  # fmt: skip
            expected_all &= refused
            holder.stdin.close()
            holder.wait(60)
            holder = None
            deadline = time.monotonic() + 60
            while not (ok_now := can_resume(gpu_free(), needed, RESUME_MARGIN_BYTES, gpu_procs()))[0] and time.monotonic() < deadline:
                time.sleep(0.2)
            r = run("resume", pid) if ok_now[0] else None
            resumed = r is not None and r.outcome is Outcome.RESUMED
            after = "-"
            if resumed:
                steps, intact, failures = engine.check_after_resume(steps)
                after = f"serving, ballast {'intact' if intact else 'CHANGED'}, {failures} mismatches"
                resumed = intact and failures == 0
            expected_all &= resumed
            cases.append(["resume after it let go", str(r.outcome) if r else "refused", (r.error or ok_now[1]) if r else ok_now[1],
                          after, "yes" if resumed else "NO (expected resumed)"])  # fmt: skip
        print(table(["case", "outcome", "detail", "engine after", "as expected"], cases))
    finally:
        if holder is not None:
            holder.kill()
        engine.close()
    return 0 if expected_all else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=("bench", "core", "hold"), help=argparse.SUPPRESS)
    parser.add_argument("--gib", type=float, default=10.0, help="GiB the engine stand-in holds (default 10)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU")
    parser.add_argument("--device", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--engine-python", help="a python with torch (default: this one if it has torch, else the engine venv's)")
    parser.add_argument("--lock-timeout-ms", type=int, default=500)
    parser.add_argument("--long-kernel-ms", type=int, default=3000)
    args = parser.parse_args()
    if args.mode == "core":
        return core_main(args)
    if args.mode == "hold":
        return hold_main(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally: the core must not outlive us
    try:
        return bench_main(args)
    except RuntimeError as exc:
        print(f"gpu_suspend: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
