"""Preflight verdicts: pure functions from gathered facts to CheckResults.

No I/O here: `r3090d.preflight.gather.gather()` collects a PreflightFacts
(one NVML reading, /proc and /sys, the port, the model directory, the
engine's vLLM version) and `run_checks()` judges it against the config.

Each failure says whether it is permanent (the host cannot run the engine
until someone changes something: exit 69, no restart) or transient (a port
held by another process, VRAM short with no process to name, which may go
away: retry for preflight.transient_give_up_s). VRAM held by other processes
is a warning, not a failure: the engine's start waits for them in
waiting-for-gpu, as every automatic start does (core.room, core.policy).

The daemon's own engine is not a foreign process: pids passed in
`own_pids` may hold the port and VRAM.
"""

from __future__ import annotations

import re
from dataclasses import replace

from packaging.version import Version

from r3090d import exitcodes
from r3090d.cards import CARDS, CardProfile
from r3090d.config import Config, EngineListen
from r3090d.config.models import engine_configs, port_for
from r3090d.core.room import ENGINE_CONTEXT_MARGIN, engine_room, gpu_memory_utilization
from r3090d.core.snapshot import GpuSample, GpuStatus, HostFacts
from r3090d.core.suspension import unavailable_here
from r3090d.engineflags import flag_value
from r3090d.measure.plan import PlanError, estimate_weights, kv_bytes_per_token, shape_from_config
from r3090d.preflight.results import CheckResult, PreflightFacts, Status
from r3090d.preflight.swapchecks import check_resident_fit, check_swap_budget
from r3090d.units import GIB, MIB
from r3090d.versions import VLLM_LAST_KNOWN_GOOD, newer_than_known_vllm, parse_version

# NVML's total differs from the marketing size by a few hundred MiB on some boards.
CARD_MEMORY_TOLERANCE = 0.03
# Below this GPU utilization the link generation may legitimately be lowered.
PCIE_GEN_LOAD_PERCENT = 30


# ------------------------------------------------------------------- helpers


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:.0f} MiB"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _own(pids, own: frozenset[int]) -> list[int]:
    return sorted(p for p in pids if p in own)


def _cuda(version: int | None) -> str:
    return f"CUDA {version // 1000}.{version % 1000 // 10}" if version else "CUDA ?"


def card_matches(gpu: GpuSample, profile: CardProfile) -> bool:
    if gpu.name is None or not re.search(profile.name_pattern, gpu.name):
        return False
    if gpu.memory_total is not None and abs(gpu.memory_total / MIB - profile.memory_mib) > CARD_MEMORY_TOLERANCE * profile.memory_mib:
        return False
    return gpu.compute_capability is None or tuple(gpu.compute_capability) == profile.compute_capability


def exit_code(results: list[CheckResult]) -> int:
    """0 all ok or skipped, 1 warnings only, 2 any failure (the monitoring-plugin scheme)."""
    statuses = {r.status for r in results}
    if Status.FAIL in statuses:
        return exitcodes.CRITICAL
    if Status.WARN in statuses:
        return exitcodes.WARNING
    return exitcodes.OK


def failures(results: list[CheckResult], *, permanent: bool | None = None) -> list[CheckResult]:
    """Failed checks; permanent=True/False narrows to those that need a human / may clear."""
    return [r for r in results if r.status is Status.FAIL and (permanent is None or r.permanent is permanent)]


# -------------------------------------------------------------------- checks

GPU_CHECKS = ("driver", "card", "pcie_width", "pcie_gen", "persistence", "vram", "model_fit", "ptrace_scope", "suspend")
# r3090ctl suspend: the driver's process checkpoint calls came with 570 (CUDA 12.8).
SUSPEND_MIN_DRIVER = Version("570")
SUSPEND_MIN_CUDA = 12080
SUSPEND_HOST_MARGIN = GIB  # host memory beyond the engine's GPU bytes, for the process to go on living


def _swap_mode(cfg: Config) -> bool:
    return bool(getattr(cfg, "models", ()))


