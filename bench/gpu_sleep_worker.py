"""vLLM's sleep mode in the stand-in's worker: the weights leave the GPU and come back, as vLLM's level 1 and 2 do.

The vLLM double (tests/fakevllm/sleep.py, with FAKE_VLLM_SLEEP_WORKER_DIR naming the worker's status dir)
answers /sleep, /wake_up and /collective_rpc reload_weights only once the worker has done the same here:
it writes `sleep-request.json` ({"seq", "op": sleep|wake|reload, ...}); the worker takes it between two
steps, does it, and writes the outcome as "sleep" in its status file (with the new weights checksum after a
wake, so the double's next greedy answer follows the weights the worker now holds).

  sleep level 1  the weights are copied to a pinned host buffer (cudaMemcpyAsync through
                 tensor.copy_(non_blocking=True)), then freed (torch.cuda.empty_cache: the memory goes back
                 to the driver, the CUDA context stays). The buffer is allocated once per worker and kept,
                 as vLLM keeps PyTorch's pinned cache after the first sleep: the first sleep's allocation is
                 reported apart (first_pinned_alloc_s), later sleeps reuse it.
  sleep level 2  the weights are freed; nothing is kept in host memory. The first level-2 sleep writes them to
                 a file in the status dir first ("the model on disk"; weights_file_write_s, apart).
  wake           device memory is allocated again; after level 1 the host copy goes back; after level 2 the
                 weights are zeros (vLLM's are whatever the new mapping holds) until a reload.
  reload         the weights are read from the file (vLLM: /collective_rpc reload_weights).
  faults         wake with "corrupt": N flips a bit in N weights after the copy back (the canary must see
                 it); sleep with "growth_mib": N keeps N MiB more on the device per sleep (a residual that grows).

Each step is timed (copy_out_s, free_s, alloc_s, copy_in_s, reload_s). The torch path needs a GPU; the CPU
path (the dry run's worker) does the same with bytearrays, so the whole exchange runs here.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

REQUEST = "sleep-request.json"  # tests/fakevllm/sleep.py: WORKER_REQUEST
WEIGHTS_FILE = "weights-{seed}.bin"
MIB = 1 << 20


def take_request(status_dir: str) -> dict | None:
    """The request the double left for this worker, removed once read; None when there is none."""
    path = Path(status_dir) / REQUEST
    try:
        request = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None  # none, or being replaced: the next poll reads it whole
    path.unlink(missing_ok=True)
    return request


class CpuWeights:
    """The dry run's weights: bytes in this process stand for the device, a bytearray kept for ever for pinned memory."""

    def __init__(self, data: bytearray):
        self.data: bytearray | None = data
        self.nbytes = len(data)
        self.host: bytearray | None = None
        self.leaked: list[bytearray] = []

    def alloc_host(self) -> None:
        self.host = bytearray(self.nbytes)

    def copy_out(self) -> None:
        self.host[:] = self.data

    def free(self) -> None:
        self.data = None

    def alloc(self) -> None:
        self.data = bytearray(self.nbytes)  # zeros: what a level-2 wake leaves until the reload

    def copy_in(self) -> None:
        self.data[:] = self.host

    def write_file(self, path: Path) -> None:
        path.write_bytes(self.data)

    def read_file(self, path: Path) -> None:
        self.data[:] = path.read_bytes()

    def flip(self, count: int, shift: int) -> None:
        stride = self.nbytes // count
        for i in range(count):
            self.data[i * stride + (stride // 2 + shift) % stride] ^= 1 << 6

    def leak(self, mib: int) -> None:
        self.leaked.append(bytearray(mib * MIB))


class TorchWeights:
    """The torch worker's weights on cuda:0; the host copy in pinned memory, allocated once."""

    def __init__(self, tensor):
        import torch

        self.torch = torch
        self.data = tensor
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.host = None
        self.leaked: list = []

    def _sync(self) -> None:
        # The stream's own synchronize: torch.cuda.synchronize is the heartbeat of a step (gpu_swap_engine).
        self.torch.cuda.current_stream(self.device).synchronize()

    def alloc_host(self) -> None:
        self.host = self.torch.empty(self.shape, dtype=self.dtype, pin_memory=True)

    def copy_out(self) -> None:
        self.host.copy_(self.data, non_blocking=True)  # cudaMemcpyAsync device -> pinned host
        self._sync()

    def free(self) -> None:
        self.data = None
        self.torch.cuda.empty_cache()  # back to the driver; the context stays

    def alloc(self) -> None:
        self.data = self.torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self._sync()

    def copy_in(self) -> None:
        self.data.copy_(self.host, non_blocking=True)  # cudaMemcpyAsync pinned host -> device
        self._sync()

    def write_file(self, path: Path) -> None:
        self.data.view(self.torch.int16).cpu().numpy().tofile(path)

    def read_file(self, path: Path) -> None:
        count = self.data.numel()
        disk = self.torch.from_file(str(path), shared=False, size=count, dtype=self.torch.int16)
        self.data.view(self.torch.int16).view(-1).copy_(disk)
        self._sync()

    def flip(self, count: int, shift: int) -> None:
        flat = self.data.view(-1).view(self.torch.int16)
        stride = flat.numel() // count
        idx = (
            self.torch.arange(count, device=self.device, dtype=self.torch.int64) * stride
            + (stride // 2 + shift) % stride
        )
        flat[idx] = flat[idx] ^ (1 << 6)
        self._sync()

    def leak(self, mib: int) -> None:
        self.leaked.append(self.torch.empty(mib * MIB, dtype=self.torch.uint8, device=self.device))


def timed(report: dict, key: str, action) -> None:
    start = time.perf_counter()
    action()
    report[key] = round(time.perf_counter() - start, 6)


class Sleeper:
    """The worker's sleep state, driven by the double's requests between steps."""

    def __init__(self, weights, status_dir: str, seed: int):
        self.weights = weights
        self.status_dir = status_dir
        self.file = Path(status_dir) / WEIGHTS_FILE.format(seed=seed)
        self.level = 0  # the level of the sleep in force; 0 awake
        self.sleeps = 0
        self.leaked_mib = 0
        self.report: dict = {"state": "awake", "sleeps": 0}
        self.first_pinned_alloc_s: float | None = None
        self.weights_file_write_s: float | None = None

    @property
    def asleep(self) -> bool:
        return self.level > 0

    def handle(self, request: dict) -> None:
        """Does what the request asks; the outcome goes to self.report (error: a sentence, the state unchanged)."""
        op = request.get("op")
        report = {"seq": request.get("seq"), "op": op}
        try:
            if op == "sleep":
                self._sleep(int(request.get("level", 1)), int(request.get("growth_mib", 0)), report)
            elif op == "wake":
                self._wake(int(request.get("corrupt", 0)), report)
            elif op == "reload":
                timed(report, "reload_s", lambda: self.weights.read_file(self.file))
            else:
                report["error"] = f"unknown op {op!r}"
        except Exception as e:  # noqa: BLE001 - the double answers 500 with it, as vLLM would
            report["error"] = f"{type(e).__name__}: {e}"
        report.update(state="asleep" if self.asleep else "awake", level=self.level, sleeps=self.sleeps, leaked_mib=self.leaked_mib,
                      pinned_bytes=self.weights.nbytes if self.weights.host is not None else 0,
                      first_pinned_alloc_s=self.first_pinned_alloc_s, weights_file_write_s=self.weights_file_write_s)  # fmt: skip
        self.report = report

    def _sleep(self, level: int, growth_mib: int, report: dict) -> None:
        if self.asleep:
            return  # vLLM: already sleeping, nothing done
        w = self.weights
        if level == 1:
            if w.host is None:  # once per worker, kept: later sleeps reuse it
                timed(report, "pinned_alloc_s", w.alloc_host)
                self.first_pinned_alloc_s = report["pinned_alloc_s"]
            timed(report, "copy_out_s", w.copy_out)
        elif not self.file.exists():
            timed(report, "weights_file_write_s", lambda: w.write_file(self.file))
            self.weights_file_write_s = report["weights_file_write_s"]
        timed(report, "free_s", w.free)
        if growth_mib > 0:
            w.leak(growth_mib)
            self.leaked_mib += growth_mib
        self.level = level
        self.sleeps += 1

    def _wake(self, corrupt: int, report: dict) -> None:
        if not self.asleep:
            return
        w = self.weights
        timed(report, "alloc_s", w.alloc)
        if self.level == 1:
            timed(report, "copy_in_s", w.copy_in)
        if corrupt > 0:
            # Other weights each time: a second faulty wake must not undo the first.
            w.flip(corrupt, self.sleeps)
            report["corrupted"] = corrupt
        self.level = 0

    def poll(self, idle) -> bool:
        """Takes and does any request; while asleep, waits here (calling `idle` between polls) until a wake.
        True when something was done, so the caller reports its status at once."""
        request = take_request(self.status_dir)
        if request is None:
            return False
        self.handle(request)
        while self.asleep:
            self.write_status()
            request = None
            while request is None:
                idle()
                request = take_request(self.status_dir)
            self.handle(request)
        return True

    def write_status(self) -> None:
        """While asleep the worker's loop is not running: the report goes out from here."""
        path = Path(self.status_dir) / f"worker-{os.getpid()}.json"
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            status = {"pid": os.getpid()}
        status.update(t=time.time(), sleep=self.report)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        os.replace(tmp, path)
