"""Which directories r3090d and r3090ctl trust: the pure verdict, and the daemon's side on real directories."""

from __future__ import annotations

import os
import pwd

import pytest

from r3090d.service import safedir
from r3090d.service.safedir import DirFacts

ME = 1000
KEY = "daemon.runtime_dir"


@pytest.mark.parametrize(
    "facts, owners, want",
    [
        (DirFacts(True, ME, 0o755), frozenset({ME, 0}), None),
        (DirFacts(True, 0, 0o750), frozenset({ME, 0}), None),
        (DirFacts(True, ME, 0o700), None, None),
        (DirFacts(True, 4242, 0o755), None, None),  # the client: any owner, the mode decides
        (DirFacts(True, ME, 0o777), frozenset({ME, 0}), "is writable by group and others (mode 0777)"),
        (DirFacts(True, 0, 0o1777), None, "is writable by group and others (mode 1777)"),  # sticky is no excuse
        (DirFacts(True, ME, 0o775), frozenset({ME, 0}), "is writable by group (mode 0775)"),
        (DirFacts(True, ME, 0o757), None, "is writable by others (mode 0757)"),
        (DirFacts(True, 4242, 0o755), frozenset({ME, 0}), "belongs to uid 4242, not to"),
        (DirFacts(False, ME, 0o644), None, "is not a directory"),
    ],
)
def test_problem(facts, owners, want):
    got = safedir.problem("/run/x", KEY, facts, owners, ME)
    if want is None:
        assert got is None
        return
    assert want in got
    assert "\n" not in got
    assert got.startswith(f"{KEY} /run/x ")
    assert "(fix: " in got


def test_the_fixes_name_the_directory():
    assert safedir.problem("/run/x", KEY, DirFacts(True, ME, 0o777), None, ME).endswith("(fix: chmod go-w /run/x)")
    wrong_owner = safedir.problem("/run/x", KEY, DirFacts(True, 4242, 0o755), frozenset({ME, 0}), ME)
    assert f"(fix: chown {safedir.user_name(ME)} /run/x, or point {KEY} at a directory of your own)" in wrong_owner


def test_ensure_creates_a_private_directory(tmp_path):
    made = safedir.ensure(tmp_path / "a" / "run", "daemon.state_dir")
    assert made.is_dir()
    assert os.stat(made).st_mode & 0o022 == 0


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o707], ids=oct)
def test_ensure_refuses_a_directory_others_can_write(tmp_path, mode):
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(safedir.UnsafeDirectory) as exc:
        safedir.ensure(d, "daemon.state_dir")
    assert str(exc.value).startswith(f"daemon.state_dir {d} is writable by ")
    assert str(exc.value).endswith(f"(fix: chmod go-w {d})")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_ensure_refuses_a_directory_another_user_owns(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(d, nobody, -1)
    with pytest.raises(safedir.UnsafeDirectory) as exc:
        safedir.ensure(d, "daemon.state_dir")
    me = safedir.user_name(os.geteuid())
    assert str(exc.value) == (
        f"daemon.state_dir {d} belongs to nobody, not to {me}, so its owner could replace the files in it "
        f"(fix: chown {me} {d}, or point daemon.state_dir at a directory of your own)"
    )


def test_ensure_accepts_our_own_0755_directory(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, 0o755)
    assert safedir.ensure(d, "daemon.state_dir") == d


def test_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "state"
    f.write_text("")
    with pytest.raises(safedir.UnsafeDirectory, match="is not a directory"):
        safedir.ensure(f, "daemon.state_dir")


def test_check_passes_a_missing_directory(tmp_path):
    safedir.check(tmp_path / "absent", KEY, owners=None)
