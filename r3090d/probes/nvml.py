"""The GPU as NVML sees it. The only module in r3090d that imports pynvml.

Every NVML call goes through one chokepoint, `_NvmlSession._invoke`, which
turns NVML's errors into data:

- "not available" (NotSupported, FunctionNotFound, NoData): the field is None,
  meaning "not measured". GeForce boards answer NotSupported to many queries.
- GpuIsLost, Unknown, ResetRequired: the card fell off the bus or needs a
  reset; the sample's status is LOST and only a reboot helps.
- anything else: the field is None and "call: error" goes to `field_errors`.

NVML can hang in uninterruptible sleep (D state), so no NVML call ever runs
on the caller's thread. `NvmlMonitor` owns one daemon worker thread that
makes every call, including nvmlInit; the loop calls `latest(now)`, which
only copies the last published sample under a lock and marks it `hung` once
the worker has sat inside one call longer than `hung_after_s`. A stuck worker
is never replaced: a second thread would block in the same driver.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from r3090d.core.snapshot import GpuProcess, GpuSample, GpuStatus
from r3090d.core.xid import RECOVERY_ACTION_CODES, RecoveryAction

# NVML return codes by the suffix of pynvml's NVML_ERROR_<NAME> constants.
NOT_AVAILABLE_ERRORS = frozenset({"NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "NO_DATA"})
LOST_ERRORS = frozenset({"GPU_IS_LOST", "UNKNOWN", "RESET_REQUIRED"})
NO_DEVICE_ERRORS = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "GPU_NOT_FOUND"})
# A burst of XIDs is drained over several polls rather than holding the worker.
MAX_XID_EVENTS_PER_POLL = 64

_IMPORT = object()  # NvmlMonitor(nvml=...) default: import pynvml in the worker
_EXPECTED = object()  # _call's answer for an error code the caller said it expects


def load_pynvml():
    """The pynvml module (package nvidia-ml-py), or None if it cannot be imported."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def clock_reason_table(nvml) -> dict[int, str]:
    """Bit -> snake_case name, from pynvml's nvmlClocksEventReason*/nvmlClocksThrottleReason* constants.

    The names match config's watchdog.throttle_warn_reasons: "hw_slowdown",
    "sw_thermal_slowdown", "hw_power_brake_slowdown", "gpu_idle", ...
    """
    table: dict[int, str] = {}
    for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
        for attr in sorted(dir(nvml)):
            suffix = attr[len(prefix):] if attr.startswith(prefix) else ""
            # UserDefinedClocks is a deprecated alias of ApplicationsClocksSetting.
            if not suffix or suffix in ("None", "All", "UserDefinedClocks"):
                continue
            bit = getattr(nvml, attr)
            if isinstance(bit, int) and bit > 0 and bit & (bit - 1) == 0:
                table.setdefault(bit, re.sub(r"(?<!^)(?=[A-Z])", "_", suffix).lower())
    return table


def decode_clock_reasons(mask: int, table: dict[int, str]) -> tuple[str, ...]:
    names = [name for bit, name in sorted(table.items()) if mask & bit]
    unknown = mask & ~sum(table)
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return tuple(names)


class _GpuLost(Exception):
    pass