def _gpu_check_names(cfg: Config) -> list[str]:
    """GPU_CHECKS, with one model_fit per [[models]] entry in swap mode."""
    if not _swap_mode(cfg):
        return list(GPU_CHECKS)
    fits = [f"model_fit:{m.name}" for m in cfg.models]
    return [n for name in GPU_CHECKS for n in (fits if name == "model_fit" else [name])]


def run_checks(facts: PreflightFacts, cfg: Config) -> list[CheckResult]:
    results: list[CheckResult] = []
    names = _gpu_check_names(cfg)
    if not cfg.gpu.required:
        results += [CheckResult(n, Status.SKIP, "not checked", "", "gpu.required = false") for n in names]
    elif not facts.gpu.usable:
        results.append(check_gpu_reading(facts.gpu, cfg))
        results += [CheckResult(n, Status.SKIP, "no GPU reading", "", "see the driver check") for n in names[1:]]
    else:
        gpu = facts.gpu
        profile = CARDS.get(cfg.gpu.card)
        matches = profile is not None and card_matches(gpu, profile)
        results += [
            check_driver(gpu, cfg),
            check_card(gpu, profile),
            check_pcie_width(gpu, profile if matches else None),
            check_pcie_gen(gpu, profile if matches else None),
            check_persistence(gpu, cfg),
            check_vram(gpu, cfg, facts),
            *check_model_fits(gpu, facts, cfg),
            check_ptrace_scope(facts, cfg),
            check_suspend(gpu, facts, cfg),
        ]
    results += [
        check_swap(facts.host),
        check_swappiness(facts.host, cfg),
        check_governor(facts.host, cfg),
        check_port(facts.host, facts.own_pids) if not cfg.engine.uds else
        CheckResult("port", Status.SKIP, "not used", "", f"the engine serves on {cfg.engine.uds}"),
        check_vllm(facts, cfg),
    ]
    if _swap_mode(cfg):
        results.append(check_engine_listen(cfg))
        results.append(check_swap_budget(facts, cfg))
        if cfg.swap.max_resident > 1:
            results.append(check_resident_fit(facts.gpu, cfg))
    return results


def check_gpu_reading(gpu: GpuSample, cfg: Config) -> CheckResult:
    """The driver row when there is no usable GPU reading: say why, once."""
    expected = f">= {cfg.gpu.min_driver}, GPU {cfg.gpu.index}"
    if gpu.hung:
        return CheckResult("driver", Status.FAIL, gpu.detail or "NVML does not answer", expected,
                           "the driver hangs (nvidia-smi will too); check dmesg and reboot")  # fmt: skip
    hints = {
        GpuStatus.NO_LIBRARY: f"install the NVIDIA driver ({cfg.gpu.min_driver} or newer), or set gpu.required = false",
        GpuStatus.NO_DRIVER: "load the kernel module (modprobe nvidia) or reinstall the driver; check dmesg",
        GpuStatus.NO_GPU: "check gpu.index against `nvidia-smi -L`",
        GpuStatus.LOST: "the GPU fell off the bus: check dmesg for XID 79, reseat power and the card, reboot",
        GpuStatus.PENDING: "NVML has not answered yet",
    }
    detail = gpu.detail or gpu.status.value
    return CheckResult("driver", Status.FAIL, detail, expected, hints.get(gpu.status, "see the error; `nvidia-smi` may say more"))


def check_driver(gpu: GpuSample, cfg: Config) -> CheckResult:
    want = parse_version(cfg.gpu.min_driver) or Version("0")
    have = parse_version(gpu.driver_version)
    expected = f">= {cfg.gpu.min_driver}"
    if have is None:
        return CheckResult("driver", Status.WARN, "version not reported", expected, "check `nvidia-smi`")
    measured = f"{gpu.driver_version} ({_cuda(gpu.cuda_driver_version)})"
    if have < want:
        return CheckResult("driver", Status.FAIL, measured, expected, f"install driver {cfg.gpu.min_driver} or newer")
    return CheckResult("driver", Status.OK, measured, expected)


