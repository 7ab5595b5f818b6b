"""The CUDA driver's process checkpoint calls, through ctypes against libcuda.so.1.

From driver 570 (CUDA 12.8) the driver can move every byte a process holds on
the GPU into that process's own host memory and back, without restarting it:

    lock (waits for in-flight work) -> checkpoint (GPU memory to host)
    restore (host to GPU, leaves it locked) -> unlock (CUDA calls flow again)

The caller needs cuInit only, never a context. The calls are declared in cuda.h
(CUDA_CHECKPOINT group; cudaTypedefs.h names them PFN_cuCheckpointProcess*_v12080,
so they are part of the CUDA 12.8 driver API and libcuda exports them from r570).

ctypes rather than NVIDIA's cuda-bindings: the daemon needs six entry points
and four 64-byte argument structs, and cuda-bindings is a compiled package whose
wheel is tied to a CUDA major version; a ctypes binding follows whatever driver
the host has and adds no dependency.

Nothing here loads libcuda at import: the library is opened on the first call
of `available()` or of a `CudaDriver` method, and only in the process that runs
them (the suspender's worker, never the daemon). Nothing here creates a context.

Test hook: when $R3090D_FAKE_CUDA_CHECKPOINT names a JSON control file,
`load_driver()` returns the fake driver of the module `r3090d_fakecuda`
(tests/fakecuda/, which must then be on PYTHONPATH) instead of the real one.
The variable is meant for tests only; unset, the real driver is always used.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from typing import Protocol

from r3090d.core.suspend_types import ProcessState, Step

LIBRARY = "libcuda.so.1"
# cuDriverGetVersion's encoding (1000 * major + 10 * minor): the checkpoint calls are CUDA 12.8 driver API.
MIN_DRIVER_API = 12080
FAKE_ENV = "R3090D_FAKE_CUDA_CHECKPOINT"
FAKE_MODULE = "r3090d_fakecuda"

CUDA_SUCCESS = 0
# The codes the checkpoint calls are documented to return, and those seen in practice
# (304 for a process of another user, 801 under tensor parallelism). cuda.h's values.
ERROR_NAMES = {
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    100: "CUDA_ERROR_NO_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    802: "CUDA_ERROR_SYSTEM_NOT_READY",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}

_SYMBOLS = (
    "cuInit",
    "cuDriverGetVersion",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class CheckpointError(Exception):
    """A checkpoint call returned an error: which step, the CUresult and its name."""

    def __init__(self, step: Step, code: int, name: str = ""):
        self.step = Step(step)
        self.code = int(code)
        self.name = name or error_name(code)
        super().__init__(f"{self.step}: {self.name} ({self.code})")


def error_name(code: int) -> str:
    return ERROR_NAMES.get(int(code), f"CUDA_ERROR_{int(code)}")


class CheckpointDriver(Protocol):
    """What the suspender needs of the driver. Each call raises CheckpointError on failure."""

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int) -> None: ...

    def unlock(self, pid: int) -> None: ...

    def state(self, pid: int) -> ProcessState: ...


# ----------------------------------------------------------------- cuda.h structs
# Every argument struct is 64 bytes; zeroed, each asks for the default behaviour
# (the header: reserved fields "must be zeroed"). Layouts as in CUDA 13.0's cuda.h;
# CUDA 12.8 declared the restore args as reserved[8], the same 64 zeroed bytes.


class LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),  # 0: no timeout; on timeout the process is left RUNNING
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(GpuPair)),  # NULL: restore onto the GPUs it was checkpointed from
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


class UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


# ---------------------------------------------------------------- the library


def _open(library: str) -> ctypes.CDLL:
    """Open libcuda and declare the calls used here. Raises OSError if it cannot be opened,
    AttributeError if a symbol is missing."""
    lib = ctypes.CDLL(library)
    c_int_p = ctypes.POINTER(ctypes.c_int)
    signatures = {
        "cuInit": (ctypes.c_uint,),
        "cuDriverGetVersion": (c_int_p,),
        "cuCheckpointProcessLock": (ctypes.c_int, ctypes.POINTER(LockArgs)),
        "cuCheckpointProcessCheckpoint": (ctypes.c_int, ctypes.POINTER(CheckpointArgs)),
        "cuCheckpointProcessRestore": (ctypes.c_int, ctypes.POINTER(RestoreArgs)),
        "cuCheckpointProcessUnlock": (ctypes.c_int, ctypes.POINTER(UnlockArgs)),
        "cuCheckpointProcessGetState": (ctypes.c_int, c_int_p),  # CUprocessState is a C enum: int
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int  # CUresult
    return lib


def judge(version: int | None, missing: tuple[str, ...]) -> tuple[bool, str]:
    """Whether a driver with this cuDriverGetVersion answer and these missing symbols can checkpoint."""
    if missing:
        return False, f"{LIBRARY} lacks {', '.join(missing)}: the driver predates process checkpointing (needs 570 or newer)"
    if version is None:
        return False, "cuDriverGetVersion did not answer"
    if version < MIN_DRIVER_API:
        return False, (
            f"the driver supports CUDA {version // 1000}.{version % 1000 // 10}; "
            f"process checkpointing needs CUDA {MIN_DRIVER_API // 1000}.{MIN_DRIVER_API % 1000 // 10} (driver 570 or newer)"
        )
    return True, f"driver API {version // 1000}.{version % 1000 // 10}"


def available(library: str = LIBRARY) -> tuple[bool, str]:
    """(True, driver version) when `library` has the checkpoint calls and a new enough driver; else (False, why).

    Loads the library (in the calling process) but calls neither cuInit nor anything that makes a context.
    """
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        return False, f"{library} cannot be loaded (no NVIDIA driver here?): {exc}"
    missing = tuple(name for name in _SYMBOLS if not hasattr(lib, name))
    if missing:
        return judge(None, missing)
    version = ctypes.c_int(0)
    get_version = lib.cuDriverGetVersion
    get_version.argtypes = (ctypes.POINTER(ctypes.c_int),)
    get_version.restype = ctypes.c_int
    rc = get_version(ctypes.byref(version))
    if rc != CUDA_SUCCESS:
        return False, f"cuDriverGetVersion failed: {error_name(rc)} ({rc})"
    return judge(version.value, ())


class CudaDriver:
    """The real driver. Opens libcuda and calls cuInit (once) on first use."""

    def __init__(self, library: str = LIBRARY):
        self._library = library
        self._lib: ctypes.CDLL | None = None

    def _call(self, step: Step, name: str, *args) -> None:
        lib = self._loaded()
        rc = getattr(lib, name)(*args)
        if rc != CUDA_SUCCESS:
            raise CheckpointError(step, rc)

    def _loaded(self) -> ctypes.CDLL:
        if self._lib is None:
            try:
                lib = _open(self._library)
            except (OSError, AttributeError) as exc:
                raise CheckpointError(Step.INIT, -1, f"{self._library}: {exc}") from None
            rc = lib.cuInit(0)
            if rc != CUDA_SUCCESS:
                raise CheckpointError(Step.INIT, rc)
            self._lib = lib
        return self._lib

    def init(self) -> None:
        """Open the library and call cuInit now, so the first real step's timing excludes them."""
        self._loaded()

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = LockArgs(timeoutMs=max(0, int(timeout_ms)))
        self._call(Step.LOCK, "cuCheckpointProcessLock", int(pid), ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        self._call(Step.CHECKPOINT, "cuCheckpointProcessCheckpoint", int(pid), ctypes.byref(CheckpointArgs()))

    def restore(self, pid: int) -> None:
        self._call(Step.RESTORE, "cuCheckpointProcessRestore", int(pid), ctypes.byref(RestoreArgs()))

    def unlock(self, pid: int) -> None:
        self._call(Step.UNLOCK, "cuCheckpointProcessUnlock", int(pid), ctypes.byref(UnlockArgs()))

    def state(self, pid: int) -> ProcessState:
        value = ctypes.c_int(-1)
        self._call(Step.STATE, "cuCheckpointProcessGetState", int(pid), ctypes.byref(value))
        return ProcessState.from_code(value.value)


def load_driver() -> tuple[CheckpointDriver | None, str]:
    """The driver to use, or None and a one-line reason why there is none.

    The real one, unless $R3090D_FAKE_CUDA_CHECKPOINT is set (the test hook above).
    The real one is initialized here (cuInit), so a host without a usable driver
    is reported now rather than at the first step.
    """
    control = os.environ.get(FAKE_ENV)
    if control:
        try:
            fake = importlib.import_module(FAKE_MODULE)
        except ImportError:
            return None, f"{FAKE_ENV} is set but {FAKE_MODULE} cannot be imported: put tests/fakecuda on PYTHONPATH, or unset {FAKE_ENV}"
        ok, reason = fake.available(control)
        return (fake.driver(control), reason) if ok else (None, reason)
    ok, reason = available()
    if not ok:
        return None, reason
    driver = CudaDriver()
    try:
        driver.init()
    except CheckpointError as exc:
        return None, f"cuInit failed: {exc}"
    return driver, reason
