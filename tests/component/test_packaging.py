"""The wheel, built as `make wheel` builds it from a copy of the checkout, and r3090d run from it alone.

The copy keeps the shared checkout's build/ out of it; a stale module planted
in build/lib must not reach the wheel.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import r3090d
from tests.checkout import copy_checkout

pytestmark = pytest.mark.component

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {
    "r3090d/data/r3090d.service": "systemd/r3090d.service",
    "r3090d/data/r3090d@.service": "systemd/r3090d@.service",
    "r3090d/data/r3090d.toml": "etc/r3090d.toml",
    "r3090d/data/prometheus-rules.yml": "etc/prometheus-rules.yml",
    "r3090d/data/haproxy.cfg": "etc/haproxy.cfg",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.skip("needs make and git")
    tree = tmp_path_factory.mktemp("checkout")
    copy_checkout(tree)
    ghost = tree / "build" / "lib" / "r3090d" / "ghost.py"
    ghost.parent.mkdir(parents=True)
    ghost.write_text("# a module deleted from the tree long ago\n")
    out_dir = tmp_path_factory.mktemp("dist")
    (out_dir / "r3090d-0.0.1-py3-none-any.whl").write_text("an older wheel\n")
    done = subprocess.run(
        ["make", "-C", str(tree), "wheel", f"WHEEL_DIR={out_dir}", f"PYTHON={sys.executable}"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = list(out_dir.glob("r3090d-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_carries_the_shipped_files(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for inside, source in SHIPPED.items():
            assert zf.read(inside) == (REPO / source).read_bytes(), inside
        assert "r3090d/ghost.py" not in names, "a stale build/lib reached the wheel"


def test_metadata(wheel):
    assert wheel.name == f"r3090d-{r3090d.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        info = f"r3090d-{r3090d.__version__}.dist-info"
        meta = email.parser.Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        assert meta["Version"] == r3090d.__version__
        assert meta["License-Expression"] == "Apache-2.0"
        assert meta.get_all("License-File") == ["LICENSE"]
        assert zf.read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        assert "Operating System :: POSIX :: Linux" in meta.get_all("Classifier")


def from_wheel(wheel: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """r3090ctl imported from the wheel file itself (zipimport), never from this checkout."""
    env = {**os.environ, "PYTHONPATH": str(wheel)}
    code = "import r3090d, sys; assert r3090d.__file__.startswith(sys.argv[1]), r3090d.__file__; from r3090d.cli import ctl_main; sys.argv[1:2] = []; ctl_main()"
    return subprocess.run([sys.executable, "-c", code, str(wheel), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_resources_from_the_installed_wheel(wheel, tmp_path):
    out = from_wheel(wheel, tmp_path, "example", "prometheus-rules")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (REPO / "etc" / "prometheus-rules.yml").read_text()
    out = from_wheel(wheel, tmp_path, "--version")
    assert out.stdout.split()[-1] == r3090d.__version__


def test_setup_from_the_wheel_alone(wheel, tmp_path):
    out = from_wheel(wheel, tmp_path, "setup", "--root", str(tmp_path / "root"), "--dry-run", "--daemon-path", "/opt/r3090d/bin/r3090d")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "would write" in out.stdout and "r3090d@.service" in out.stdout