def _card_text(name, memory_mib, cc) -> str:
    cc_text = f"CC {cc[0]}.{cc[1]}" if cc else "CC ?"
    mem = f"{memory_mib:.0f} MiB" if memory_mib is not None else "? MiB"
    return f"{name or '?'}, {mem}, {cc_text}"


def check_card(gpu: GpuSample, profile: CardProfile | None) -> CheckResult:
    measured = _card_text(gpu.name, gpu.memory_total / MIB if gpu.memory_total is not None else None, gpu.compute_capability)
    if profile is None:
        return CheckResult("card", Status.OK, measured, "any (gpu.card = any)")
    expected = _card_text(profile.label, profile.memory_mib, profile.compute_capability)
    if card_matches(gpu, profile):
        return CheckResult("card", Status.OK, measured, expected)
    return CheckResult("card", Status.WARN, measured, expected,
                       f"not the {profile.label} that gpu.card = {profile.key!r} describes; set gpu.card to match, or 'any'")  # fmt: skip


def check_pcie_width(gpu: GpuSample, profile: CardProfile | None) -> CheckResult:
    cur, top = gpu.pcie_width, gpu.pcie_width_max
    if cur is None or top is None:
        return CheckResult("pcie_width", Status.SKIP, "not reported", "", "NVML does not report the link width here")
    want = profile.pcie_width if profile is not None else top
    expected = f"x{want}" + ("" if profile is not None else " (the maximum the card reports)")
    measured = f"x{cur} of x{top}"
    if cur == top == want:
        return CheckResult("pcie_width", Status.OK, measured, expected)
    if top < want:
        hint = (f"the slot only offers x{top}: move the card to a full x{want} slot wired to the CPU, "
                "and check the BIOS lane setting (some boards default that slot to x4)")  # fmt: skip
    else:
        hint = f"the link trained at x{cur} of x{top}: reseat the card, check the riser, and check the BIOS slot setting"
    return CheckResult("pcie_width", Status.FAIL, measured, expected, hint)


def check_pcie_gen(gpu: GpuSample, profile: CardProfile | None) -> CheckResult:
    cur, top = gpu.pcie_gen, gpu.pcie_gen_max
    if cur is None or top is None:
        return CheckResult("pcie_gen", Status.SKIP, "not reported", "", "NVML does not report the link generation here")
    measured = f"Gen{cur} of Gen{top}"
    if profile is not None and top < profile.pcie_gen:
        return CheckResult("pcie_gen", Status.WARN, measured, f"Gen{profile.pcie_gen}",
                           f"the slot or BIOS limits the link to Gen{top}; set the slot to Gen{profile.pcie_gen} or Auto in the BIOS")  # fmt: skip
    expected = f"Gen{top} under load"
    if cur >= top:
        return CheckResult("pcie_gen", Status.OK, measured, expected)
    util = gpu.utilization_gpu
    if util is not None and util >= PCIE_GEN_LOAD_PERCENT:
        return CheckResult("pcie_gen", Status.WARN, f"{measured} at {util}% load", expected,
                           "the link stays below its maximum under load: check the slot, riser and BIOS PCIe setting")  # fmt: skip
    return CheckResult("pcie_gen", Status.OK, f"{measured} at idle", expected,
                       "GeForce cards lower the link generation at idle to save power; judge it under load")  # fmt: skip


def check_persistence(gpu: GpuSample, cfg: Config) -> CheckResult:
    want = cfg.gpu.expect_persistence
    if gpu.persistence_mode is None:
        return CheckResult("persistence", Status.SKIP, "not reported", want)
    measured = "on" if gpu.persistence_mode else "off"
    if want == "report":
        return CheckResult("persistence", Status.OK, measured, "report only (gpu.expect_persistence)")
    if measured == want:
        return CheckResult("persistence", Status.OK, measured, want)
    return CheckResult("persistence", Status.WARN, measured, want,
                       f"nvidia-smi -pm {1 if want == 'on' else 0} (or nvidia-persistenced), or set gpu.expect_persistence")  # fmt: skip


