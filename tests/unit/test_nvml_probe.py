"""The NVML probe against a fake at the pynvml boundary.

The fake carries the real pynvml's error classes and constants (importing
pynvml needs no GPU), so the probe's error handling meets the exceptions
the real binding raises; only the C calls are replaced.
"""

from __future__ import annotations

import ast
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml as real
import pytest

from r3090d.config import WatchdogConfig
from r3090d.core.snapshot import GpuStatus
from r3090d.probes import nvml as probe
from r3090d.units import GIB, MIB
from tests.waiting import wait_until

PACKAGE = Path(probe.__file__).resolve().parents[1]


def err(code_name: str) -> Exception:
    return real.NVMLError(getattr(real, "NVML_ERROR_" + code_name))


class FakeNvml:
    """pynvml's surface: real constants and errors, scripted calls.

    A response is a value, an exception instance (raised), or a callable
    (called with the call's arguments). Functions with no response are
    absent, as in an older binding.
    """

    NVMLError = real.NVMLError

    def __init__(self, responses: dict):
        for attr in dir(real):
            value = getattr(real, attr)
            if attr.startswith(("NVML_", "nvmlClocks", "nvmlEventType", "nvmlMemory_v2")) and isinstance(value, int):
                setattr(self, attr, value)
        self.responses = dict(responses)
        self.calls: list[str] = []
        self.threads: set[str] = set()

    def __getattr__(self, name):
        responses = self.__dict__.get("responses", {})
        if name not in responses:
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append(name)
            self.threads.add(threading.current_thread().name)
            response = self.responses[name]
            if isinstance(response, BaseException):
                raise response
            return response(*args, **kwargs) if callable(response) else response

        return call


def memory(h, version=None):
    total, reserved, free = 24 * GIB, 300 * MIB, 20 * GIB
    if version:
        return SimpleNamespace(version=version, total=total, reserved=reserved, free=free, used=total - reserved - free)
    return SimpleNamespace(total=total, free=free, used=total - free)


def rtx3090(**overrides) -> dict:
    xids: list[int] = []
    responses = {
        "nvmlInit": None,
        "nvmlShutdown": None,
        "nvmlDeviceGetCount": 1,
        "nvmlDeviceGetHandleByIndex": lambda i: f"handle-{i}",
        "nvmlDeviceGetName": "NVIDIA GeForce RTX 3090",
        "nvmlDeviceGetUUID": "GPU-3090",
        "nvmlSystemGetDriverVersion": "535.183.01",
        "nvmlSystemGetCudaDriverVersion_v2": 12020,
        "nvmlDeviceGetCudaComputeCapability": (8, 6),
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=37, memory=12),
        "nvmlDeviceGetTemperature": 61,
        "nvmlDeviceGetPowerUsage": 215_500,
        "nvmlDeviceGetEnforcedPowerLimit": 350_000,
        "nvmlDeviceGetClockInfo": lambda h, clock: {real.NVML_CLOCK_SM: 1695, real.NVML_CLOCK_MEM: 9751}[clock],
        "nvmlDeviceGetCurrentClocksEventReasons": real.nvmlClocksEventReasonSwPowerCap | real.nvmlClocksEventReasonHwThermalSlowdown,
        "nvmlDeviceGetCurrPcieLinkWidth": 16,
        "nvmlDeviceGetMaxPcieLinkWidth": 16,
        "nvmlDeviceGetCurrPcieLinkGeneration": 1,
        "nvmlDeviceGetMaxPcieLinkGeneration": 4,
        "nvmlDeviceGetPersistenceMode": 0,
        "nvmlDeviceGetComputeRunningProcesses_v3": [SimpleNamespace(pid=4242, usedGpuMemory=21 * GIB)],
        "nvmlEventSetCreate": "event-set",
        "nvmlDeviceRegisterEvents": None,
        "nvmlEventSetWait": lambda es, timeout: _next_xid(xids),
        "nvmlEventSetFree": None,
    }
    responses.update(overrides)
    fake = FakeNvml(responses)
    fake.xids = xids
    return fake


def _next_xid(queue: list[int]):
    if not queue:
        raise err("TIMEOUT")
    return SimpleNamespace(eventType=real.nvmlEventTypeXidCriticalError, eventData=queue.pop(0))


def read(fake, index=0, timeout=5.0):
    return probe.read_gpu(index, timeout, nvml=fake)


# ------------------------------------------------------------------ readings


