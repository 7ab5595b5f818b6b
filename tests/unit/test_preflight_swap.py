"""Preflight in swap mode: how many engines the host memory budget can hold parked."""

from __future__ import annotations

import dataclasses

import pytest

from r3090d import config
from r3090d.core.hostmemory import ESTIMATED_BASE_RSS_MIB, HostMemory
from r3090d.core.snapshot import GpuSample, GpuStatus
from r3090d.preflight import gather
from r3090d.preflight.checks import PreflightFacts, Status, check_swap_budget, judge_swap_budget, run_checks
from r3090d.units import MIB

# ------------------------------------------------------------ plain numbers

JUDGED = [
    ("all-fit", 60_000, (("a", 24_000), ("b", 24_000), ("c", 7_000)), 2, (), Status.OK,
     "60000 MiB (the source) holds 3 of 3 engines parked (a 24000 MiB, b 24000 MiB, c 7000 MiB"),
    ("enough-for-those-out", 31_000, (("a", 24_000), ("b", 24_000), ("c", 7_000)), 2, (), Status.OK,
     "holds 2 of 3 engines parked"),
    ("fewer-than-out", 30_000, (("a", 24_000), ("b", 24_000), ("c", 7_000)), 2, (), Status.WARN,
     "holds 1 of 3 engines parked"),
    ("none-fit", 6_000, (("a", 24_000), ("b", 24_000)), 1, (), Status.WARN, "holds 0 of 2 engines parked"),
    ("all-resident", 0, (("a", 24_000), ("b", 24_000)), 0, (), Status.OK, "holds 0 of 2 engines parked"),
    ("one-cannot-suspend", 30_000, (("a", 24_000),), 1, ("big",), Status.OK,
     "; big: cannot be suspended, so a swap stops it drained and cold-starts it later"),
    ("none-can-suspend", 30_000, (), 1, ("a", "b"), Status.SKIP, "no engine can be suspended; a, b: cannot be suspended"),
    ("unmeasured", None, (("a", 24_000),), 1, (), Status.SKIP, "host memory not measured: the source"),
]  # fmt: skip


@pytest.mark.parametrize(("budget", "costs", "out", "cold", "status", "text"), [r[1:] for r in JUDGED],
                         ids=[r[0] for r in JUDGED])  # fmt: skip
def test_judged_from_plain_numbers(budget, costs, out, cold, status, text):
    r = judge_swap_budget(budget, "the source", costs, out, cold)
    assert r.name == "swap_budget" and r.status is status and text in r.measured, r
    assert "\n" not in r.measured
    # What to do, wherever there is something to do.
    assert (r.hint != "") is (status is Status.WARN or budget is None)


def test_a_warning_says_what_a_swap_does_then_and_what_to_change():
    r = judge_swap_budget(1000, "x", (("a", 24_000),), 1)
    assert "cold-starts it later" in r.hint and "add host memory" in r.hint
    assert r.expected == "room to park 1 engines at once (the models beyond swap.max_resident)"


# ---------------------------------------------------------- from the config

HAS_MODELS = "models" in {f.name for f in dataclasses.fields(config.Config)}
needs_swap_config = pytest.mark.skipif(not HAS_MODELS, reason="the config has no [[models]] yet")

RTX3090 = GpuSample(GpuStatus.OK, name="NVIDIA GeForce RTX 3090", memory_total=24576 * MIB, memory_free=24000 * MIB,
                    driver_version="580.95.05", processes=())  # fmt: skip
MODELS = [
    {"name": "chat", "model": "/m/chat"},  # the top-level profile: realtime, 0.90
    {"name": "coder", "model": "/m/coder", "profile": "batch"},  # 0.92
    {"name": "emb", "model": "/m/emb", "kind": "embed", "profile": "none",
     "extra_args": ["--gpu-memory-utilization", "0.2"]},
]  # fmt: skip
# Each engine's share of the 3090's 24576 MiB, plus the base RSS estimate.
CHAT = int(0.90 * 24576) + ESTIMATED_BASE_RSS_MIB
CODER = int(0.92 * 24576) + ESTIMATED_BASE_RSS_MIB
EMB = int(0.2 * 24576) + ESTIMATED_BASE_RSS_MIB


def swap_cfg(models=MODELS, **sections) -> config.Config:
    return config.from_dict({"models": models, **sections}, check_files=False)


PLENTY = HostMemory(60_000)


def swap_facts(memory=PLENTY, gpu=RTX3090) -> PreflightFacts:
    return PreflightFacts(gpu=gpu, host=gather.gather_host("127.0.0.1", 1), host_memory=memory)