def check_vram(gpu: GpuSample, cfg: Config, facts: PreflightFacts) -> CheckResult:
    """The room for the engine to start (core.room, as every automatic start judges it): other processes may
    hold the card as long as they leave it."""
    util = gpu_memory_utilization(cfg)
    if gpu.memory_total is None or gpu.memory_free is None:
        return CheckResult("vram", Status.SKIP, "memory not reported", "")
    room = engine_room(gpu, cfg, tuple(facts.own_pids), facts.pid_names)
    if room is None:
        return CheckResult("vram", Status.SKIP, "NVML gives no usable reading", "")
    expected = (f"free >= {util:g} x {_mib(gpu.memory_total)} = {util * gpu.memory_total / MIB:.0f} MiB "
                f"+ {ENGINE_CONTEXT_MARGIN / MIB:.0f} MiB for the engine's CUDA context")  # fmt: skip
    own = _own((p.pid for p in gpu.processes or ()), facts.own_pids)
    if own and not room.holders:
        return CheckResult("vram", Status.OK, f"held by r3090d's engine (pid {', '.join(map(str, own))})", expected)
    measured = room.text() + (" (process list not reported)" if gpu.processes is None else "")
    if room.fits:
        return CheckResult("vram", Status.OK, measured, expected)
    if room.holders:
        # Not a failure: the engine's start waits for the holders in waiting-for-gpu (core.policy's start
        # gate), the daemon up and the unit active, rather than preflight retrying until it exits 75.
        return CheckResult("vram", Status.WARN, measured, expected,
                           "the engine waits in waiting-for-gpu until they let go; stop that process "
                           "(an engine left over from a crash keeps VRAM until killed)")  # fmt: skip
    return CheckResult("vram", Status.FAIL, measured, expected,
                       "something outside NVML's process list holds VRAM (a display server, another container); "
                       "free it or lower gpu_memory_utilization", permanent=False)  # fmt: skip


PTRACE_SCOPE_REFUSED = {
    2: ("even an ancestor is refused without CAP_SYS_PTRACE: r3090ctl suspend will fail",
        "sysctl kernel.yama.ptrace_scope=1 (and persist it in /etc/sysctl.d/), or give r3090d CAP_SYS_PTRACE"),
    3: ("every process is refused, even an ancestor with CAP_SYS_PTRACE: r3090ctl suspend will fail",
        "set kernel.yama.ptrace_scope = 1 in /etc/sysctl.d/ and reboot: 3 cannot be lowered until then"),
}  # fmt: skip


def check_ptrace_scope(facts: PreflightFacts, cfg: Config) -> CheckResult:
    """Whether Yama lets the checkpoint calls reach the engine. The driver applies ptrace's rules to them;
    r3090d makes them from the engine's launcher, an ancestor of every engine process, which scope 1 allows."""
    expected = "0 or 1 (r3090d calls from an ancestor of the engine)"
    refusal = unavailable_here(cfg)
    if refusal is not None:
        return CheckResult("ptrace_scope", Status.SKIP, f"suspend unavailable: {refusal.text}", expected)
    scope = facts.ptrace_scope
    if scope is None:
        return CheckResult("ptrace_scope", Status.SKIP, "no Yama in this kernel: ptrace's own rules apply", expected)
    measured = f"kernel.yama.ptrace_scope = {scope}"
    if scope in PTRACE_SCOPE_REFUSED:
        why, hint = PTRACE_SCOPE_REFUSED[scope]
        return CheckResult("ptrace_scope", Status.WARN, f"{measured}: {why}", expected, hint)
    return CheckResult("ptrace_scope", Status.OK, measured, expected)