def test_healthy_reading_maps_every_field():
    s = read(rtx3090())
    assert s.status is GpuStatus.OK and s.usable and not s.field_errors
    assert (s.name, s.uuid, s.driver_version, s.cuda_driver_version) == ("NVIDIA GeForce RTX 3090", "GPU-3090", "535.183.01", 12020)
    assert s.compute_capability == (8, 6)
    # v2: used excludes the driver's reserved memory
    assert s.memory_total == 24 * GIB and s.memory_reserved == 300 * MIB
    assert s.memory_used == s.memory_total - s.memory_reserved - s.memory_free
    assert (s.utilization_gpu, s.utilization_memory, s.temperature_c) == (37, 12, 61)
    assert s.power_w == pytest.approx(215.5) and s.power_limit_w == pytest.approx(350.0)
    assert (s.sm_clock_mhz, s.mem_clock_mhz) == (1695, 9751)
    assert s.clock_event_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert (s.pcie_width, s.pcie_width_max, s.pcie_gen, s.pcie_gen_max) == (16, 16, 1, 4)
    assert s.persistence_mode is False
    assert [(p.pid, p.used_bytes) for p in s.processes] == [(4242, 21 * GIB)]
    assert s.xid_monitored and s.xid_errors == ()
    assert s.taken_at is not None and s.age_s is not None and s.age_s >= 0


def test_all_calls_run_on_the_worker_thread_only():
    fake = rtx3090()
    read(fake)
    assert fake.threads == {"nvml-0"}
    assert fake.calls.count("nvmlInit") == 1


def test_memory_v1_fallback_when_v2_is_not_there():
    s = read(rtx3090(nvmlDeviceGetMemoryInfo=lambda h, version=None: (_ for _ in ()).throw(err("FUNCTION_NOT_FOUND")) if version else memory(h)))
    assert s.status is GpuStatus.OK
    assert s.memory_total == 24 * GIB and s.memory_used == 4 * GIB and s.memory_reserved is None
    assert not s.field_errors


def test_memory_v1_fallback_on_version_mismatch():
    s = read(rtx3090(nvmlDeviceGetMemoryInfo=lambda h, version=None: (_ for _ in ()).throw(err("ARGUMENT_VERSION_MISMATCH")) if version else memory(h)))
    assert s.memory_free == 20 * GIB and s.memory_reserved is None and not s.field_errors


def test_not_supported_reads_as_not_measured():
    ns = err("NOT_SUPPORTED")
    s = read(rtx3090(
        nvmlDeviceGetPowerUsage=ns, nvmlDeviceGetEnforcedPowerLimit=ns, nvmlDeviceGetCurrPcieLinkWidth=ns,
        nvmlDeviceGetPersistenceMode=ns, nvmlDeviceGetComputeRunningProcesses_v3=ns, nvmlDeviceGetTemperature=ns,
        nvmlDeviceGetCurrentClocksEventReasons=ns, nvmlDeviceRegisterEvents=ns,
    ))  # fmt: skip
    assert s.status is GpuStatus.OK and s.usable
    assert s.power_w is None and s.power_limit_w is None and s.pcie_width is None and s.temperature_c is None
    assert s.persistence_mode is None and s.processes is None and s.clock_event_reasons is None
    assert s.pcie_width_max == 16  # the neighbours still read
    assert not s.xid_monitored and s.xid_errors == ()
    assert s.field_errors == ()  # NotSupported is not an error


def test_older_api_generation_is_used_when_the_newer_one_is_missing():
    fake = rtx3090(nvmlDeviceGetCurrentClocksEventReasons=err("FUNCTION_NOT_FOUND"), nvmlDeviceGetCurrentClocksThrottleReasons=real.nvmlClocksThrottleReasonGpuIdle)
    del fake.responses["nvmlDeviceGetComputeRunningProcesses_v3"]
    fake.responses["nvmlDeviceGetComputeRunningProcesses_v2"] = []
    s = read(fake)
    assert s.clock_event_reasons == ("gpu_idle",)
    assert s.processes == ()


def test_other_errors_are_recorded_not_raised():
    s = read(rtx3090(nvmlDeviceGetPowerUsage=err("NO_PERMISSION"), nvmlDeviceGetTemperature=RuntimeError("ctypes blew up")))
    assert s.status is GpuStatus.OK
    assert s.power_w is None and s.temperature_c is None
    assert any(e.startswith("nvmlDeviceGetPowerUsage: Insufficient Permissions") for e in s.field_errors)
    assert any("RuntimeError: ctypes blew up" in e for e in s.field_errors)


@pytest.mark.parametrize("code", ["GPU_IS_LOST", "UNKNOWN"])
def test_lost_gpu(code):
    s = read(rtx3090(nvmlDeviceGetPowerUsage=err(code)))
    assert s.status is GpuStatus.LOST and s.lost and not s.usable
    assert "reboot" in s.detail and "nvmlDeviceGetPowerUsage" in s.detail
    assert s.name == "NVIDIA GeForce RTX 3090"  # what was known before the loss is kept


