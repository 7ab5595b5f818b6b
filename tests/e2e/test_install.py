"""`make install` and `make uninstall` into scratch locations: what lands where, what is never overwritten."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, TEST_ROOT

pytestmark = pytest.mark.systemd


@pytest.fixture
def scratch():
    if os.geteuid() != 0:
        pytest.skip("make install needs root (it creates the r3090 system user)")
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no Debian /usr/bin/python3 to build the service venv from")
    root = TEST_ROOT / "install-check"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    os.chmod(TEST_ROOT, 0o755)
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def make(target: str, root: Path) -> str:
    paths = {
        "PREFIX": root / "opt",
        "UNITDIR": root / "units",
        "CONFDIR": root / "etc",
        "BINDIR": root / "bin",
        "ENGINE_VENV": root / "no-engine",
        "COMPLETIONDIR": root / "completions",
    }
    (root / "bin").mkdir(exist_ok=True)
    out = subprocess.run(
        ["make", "-C", str(REPO), target, *(f"{k}={v}" for k, v in paths.items())],
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"make {target} failed:\n{text}"
    return text


def test_install_then_uninstall(scratch):
    conf = scratch / "etc" / "r3090d.toml"
    conf.parent.mkdir()
    conf.write_text("# the admin's own config\n")

    text = make("install", scratch)
    print(text)
    prefix = scratch / "opt"
    assert "keeping the existing" in text and conf.read_text() == "# the admin's own config\n", (
        "install must never overwrite a config"
    )
    assert "no vLLM venv" in text, "install says where the engine is missing"

    # A venv of Debian's python (a pyenv python under /root is invisible to the service user),
    # holding a copy of r3090d, not a link back to this checkout.
    assert "home = /usr/bin" in (prefix / "pyvenv.cfg").read_text()
    where = subprocess.run(
        [prefix / "bin" / "python", "-c", "import r3090d; print(r3090d.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert where.stdout.startswith(str(prefix)), where.stdout + where.stderr
    site = next(prefix.glob("lib/python3*/site-packages"))
    assert not [
        p for p in site.iterdir() if p.suffix in (".pth", ".egg-link") and str(REPO) in p.read_text()
    ], "an editable install"
    # ... which the service user can run.
    as_service = subprocess.run(
        ["runuser", "-u", "r3090", "--", str(scratch / "bin" / "r3090ctl"), "--help"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert as_service.returncode == 0, as_service.stderr
    assert (scratch / "bin" / "r3090d").resolve() == (prefix / "bin" / "r3090d").resolve()

    for unit in ("r3090d.service", "r3090d@.service"):
        text_unit = (scratch / "units" / unit).read_text()
        assert f"ExecStart={prefix}/bin/r3090d\n" in text_unit
        assert oct((scratch / "units" / unit).stat().st_mode & 0o777) == "0o644"
    assert (prefix / "share" / "r3090d" / "r3090d.toml.example").read_text() == (
        REPO / "etc" / "r3090d.toml"
    ).read_text()
    completion = scratch / "completions" / "r3090ctl"
    assert "complete -o nosort -F _r3090ctl_completion r3090ctl" in completion.read_text()
    # The units and config came from the installed wheel's own copies (r3090ctl setup).
    assert "setup: " in text

    # A fresh config directory gets the annotated reference, readable by the service group only.
    conf.unlink()
    text = make("install", scratch)
    assert "reusing venv" in text
    assert conf.read_text() == (REPO / "etc" / "r3090d.toml").read_text()
    st = conf.stat()
    assert (st.st_uid, grp.getgrgid(st.st_gid).gr_name, st.st_mode & 0o777) == (0, "r3090", 0o640)

    text = make("uninstall", scratch)
    print(text)
    assert not prefix.exists()
    assert not list((scratch / "units").iterdir())
    assert not list((scratch / "bin").iterdir())
    assert not completion.exists()
    assert conf.exists(), "uninstall keeps the config"