def check_suspend(gpu: GpuSample, facts: PreflightFacts, cfg: Config) -> CheckResult:
    """Whether `r3090ctl suspend` can work here: a note (SKIP) when it cannot, never a failure;
    a warning when the checkpoint would fit only with swap (resume would crawl)."""
    expected = f"driver >= {SUSPEND_MIN_DRIVER}, host memory for the engine's GPU memory + {_gib(SUSPEND_HOST_MARGIN)}"
    refusal = unavailable_here(cfg)
    if refusal is not None:
        return CheckResult("suspend", Status.SKIP, f"suspend unavailable: {refusal.text}", expected)
    version = parse_version(gpu.driver_version)
    if version is not None:
        new_enough = version >= SUSPEND_MIN_DRIVER
    else:
        new_enough = (gpu.cuda_driver_version or 0) >= SUSPEND_MIN_CUDA
    if not new_enough:
        return CheckResult("suspend", Status.SKIP, f"suspend unavailable: driver {gpu.driver_version or '?'} ({_cuda(gpu.cuda_driver_version)}) "
                           "predates process checkpointing", expected, f"a {SUSPEND_MIN_DRIVER} or newer driver enables it")  # fmt: skip
    if facts.checkpoint_state is not None and facts.checkpoint_state.startswith("unavailable"):
        return CheckResult("suspend", Status.SKIP, f"suspend {facts.checkpoint_state}", expected)
    own = [p for p in gpu.processes or () if p.pid in facts.own_pids]
    engine = sum(p.used_bytes or 0 for p in own) if own else gpu_memory_utilization(cfg) * (gpu.memory_total or 0)
    asked = f"; the driver answers for {facts.checkpoint_state}" if facts.checkpoint_state else ""
    host = facts.host
    if host.mem_available_bytes is None:
        return CheckResult("suspend", Status.OK, f"driver {gpu.driver_version} can checkpoint; host memory not measured{asked}", expected)
    need = engine + SUSPEND_HOST_MARGIN
    room = f"{_gib(host.mem_available_bytes)} of host memory available for the engine's {_gib(engine)} + {_gib(SUSPEND_HOST_MARGIN)}"
    if host.mem_available_bytes >= need:
        return CheckResult("suspend", Status.OK, f"driver {gpu.driver_version} can checkpoint; {room}{asked}", expected)
    if host.mem_available_bytes + (host.swap_total_bytes or 0) >= need:
        return CheckResult("suspend", Status.WARN, f"swap would take the checkpoint: {room}", expected,
                           "add host memory or lower gpu_memory_utilization: a checkpoint in swap makes resume slow")  # fmt: skip
    return CheckResult("suspend", Status.SKIP, f"suspend unavailable: only {room}", expected,
                       "suspend needs host memory for all the engine holds on the GPU")  # fmt: skip


def served_context(cfg: Config, config_max: int | None) -> tuple[int | None, str]:
    """The max_model_len vLLM will serve, and where it comes from: the profile, --max-model-len, else the model's own."""
    profile = cfg.active_profile
    if profile is not None:
        return profile.max_model_len, "max_model_len"
    raw = flag_value(cfg.engine.extra_args, "--max-model-len")
    if raw is not None and str(raw).isdigit():
        return int(raw), "--max-model-len"
    return config_max, "max_position_embeddings"  # vLLM's default: the model's own limit


def check_model_fits(gpu: GpuSample, facts: PreflightFacts, cfg: Config) -> list[CheckResult]:
    """The one engine's fit; in swap mode each [[models]] entry's (model_fit:NAME), with its own profile and flags."""
    if not _swap_mode(cfg):
        return [check_model_fit(gpu, facts.host, cfg)]
    dirs = dict(facts.models)
    return [
        replace(check_model_fit(gpu, replace(facts.host, model=dirs.get(name)), engine, key=f"models[{i}].model"), name=f"model_fit:{name}")
        for i, (name, engine) in enumerate(engine_configs(cfg).items())
    ]