def test_lost_while_opening_the_device():
    s = read(rtx3090(nvmlDeviceGetHandleByIndex=err("GPU_IS_LOST")))
    assert s.status is GpuStatus.LOST and s.lost


def test_missing_python_binding():
    s = read(None)
    assert s.status is GpuStatus.NO_LIBRARY and s.detail.startswith("no NVIDIA driver")


def test_load_pynvml_returns_none_when_the_import_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert probe.load_pynvml() is None


def test_missing_shared_library():
    s = read(rtx3090(nvmlInit=err("LIBRARY_NOT_FOUND")))
    assert s.status is GpuStatus.NO_LIBRARY and "libnvidia-ml.so.1" in s.detail and s.detail.startswith("no NVIDIA driver")


def test_driver_not_loaded():
    s = read(rtx3090(nvmlInit=err("DRIVER_NOT_LOADED")))
    assert s.status is GpuStatus.NO_DRIVER and s.detail.startswith("no NVIDIA driver")


def test_no_gpu_when_count_is_zero():
    s = read(rtx3090(nvmlDeviceGetCount=0))
    assert s.status is GpuStatus.NO_GPU and "0 found" in s.detail


def test_no_gpu_at_an_index_out_of_range():
    s = read(rtx3090(), index=3)
    assert s.status is GpuStatus.NO_GPU and "index 3" in s.detail


def test_init_is_retried_after_a_failure_and_done_once_after_success():
    attempts = []

    def init():
        attempts.append(1)
        if len(attempts) == 1:
            raise err("DRIVER_NOT_LOADED")

    fake = rtx3090(nvmlInit=init)
    mon = probe.NvmlMonitor(0, 5.0, nvml=fake)
    try:
        assert mon.wait_sample(5).status is GpuStatus.NO_DRIVER
        assert mon.wait_sample(5).status is GpuStatus.OK
        assert mon.wait_sample(5).status is GpuStatus.OK
    finally:
        mon.close()
    assert len(attempts) == 2


def test_xids_are_drained_and_handed_out_once():
    fake = rtx3090()
    fake.xids.extend([79, 48])
    mon = probe.NvmlMonitor(0, 5.0, nvml=fake)
    try:
        assert mon.wait_sample(5).xid_errors == (79, 48)
        assert mon.latest(time.monotonic()).xid_errors == ()
        fake.xids.append(13)
        assert mon.wait_sample(5).xid_errors == (13,)
        assert mon.wait_sample(5).xid_errors == ()
    finally:
        mon.close()


def test_xid_registration_error_other_than_not_supported_is_recorded():
    s = read(rtx3090(nvmlDeviceRegisterEvents=err("NO_PERMISSION")))
    assert s.status is GpuStatus.OK and not s.xid_monitored
    assert any("nvmlDeviceRegisterEvents" in e for e in s.field_errors)


def test_close_shuts_nvml_down_on_the_worker():
    fake = rtx3090()
    mon = probe.NvmlMonitor(0, 5.0, nvml=fake)
    mon.wait_sample(5)
    mon.close(join_s=5)
    assert fake.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]
    assert fake.threads == {"nvml-0"}


# --------------------------------------------------------------------- hangs


def test_a_call_that_never_returns_reads_hung_while_the_loop_ticks_on():
    release = threading.Event()
    polls = []

    def power(h):
        polls.append(1)
        if len(polls) >= 2:  # the second poll blocks, as a driver in D state does
            release.wait()
        return 100_000

    hung_after, period = 0.3, 0.05
    fake = rtx3090(nvmlDeviceGetPowerUsage=power)
    mon = probe.NvmlMonitor(0, hung_after, period_s=period, nvml=fake)
    try:
        first = mon.wait_sample(5)  # starts the worker; its first poll answers
        assert first.usable
        blocked_at = None
        slowest = 0.0

        def tick():  # the daemon's loop, a tick every 20 ms: (when, sample) once the sample reads hung
            nonlocal blocked_at, slowest
            t0 = time.monotonic()
            s = mon.latest(t0)
            slowest = max(slowest, time.monotonic() - t0)
            if blocked_at is None and len(polls) >= 2:
                blocked_at = t0
            return (t0, s) if s.hung else None

        hung_at, s = wait_until(tick, 5, what="latest() to read hung", interval=0.02)
        assert hung_at - blocked_at <= hung_after + period + 0.2
        assert slowest < 0.05  # latest() never waits on NVML
        assert not s.usable and "nvmlDeviceGetPowerUsage" in s.detail
        assert s.status is GpuStatus.OK and s.age_s >= hung_after  # the last good sample, aged
        # Asking again starts no second worker while this one is stuck.
        mon.start()
        mon.request()
        time.sleep(0.1)  # time passing on purpose: room for a second worker to appear, were one started
        assert [t.name for t in threading.enumerate()].count("nvml-0") == 1
        assert mon.latest(time.monotonic()).hung
    finally:
        release.set()
        mon.close(join_s=2)
    assert not mon.latest(time.monotonic()).hung


