"""`make demo`, `make test` and the rest run in the project's venv, never in the system python's site-packages.

Debian 12's python refuses `pip install` (PEP 668). python3 here is a stand-in
for it (tests/managed_python.py), first on PATH as on a newcomer's machine.
`make -n` prints the recipes it would run; the venv itself is built for real
in tests/e2e/test_newcomer_venv.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.managed_python import CALLER_SETTINGS, EXTRAS, make_managed_python

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@pytest.fixture(scope="module")
def debian_python(tmp_path_factory) -> Path:
    """A bin folder whose python3 refuses pip (EXTERNALLY-MANAGED) and has venv with ensurepip."""
    return make_managed_python(tmp_path_factory.mktemp("debian-python"))


@pytest.fixture(scope="module")
def debian_python_without_venv(tmp_path_factory) -> Path:
    """The same python as on Debian without the python3-venv package: no ensurepip."""
    return make_managed_python(tmp_path_factory.mktemp("debian-python-no-venv"), ensurepip=False)


def run_make(bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in CALLER_SETTINGS}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run(["make", *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=60)


def make_n(bin_dir: Path, *args: str) -> str:
    out = run_make(bin_dir, "-n", *args)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def isolated(tmp_path: Path) -> list[str]:
    """Every path the recipes would write, under tmp_path: so the shared checkout's build/ decides nothing."""
    return [
        f"VENV={tmp_path / 'venv'}",
        f"ENGINE_VENV={tmp_path / 'engine'}",
        f"TINY_MODEL={tmp_path / 'tiny'}",
        f"TINY_MODEL_WEIGHTS={tmp_path / 'tiny-weights'}",
    ]


# What each goal then runs with the venv's python.
GOAL_COMMANDS = {
    "demo": "{py} -m r3090d --config etc/demo.toml",
    "demo-swap": "{py} -m r3090d --config etc/demo-swap.toml",
    "test": "{py} -m pytest tests -q",
    "test-fast": "{py} -m pytest tests/unit tests/component -q",
    "lint": "{py} -m ruff check r3090d tests bench scripts",
    "bench": "{py} $b",
}


@pytest.mark.parametrize("goal", sorted(GOAL_COMMANDS))
def test_each_goal_makes_the_venv_installs_there_and_runs_its_python(debian_python, tmp_path, goal):
    recipe = make_n(debian_python, goal, *isolated(tmp_path))
    venv = tmp_path / "venv"
    py = f"{venv}/bin/python"
    assert f'"python3" -m venv --clear "{venv}"' in recipe, recipe
    assert f"{py} -m pip install -q -e {EXTRAS}" in recipe, recipe
    # The system python is never asked to install anything (the engine's own venv is another matter).
    assert not re.search(r'(^|\s)"?python3"? -m pip', recipe, re.MULTILINE), recipe
    assert "--break-system-packages" not in recipe
    assert GOAL_COMMANDS[goal].format(py=py) in recipe, recipe
    # The venv comes first: before the engine, the tiny model or the goal's own command.
    assert recipe.index("-m venv") < recipe.index(GOAL_COMMANDS[goal].format(py=py))


def test_the_demo_model_is_written_by_the_venvs_python(debian_python, tmp_path):
    recipe = make_n(debian_python, "demo", *isolated(tmp_path))
    assert (
        f"{tmp_path}/venv/bin/python scripts/make_tiny_model.py --weights {tmp_path}/tiny-weights" in recipe
    ), recipe


def test_the_venv_is_reused_until_pyproject_changes(debian_python, tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    stamp = venv / ".r3090d-dev-installed"
    stamp.touch()
    pyproject_mtime = (REPO / "pyproject.toml").stat().st_mtime
    os.utime(stamp, (time.time(), max(time.time(), pyproject_mtime + 10)))
    reused = make_n(debian_python, "test-fast", *isolated(tmp_path))
    assert "-m venv" not in reused and "pip install" not in reused, reused
    assert f"{venv}/bin/python -m pytest tests/unit tests/component -q" in reused, reused

    os.utime(stamp, (pyproject_mtime - 10, pyproject_mtime - 10))
    remade = make_n(debian_python, "test-fast", *isolated(tmp_path))
    assert f'"python3" -m venv --clear "{venv}"' in remade, remade
    assert f"{venv}/bin/python -m pip install -q -e {EXTRAS}" in remade, remade


def test_a_python_of_ones_own_is_used_as_given_without_a_venv(debian_python, tmp_path):
    # -B: the recipes as if nothing were built yet, whatever this checkout's build/ holds.
    recipe = make_n(debian_python, "-B", "test", "PYTHON=/opt/mine/bin/python", *isolated(tmp_path))
    assert f"/opt/mine/bin/python -m pip install -q -e {EXTRAS}" in recipe, recipe
    assert "/opt/mine/bin/python -m pytest tests -q" in recipe, recipe
    assert "-m venv --clear" not in recipe and "/venv/bin/python" not in recipe, recipe


@pytest.mark.parametrize("goal", ["demo", "demo-swap", "test"])
def test_without_python3_venv_the_first_line_names_the_package_and_nothing_runs(
    debian_python_without_venv, tmp_path, goal
):
    out = run_make(debian_python_without_venv, goal, *isolated(tmp_path))
    lines = (out.stdout + out.stderr).splitlines()
    assert out.returncode != 0
    assert "sudo apt-get install python3-venv" in lines[0], lines
    assert len(lines) == 1, lines  # nothing else ran
    assert not (tmp_path / "venv").exists() and not (tmp_path / "engine").exists()


def test_without_python3_at_all_the_first_line_says_what_to_install(tmp_path):
    out = run_make(tmp_path, "demo", "VENV_BASE_PYTHON=/nonexistent/python3", *isolated(tmp_path))
    lines = (out.stdout + out.stderr).splitlines()
    assert out.returncode != 0 and len(lines) == 1, lines
    assert "sudo apt-get install python3 python3-venv" in lines[0], lines


def test_goals_that_need_no_python_do_not_check_for_venv(debian_python_without_venv, tmp_path):
    out = run_make(debian_python_without_venv, "-n", "engine", *isolated(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_readme_and_ci_install_the_same_debian_packages_as_make_test_deps():
    (debs,) = re.findall(r"^TEST_DEBS := (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    readme = (REPO / "README.md").read_text()
    assert f"`{debs}`" in readme, f"README.md should list make test-deps' packages as `{debs}`"
    assert "make test-deps" in readme
    assert re.search(r"^\s*make test-deps$", (REPO / ".ci" / "run").read_text(), re.MULTILINE)
