"""Fixtures shared by every test directory."""

from __future__ import annotations

import functools

import pytest

from tests import unprivileged as unprivileged_mod
from tests.fakevllm.harness import FakeVllm, make_engine_python


@pytest.fixture(scope="session")
def make_fake_engine_python(tmp_path_factory):
    """make(version="0.32.0") -> path of a python that runs the vLLM double as that vLLM version."""

    @functools.cache
    def make(version: str = "0.32.0") -> str:
        return str(make_engine_python(tmp_path_factory.mktemp(f"fake-engine-{version}") / "venv", version))

    return make


@pytest.fixture(scope="session")
def fake_engine_python(make_fake_engine_python) -> str:
    """A python for engine.python: `-m vllm.entrypoints.openai.api_server` runs the double (vLLM 0.32.0)."""
    return make_fake_engine_python()


@pytest.fixture
def fake_vllm(fake_engine_python, tmp_path):
    """launch(*extra_args, **FakeVllm kwargs) -> a started FakeVllm; every one is SIGKILLed (whole group) at teardown."""
    launched: list[FakeVllm] = []

    def launch(*extra_args: str, **kwargs) -> FakeVllm:
        kwargs.setdefault("log_path", tmp_path / f"fakevllm-{len(launched)}.log")
        double = FakeVllm(fake_engine_python, *extra_args, **kwargs)
        launched.append(double)
        return double.start()

    yield launch
    for double in launched:
        double.kill_all()


@pytest.fixture
def unprivileged():
    """A tests.unprivileged.Unprivileged: a permission test's check, run where root's privileges do not reach."""
    why_not = unprivileged_mod.available()
    if why_not:
        pytest.skip(why_not)
    scratch = unprivileged_mod.Unprivileged()
    yield scratch
    scratch.close()