def check_model_fit(gpu: GpuSample, host: HostFacts, cfg: Config, key: str = "engine.model") -> CheckResult:
    """Weights plus the KV cache of one max_model_len sequence within gpu_memory_utilization x total.

    vLLM refuses to start when the KV cache cannot hold one full-length
    sequence. Activations and CUDA graphs need more on top, so passing this
    is necessary, not sufficient; a failure is certain, hence permanent.
    """
    model = host.model
    if model is None:
        return CheckResult("model_fit", Status.SKIP, f"{key} is not a local directory", "", "sizes are read from a local model directory")
    if not model.is_dir or model.config is None:
        return CheckResult("model_fit", Status.FAIL, model.error or "config.json missing", "a model directory with config.json",
                           f"point {key} at the model directory")  # fmt: skip
    if any(w.error for w in model.weight_files):
        return CheckResult("model_fit", Status.FAIL, model.error or "unreadable weights", "readable safetensors",
                           "re-download the damaged or missing weight files")  # fmt: skip
    if gpu.memory_total is None:
        return CheckResult("model_fit", Status.SKIP, "GPU memory not reported", "")
    try:
        shape = shape_from_config(model.config)
    except PlanError as exc:
        return CheckResult("model_fit", Status.WARN, f"config.json: {exc}", "", "cannot judge the fit before loading")
    weights, source = model.weight_bytes, "safetensors"
    if weights is None:
        try:
            weights, source = estimate_weights(shape).bytes, "estimated from config.json"
        except PlanError as exc:
            return CheckResult("model_fit", Status.WARN, f"weight size unknown: {exc}", "", "cannot judge the fit before loading")
    max_len, len_source = served_context(cfg, shape.max_position_embeddings)
    kv_dtype = flag_value(cfg.engine.extra_args, "--kv-cache-dtype") or "auto"
    try:
        per_token = kv_bytes_per_token(shape, kv_dtype)
    except PlanError:
        per_token = None
    kv = per_token * max_len if per_token is not None and max_len is not None else 0
    util = gpu_memory_utilization(cfg)
    budget = util * gpu.memory_total
    need = weights + kv
    kv_text = f"KV {_gib(kv)} for one {max_len}-token sequence" if kv else "KV size unknown"
    measured = f"weights {_gib(weights)} ({source}) + {kv_text} = {_gib(need)}"
    expected = f"<= {util:g} x {_gib(gpu.memory_total)} = {_gib(budget)}"
    if need > budget:
        return CheckResult("model_fit", Status.FAIL, measured, expected,
                           f"short by {_gib(need - budget)}: use a smaller or quantized model, lower {len_source}, "
                           "or raise gpu_memory_utilization")  # fmt: skip
    return CheckResult("model_fit", Status.OK, f"{measured}; {_gib(budget - need)} left for more KV and activations", expected)


def check_swap(host: HostFacts) -> CheckResult:
    if host.swap_total_bytes is None:
        return CheckResult("swap", Status.SKIP, "/proc/swaps not readable", "off")
    if host.swap_total_bytes == 0:
        return CheckResult("swap", Status.OK, "off", "off")
    return CheckResult("swap", Status.WARN, f"{_mib(host.swap_total_bytes)} on {', '.join(host.swap_devices)}", "off",
                       "swapoff -a, and remove the swap lines from /etc/fstab")  # fmt: skip


def check_swappiness(host: HostFacts, cfg: Config) -> CheckResult:
    limit = cfg.preflight.max_swappiness
    if host.swappiness is None:
        return CheckResult("swappiness", Status.SKIP, "not readable", f"<= {limit}")
    if host.swappiness <= limit:
        return CheckResult("swappiness", Status.OK, str(host.swappiness), f"<= {limit}")
    return CheckResult("swappiness", Status.WARN, str(host.swappiness), f"<= {limit}",
                       "sysctl vm.swappiness=1, and persist it in /etc/sysctl.d/")  # fmt: skip


