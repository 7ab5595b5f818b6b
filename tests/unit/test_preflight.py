"""Preflight verdicts: facts in, results out. No I/O."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from r3090d import cards, config
from r3090d.core.snapshot import GpuProcess, GpuSample, GpuStatus, HostFacts, PortFacts, PortHolder
from r3090d.measure.modelinfo import ModelFacts, WeightFile
from r3090d.preflight import checks as preflight
from r3090d.preflight.checks import PreflightFacts, Status, exit_code, failures, run_checks
from r3090d.units import GIB, MIB

QWEN_7B = json.loads((Path(__file__).parents[1] / "data" / "qwen2.5-7b-config.json").read_text())

RTX3090 = GpuSample(
    status=GpuStatus.OK,
    index=0,
    name="NVIDIA GeForce RTX 3090",
    driver_version="580.95.05",
    cuda_driver_version=13000,
    compute_capability=(8, 6),
    memory_total=24576 * MIB,
    memory_free=24000 * MIB,
    memory_used=276 * MIB,
    memory_reserved=300 * MIB,
    utilization_gpu=0,
    pcie_width=16,
    pcie_width_max=16,
    pcie_gen=1,
    pcie_gen_max=4,
    persistence_mode=False,
    processes=(),
)
QWEN_DIR = ModelFacts(path="/models/qwen", is_dir=True, config=QWEN_7B)
HOST = HostFacts(
    swap_total_bytes=0,
    swappiness=1,
    governors=("performance",),
    port=PortFacts("127.0.0.1", 8000, True, "bindable"),
    model=QWEN_DIR,
)
FACTS = PreflightFacts(gpu=RTX3090, host=HOST, engine_version="0.32.0", ptrace_scope=1)  # Yama as Ubuntu sets it


def cfg(**sections) -> config.Config:
    """A config with engine.model set; keyword arguments are top-level keys or tables."""
    data: dict = {"engine": {"model": "/models/qwen"}}
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return config.from_dict(data, check_files=False)


def facts(gpu=None, host=None, **kw) -> PreflightFacts:
    return dataclasses.replace(
        FACTS,
        gpu=dataclasses.replace(RTX3090, **(gpu or {})),
        host=dataclasses.replace(HOST, **(host or {})),
        **kw,
    )


def results(f=FACTS, c=None) -> dict[str, preflight.CheckResult]:
    return {r.name: r for r in run_checks(f, c or cfg())}


def test_a_healthy_3090_host_passes():
    rs = run_checks(FACTS, cfg())
    by = {r.name: r for r in rs}
    assert [r.name for r in rs] == list(preflight.GPU_CHECKS) + ["swap", "swappiness", "governor", "port", "vllm"]
    assert {n: r.status for n, r in by.items() if r.status is not Status.OK} == {}
    assert exit_code(rs) == 0
    assert by["driver"].measured == "580.95.05 (CUDA 13.0)"
    assert by["card"].measured == "NVIDIA GeForce RTX 3090, 24576 MiB, CC 8.6"
    assert "at idle" in by["pcie_gen"].measured and "GeForce" in by["pcie_gen"].hint
    assert by["vllm"].measured == "vLLM 0.32.0"


# ------------------------------------------------------------------ GPU state


@pytest.mark.parametrize(
    "sample, words",
    [
        (GpuSample(GpuStatus.NO_LIBRARY, "no NVIDIA driver: libnvidia-ml.so.1 not found"), "install the NVIDIA driver"),
        (GpuSample(GpuStatus.NO_DRIVER, "no NVIDIA driver: the kernel module is not loaded"), "modprobe"),
        (GpuSample(GpuStatus.NO_GPU, "no GPU at index 1 (1 found)"), "nvidia-smi -L"),
        (GpuSample(GpuStatus.LOST, "GPU lost (nvmlDeviceGetPowerUsage: GPU is lost); a reboot is needed", lost=True), "reboot"),
        (dataclasses.replace(RTX3090, hung=True, detail="NVML call nvmlDeviceGetPowerUsage has not returned for 12.0 s"), "reboot"),
    ],
)
def test_no_usable_gpu_fails_once_and_skips_the_rest(sample, words):
    rs = run_checks(dataclasses.replace(FACTS, gpu=sample), cfg())
    by = {r.name: r for r in rs}
    assert by["driver"].status is Status.FAIL and by["driver"].permanent
    assert by["driver"].measured == sample.detail and words in by["driver"].hint
    assert all(by[n].status is Status.SKIP for n in preflight.GPU_CHECKS[1:])
    assert exit_code(rs) == 2


def test_no_driver_is_named_on_exactly_one_line():
    sample = GpuSample(GpuStatus.NO_LIBRARY, "no NVIDIA driver: libnvidia-ml.so.1 not found")
    rs = run_checks(dataclasses.replace(FACTS, gpu=sample), cfg())
    lines = [" ".join((r.measured, r.expected, r.hint)) for r in rs]
    assert sum("no NVIDIA driver" in line for line in lines) == 1


def test_gpu_not_required_skips_gpu_checks():
    sample = GpuSample(GpuStatus.DISABLED, "gpu.required = false")
    rs = run_checks(dataclasses.replace(FACTS, gpu=sample), cfg(gpu={"required": False}))
    by = {r.name: r for r in rs}
    assert all(by[n].status is Status.SKIP and by[n].hint == "gpu.required = false" for n in preflight.GPU_CHECKS)
    assert exit_code(rs) == 0


@pytest.mark.parametrize(
    "version, minimum, status",
    [("535.183.01", "535.0", Status.OK), ("535.0", "535.0", Status.OK), ("470.256.02", "535.0", Status.FAIL),
     ("550.54.14", "550.54.15", Status.FAIL), ("580.159.04", "535", Status.OK), (None, "535.0", Status.WARN),
     ("580.65.06", "580", Status.OK), ("535.288.01", "570", Status.FAIL), ("N/A", "535.0", Status.WARN)],
)  # fmt: skip
def test_driver_minimum(version, minimum, status):
    r = results(facts(gpu={"driver_version": version}), cfg(gpu={"min_driver": minimum}))["driver"]
    assert r.status is status and r.expected == f">= {minimum}"
    if status is Status.FAIL:
        assert r.permanent and minimum in r.hint


# ------------------------------------------------------------------- the card


@pytest.mark.parametrize(
    "changes, card, status",
    [
        ({}, "rtx3090", Status.OK),
        ({"name": "GeForce RTX 3090"}, "rtx3090", Status.OK),  # older drivers leave out "NVIDIA"
        ({"name": "NVIDIA GeForce RTX 3090 Ti"}, "rtx3090", Status.WARN),
        ({"name": "NVIDIA GeForce RTX 3090 Ti"}, "rtx3090ti", Status.OK),
        ({"name": "NVIDIA GeForce RTX 4090", "compute_capability": (8, 9), "memory_total": 24564 * MIB}, "rtx4090", Status.OK),
        ({"memory_total": 12288 * MIB}, "rtx3090", Status.WARN),
        ({"compute_capability": (8, 9)}, "rtx3090", Status.WARN),
        ({"name": "NVIDIA H200", "memory_total": 143771 * MIB, "compute_capability": (9, 0)}, "rtx3090", Status.WARN),
        ({"name": "NVIDIA H200", "memory_total": 143771 * MIB, "compute_capability": (9, 0)}, "any", Status.OK),
    ],
)
def test_card_profile(changes, card, status):
    r = results(facts(gpu=changes), cfg(gpu={"card": card}))["card"]
    assert r.status is status
    if status is Status.WARN:
        gpu = dataclasses.replace(RTX3090, **changes)
        assert gpu.name in r.measured and f"{gpu.memory_total // MIB} MiB" in r.measured  # shows what it found
        assert "RTX 3090" in r.expected and "gpu.card" in r.hint


@pytest.mark.parametrize("key", sorted(cards.CARDS))
def test_every_configurable_card_has_a_profile(key):
    # Config accepts the key, and preflight checks the card against that card's profile.
    r = results(facts(), cfg(gpu={"card": key}))["card"]
    assert cards.CARDS[key].label in r.expected


@pytest.mark.parametrize(
    "width, width_max, status, hint",
    [(16, 16, Status.OK, ""), (4, 16, Status.FAIL, "reseat"), (8, 16, Status.FAIL, "BIOS"),
     (4, 4, Status.FAIL, "slot only offers x4"), (None, 16, Status.SKIP, "")],
)  # fmt: skip
def test_pcie_width_on_a_3090(width, width_max, status, hint):
    r = results(facts(gpu={"pcie_width": width, "pcie_width_max": width_max}))["pcie_width"]
    assert r.status is status and hint in r.hint
    if status is not Status.SKIP:
        assert r.measured == f"x{width} of x{width_max}" and r.expected == "x16"
    if status is Status.FAIL:
        assert r.permanent


def test_pcie_width_of_another_card_is_judged_against_its_own_maximum():
    other = {"name": "NVIDIA GeForce RTX 4060 Ti", "compute_capability": (8, 9), "memory_total": 16380 * MIB}
    assert results(facts(gpu={**other, "pcie_width": 8, "pcie_width_max": 8}))["pcie_width"].status is Status.OK
    assert results(facts(gpu={**other, "pcie_width": 4, "pcie_width_max": 8}))["pcie_width"].status is Status.FAIL


@pytest.mark.parametrize(
    "gen, gen_max, util, status, words",
    [(4, 4, 0, Status.OK, ""), (1, 4, 0, Status.OK, "at idle"), (1, 4, 95, Status.WARN, "under load"),
     (3, 3, 95, Status.WARN, "limits the link to Gen3"), (None, 4, 0, Status.SKIP, "")],
)  # fmt: skip
def test_pcie_generation(gen, gen_max, util, status, words):
    r = results(facts(gpu={"pcie_gen": gen, "pcie_gen_max": gen_max, "utilization_gpu": util}))["pcie_gen"]
    assert r.status is status and words in r.measured + r.hint


@pytest.mark.parametrize(
    "mode, expect, status",
    [(False, "report", Status.OK), (True, "report", Status.OK), (True, "on", Status.OK), (False, "on", Status.WARN),
     (True, "off", Status.WARN), (None, "on", Status.SKIP)],
)  # fmt: skip
def test_persistence(mode, expect, status):
    r = results(facts(gpu={"persistence_mode": mode}), cfg(gpu={"expect_persistence": expect}))["persistence"]
    assert r.status is status
    if mode is not None:
        assert r.measured == ("on" if mode else "off")


# ----------------------------------------------------------------------- VRAM


def test_vram_held_by_a_foreign_process_warns_naming_it_and_leaves_the_wait_to_the_start_gate():
    """No failure: the daemon goes up and its first start waits in waiting-for-gpu (core.policy's start gate);
    run by hand, preflight says WARNING (exit 1) and who holds the card."""
    f = facts(gpu={"processes": (GpuProcess(777, 20 * GIB),), "memory_free": 3 * GIB}, pid_names=((777, "python3"),))
    r = results(f)["vram"]
    assert r.status is Status.WARN
    assert r.measured.endswith("; held by pid 777 (python3, 20480 MiB)"), r.measured
    assert "waiting-for-gpu" in r.hint
    assert failures(run_checks(f, cfg())) == []
    assert exit_code([r]) == 1


def test_vram_held_by_our_own_engine_passes():
    f = facts(gpu={"processes": (GpuProcess(777, 20 * GIB), GpuProcess(778, 1 * GIB)), "memory_free": 3 * GIB}, own_pids=frozenset({777, 778}))
    r = results(f)["vram"]
    assert r.status is Status.OK and r.measured == "held by r3090d's engine (pid 777, 778)"


def test_vram_one_foreign_among_our_own_still_warns():
    f = facts(gpu={"processes": (GpuProcess(777, 20 * GIB), GpuProcess(900, 1 * GIB)), "memory_free": 3 * GIB}, own_pids=frozenset({777}))
    r = results(f)["vram"]
    assert r.status is Status.WARN and "pid 900" in r.measured and "777" not in r.measured


@pytest.mark.parametrize(
    "free_mib, util, status",
    # 0.90 x 24576 MiB = 22118 MiB, + 512 MiB for the engine's CUDA context
    [(24000, 0.90, Status.OK), (22631, 0.90, Status.OK), (22500, 0.90, Status.FAIL), (23000, 0.95, Status.FAIL)],
)
def test_vram_free_against_gpu_memory_utilization(free_mib, util, status):
    c = cfg(profiles={"realtime": {"gpu_memory_utilization": util}}, watchdog={"gpu_memory_alert_mib": 24500})
    r = results(facts(gpu={"memory_free": free_mib * MIB}), c)["vram"]
    assert r.status is status
    assert f"{util:g} x 24576 MiB = {util * 24576:.0f} MiB" in r.expected
    if status is Status.FAIL:
        assert not r.permanent and f"{free_mib} MiB free" in r.measured


def test_vram_held_by_a_small_foreign_process_that_leaves_room_passes():
    """A desktop's or a monitoring agent's small context does not stop the engine from starting."""
    f = facts(gpu={"processes": (GpuProcess(777, 300 * MIB),), "memory_free": 23 * GIB}, pid_names=((777, "Xorg"),))
    r = results(f)["vram"]
    assert r.status is Status.OK and "held by pid 777 (Xorg, 300 MiB)" in r.measured


def test_vram_without_a_process_list_is_judged_by_free_memory():
    r = results(facts(gpu={"processes": None}))["vram"]
    assert r.status is Status.OK and "process list not reported" in r.measured


# ----------------------------------------------------------------------- port


def test_port_held_by_a_foreign_process():
    port = PortFacts("127.0.0.1", 8000, False, "listening", holders=(PortHolder(555, "nginx"),))
    r = results(facts(host={"port": port}))["port"]
    assert r.status is Status.FAIL and not r.permanent and "pid 555 (nginx)" in r.measured


def test_port_held_by_our_engine():
    port = PortFacts("127.0.0.1", 8000, False, "listening", holders=(PortHolder(555, "python3"),))
    r = results(facts(host={"port": port}, own_pids=frozenset({555})))["port"]
    assert r.status is Status.OK and r.measured == "held by r3090d's engine (pid 555)"


def test_port_owner_invisible_while_our_engine_runs():
    port = PortFacts("127.0.0.1", 8000, False, "listening", holders=(PortHolder(None),))
    assert results(facts(host={"port": port}))["port"].status is Status.FAIL
    r = results(facts(host={"port": port}, own_pids=frozenset({555})))["port"]
    assert r.status is Status.OK and "555" in r.measured


def test_port_check_error_is_permanent():
    port = PortFacts("10.9.9.9", 8000, None, error="10.9.9.9 is not an address of this machine")
    r = results(facts(host={"port": port}))["port"]
    assert r.status is Status.FAIL and r.permanent and "engine.host" in r.hint


# ------------------------------------------------------------------ the model


def test_qwen_7b_fits_a_3090_by_estimate():
    r = results()["model_fit"]
    assert r.status is Status.OK
    # 7.62 B parameters in bf16 = 15.23 GB = 14.19 GiB; KV 57,344 B/token x 4096 = 0.22 GiB
    assert "weights 14.19 GiB (estimated from config.json)" in r.measured
    assert "KV 0.22 GiB for one 4096-token sequence" in r.measured
    assert r.expected == "<= 0.9 x 24.00 GiB = 21.60 GiB"


def test_measured_weights_win_over_the_estimate():
    model = dataclasses.replace(QWEN_DIR, weight_bytes=15_231_233_024)
    r = results(facts(host={"model": model}))["model_fit"]
    assert "weights 14.19 GiB (safetensors)" in r.measured


def test_a_model_that_cannot_fit_fails_permanently_with_numbers():
    model = dataclasses.replace(QWEN_DIR, weight_bytes=30 * GIB)  # a 14-16 B model in bf16
    r = results(facts(host={"model": model}))["model_fit"]
    assert r.status is Status.FAIL and r.permanent
    assert "weights 30.00 GiB" in r.measured and "21.60 GiB" in r.expected and "short by 8.62 GiB" in r.hint


def test_a_context_too_long_for_the_kv_cache_fails():
    # profile "none": vLLM defaults to the model's own 131072 tokens: 7.0 GiB of KV on top of 14.19 GiB.
    c = cfg(profile="none", engine={"extra_args": ["--gpu-memory-utilization", "0.85"]})
    r = results(FACTS, c)["model_fit"]
    assert r.status is Status.FAIL and "131072-token" in r.measured and "max_position_embeddings" in r.hint
    c8 = cfg(profile="none", engine={"extra_args": ["--gpu-memory-utilization", "0.85", "--max-model-len=8192", "--kv-cache-dtype", "fp8"]})
    assert results(FACTS, c8)["model_fit"].status is Status.OK


@pytest.mark.parametrize(
    "model, status",
    [
        (None, Status.SKIP),  # a hub name
        (ModelFacts(path="/nope", is_dir=False, error="/nope does not exist"), Status.FAIL),
        (ModelFacts(path="/m", is_dir=True, error="config.json: missing"), Status.FAIL),
        (dataclasses.replace(QWEN_DIR, error="model.safetensors: truncated",
                             weight_files=(WeightFile("model.safetensors", "safetensors", 10, error="truncated"),)), Status.FAIL),
        (dataclasses.replace(QWEN_DIR, config={"architectures": ["Foo"], "model_type": "foo", "num_hidden_layers": 2,
                                               "hidden_size": 64, "num_attention_heads": 4}), Status.WARN),
    ],
)  # fmt: skip
def test_model_directory_problems(model, status):
    r = results(facts(host={"model": model}))["model_fit"]
    assert r.status is status


# ------------------------------------------------------------------ host, vllm


def test_host_tuning_warnings():
    by = results(facts(host={"swap_total_bytes": 8 * GIB, "swap_devices": ("/swapfile",), "swappiness": 60, "governors": ("powersave",)}))
    assert {n: by[n].status for n in ("swap", "swappiness", "governor")} == {n: Status.WARN for n in ("swap", "swappiness", "governor")}
    assert by["swap"].measured == "8192 MiB on /swapfile"
    assert exit_code(list(by.values())) == 1


def test_governor_expectation_comes_from_config():
    c = cfg(preflight={"governor": "schedutil"})
    assert results(facts(host={"governors": ("schedutil",)}), c)["governor"].status is Status.OK
    assert results(facts(host={"governors": ("performance",)}), c)["governor"].status is Status.WARN
    assert results(FACTS, cfg(preflight={"governor": ""}))["governor"].status is Status.SKIP


def test_vllm_missing_is_a_permanent_failure():
    r = results(dataclasses.replace(FACTS, engine_version=None, engine_error="vllm is not installed for /usr/bin/python3"))["vllm"]
    assert r.status is Status.FAIL and r.permanent and "not installed" in r.measured


@pytest.mark.parametrize(
    "version, status",
    [("0.32.0", Status.OK), ("0.32.0+cpu", Status.OK), ("0.32.0.post1", Status.OK), ("0.31.2", Status.OK),
     ("0.10.2rc1", Status.OK), ("0.32.1", Status.WARN), ("0.33.0rc1", Status.WARN), ("0.32.1.dev45+g1234abc", Status.WARN),
     ("0.40.0", Status.WARN), ("1.0.0+cpu", Status.WARN)],
)  # fmt: skip
def test_vllm_newer_than_the_last_known_to_work_warns(version, status):
    # A build of the known release (+cpu, .post1) is that release; a pre-release of the next one is not.
    r = results(dataclasses.replace(FACTS, engine_version=version))["vllm"]
    assert r.status is status and r.measured == f"vLLM {version}"
    if status is Status.WARN:
        assert f"vLLM {version} is newer than 0.32.0, the last version known to work" in r.hint


def test_exit_codes():
    ok = preflight.CheckResult("a", Status.OK, "", "")
    skip = preflight.CheckResult("b", Status.SKIP, "", "")
    warn = preflight.CheckResult("c", Status.WARN, "", "")
    fail = preflight.CheckResult("d", Status.FAIL, "", "", permanent=False)
    assert exit_code([ok, skip]) == 0
    assert exit_code([ok, warn, skip]) == 1
    assert exit_code([warn, fail]) == 2
    assert failures([ok, fail], permanent=True) == [] and failures([ok, fail]) == [fail]


# ---------------------------------------------------------------------- purity

IO_MODULES = {"os", "subprocess", "socket", "time", "pynvml", "psutil", "requests", "httpx", "pathlib", "threading", "shutil", "urllib"}


def test_preflight_imports_no_io():
    tree = ast.parse(Path(preflight.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
            imported |= {f"{node.module}.{a.name}" for a in node.names}
    assert not imported & IO_MODULES
    assert not {m for m in imported if m.startswith("r3090d.probes")}
