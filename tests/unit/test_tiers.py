"""The lines a test run ends with: one per tier that did not run fully, with how many tests and why."""

from __future__ import annotations

from tests.tiers import Skip, Tier, skip_reason, summary_lines, tier_of


def test_a_tier_is_its_mark_else_its_folder():
    assert tier_of("tests/unit/test_x.py::test_a", []) is Tier.UNIT
    assert tier_of("tests/component/test_x.py::test_a", []) is Tier.COMPONENT
    assert tier_of("tests/component/test_x.py::test_a", ["component"]) is Tier.COMPONENT
    assert tier_of("tests/e2e/test_x.py::test_a", ["vllm"]) is Tier.VLLM
    assert tier_of("tests/e2e/test_x.py::test_a", ["systemd"]) is Tier.SYSTEMD
    # Needing both, a test needs root and systemd first.
    assert tier_of("tests/e2e/test_x.py::test_a", ["vllm", "systemd"]) is Tier.SYSTEMD
    assert tier_of("tests/e2e/test_x.py", []) is Tier.END_TO_END


def test_one_line_per_tier_with_skips_in_the_order_the_tiers_run():
    skips = [Skip(Tier.SYSTEMD, "needs root and systemd")] * 41 + [
        Skip(Tier.COMPONENT, "haproxy is not installed (apt-get install haproxy)"),
        Skip(Tier.COMPONENT, "promtool is not installed (apt-get install prometheus)"),
        Skip(Tier.COMPONENT, "promtool is not installed (apt-get install prometheus)"),
    ]
    assert summary_lines(skips) == [
        "component tier: skipped 3 tests: promtool is not installed (apt-get install prometheus) (2); "
        "haproxy is not installed (apt-get install haproxy) (1)",
        "real systemd tier: skipped 41 tests: needs root and systemd",
    ]


def test_a_tier_that_ran_fully_has_no_line():
    assert summary_lines([]) == []
    assert [line.split(":")[0] for line in summary_lines([Skip(Tier.VLLM, "no engine")])] == [
        "real vLLM tier"
    ]


def test_a_file_skipped_whole_is_counted_as_a_file():
    line = summary_lines(
        [Skip(Tier.UNIT, "PyYAML is not installed", whole_file=True), Skip(Tier.UNIT, "no cc")]
    )
    assert line == ["unit tier: skipped 1 test and 1 whole test file: PyYAML is not installed (1); no cc (1)"]


def test_the_reason_is_pytests_without_its_prefix():
    assert skip_reason(("tests/x.py", 3, "Skipped: haproxy is not installed")) == "haproxy is not installed"
    assert skip_reason("Skipped: odd") == "odd"
