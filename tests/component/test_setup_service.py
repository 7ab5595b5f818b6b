"""`r3090ctl setup`: the service laid down from an installed r3090d, into a scratch system tree.

The accounts go into the tree's own /etc (useradd --prefix), so the host's
users are never touched.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from r3090d.cli import setup_cmd

pytestmark = pytest.mark.component

REPO = Path(__file__).resolve().parents[2]
CTL = [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]
DAEMON = "/opt/elsewhere/bin/r3090d"
UNIT_DIR = "usr/local/lib/systemd/system"


def setup(*args, timeout=120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("R3090D_CONFIG", "R3090D_INSTANCE")}
    return subprocess.run([*CTL, "setup", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def system(tmp_path) -> Path:
    """A system tree with nothing but root in its account files."""
    if os.geteuid() != 0:
        pytest.skip("setup creates accounts and chowns files: root only")
    root = tmp_path / "system"
    etc = root / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*::0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    for name in ("shadow", "gshadow"):
        os.chmod(etc / name, 0o640)
    return root


def entry(path: Path, name: str) -> list[str]:
    for line in path.read_text().splitlines():
        if line.split(":")[0] == name:
            return line.split(":")
    raise AssertionError(f"no {name} in {path}:\n{path.read_text()}")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_setup_lays_the_service_down(system):
    out = setup("--root", system, "--daemon-path", DAEMON)
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)

    user = entry(system / "etc" / "passwd", "r3090")
    gid = int(entry(system / "etc" / "group", "r3090")[2])
    assert int(user[3]) == gid and user[5:] == ["/var/lib/r3090d", "/usr/sbin/nologin"]
    assert int(user[2]) < 1000, "a system user"

    for unit in ("r3090d.service", "r3090d@.service"):
        path = system / UNIT_DIR / unit
        shipped = (REPO / "systemd" / unit).read_text()
        assert path.read_text() == shipped.replace("ExecStart=/opt/r3090d/bin/r3090d\n", f"ExecStart={DAEMON}\n")
        assert mode(path) == 0o644 and path.stat().st_uid == 0

    config = system / "etc" / "r3090d" / "r3090d.toml"
    assert config.read_text() == (REPO / "etc" / "r3090d.toml").read_text()
    assert (mode(config), config.stat().st_uid, config.stat().st_gid) == (0o640, 0, gid)
    assert (mode(config.parent), config.parent.stat().st_gid) == (0o750, gid)

    completion = system / "usr/local/share/bash-completion/completions/r3090ctl"
    assert "complete -o nosort -F _r3090ctl_completion r3090ctl" in completion.read_text()
    assert "skipped systemctl daemon-reload" in out.stdout
    assert not list(system.rglob("*.new")), "no half-written files left"


def test_setup_again_keeps_the_config_and_replaces_the_units(system):
    assert setup("--root", system, "--daemon-path", DAEMON).returncode == 0
    config = system / "etc" / "r3090d" / "r3090d.toml"
    config.write_text("# the admin's own\n")
    unit = system / UNIT_DIR / "r3090d.service"
    unit.write_text("stale\n")

    out = setup("--root", system, "--daemon-path", "/opt/new/bin/r3090d")
    assert out.returncode == 0, out.stdout + out.stderr
    assert config.read_text() == "# the admin's own\n"
    assert f"keeping the existing {config}" in out.stdout
    assert "ExecStart=/opt/new/bin/r3090d\n" in unit.read_text()
    assert "user r3090 exists" in out.stdout and "group r3090 exists" in out.stdout
    assert len([line for line in (system / "etc" / "passwd").read_text().splitlines() if line.startswith("r3090:")]) == 1


def test_dry_run_changes_nothing(system):
    before = sorted((p.relative_to(system), p.read_bytes()) for p in system.rglob("*") if p.is_file())
    out = setup("--root", system, "--dry-run", "--daemon-path", DAEMON)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted((p.relative_to(system), p.read_bytes()) for p in system.rglob("*") if p.is_file()) == before
    assert f"would write {system / UNIT_DIR / 'r3090d.service'}" in out.stdout
    assert "would create system user r3090" in out.stdout


def test_exec_start_defaults_to_this_installation(system):
    out = setup("--root", system)
    assert out.returncode == 0, out.stdout + out.stderr
    expected = Path(sysconfig.get_path("scripts")) / "r3090d"
    assert f"ExecStart={expected}\n" in (system / UNIT_DIR / "r3090d.service").read_text()


@pytest.mark.parametrize("path", ["relative/r3090d", "/opt/with space/r3090d", "/opt/%i/r3090d"])
def test_a_path_execstart_cannot_hold_is_refused(system, path):
    out = setup("--root", system, "--daemon-path", path)
    assert out.returncode == 64, out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "ExecStart=" in out.stderr
    assert not (system / UNIT_DIR).exists()


def test_a_tree_without_account_files_gets_the_files_and_a_note(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("root only")
    out = setup("--root", tmp_path, "--daemon-path", DAEMON)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"no {tmp_path}/etc/passwd: not creating user r3090 there" in out.stdout
    assert (tmp_path / UNIT_DIR / "r3090d.service").exists()


def test_examples_print_the_shipped_files():
    for name, path in (("unit", "systemd/r3090d.service"), ("template-unit", "systemd/r3090d@.service"),
                       ("config", "etc/r3090d.toml"), ("prometheus-rules", "etc/prometheus-rules.yml"),
                       ("haproxy", "etc/haproxy.cfg")):  # fmt: skip
        out = subprocess.run([*CTL, "example", name], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout == (REPO / path).read_text(), name


def test_render_unit_replaces_only_exec_start():
    text = "[Service]\nExecStartPre=/bin/true\nExecStart=/opt/r3090d/bin/r3090d\nExecReload=/bin/kill -HUP $MAINPID\n"
    assert setup_cmd.render_unit(text, "/usr/bin/r3090d") == text.replace("ExecStart=/opt/r3090d/bin/r3090d", "ExecStart=/usr/bin/r3090d")
    with pytest.raises(ValueError):
        setup_cmd.render_unit("[Service]\n", "/usr/bin/r3090d")


def test_hidden_from_service(tmp_path):
    script = tmp_path / "r3090d"
    script.write_text("#!/root/venv/bin/python\n")
    assert "ProtectHome" in (setup_cmd.hidden_from_service(str(script)) or "")
    script.write_text("#!/usr/bin/python3\n")
    assert setup_cmd.hidden_from_service(str(script)) is None


def test_without_root_it_refuses_unless_dry(monkeypatch, capsys, tmp_path):
    from r3090d.cli.common import ctl, run_click

    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the process's identity is the boundary here
    assert run_click(ctl, ["setup", "--root", str(tmp_path), "--daemon-path", DAEMON]) == setup_cmd.EX_NOPERM
    assert "must run as root" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert run_click(ctl, ["setup", "--root", str(tmp_path), "--daemon-path", DAEMON, "--dry-run"]) == 0
    assert not list(tmp_path.iterdir())
