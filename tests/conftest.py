"""Fixtures shared by every test directory."""

from __future__ import annotations

import functools

import pytest

from tests import tiers
from tests import unprivileged as unprivileged_mod
from tests.fakevllm.harness import FakeVllm, make_engine_python

_TIER_OF_TEST = pytest.StashKey[dict[str, tiers.Tier]]()


def pytest_collection_modifyitems(config, items):
    """Each test's tier, from its marks, for the skip summary."""
    config.stash[_TIER_OF_TEST] = {
        item.nodeid: tiers.tier_of(item.nodeid, (m.name for m in item.iter_markers())) for item in items
    }


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session):
    """After pytest's own last line: one line per tier that did not run fully, saying how much and why."""
    result = yield
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        tier_of_test = session.config.stash.get(_TIER_OF_TEST, {})
        skips = []
        for report in reporter.stats.get("skipped", []):
            whole_file = report.nodeid not in tier_of_test  # skipped at collection: a test file, not a test
            tier = tier_of_test.get(report.nodeid) or tiers.tier_of(report.nodeid, ())
            skips.append(tiers.Skip(tier, tiers.skip_reason(report.longrepr), whole_file))
        for line in tiers.summary_lines(skips):
            reporter.write_line(line, yellow=True)
    return result


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
