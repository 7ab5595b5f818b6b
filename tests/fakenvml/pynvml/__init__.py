"""A stand-in for pynvml (nvidia-ml-py) on a machine without a GPU.

Put this directory first on PYTHONPATH of a process under test. The real
binding's constants and error classes are loaded and re-exported, so error
handling meets what the real binding raises; only the calls into the driver
are replaced. The card is described by the JSON file named in
$R3090D_FAKE_NVML, re-read on every call, so a test can change what the card
reports (memory used, a lost GPU) while the daemon runs.

`"xids": [31, 79]` in the card are XID events, each delivered once by
nvmlEventSetWait in order (append to the list to raise another).
`"recovery_action": N` is what nvmlDeviceGetFieldValues answers for the GPU
recovery action field; without it that field answers NotSupported, as on a
GeForce card.

`"hang": true` in the card makes every call that reads the card block, as a
driver stuck in D state does, until the key is cleared (write the file
atomically: a half-written file reads as still hanging).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

_HERE = Path(__file__).resolve().parent.parent


def _load_real():
    paths = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("pynvml", paths)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_real = _load_real()
for _name in dir(_real):
    if _name.startswith(("NVML_", "NVMLError", "nvmlClocks", "nvmlEventType", "nvmlMemory_v")):
        globals()[_name] = getattr(_real, _name)
NVMLError = _real.NVMLError

MIB = 1024 * 1024
HANG_POLL_S = 0.05


def _read_card() -> dict:
    return json.loads(Path(os.environ["R3090D_FAKE_NVML"]).read_text())


def _card() -> dict:
    card = _read_card()
    while card.get("hang"):
        time.sleep(HANG_POLL_S)
        try:
            card = _read_card()
        except ValueError:
            pass  # caught mid-write: the call stays stuck until the file reads whole
    fail = card.get("fail")  # e.g. "GPU_IS_LOST": every call raises that NVML error
    if fail:
        raise NVMLError(getattr(_real, "NVML_ERROR_" + fail))
    return card


def nvmlInit():
    _card()


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return _card().get("count", 1)


def nvmlDeviceGetHandleByIndex(index):
    if index >= nvmlDeviceGetCount():
        raise NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
    return index


def nvmlDeviceGetName(handle):
    return _card().get("name", "NVIDIA GeForce RTX 3090")


def nvmlDeviceGetUUID(handle):
    return _card().get("uuid", "GPU-00000000-fake-3090")


def nvmlSystemGetDriverVersion():
    return _card().get("driver", "580.95.05")


def nvmlSystemGetCudaDriverVersion_v2():
    return _card().get("cuda", 13000)


def nvmlDeviceGetCudaComputeCapability(handle):
    return tuple(_card().get("cc", (8, 6)))


def nvmlDeviceGetMemoryInfo(handle, version=None):
    card = _card()
    total = card.get("memory_total_mib", 24576) * MIB
    used = card.get("memory_used_mib", 0) * MIB
    reserved = card.get("memory_reserved_mib", 300) * MIB
    free = total - used - reserved
    if version:
        return SimpleNamespace(version=version, total=total, reserved=reserved, free=free, used=used)
    return SimpleNamespace(total=total, free=free, used=used + reserved)


def nvmlDeviceGetUtilizationRates(handle):
    return SimpleNamespace(gpu=_card().get("util", 0), memory=0)


def nvmlDeviceGetTemperature(handle, sensor):
    return _card().get("temperature", 45)


def nvmlDeviceGetPowerUsage(handle):
    return int(_card().get("power_w", 100) * 1000)


def nvmlDeviceGetEnforcedPowerLimit(handle):
    return int(_card().get("power_limit_w", 350) * 1000)


def nvmlDeviceGetClockInfo(handle, clock):
    return 1695 if clock == _real.NVML_CLOCK_SM else 9751


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return _card().get("clock_event_reasons", 0)


def nvmlDeviceGetCurrPcieLinkWidth(handle):
    return _card().get("pcie_width", 16)


def nvmlDeviceGetMaxPcieLinkWidth(handle):
    return 16


def nvmlDeviceGetCurrPcieLinkGeneration(handle):
    return _card().get("pcie_gen", 4)


def nvmlDeviceGetMaxPcieLinkGeneration(handle):
    return 4


def nvmlDeviceGetPersistenceMode(handle):
    return 1 if _card().get("persistence", False) else 0


def nvmlDeviceGetComputeRunningProcesses_v3(handle):
    return [SimpleNamespace(pid=p, usedGpuMemory=m * MIB) for p, m in _card().get("processes", [])]


def nvmlDeviceGetGraphicsRunningProcesses_v3(handle):
    return [SimpleNamespace(pid=p, usedGpuMemory=m * MIB) for p, m in _card().get("graphics_processes", [])]


def nvmlEventSetCreate():
    return "event-set"


def nvmlDeviceRegisterEvents(handle, types, event_set):
    pass


_xids_delivered = 0  # how many of the card's "xids" this process has handed out


def nvmlEventSetWait(event_set, timeout_ms):
    global _xids_delivered
    xids = _card().get("xids", [])
    if _xids_delivered >= len(xids):
        raise NVMLError(_real.NVML_ERROR_TIMEOUT)
    xid = xids[_xids_delivered]
    _xids_delivered += 1
    return SimpleNamespace(eventType=_real.nvmlEventTypeXidCriticalError, eventData=xid)


def nvmlDeviceGetFieldValues(handle, field_ids):
    card = _card()
    out = []
    for field_id in field_ids:
        action = card.get("recovery_action") if field_id == getattr(_real, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None) else None
        code = _real.NVML_SUCCESS if action is not None else _real.NVML_ERROR_NOT_SUPPORTED
        out.append(SimpleNamespace(fieldId=field_id, nvmlReturn=code, value=SimpleNamespace(uiVal=action or 0)))
    return out


def nvmlEventSetFree(event_set):
    pass