def test_read_gpu_is_bounded_when_init_hangs():
    release = threading.Event()
    fake = rtx3090(nvmlInit=lambda: release.wait())
    t0 = time.monotonic()
    try:
        s = probe.read_gpu(0, 0.3, nvml=fake)
    finally:
        release.set()
    assert time.monotonic() - t0 < 2.0
    assert s.hung and not s.usable and "nvmlInit" in s.detail


# ------------------------------------------------------------ constants, codec


def test_reason_names_cover_the_configured_throttle_reasons():
    names = set(probe.clock_reason_table(real).values())
    assert set(WatchdogConfig().throttle_warn_reasons) <= names
    assert {"gpu_idle", "sw_power_cap", "hw_slowdown", "sync_boost"} <= names
    assert "user_defined_clocks" not in names  # deprecated alias


def test_unknown_reason_bits_are_kept():
    table = probe.clock_reason_table(real)
    assert probe.decode_clock_reasons(1 | (1 << 40), table) == ("gpu_idle", f"unknown_{1 << 40:#x}")


def test_sample_json_round_trip():
    s = read(rtx3090())
    assert probe.sample_from_dict(probe.sample_to_dict(s)) == s


def test_real_pynvml_on_this_machine_never_raises():
    s = probe.read_gpu(0, 10.0)
    if s.status is GpuStatus.OK:
        pytest.skip("this machine has a GPU")
    assert s.status in (GpuStatus.NO_LIBRARY, GpuStatus.NO_DRIVER)
    assert s.detail.startswith("no NVIDIA driver")


# ------------------------------------------------------------------- imports


def _imports_pynvml(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pynvml" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pynvml":
            return True
        if isinstance(node, ast.Constant) and node.value == "pynvml":
            return True  # importlib.import_module("pynvml") and friends
    return False


def test_only_the_probe_imports_pynvml():
    importers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _imports_pynvml(p))
    assert importers == ["probes/nvml.py"]


# ------------------------------------------------------------------ the driver's recovery action


def field_values(action=None, code=None):
    """nvmlDeviceGetFieldValues as the driver answers it: a return code per field."""

    def call(h, ids):
        assert ids == [real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        rc = code if code is not None else (real.NVML_SUCCESS if action is not None else real.NVML_ERROR_NOT_SUPPORTED)
        return [SimpleNamespace(fieldId=ids[0], nvmlReturn=rc, value=SimpleNamespace(uiVal=action or 0))]

    return call


@pytest.mark.parametrize("code, expected", [(0, "none"), (1, "gpu_reset"), (2, "node_reboot"), (3, "drain_p2p"), (4, "drain_and_reset")])
def test_the_recovery_action_field_is_read(code, expected):
    s = read(rtx3090(nvmlDeviceGetFieldValues=field_values(code)))
    assert s.recovery_action is not None and s.recovery_action.value == expected and not s.field_errors


def test_a_recovery_action_not_supported_is_no_verdict_and_no_error():
    s = read(rtx3090(nvmlDeviceGetFieldValues=field_values(None)))
    assert s.recovery_action is None and not any("RECOVERY" in e for e in s.field_errors)
    s = read(rtx3090())  # a binding or a driver without nvmlDeviceGetFieldValues
    assert s.recovery_action is None and s.status is GpuStatus.OK


def test_a_recovery_action_field_that_fails_otherwise_is_recorded():
    s = read(rtx3090(nvmlDeviceGetFieldValues=field_values(code=real.NVML_ERROR_NO_PERMISSION)))
    assert s.recovery_action is None and any("GPU_RECOVERY_ACTION" in e and "NO_PERMISSION" in e for e in s.field_errors)


def test_after_a_lost_gpu_nvml_is_opened_afresh_so_a_card_that_comes_back_is_seen():
    lost = {"now": True}

    def power(h):
        if lost["now"]:
            raise err("GPU_IS_LOST")
        return 215_500

    fake = rtx3090(nvmlDeviceGetPowerUsage=power)
    mon = probe.NvmlMonitor(0, 5.0, nvml=fake)
    try:
        assert mon.wait_sample(5).status is GpuStatus.LOST
        inits = fake.calls.count("nvmlInit")
        lost["now"] = False  # the card was reset
        assert mon.wait_sample(5).status is GpuStatus.OK
        assert fake.calls.count("nvmlInit") == inits + 1 and "nvmlShutdown" in fake.calls
    finally:
        mon.close()
