"""The ctypes binding of the driver's process checkpoint calls, on a machine without a GPU.

The struct layouts are checked against cuda.h: against numbers copied from the
CUDA 13.0 header always, and against the header itself, compiled, where one and
a C compiler are installed.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from r3090d.core.suspend_types import ProcessState, Step
from r3090d.effectors import checkpoint as ck

# sizeof and offsetof as cuda.h (CUDA 13.0, x86-64) lays them out.
HEADER_LAYOUT = {
    "CUcheckpointLockArgs": (ck.LockArgs, 64, {"timeoutMs": 0, "reserved0": 4, "reserved1": 8}),
    "CUcheckpointCheckpointArgs": (ck.CheckpointArgs, 64, {"reserved": 0}),
    "CUcheckpointGpuPair": (ck.GpuPair, 32, {"oldUuid": 0, "newUuid": 16}),
    "CUcheckpointRestoreArgs": (ck.RestoreArgs, 64, {"gpuPairs": 0, "gpuPairsCount": 8, "reserved": 12, "reserved1": 56}),
    "CUcheckpointUnlockArgs": (ck.UnlockArgs, 64, {"reserved": 0}),
}
CUDA_HEADERS = [Path("/usr/local/cuda/include/cuda.h"), *sorted(Path("/usr/local").glob("cuda-*/include/cuda.h"))]


def ctypes_layout(struct) -> tuple[int, dict[str, int]]:
    return ctypes.sizeof(struct), {name: getattr(struct, name).offset for name, *_ in struct._fields_}


@pytest.mark.parametrize("c_name", sorted(HEADER_LAYOUT))
def test_struct_layout_matches_the_header(c_name):
    struct, size, offsets = HEADER_LAYOUT[c_name]
    assert ctypes_layout(struct) == (size, offsets)
    assert [name for name, *_ in struct._fields_] == list(offsets)  # declaration order too


def test_struct_layout_matches_an_installed_cuda_h(tmp_path):
    header = next((h for h in CUDA_HEADERS if h.is_file() and "cuCheckpointProcessLock" in h.read_text(errors="replace")), None)
    cc = shutil.which("cc") or shutil.which("gcc")
    if header is None or cc is None:
        pytest.skip("no cuda.h with the checkpoint calls, or no C compiler, on this machine")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "cuda.h"', "int main(void) {"]
    for c_name, (_, _, offsets) in HEADER_LAYOUT.items():
        lines.append(f'printf("{c_name} size %zu\\n", sizeof({c_name}));')
        lines += [f'printf("{c_name} {f} %zu\\n", offsetof({c_name}, {f}));' for f in offsets]
    for state in ("RUNNING", "LOCKED", "CHECKPOINTED", "FAILED"):
        lines.append(f'printf("state {state} %d\\n", (int)CU_PROCESS_STATE_{state});')
    lines += ['printf("CUprocessState size %zu\\n", sizeof(CUprocessState));', "return 0; }"]
    (tmp_path / "layout.c").write_text("\n".join(lines))
    subprocess.run([cc, "-I", str(header.parent), "-o", str(tmp_path / "layout"), str(tmp_path / "layout.c")], check=True)
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout.split("\n")
    seen = dict((" ".join(w[:2]), int(w[2])) for w in (line.split() for line in out) if len(w) == 3)
    for c_name, (struct, _, _) in HEADER_LAYOUT.items():
        size, offsets = ctypes_layout(struct)
        assert seen[f"{c_name} size"] == size, c_name
        for f, offset in offsets.items():
            assert seen[f"{c_name} {f}"] == offset, f"{c_name}.{f}"
    for state in ("RUNNING", "LOCKED", "CHECKPOINTED", "FAILED"):
        assert seen[f"state {state}"] == ProcessState[state].value
    assert seen["CUprocessState size"] == ctypes.sizeof(ctypes.c_int)  # GetState writes a C int


def test_importing_the_binding_loads_no_library():
    # A spy on ctypes.CDLL: this machine may have no libcuda to find in /proc/self/maps.
    code = (
        "import ctypes, json\n"
        "opened = []\n"
        "class Spy(ctypes.CDLL):\n"
        "    def __init__(self, name, *a, **k):\n"
        "        opened.append(name)\n"
        "        super().__init__(name, *a, **k)\n"
        "ctypes.CDLL = Spy\n"
        "import r3090d.effectors.checkpoint as ck, r3090d.effectors.suspender, r3090d.effectors.suspender_worker\n"
        "at_import = list(opened)\n"
        "ck.available()\n"
        "print(json.dumps([at_import, opened, 'libcuda' in open('/proc/self/maps').read()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    at_import, after_available, _ = json.loads(out)
    assert at_import == []
    assert after_available == [ck.LIBRARY]  # the spy sees the one load available() does


def test_available_without_a_driver_says_why():
    ok, reason = ck.available("libcuda-absent-for-this-test.so.1")
    assert ok is False
    assert "libcuda-absent-for-this-test.so.1 cannot be loaded" in reason
    assert "\n" not in reason


def test_available_on_this_machine_is_false_with_a_reason():
    try:
        ctypes.CDLL(ck.LIBRARY)
    except OSError:
        pass
    else:
        pytest.skip("this machine has libcuda.so.1")
    ok, reason = ck.available()
    assert ok is False and ck.LIBRARY in reason


def test_available_names_missing_symbols():
    ok, reason = ck.available("libc.so.6")  # loads, but is no CUDA driver
    assert ok is False
    assert "lacks cuInit, cuDriverGetVersion, cuCheckpointProcessLock" in reason


@pytest.mark.parametrize(
    ("version", "ok", "text"),
    [
        (12040, False, "supports CUDA 12.4; process checkpointing needs CUDA 12.8 (driver 570 or newer)"),
        (12080, True, "driver API 12.8"),
        (13000, True, "driver API 13.0"),
        (None, False, "did not answer"),
    ],
)
def test_judge_driver_versions(version, ok, text):
    got_ok, reason = ck.judge(version, ())
    assert got_ok is ok and text in reason


def test_process_state_values_and_unknown_codes():
    assert [ProcessState.from_code(i) for i in range(4)] == [
        ProcessState.RUNNING, ProcessState.LOCKED, ProcessState.CHECKPOINTED, ProcessState.FAILED,
    ]  # fmt: skip
    assert ProcessState.from_code(42) is ProcessState.UNKNOWN


def test_checkpoint_error_names_step_code_and_name():
    err = ck.CheckpointError(Step.LOCK, 304)
    assert (err.step, err.code, err.name) == (Step.LOCK, 304, "CUDA_ERROR_OPERATING_SYSTEM")
    assert str(err) == "lock: CUDA_ERROR_OPERATING_SYSTEM (304)"
    assert ck.CheckpointError(Step.CHECKPOINT, 801).name == "CUDA_ERROR_NOT_SUPPORTED"
    assert ck.CheckpointError(Step.RESTORE, 12345).name == "CUDA_ERROR_12345"


def test_the_real_driver_fails_cleanly_without_libcuda():
    driver = ck.CudaDriver("libcuda-absent-for-this-test.so.1")
    with pytest.raises(ck.CheckpointError) as info:
        driver.state(1)
    assert info.value.step is Step.INIT


def test_load_driver_without_a_driver_gives_a_reason(monkeypatch):
    monkeypatch.delenv(ck.FAKE_ENV, raising=False)
    monkeypatch.setattr(ck, "available", lambda library=ck.LIBRARY: (False, "no driver"))
    assert ck.load_driver() == (None, "no driver")


def test_load_driver_names_the_fix_when_the_fake_is_not_importable(monkeypatch, tmp_path):
    monkeypatch.setenv(ck.FAKE_ENV, str(tmp_path / "control.json"))
    monkeypatch.setattr(ck, "FAKE_MODULE", "r3090d_fakecuda_not_on_the_path")
    driver, reason = ck.load_driver()
    assert driver is None and "PYTHONPATH" in reason and ck.FAKE_ENV in reason
