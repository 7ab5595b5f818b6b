"""The double's engine core: the process that really produces the tokens.

The API server (server.py) starts this as its child, so the tree has vLLM's
three levels: API server -> fake-EngineCore -> fake-Worker. Generation happens
here, one token per running request per step, so stopping this process
(SIGSTOP) really stalls every completion while the API server keeps answering
/health, and killing it really ends generation.

Protocol: JSON lines. The server writes requests to our stdin:
  {"op": "add", "id": ..., "prompt_tokens": P, "max_tokens": M, "eos_after": N|null}
  {"op": "abort", "id": ...}
  {"op": "config", "token_delay": S}
  {"op": "hold", "on": bool}   (a pause in keep mode: no steps while on; requests stay where they are)
and we write to stdout:
  {"t": "ready", "worker_pid": PID}
  {"t": "step", "out": [[id, generated, finish_reason|null], ...], "stats": {...}}
  {"t": "stats", "stats": {...}}

Run as: python engine_core.py fake-EngineCore --num-gpu-blocks N --block-size B ...
     or python engine_core.py fake-Worker  (started by the core itself)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

CORE_NAME = "fake-EngineCore"
WORKER_NAME = "fake-Worker"


def set_process_name(name: str) -> None:
    """Make the process recognisable in ps/psutil, as vLLM's setproctitle does."""
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(name)
        return
    except ImportError:
        pass
    try:
        import ctypes

        pr_set_name = 15
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def log(message: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"(EngineCore_DP0 pid={os.getpid()}) INFO {stamp} [core.py] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------- scheduling (pure)


@dataclass
class Request:
    id: str
    prompt_tokens: int
    max_tokens: int
    eos_after: int | None
    generated: int = 0
    blocks: int = 0
    running: bool = False


class Scheduler:
    """Continuous batching over a fixed pool of KV blocks, with recompute preemption.

    One block of the pool is vLLM's null block, so usage is used / (num_blocks - 1).
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int):
        self.usable_blocks = max(1, num_blocks - 1)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.used_blocks = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.preemptions = 0

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def free_blocks(self) -> int:
        return self.usable_blocks - self.used_blocks

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req_id: str) -> None:
        for req in self.running:
            if req.id == req_id:
                self._release(req)
                return
        self.waiting = deque(r for r in self.waiting if r.id != req_id)

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        req.running = False
        self.used_blocks -= req.blocks
        req.blocks = 0

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self.blocks_for(req.prompt_tokens + req.generated + 1)
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            req.blocks = need
            req.running = True
            self.used_blocks += need
            self.running.append(req)
            # A preempted request recomputes its prompt and what it had generated.
            self.prompt_tokens += req.prompt_tokens + req.generated

    def step(self) -> list[tuple[str, int, str | None]]:
        """One engine iteration: admit, then one token for every running request."""
        self._admit()
        out: list[tuple[str, int, str | None]] = []
        for req in list(self.running):
            if not req.running:
                continue  # preempted earlier in this step
            grow = self.blocks_for(req.prompt_tokens + req.generated + 1) - req.blocks
            while grow > self.free_blocks:
                victim = self.running[-1]  # the newest request gives way, as in vLLM
                self._preempt(victim)
                if victim is req:
                    break
            if not req.running:
                continue
            req.blocks += grow
            self.used_blocks += grow
            req.generated += 1
            self.generation_tokens += 1
            finish = None
            if req.generated >= req.max_tokens:
                finish = "length"
            elif req.eos_after is not None and req.generated >= req.eos_after:
                finish = "stop"
            out.append((req.id, req.generated, finish))
            if finish:
                self._release(req)
        return out

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_cache_usage_perc": self.used_blocks / self.usable_blocks,
            "generation_tokens": self.generation_tokens,
            "prompt_tokens": self.prompt_tokens,
            "preemptions": self.preemptions,
        }


# ----------------------------------------------------------------- process roles


def run_worker() -> int:
    """Holds nothing, does nothing; exits when its core goes away, like vLLM's death pipe."""
    set_process_name(WORKER_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.read(0, 4096):
        pass
    return 0


class Core:
    def __init__(self, opts: argparse.Namespace):
        self.opts = opts
        self.sched = Scheduler(opts.num_gpu_blocks, opts.block_size, opts.max_num_seqs)
        self.token_delay = opts.token_delay
        self.next_step = 0.0
        self.buffer = b""
        self.held = False

    def emit(self, message: dict) -> bool:
        try:
            os.write(1, (json.dumps(message, separators=(",", ":")) + "\n").encode())
            return True
        except BrokenPipeError:
            return False

    def handle(self, message: dict) -> None:
        op = message.get("op")
        if op == "add":
            if not self.sched.has_work():
                self.next_step = time.monotonic() + self.token_delay
            self.sched.add(Request(str(message["id"]), int(message["prompt_tokens"]), int(message["max_tokens"]), message.get("eos_after")))
        elif op == "abort":
            self.sched.abort(str(message["id"]))
        elif op == "config":
            self.token_delay = float(message.get("token_delay", self.token_delay))
        elif op == "hold":
            self.held = bool(message.get("on"))
            self.next_step = time.monotonic() + self.token_delay

    def read_messages(self) -> bool:
        """Reads what the server sent; False once the server has gone."""
        data = os.read(0, 65536)
        if not data:
            return False
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if line.strip():
                self.handle(json.loads(line))
        return True

    def linger_as_orphan(self) -> int:
        # vLLM's EngineCore outlives a SIGKILLed API server (reparented to init).
        # The double does the same, but bounded, so a failed test cannot leave it forever.
        log(f"API server is gone; lingering as an orphan for {self.opts.orphan_linger:g} s")
        time.sleep(self.opts.orphan_linger)
        return 0

    def run(self) -> int:
        if not self.emit({"t": "ready", "worker_pid": self.opts.worker_pid}):
            return self.linger_as_orphan()
        while True:
            timeout = None
            if self.sched.has_work() and not self.held:
                timeout = max(0.0, self.next_step - time.monotonic())
            readable, _, _ = select.select([0], [], [], timeout)
            if readable:
                if not self.read_messages():
                    return self.linger_as_orphan()
                if not self.emit({"t": "stats", "stats": self.sched.stats()}):
                    return self.linger_as_orphan()
            now = time.monotonic()
            if self.sched.has_work() and not self.held and now >= self.next_step:
                out = self.sched.step()
                # Steps keep to a fixed grid, so a late wake-up does not lengthen the period;
                # after an idle spell (or a wake-up later than a whole step) the grid starts anew.
                late = now - self.next_step
                self.next_step = (self.next_step if late < self.token_delay else now) + self.token_delay
                if not self.emit({"t": "step", "out": out, "stats": self.sched.stats()}):
                    return self.linger_as_orphan()


def main(argv: list[str]) -> int:
    if argv[:1] == [WORKER_NAME]:
        return run_worker()
    parser = argparse.ArgumentParser(prog=CORE_NAME)
    parser.add_argument("role", choices=[CORE_NAME])
    parser.add_argument("--num-gpu-blocks", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--token-delay", type=float, required=True)
    parser.add_argument("--orphan-linger", type=float, default=120.0)
    parser.add_argument("--ignore-sigterm", action="store_true")
    opts = parser.parse_args(argv)
    set_process_name(CORE_NAME)
    # Ctrl-C in a terminal reaches the whole group; the API server decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if opts.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The worker must not hold our stdout, or the server would not see EOF when we die.
    worker = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), WORKER_NAME], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    opts.worker_pid = worker.pid
    log(f"started {WORKER_NAME} pid={worker.pid}; {opts.num_gpu_blocks} KV blocks of {opts.block_size} tokens")
    return Core(opts).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
