"""Preflight over NVML readings captured on a real NVIDIA H200 (driver 580.159.04).

nvml-h200-sample.json: idle. nvml-h200-load-sample.json: a PyTorch process
(pid 434) holding 21 GiB and running bf16 matrix products. Both were taken
by r3090d's own probe (scripts/nvml_sample.py). Expectations are derived
from the captured values, so the test states the rule, not the numbers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from r3090d import config
from r3090d.core.snapshot import GpuStatus, HostFacts, PortFacts
from r3090d.measure.modelinfo import ModelFacts
from r3090d.preflight.checks import PreflightFacts, Status, run_checks
from r3090d.probes.nvml import sample_from_dict
from r3090d.units import MIB

DATA = Path(__file__).parents[1] / "data"
IDLE = sample_from_dict(json.loads((DATA / "nvml-h200-sample.json").read_text()))
LOAD = sample_from_dict(json.loads((DATA / "nvml-h200-load-sample.json").read_text()))
QWEN = ModelFacts(path="/m", is_dir=True, config=json.loads((DATA / "qwen2.5-7b-config.json").read_text()))
HOST = HostFacts(swap_total_bytes=0, swappiness=1, governors=None, port=PortFacts("127.0.0.1", 8000, True, "bindable"), model=QWEN)


def check(sample, card="rtx3090", own=()):
    cfg = config.from_dict({"engine": {"model": "/m"}, "gpu": {"card": card}}, check_files=False)
    facts = PreflightFacts(gpu=sample, host=HOST, engine_version="0.32.0", own_pids=frozenset(own))
    return {r.name: r for r in run_checks(facts, cfg)}


def test_the_capture_is_a_complete_reading():
    for s in (IDLE, LOAD):
        assert s.status is GpuStatus.OK and s.usable and not s.field_errors
        assert s.name == "NVIDIA H200" and s.compute_capability == (9, 0)
        assert s.xid_monitored and s.xid_errors == ()
        # memory info v2: used excludes the driver's reservation
        assert s.memory_reserved > 0 and s.memory_used + s.memory_reserved + s.memory_free == s.memory_total
    assert IDLE.clock_event_reasons == ("gpu_idle",) and IDLE.processes == ()
    assert LOAD.utilization_gpu > 90 and "gpu_idle" not in LOAD.clock_event_reasons


def test_idle_h200_against_the_rtx3090_profile():
    by = check(IDLE)
    assert by["driver"].status is Status.OK and by["driver"].measured.startswith(IDLE.driver_version)
    # Not a 3090: a warning that shows what was measured.
    assert by["card"].status is Status.WARN
    assert by["card"].measured == f"NVIDIA H200, {IDLE.memory_total // MIB} MiB, CC 9.0"
    # PCIe is judged against what this card reports, not the 3090's profile.
    width = by["pcie_width"]
    assert width.measured == f"x{IDLE.pcie_width} of x{IDLE.pcie_width_max}"
    assert width.status is (Status.OK if IDLE.pcie_width == IDLE.pcie_width_max else Status.FAIL)
    gen = by["pcie_gen"]
    assert gen.measured.startswith(f"Gen{IDLE.pcie_gen} of Gen{IDLE.pcie_gen_max}")
    assert gen.status is Status.OK  # at full generation, or lowered at idle
    assert by["persistence"].status is Status.OK and by["persistence"].measured == ("on" if IDLE.persistence_mode else "off")
    vram = by["vram"]
    need = int(0.9 * IDLE.memory_total) + 512 * MIB  # the engine's share, and its CUDA context
    assert vram.status is (Status.OK if IDLE.memory_free >= need else Status.FAIL)
    assert vram.measured == f"{IDLE.memory_free / MIB:.0f} MiB free, {need / MIB:.0f} MiB needed"
    assert by["model_fit"].status is Status.OK


def test_any_card_accepts_the_h200():
    assert check(IDLE, card="any")["card"].status is Status.OK


def test_under_load_the_process_is_foreign_unless_it_is_ours():
    (proc,) = LOAD.processes
    foreign = check(LOAD)["vram"]
    assert foreign.status is Status.WARN
    assert foreign.measured.endswith(f"; held by pid {proc.pid} ({proc.used_bytes / MIB:.0f} MiB)"), foreign.measured
    own = check(LOAD, own=(proc.pid,))["vram"]
    assert own.status is Status.OK and own.measured == f"held by r3090d's engine (pid {proc.pid})"


@pytest.mark.parametrize("width", [8, 4])
def test_a_narrower_link_on_the_same_card_fails(width):
    r = check(dataclasses.replace(IDLE, pcie_width=width))["pcie_width"]
    assert r.status is Status.FAIL and r.measured == f"x{width} of x{IDLE.pcie_width_max}"
