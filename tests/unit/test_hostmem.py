"""Host memory for parked engines: the probe against files a test writes, and the budget's pure arithmetic."""

from __future__ import annotations

import pytest

from r3090d.core.hostmemory import HostMemory, host_budget_mib, parkable_count, parked_cost_mib
from r3090d.probes.hostmem import read_host_memory
from r3090d.units import MIB

MEMINFO = "MemTotal: 65536000 kB\nMemFree: 1000000 kB\nMemAvailable: {kib} kB\nBuffers: 1 kB\n"
SERVICE = "system.slice/r3090d.service"


def host(tmp_path, *, kib=32 * 1024 * 1024, self_cgroup=f"0::/{SERVICE}\n", levels=None):
    """Writes meminfo, /proc/self/cgroup and the cgroup tree: `levels` maps a cgroup path ("" for the root)
    to (memory.max, memory.current) as the kernel writes them (None: no such file). Returns the reader's kwargs."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO.format(kib=kib))
    own = tmp_path / "self-cgroup"
    own.write_text(self_cgroup)
    root = tmp_path / "cgroup"
    root.mkdir()
    for path, files in (levels or {}).items():
        directory = root / path
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in zip(("memory.max", "memory.current"), files, strict=True):
            if text is not None:
                (directory / name).write_text(text + "\n")
    return {"meminfo": meminfo, "cgroup_root": root, "self_cgroup": own}


def mib(n: int) -> str:
    return str(n * MIB)


@pytest.mark.parametrize(
    ("levels", "want_max", "want_current"),
    [
        ({SERVICE: ("max", mib(1000)), "system.slice": ("max", mib(3000))}, None, 1000),
        ({SERVICE: (mib(40_000), mib(1000)), "system.slice": ("max", mib(3000))}, 40_000, 1000),
        # The slice above binds: 8000 - 7000 leaves less room than the unit's 40000 - 1000.
        ({SERVICE: (mib(40_000), mib(1000)), "system.slice": (mib(8000), mib(7000))}, 8000, 7000),
        # A container's namespace root holds its limit; the host's real root has no memory.max.
        ({SERVICE: ("max", mib(1000)), "system.slice": ("max", mib(2000)), "": (mib(20_000), mib(5000))}, 20_000, 5000),
        ({SERVICE: ("max", mib(1000)), "": (None, mib(9000))}, None, 1000),
        # Not a whole MiB: the room rounds down (the limit down, the current use up).
        ({SERVICE: (str(100 * MIB + 5), str(10 * MIB + 1))}, 100, 11),
    ],
    ids=["no-limit", "unit-limit", "slice-binds", "namespace-root", "real-root", "rounding"],
)  # fmt: skip
def test_the_tightest_cgroup_level_binds(tmp_path, levels, want_max, want_current):
    got = read_host_memory(**host(tmp_path, levels=levels))
    assert got == HostMemory(32 * 1024, want_max, want_current, ())


def test_mem_available_in_mib(tmp_path):
    got = read_host_memory(**host(tmp_path, kib=1536 * 1024 + 1023, levels={SERVICE: ("max", "0")}))
    assert got.mem_available_mib == 1536 and got.errors == ()


@pytest.mark.parametrize(
    ("meminfo", "words"),
    [
        (None, "cannot read"),
        ("MemTotal: 1 kB\n", "has no MemAvailable"),
        ("MemAvailable: lots\n", "does not parse"),
        ("MemAvailable: 12 MB\n", "does not parse"),
    ],
    ids=["missing", "absent-key", "not-a-number", "unit"],
)
def test_meminfo_failures_are_fields(tmp_path, meminfo, words):
    kwargs = host(tmp_path, levels={SERVICE: (mib(100), mib(10))})
    if meminfo is None:
        kwargs["meminfo"].unlink()
    else:
        kwargs["meminfo"].write_text(meminfo)
    got = read_host_memory(**kwargs)
    assert got.mem_available_mib is None and (got.cgroup_max_mib, got.cgroup_current_mib) == (100, 10)
    assert len(got.errors) == 1 and words in got.errors[0]


@pytest.mark.parametrize(
    ("self_cgroup", "levels", "words"),
    [
        (None, {}, "cannot read"),
        ("4:memory:/x\n1:cpu:/\n", {}, "no cgroup v2"),
        (f"0::/{SERVICE}\n", {}, "no memory controller"),
        (f"0::/{SERVICE}\n", {SERVICE: ("max", None)}, "no memory controller"),
        (f"0::/{SERVICE}\n", {SERVICE: ("lots", mib(1))}, "cannot read the memory files"),
    ],
    ids=["no-self-cgroup", "v1-only", "no-directory", "no-current", "garbage"],
)
def test_cgroup_failures_are_fields(tmp_path, self_cgroup, levels, words):
    kwargs = host(tmp_path, levels=levels)
    if self_cgroup is None:
        kwargs["self_cgroup"].unlink()
    else:
        kwargs["self_cgroup"].write_text(self_cgroup)
    got = read_host_memory(**kwargs)
    assert got.mem_available_mib == 32 * 1024 and (got.cgroup_max_mib, got.cgroup_current_mib) == (None, None)
    assert len(got.errors) == 1 and words in got.errors[0], got.errors


def test_an_unreadable_ancestor_leaves_the_levels_read(tmp_path):
    kwargs = host(tmp_path, levels={SERVICE: (mib(500), mib(100)), "system.slice": (None, None)})
    (kwargs["cgroup_root"] / "system.slice" / "memory.max").mkdir()  # unreadable as a file, for root too
    got = read_host_memory(**kwargs)
    assert (got.cgroup_max_mib, got.cgroup_current_mib) == (500, 100)
    assert len(got.errors) == 1 and "system.slice" in got.errors[0]


def test_the_unified_entry_is_found_among_v1_lines(tmp_path):
    got = read_host_memory(**host(tmp_path, self_cgroup=f"9:name=systemd:/\n4:memory:/else\n0::/{SERVICE}\n",
                                  levels={SERVICE: (mib(64), mib(32))}))  # fmt: skip
    assert (got.cgroup_max_mib, got.cgroup_current_mib, got.errors) == (64, 32, ())


def test_this_hosts_own_reading_never_raises():
    got = read_host_memory()
    assert got.mem_available_mib is not None and got.mem_available_mib > 0  # a Linux host has /proc/meminfo
    assert all(isinstance(e, str) and "\n" not in e for e in got.errors)


# --------------------------------------------------------------- the budget


@pytest.mark.parametrize(
    ("available", "limit", "current", "margin", "held", "budget"),
    [
        (60_000, None, None, 4000, 0, 56_000),
        (60_000, 40_000, 10_000, 4000, 0, 26_000),  # the cgroup's room is lower
        (20_000, 40_000, 10_000, 4000, 0, 16_000),  # MemAvailable is lower
        (60_000, 40_000, None, 4000, 0, 56_000),  # a limit without its current use says nothing
        (None, 40_000, 10_000, 4000, 0, 26_000),
        (None, None, None, 4000, 0, 0),  # nothing known: nothing parked
        (3000, None, None, 4000, 0, 0),  # never below 0
        (60_000, 40_000, 50_000, 0, 0, 0),  # over its limit already
        # Parked engines live in the cgroup: both readings count what they hold as used.
        (20_000, 40_000, 30_000, 4000, 18_000, 24_000),
    ],
    ids=["meminfo-only", "cgroup-lower", "meminfo-lower", "limit-without-current", "cgroup-only", "nothing-known",
         "floor", "over-limit", "held-added-back"],
)  # fmt: skip
def test_host_budget(available, limit, current, margin, held, budget):
    assert host_budget_mib(available, limit, current, margin, held_by_parked_mib=held) == budget
    assert HostMemory(available, limit, current).budget_mib(margin, held_by_parked_mib=held) == budget


@pytest.mark.parametrize(
    ("budget", "costs", "count"),
    [
        (0, [1], 0),
        (100, [], 0),
        (100, [100], 1),
        (100, [101], 0),
        (100, [60, 30, 50], 2),  # 30 + 50, cheapest first; 60 + 30 would also be two
        (99, [70, 10, 10, 10], 3),
        (100, [70, 10, 10, 10], 4),
        (24_000, [23_400, 23_400, 23_400], 1),
        (10**6, [23_400] * 5, 5),
    ],
    ids=["zero", "none", "exact", "one-over", "cheapest-first", "small-ones", "all-four-exactly", "one-of-three",
         "all"],
)  # fmt: skip
def test_parkable_count(budget, costs, count):
    assert parkable_count(budget, costs) == count


def test_parked_cost_is_gpu_memory_plus_base_rss():
    assert parked_cost_mib(15_000, 2048) == 17_048
    assert parked_cost_mib(-5, 2048) == 2048  # a negative reading never lowers the cost