def check_governor(host: HostFacts, cfg: Config) -> CheckResult:
    want = cfg.preflight.governor
    if not want:
        return CheckResult("governor", Status.SKIP, "not checked", "", "preflight.governor is empty")
    if host.governors is None:
        return CheckResult("governor", Status.SKIP, "no cpufreq on this host", want)
    if host.governors == (want,):
        return CheckResult("governor", Status.OK, want, want)
    return CheckResult("governor", Status.WARN, ", ".join(host.governors), want,
                       f"cpupower frequency-set -g {want} (persist it with a unit or the distribution's tool)")  # fmt: skip


def check_port(host: HostFacts, own_pids: frozenset[int]) -> CheckResult:
    port = host.port
    if port is None:
        return CheckResult("port", Status.SKIP, "not checked", "")
    where = f"{port.host}:{port.port}"
    expected = f"{where} free"
    if port.error:
        return CheckResult("port", Status.FAIL, port.error, expected, "fix engine.host / engine.port")
    if port.free is None:
        return CheckResult("port", Status.SKIP, "could not be checked", expected)
    if port.free:
        return CheckResult("port", Status.OK, port.detail or "free", expected)
    pids = [h.pid for h in port.holders if h.pid is not None]
    own = _own(pids, own_pids)
    if pids and len(own) == len(pids):
        return CheckResult("port", Status.OK, f"held by r3090d's engine (pid {', '.join(map(str, own))})", expected)
    if not pids and own_pids:
        return CheckResult("port", Status.OK, f"in use ({port.detail}), owner not visible; r3090d's engine is running "
                           f"(pid {', '.join(map(str, sorted(own_pids)))})", expected)  # fmt: skip
    foreign = [h for h in port.holders if h.pid not in own_pids]
    who = ", ".join(f"pid {h.pid}" + (f" ({h.name})" if h.name else "") for h in foreign if h.pid is not None)
    measured = f"port {port.port} in use ({port.detail})" + (f" by {who}" if who else "")
    return CheckResult("port", Status.FAIL, measured, expected, "stop that process or change engine.port", permanent=False)


def check_engine_listen(cfg: Config) -> CheckResult:
    """Swap mode: engines on TCP ports answer every local user on the routes vLLM serves without its key
    (/invocations, /pooling, /pause, /sleep, ...), past the router's key and the arbiter's counts."""
    expected = "each engine on a unix socket only the daemon's user can reach"
    if cfg.engine.listen is EngineListen.UDS:
        return CheckResult("engine_listen", Status.OK, f"unix sockets in {cfg.daemon.runtime_dir}/engines (mode 0700)", expected)
    ports = [port_for(cfg.swap.engine_port_base, cfg.instance, i) for i in range(len(cfg.models))]
    where = f"127.0.0.1:{ports[0]}" + (f"-{ports[-1]}" if len(ports) > 1 else "")
    return CheckResult("engine_listen", Status.WARN, f"engines on TCP {where}: any local user can use vLLM's routes that take no key",
                       expected, 'remove engine.listen = "tcp" (the engines then serve on unix sockets), unless a setup needs the ports')  # fmt: skip


def check_vllm(facts: PreflightFacts, cfg: Config) -> CheckResult:
    expected = f"vLLM installed for {cfg.engine.python}"
    if not facts.engine_version:
        return CheckResult("vllm", Status.FAIL, facts.engine_error or "not found", expected,
                           "install vLLM into that venv (make engine), or point engine.python at the venv's python")  # fmt: skip
    measured = f"vLLM {facts.engine_version}"
    version = parse_version(facts.engine_version)
    if version is not None and newer_than_known_vllm(version):
        known = VLLM_LAST_KNOWN_GOOD
        return CheckResult("vllm", Status.WARN, measured, f"vLLM {known} or older",
                           f"vLLM {facts.engine_version} is newer than {known}, the last version known to work: its flags "
                           f"or metrics may have changed; if the engine misbehaves, install vllm=={known} (make engine)")  # fmt: skip
    return CheckResult("vllm", Status.OK, measured, expected)