@needs_swap_config
@pytest.mark.parametrize(
    ("cfg", "facts", "status", "text"),
    [
        (swap_cfg(), swap_facts(), Status.OK,
         f"55904 MiB (MemAvailable 60000 MiB, less the 4096 MiB margin) holds 3 of 3 engines parked "
         f"(chat {CHAT} MiB, coder {CODER} MiB, emb {EMB} MiB"),
        (swap_cfg(), swap_facts(HostMemory(36_000)), Status.OK, "holds 2 of 3"),
        (swap_cfg(), swap_facts(HostMemory(30_000)), Status.WARN, "holds 1 of 3"),
        (swap_cfg(), swap_facts(HostMemory(60_000, 30_000, 2_000)), Status.WARN,
         "23904 MiB (the lower of MemAvailable 60000 MiB and the cgroup's 30000 - 2000 MiB, less the 4096 MiB margin) "
         "holds 1 of 3"),
        (swap_cfg(swap={"host_memory_margin_mib": 0}), swap_facts(HostMemory(31_200)), Status.OK, "(MemAvailable 31200 MiB, "
         "less the 0 MiB margin) holds 2 of 3"),
        (swap_cfg(swap={"host_memory_budget_mib": 10_000}), swap_facts(), Status.WARN,
         "10000 MiB (swap.host_memory_budget_mib) holds 1 of 3"),
        (swap_cfg(swap={"max_resident": 3}), swap_facts(HostMemory(0)), Status.OK, "holds 0 of 3"),
        (swap_cfg(), swap_facts(None), Status.SKIP, "host memory not measured: not read"),
        (swap_cfg(), swap_facts(HostMemory(errors=("cannot read /proc/meminfo: gone",))), Status.SKIP,
         "host memory not measured: cannot read /proc/meminfo: gone"),
        (swap_cfg(gpu={"required": False}), swap_facts(), Status.SKIP, "no GPU: nothing is parked"),
        (swap_cfg(MODELS[:2] + [{"name": "big", "model": "/m/big", "extra_args": ["--tensor-parallel-size", "2"]}]),
         swap_facts(HostMemory(55_000)), Status.OK, "holds 2 of 2 engines parked (chat"),
        # gpu.card = any: the card's memory is NVML's.
        (swap_cfg(gpu={"card": "any"}), swap_facts(gpu=dataclasses.replace(RTX3090, memory_total=12288 * MIB)),
         Status.OK, f"chat {int(0.9 * 12288) + ESTIMATED_BASE_RSS_MIB} MiB"),
        (swap_cfg(gpu={"card": "any"}), swap_facts(gpu=GpuSample(GpuStatus.NO_DRIVER)), Status.SKIP,
         "the card's memory is unknown"),
    ],
    ids=["all-fit", "two-fit", "one-fits", "cgroup-binds", "margin", "configured", "all-resident", "not-read",
         "unreadable", "no-gpu", "tp2-never-parks", "any-card", "any-card-unknown"],
)  # fmt: skip
def test_swap_budget_from_the_config(cfg, facts, status, text):
    r = check_swap_budget(facts, cfg)
    assert r.name == "swap_budget" and r.status is status and text in r.measured, r


@needs_swap_config
def test_the_check_runs_in_swap_mode_only():
    names = [r.name for r in run_checks(swap_facts(), swap_cfg())]
    assert names[-1] == "swap_budget" and names.count("swap_budget") == 1


def test_a_single_engine_config_gets_no_swap_budget_check():
    single = config.from_dict({"engine": {"model": "/m"}}, check_files=False)
    assert "swap_budget" not in [r.name for r in run_checks(swap_facts(), single)]


# ------------------------------------------------------------------ gathering


def write_host(root, *, available_kib, limit, current):
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    (root / "proc" / "self" / "cgroup").write_text("0::/system.slice/r3090d.service\n")
    unit = root / "sys" / "fs" / "cgroup" / "system.slice" / "r3090d.service"
    unit.mkdir(parents=True)
    (unit / "memory.max").write_text(f"{limit}\n")
    (unit / "memory.current").write_text(f"{current}\n")


def test_host_memory_is_gathered_under_the_root(tmp_path):
    write_host(tmp_path, available_kib=8 * 1024 * 1024, limit=6 * 1024 * MIB, current=1024 * MIB)
    assert gather._host_memory(tmp_path) == HostMemory(8 * 1024, 6 * 1024, 1024, ())


@needs_swap_config
def test_gather_reads_host_memory_in_swap_mode_only(tmp_path):
    write_host(tmp_path, available_kib=8 * 1024 * 1024, limit="max", current=1024 * MIB)
    engine = {"python": str(tmp_path / "no-python"), "port": 1}
    swap = gather.gather(swap_cfg(gpu={"required": False}, engine=engine), root=tmp_path)
    assert swap.host_memory == HostMemory(8 * 1024, None, 1024, ())
    single = config.from_dict({"engine": {"model": "/m", **engine}, "gpu": {"required": False}},
                              check_files=False)  # fmt: skip
    assert gather.gather(single, root=tmp_path).host_memory is None