class _NvmlSession:
    """NVML state for one worker thread: init once, the device handle, the XID event set."""

    def __init__(self, nvml, index: int, on_call: Callable[[str | None], None], clock: Callable[[], float]):
        self.nvml = nvml
        self.index = index
        self._on_call = on_call
        self._clock = clock
        self.initialized = False
        self.handle = None
        self.static: dict[str, Any] = {}
        self.event_set = None
        self.xid_monitored = False
        self.errors: list[str] = []  # this poll's
        self.setup_errors: list[str] = []  # opening the device's, repeated in every sample
        self.xids: list[int] = []
        self._code_names: dict[int, str] = {}
        if nvml is not None:
            for attr in dir(nvml):
                if attr.startswith("NVML_ERROR_") and isinstance(getattr(nvml, attr), int):
                    self._code_names.setdefault(getattr(nvml, attr), attr[len("NVML_ERROR_"):])
        self._reasons = clock_reason_table(nvml) if nvml is not None else {}

    # ------------------------------------------------------------ chokepoint

    def _invoke(self, fname: str, *args, **kwargs) -> tuple[bool, Any, str, str]:
        """The one place an NVML function is called: (ok, value, error code name, message)."""
        fn = getattr(self.nvml, fname, None)
        if fn is None:
            return False, None, "FUNCTION_NOT_FOUND", f"{fname} is not in this pynvml"
        self._on_call(fname)
        try:
            return True, fn(*args, **kwargs), "", ""
        except self.nvml.NVMLError as exc:
            code = self._code_names.get(getattr(exc, "value", None), f"CODE_{getattr(exc, 'value', '?')}")
            try:
                message = str(exc)
            except Exception:  # str() asks the library for the text; it may be gone
                message = code
            return False, None, code, message
        except Exception as exc:  # a binding mismatch or a ctypes failure: record, never raise
            return False, None, "EXCEPTION", f"{type(exc).__name__}: {exc}"
        finally:
            self._on_call(None)

    def _call(self, fname: str, *args, expected: tuple[str, ...] = (), **kwargs):
        """A measurement: its value, or None when not measured. Raises _GpuLost."""
        ok, value, code, message = self._invoke(fname, *args, **kwargs)
        if ok:
            return value
        if code in expected:
            return _EXPECTED
        if code in NOT_AVAILABLE_ERRORS:
            return None
        if code in LOST_ERRORS:
            raise _GpuLost(f"{fname}: {message}")
        self.errors.append(f"{fname}: {message}")
        return None

    def _first(self, fnames: tuple[str, ...], *args):
        """The first of several API generations that answers (newer names first)."""
        for fname in fnames:
            value = self._call(fname, *args, expected=("FUNCTION_NOT_FOUND",))
            if value is not _EXPECTED and value is not None:
                return value
        return None

    # ---------------------------------------------------------------- polls

    def poll(self) -> GpuSample:
        self.errors = []
        if self.nvml is None:
            return self._sample(GpuStatus.NO_LIBRARY, "no NVIDIA driver: pynvml (nvidia-ml-py) is not installed")
        try:
            if self.handle is None:
                failed = self._open()
                if failed is not None:
                    return failed
            return self._read()
        except _GpuLost as exc:
            # Open NVML afresh at the next poll: a card that comes back (a reset) is seen again.
            self.close()
            self.handle = None
            return self._sample(GpuStatus.LOST, f"GPU lost ({exc}); a reset or a reboot is needed", lost=True)

    def _open(self) -> GpuSample | None:
        if not self.initialized:
            ok, _, code, message = self._invoke("nvmlInit")
            if not ok:
                if code == "LIBRARY_NOT_FOUND":
                    return self._sample(GpuStatus.NO_LIBRARY, "no NVIDIA driver: libnvidia-ml.so.1 not found")
                if code == "DRIVER_NOT_LOADED":
                    return self._sample(GpuStatus.NO_DRIVER, "no NVIDIA driver: the kernel module is not loaded")
                if code == "LIB_RM_VERSION_MISMATCH":
                    return self._sample(GpuStatus.ERROR, f"nvmlInit: {message} (the driver was upgraded without a reboot)")
                if code in LOST_ERRORS:
                    raise _GpuLost(f"nvmlInit: {message}")
                return self._sample(GpuStatus.ERROR, f"nvmlInit: {message}")
            self.initialized = True
        ok, count, code, message = self._invoke("nvmlDeviceGetCount")
        if not ok:
            if code in LOST_ERRORS:
                raise _GpuLost(f"nvmlDeviceGetCount: {message}")
            return self._sample(GpuStatus.ERROR, f"nvmlDeviceGetCount: {message}")
        if self.index >= count:
            return self._sample(GpuStatus.NO_GPU, f"no GPU at index {self.index} ({count} found)")
        ok, handle, code, message = self._invoke("nvmlDeviceGetHandleByIndex", self.index)
        if not ok:
            if code in LOST_ERRORS:
                raise _GpuLost(f"nvmlDeviceGetHandleByIndex: {message}")
            status = GpuStatus.NO_GPU if code in NO_DEVICE_ERRORS else GpuStatus.ERROR
            return self._sample(status, f"GPU {self.index}: {message}")
        self.handle = handle
        self.setup_errors = []
        cc = self._call("nvmlDeviceGetCudaComputeCapability", handle)
        self.static = {
            "name": _text(self._call("nvmlDeviceGetName", handle)),
            "uuid": _text(self._call("nvmlDeviceGetUUID", handle)),
            "driver_version": _text(self._call("nvmlSystemGetDriverVersion")),
            "cuda_driver_version": self._first(("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion")),
            "compute_capability": tuple(cc) if cc is not None else None,
        }
        self._register_xid_events(handle)
        return None

    def _register_xid_events(self, handle) -> None:
        xid_type = getattr(self.nvml, "nvmlEventTypeXidCriticalError", None)
        if xid_type is None:
            return
        ok, event_set, code, message = self._invoke("nvmlEventSetCreate")
        if not ok:
            if code in LOST_ERRORS:
                raise _GpuLost(f"nvmlEventSetCreate: {message}")
            return
        ok, _, code, message = self._invoke("nvmlDeviceRegisterEvents", handle, xid_type, event_set)
        if ok:
            self.event_set, self.xid_monitored = event_set, True
            return
        if code in LOST_ERRORS:
            raise _GpuLost(f"nvmlDeviceRegisterEvents: {message}")
        if code not in NOT_AVAILABLE_ERRORS:
            self.setup_errors.append(f"nvmlDeviceRegisterEvents: {message}")
        self._invoke("nvmlEventSetFree", event_set)

    def _read(self) -> GpuSample:
        nvml, h = self.nvml, self.handle
        total = used = free = reserved = None
        mem = None
        if hasattr(nvml, "nvmlMemory_v2"):
            mem = self._call("nvmlDeviceGetMemoryInfo", h, version=nvml.nvmlMemory_v2, expected=("ARGUMENT_VERSION_MISMATCH",))
        if mem is None or mem is _EXPECTED:
            mem = self._call("nvmlDeviceGetMemoryInfo", h)
        if mem is not None:
            total, used, free = int(mem.total), int(mem.used), int(mem.free)
            reserved = int(mem.reserved) if hasattr(mem, "reserved") else None
        util = self._call("nvmlDeviceGetUtilizationRates", h)
        power_mw = self._call("nvmlDeviceGetPowerUsage", h)
        limit_mw = self._first(("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit"), h)
        reasons = self._first(("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h)
        persistence = self._call("nvmlDeviceGetPersistenceMode", h)
        procs = self._first(
            ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetComputeRunningProcesses"), h
        )
        graphics = self._first(
            ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses"), h
        )
        values = dict(
            memory_total=total,
            memory_used=used,
            memory_free=free,
            memory_reserved=reserved,
            utilization_gpu=_int(getattr(util, "gpu", None)),
            utilization_memory=_int(getattr(util, "memory", None)),
            temperature_c=_int(self._call("nvmlDeviceGetTemperature", h, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))),
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            sm_clock_mhz=_int(self._call("nvmlDeviceGetClockInfo", h, getattr(nvml, "NVML_CLOCK_SM", 1))),
            mem_clock_mhz=_int(self._call("nvmlDeviceGetClockInfo", h, getattr(nvml, "NVML_CLOCK_MEM", 2))),
            clock_event_reasons=decode_clock_reasons(int(reasons), self._reasons) if reasons is not None else None,
            pcie_width=_int(self._call("nvmlDeviceGetCurrPcieLinkWidth", h)),
            pcie_width_max=_int(self._call("nvmlDeviceGetMaxPcieLinkWidth", h)),
            pcie_gen=_int(self._call("nvmlDeviceGetCurrPcieLinkGeneration", h)),
            pcie_gen_max=_int(self._call("nvmlDeviceGetMaxPcieLinkGeneration", h)),
            persistence_mode=bool(persistence) if persistence is not None else None,
            processes=_processes(procs),
            graphics_processes=_processes(graphics),
        )
        self._drain_xids()
        values["recovery_action"] = self._recovery_action(h)
        detail = f"{len(self.errors)} NVML read(s) failed" if self.errors else ""
        return self._sample(GpuStatus.OK, detail, **values)

    def _recovery_action(self, h) -> RecoveryAction | None:
        """The driver's own verdict on what the GPU needs (driver 565+); None where it gives none.

        Each field of nvmlDeviceGetFieldValues carries its own return code: NotSupported
        (GeForce cards, older drivers) is no verdict, not an error.
        """
        field_id = getattr(self.nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)  # absent from older nvidia-ml-py
        if field_id is None:
            return None
        values = self._call("nvmlDeviceGetFieldValues", h, [field_id])
        if not values:
            return None
        value = values[0]
        code = int(getattr(value, "nvmlReturn", -1))
        if code != getattr(self.nvml, "NVML_SUCCESS", 0):
            name = self._code_names.get(code, f"CODE_{code}")
            if name not in NOT_AVAILABLE_ERRORS:
                self.errors.append(f"nvmlDeviceGetFieldValues(GPU_RECOVERY_ACTION): {name}")
            return None
        raw = getattr(getattr(value, "value", None), "uiVal", None)
        action = RECOVERY_ACTION_CODES.get(int(raw)) if isinstance(raw, int) else None
        if action is None:
            self.errors.append(f"nvmlDeviceGetFieldValues(GPU_RECOVERY_ACTION): unknown value {raw!r}")
        return action

    def _drain_xids(self) -> None:
        if self.event_set is None:
            return
        xid_type = self.nvml.nvmlEventTypeXidCriticalError
        for _ in range(MAX_XID_EVENTS_PER_POLL):
            data = self._call("nvmlEventSetWait", self.event_set, 0, expected=("TIMEOUT",))
            if data is None or data is _EXPECTED:
                return
            if int(getattr(data, "eventType", 0)) & xid_type:
                self.xids.append(int(data.eventData))

    def _sample(self, status: GpuStatus, detail: str, *, lost: bool = False, **values) -> GpuSample:
        return GpuSample(
            status=status,
            detail=detail,
            index=self.index,
            taken_at=self._clock(),
            lost=lost,
            xid_monitored=self.xid_monitored,
            field_errors=tuple(self.setup_errors + self.errors),
            **self.static,
            **values,
        )

    def close(self) -> None:
        if self.event_set is not None:
            self._invoke("nvmlEventSetFree", self.event_set)
            self.event_set = None
        if self.initialized:
            self._invoke("nvmlShutdown")
            self.initialized = False
        self.handle = None


def _text(value) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if value is None else str(value)


def _int(value) -> int | None:
    return int(value) if value is not None else None


class NvmlMonitor:
    """One GPU, polled in one daemon worker thread; `latest(now)` never blocks on NVML.

    Daemon use:
        monitor = NvmlMonitor(cfg.gpu.index, cfg.watchdog.nvml_hung_after,
                              period_s=cfg.watchdog.poll_interval)
        monitor.start()
        ... each tick: gpu = monitor.latest(time.monotonic())
        ... at exit:   monitor.close()

    With period_s=None the worker polls only when `request()` is called.
    XID codes drained by the worker accumulate until a `latest()` call hands
    them out; each XID is handed out once.
    """

    def __init__(
        self,
        index: int = 0,
        hung_after_s: float = 10.0,
        *,
        period_s: float | None = None,
        nvml: Any = _IMPORT,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.index = index
        self.hung_after_s = hung_after_s
        self.period_s = period_s
        self._nvml = nvml
        self._clock = clock
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sample: GpuSample | None = None
        self._published = 0
        self._xids: list[int] = []
        self._busy: tuple[float, str] | None = None  # (since, call); swapped atomically by the worker

    # ----------------------------------------------------------- lifecycle

    def start(self) -> bool:
        """Start the worker, which polls at once. False (a no-op) while a worker is alive, even a stuck one."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return False
            self._stop.clear()
            self._wake.set()
            self._thread = threading.Thread(target=self._run, name=f"nvml-{self.index}", daemon=True)
            self._thread.start()
            return True

    def close(self, join_s: float = 0.5) -> None:
        """Ask the worker to shut NVML down and exit; waits at most join_s (it may be stuck)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    def request(self) -> None:
        """Ask for a fresh poll. Returns at once; requests made during a poll coalesce."""
        self._wake.set()

    # -------------------------------------------------------------- reading

    def latest(self, now: float) -> GpuSample:
        """The newest sample, with age_s and hung filled in for `now` (same clock as time.monotonic)."""
        with self._cond:
            sample = self._sample
            xids = tuple(self._xids)
            self._xids.clear()
        busy = self._busy
        if sample is None:
            sample = GpuSample(GpuStatus.PENDING, "waiting for the first NVML reading", index=self.index)
        age = now - sample.taken_at if sample.taken_at is not None else None
        hung = busy is not None and now - busy[0] > self.hung_after_s
        detail = sample.detail
        if hung:
            detail = f"NVML call {busy[1]} has not returned for {now - busy[0]:.1f} s"
        return dataclasses.replace(sample, age_s=age, hung=hung, detail=detail, xid_errors=xids)

    def wait_sample(self, timeout_s: float) -> GpuSample:
        """Request a poll and wait up to timeout_s for it (for one-shot callers such as the CLI)."""
        with self._cond:
            seen = self._published
        if not self.start():
            self.request()
        deadline = self._clock() + timeout_s
        with self._cond:
            arrived = self._cond.wait_for(lambda: self._published > seen, max(0.0, deadline - self._clock()))
        sample = self.latest(self._clock())
        if not arrived and not sample.hung:
            busy = self._busy
            where = f" (inside {busy[1]})" if busy else ""
            sample = dataclasses.replace(sample, hung=True, detail=f"NVML did not answer within {timeout_s:g} s{where}")
        return sample

    # --------------------------------------------------------------- worker

    def _mark_call(self, fname: str | None) -> None:
        self._busy = (self._clock(), fname) if fname is not None else None

    def _run(self) -> None:
        nvml = load_pynvml() if self._nvml is _IMPORT else self._nvml
        session = _NvmlSession(nvml, self.index, self._mark_call, self._clock)
        try:
            while True:
                self._wake.wait(self.period_s)
                if self._stop.is_set():
                    break
                self._wake.clear()
                try:
                    sample = session.poll()
                except Exception as exc:  # a bug here must not kill the only worker
                    sample = GpuSample(GpuStatus.ERROR, f"NVML probe failed: {type(exc).__name__}: {exc}", index=self.index, taken_at=self._clock())
                with self._cond:
                    self._xids.extend(session.xids)
                    session.xids.clear()
                    self._sample = sample
                    self._published += 1
                    self._cond.notify_all()
        finally:
            session.close()


def read_gpu(index: int, timeout_s: float = 10.0, *, nvml: Any = _IMPORT) -> GpuSample:
    """One bounded reading, for commands that run once. A stuck NVML reads as hung, not as a hang."""
    monitor = NvmlMonitor(index, hung_after_s=timeout_s, nvml=nvml)
    sample = None
    try:
        sample = monitor.wait_sample(timeout_s)
        return sample
    finally:
        # Let a healthy worker shut NVML down; never wait on a stuck one.
        monitor.close(join_s=1.0 if sample is not None and not sample.hung else 0.0)


# ------------------------------------------------------------------ JSON codec


def sample_to_dict(sample: GpuSample) -> dict:
    data = dataclasses.asdict(sample)
    data["status"] = sample.status.value
    return data


def sample_from_dict(data: dict) -> GpuSample:
    names = {f.name for f in dataclasses.fields(GpuSample)}
    values = {k: v for k, v in data.items() if k in names}
    values["status"] = GpuStatus(values["status"])
    for key in ("compute_capability", "clock_event_reasons", "xid_errors", "field_errors"):
        if values.get(key) is not None:
            values[key] = tuple(values[key])
    for key in ("processes", "graphics_processes"):
        if values.get(key) is not None:
            values[key] = tuple(GpuProcess(int(p["pid"]), p.get("used_bytes")) for p in values[key])
    return GpuSample(**values)


def _processes(procs) -> tuple[GpuProcess, ...] | None:
    """NVML's process list as samples; None when the call is not supported."""
    if procs is None:
        return None
    return tuple(GpuProcess(int(p.pid), _int(getattr(p, "usedGpuMemory", None))) for p in procs)
