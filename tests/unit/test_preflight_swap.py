"""Preflight in swap mode: how many engines the host memory budget can hold parked."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from r3090d import config
from r3090d.core.hostmemory import ESTIMATED_BASE_RSS_MIB, HostMemory
from r3090d.core.snapshot import GpuSample, GpuStatus
from r3090d.measure.modelinfo import ModelFacts
from r3090d.preflight import gather
from r3090d.preflight.checks import PreflightFacts, Status, exit_code, run_checks
from r3090d.preflight.swapchecks import check_swap_budget, judge_swap_budget
from r3090d.units import GIB, MIB

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


# ------------------------------------------------------------------ each model's fit, and the resident ones together

QWEN_7B = json.loads((Path(__file__).parents[1] / "data" / "qwen2.5-7b-config.json").read_text())


def model_dir(path: str, weight_bytes: int | None = None) -> ModelFacts:
    return ModelFacts(path=path, is_dir=True, config=QWEN_7B, weight_bytes=weight_bytes)


@needs_swap_config
def test_each_model_is_checked_for_its_own_fit_with_its_own_share():
    facts = dataclasses.replace(swap_facts(), models=(("chat", model_dir("/m/chat")), ("coder", model_dir("/m/coder", 30 * GIB)),
                                                      ("emb", None)))  # fmt: skip
    rows = {r.name: r for r in run_checks(facts, swap_cfg())}
    assert "model_fit" not in rows  # the top level serves no model of its own
    chat, coder, emb = rows["model_fit:chat"], rows["model_fit:coder"], rows["model_fit:emb"]
    assert chat.status is Status.OK and "0.9 x" in chat.expected, chat  # the realtime profile: 4096 tokens
    assert coder.status is Status.FAIL and coder.permanent and "weights 30.00 GiB" in coder.measured, coder
    assert "0.92 x" in coder.expected and "short by" in coder.hint  # the batch profile's share
    assert emb.status is Status.SKIP and "models[2].model" in emb.measured, emb
    assert exit_code(list(rows.values())) == 2


@needs_swap_config
def test_without_a_gpu_reading_each_model_fit_is_skipped_by_name():
    names = [r.name for r in run_checks(swap_facts(gpu=GpuSample(GpuStatus.NO_DRIVER)), swap_cfg())]
    assert {"model_fit:chat", "model_fit:coder", "model_fit:emb"} <= set(names) and "model_fit" not in names


def small(name: str, share: float) -> dict:
    return {"name": name, "model": f"/m/{name}", "profile": "none", "extra_args": ["--gpu-memory-utilization", str(share)]}


@needs_swap_config
@pytest.mark.parametrize(
    ("models", "max_resident", "status", "text"),
    [
        (MODELS, 2, Status.FAIL, "the 2 largest shares (coder 0.92, chat 0.9) and 2 engine contexts need 45752 MiB"),
        (MODELS, 3, Status.FAIL, "the 3 largest shares (coder 0.92, chat 0.9, emb 0.2)"),
        ([small("a", 0.45), small("b", 0.45), small("c", 0.3)], 2, Status.OK, "need 23142 MiB of 24576 MiB"),
        # The shares add up to less than the card, but not with each engine's own CUDA context.
        ([small("a", 0.48), small("b", 0.5)], 2, Status.FAIL, "need 25108 MiB of 24576 MiB"),
    ],
    ids=["two-big", "three", "fit", "contexts-do-not-fit"],
)
def test_the_resident_engines_shares_fit_the_card_together(models, max_resident, status, text):
    c = swap_cfg(models, swap={"max_resident": max_resident})
    (r,) = [r for r in run_checks(swap_facts(), c) if r.name == "resident_fit"]
    assert r.status is status and text in r.measured, r
    if status is Status.FAIL:
        assert r.permanent and "gpu_memory_utilization" in r.hint and "swap.max_resident" in r.hint


@needs_swap_config
def test_one_resident_engine_needs_no_resident_fit_and_no_gpu_skips_it():
    assert "resident_fit" not in [r.name for r in run_checks(swap_facts(), swap_cfg())]
    c = swap_cfg(swap={"max_resident": 2}, gpu={"required": False})
    (r,) = [r for r in run_checks(swap_facts(), c) if r.name == "resident_fit"]
    assert r.status is Status.SKIP


@needs_swap_config
def test_gather_reads_each_models_directory_in_swap_mode(tmp_path):
    chat = tmp_path / "chat"
    chat.mkdir()
    (chat / "config.json").write_text(json.dumps(QWEN_7B))
    models = [{"name": "chat", "model": str(chat)}, {"name": "hub", "model": "Qwen/Qwen2.5-7B-Instruct"}]
    engine = {"python": str(tmp_path / "no-python"), "port": 1}
    facts = gather.gather(swap_cfg(models, gpu={"required": False}, engine=engine), root=tmp_path)
    got = dict(facts.models)
    assert got["chat"].config == QWEN_7B and got["hub"] is None
