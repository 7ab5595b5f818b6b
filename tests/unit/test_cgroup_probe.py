"""The unit's OOM-kill count from its cgroup's memory.events, read from files a test writes."""

from __future__ import annotations

import pytest

from r3090d.probes.cgroup import OomKillCount, OomKillCounter

MEMORY_EVENTS = "low 0\nhigh 0\nmax 12\noom 4\noom_kill {n}\noom_group_kill 0\n"


@pytest.fixture
def tree(tmp_path):
    """(counter, the memory.events file) for a service cgroup under a fake /sys/fs/cgroup."""
    root = tmp_path / "cgroup"
    group = root / "system.slice" / "r3090d.service"
    group.mkdir(parents=True)
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("0::/system.slice/r3090d.service\n")
    return OomKillCounter(cgroup_root=root, self_cgroup=self_cgroup), group / "memory.events"


def test_reads_the_oom_kill_count_of_its_own_cgroup(tree):
    counter, events = tree
    events.write_text(MEMORY_EVENTS.format(n=3))
    assert counter.read() == OomKillCount(3)
    events.write_text(MEMORY_EVENTS.format(n=4))
    assert counter.read() == OomKillCount(4)


def test_the_unified_entry_is_found_among_v1_lines(tmp_path):
    root = tmp_path / "cgroup"
    (root / "a.slice").mkdir(parents=True)
    (root / "a.slice" / "memory.events").write_text(MEMORY_EVENTS.format(n=7))
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("9:name=systemd:/\n4:memory:/elsewhere\n0::/a.slice\n")
    assert OomKillCounter(cgroup_root=root, self_cgroup=self_cgroup).read() == OomKillCount(7)


def test_no_memory_events_is_a_field_not_an_exception(tree):
    counter, events = tree
    got = counter.read()
    assert got.count is None and str(events) in got.error and "no memory controller" in got.error


def test_no_unified_entry_is_a_field(tmp_path):
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("4:memory:/x\n1:cpu:/\n")
    got = OomKillCounter(cgroup_root=tmp_path, self_cgroup=self_cgroup).read()
    assert got.count is None and "no cgroup v2" in got.error


def test_an_unreadable_self_cgroup_is_a_field(tmp_path):
    got = OomKillCounter(cgroup_root=tmp_path, self_cgroup=tmp_path / "absent").read()
    assert got.count is None and "cannot read" in got.error


def test_an_unreadable_memory_events_is_a_field(tree):
    counter, events = tree
    events.mkdir()  # unreadable as a file, for root too
    got = counter.read()
    assert got.count is None and "cannot read" in got.error


@pytest.mark.parametrize("text", ["low 0\noom 1\n", "oom_kill many\n", ""])
def test_a_file_without_a_count_is_a_field(tree, text):
    counter, events = tree
    events.write_text(text)
    got = counter.read()
    assert got.count is None and "no oom_kill count" in got.error
