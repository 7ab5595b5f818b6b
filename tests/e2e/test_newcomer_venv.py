"""A newcomer's first `make` on Debian 12, whose python refuses `pip install` (PEP 668).

In a copy of the checkout (no build/, no venv yet), with python3 on PATH a
python whose stdlib carries EXTERNALLY-MANAGED (tests/managed_python.py): the
old recipe, pip into the system python, is refused there; `make -n demo`
installs into build/venv instead, and `make dev` builds that venv from nothing
and installs r3090d with its extras into it.

It installs from the package index as the newcomer's first make does (about
half a minute with pip's cache, minutes without), so it runs with the slow
tiers of `make test`, not in `make test-fast`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.checkout import copy_checkout
from tests.managed_python import CALLER_SETTINGS, EXTRAS, make_managed_python

pytestmark = pytest.mark.vllm



class Newcomer:
    """A fresh checkout, and make run there with the externally managed python3 first on PATH."""

    def __init__(self, root: Path):
        self.tree = root / "checkout"
        copy_checkout(self.tree)
        self.bin_dir = make_managed_python(root / "debian-python", pip=True)
        self.engine_venv = root / "engine"  # never built here: only `make -n` reaches the engine's recipe
        self.env = {k: v for k, v in os.environ.items() if k not in CALLER_SETTINGS}
        self.env["PATH"] = f"{self.bin_dir}:{self.env.get('PATH', '/usr/bin:/bin')}"
        self.env.pop("PYTHONPATH", None)  # the venv's python must find r3090d by its own install

    def run(self, *argv: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), cwd=cwd or self.tree, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def make(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run("make", f"ENGINE_VENV={self.engine_venv}", *args, timeout=timeout)


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory) -> Newcomer:
    return Newcomer(tmp_path_factory.mktemp("newcomer"))


def test_the_system_python_refuses_pip_as_debians_does(newcomer):
    refused = newcomer.run("python3", "-m", "pip", "install", "-e", ".")
    assert refused.returncode != 0
    assert "externally-managed-environment" in refused.stdout + refused.stderr, (
        refused.stdout + refused.stderr
    )


def test_make_demo_installs_into_a_venv_built_from_scratch(newcomer):
    venv_python = newcomer.tree / "build" / "venv" / "bin" / "python"
    planned = newcomer.make("-n", "demo")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert '"python3" -m venv --clear "build/venv"' in planned.stdout, planned.stdout
    assert f"build/venv/bin/python -m pip install -q -e {EXTRAS}" in planned.stdout, planned.stdout
    assert "build/venv/bin/python -m r3090d --config etc/demo.toml" in planned.stdout, planned.stdout

    built = newcomer.make("dev", timeout=900)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "dev: creating the venv build/venv from python3" in built.stdout, built.stdout
    cfg = (newcomer.tree / "build" / "venv" / "pyvenv.cfg").read_text()
    assert f"home = {newcomer.bin_dir}" in cfg.splitlines(), cfg

    # r3090d from this checkout, and the extras the tests, the demo's model and the plots need.
    code = "import r3090d, pytest, hypothesis, tokenizers, safetensors, matplotlib; print(r3090d.__file__)"
    # Run from /, so that r3090d cannot come from the current folder.
    imported = newcomer.run(str(venv_python), "-c", code, cwd=Path("/"), timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()).is_relative_to(newcomer.tree), imported.stdout
    # Nothing went into the system python.
    outside = newcomer.run("python3", "-c", "import r3090d", cwd=Path("/"))
    assert outside.returncode != 0 and "No module named 'r3090d'" in outside.stderr, outside.stderr

    # The next make reuses the venv.
    again = newcomer.make("-n", "demo")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "-m venv --clear" not in again.stdout and "pip install -q -e" not in again.stdout, again.stdout
