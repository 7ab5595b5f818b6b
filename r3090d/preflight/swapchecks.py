"""Preflight's checks of swap mode ([[models]]): what the engines need of the card and the host together. Pure: no I/O.

Each model's own fit is checks.check_model_fits; here, the host memory for the parked engines
(swap_budget) and the card's memory for the resident ones (resident_fit).
"""

from __future__ import annotations

from dataclasses import replace

from r3090d.cards import CARDS
from r3090d.config import Config
from r3090d.config.models import engine_configs
from r3090d.core.hostmemory import DEFAULT_HOST_MARGIN_MIB, ESTIMATED_BASE_RSS_MIB, HostMemory, parkable_count
from r3090d.core.room import ENGINE_CONTEXT_MARGIN, gpu_memory_utilization
from r3090d.core.snapshot import GpuSample
from r3090d.core.suspension import unavailable_here
from r3090d.preflight.results import CheckResult, PreflightFacts, Status
from r3090d.units import MIB


def check_resident_fit(gpu: GpuSample, cfg: Config) -> CheckResult:
    """Swap mode with swap.max_resident > 1: any max_resident engines fit on the card together. vLLM starts an engine
    only when the free memory holds its share (gpu_memory_utilization x the card), so the largest shares, each with
    its engine's CUDA context, must fit side by side; a failure is certain, hence permanent."""
    name, k = "resident_fit", cfg.swap.max_resident
    if not cfg.gpu.required:
        return CheckResult(name, Status.SKIP, "no GPU: the engines share no card memory", "", "gpu.required = false")
    shares = sorted(((gpu_memory_utilization(e), n) for n, e in engine_configs(cfg).items()), key=lambda s: (-s[0], s[1]))
    card = CARDS.get(cfg.gpu.card)
    total_mib = gpu.memory_total / MIB if gpu.memory_total else (card.memory_mib if card is not None else None)

    def need(j: int) -> float:  # MiB for the j largest; without the card's size, the fraction of it
        fraction = sum(u for u, _ in shares[:j])
        return fraction if total_mib is None else fraction * total_mib + j * ENGINE_CONTEXT_MARGIN / MIB

    limit = 1.0 if total_mib is None else total_mib
    named = f"the {k} largest shares ({', '.join(f'{n} {u:g}' for u, n in shares[:k])})"
    if total_mib is None:
        measured, expected = f"{named} add up to {need(k):g} of the card", "at most 1 of the card"
    else:
        measured = f"{named} and {k} engine contexts need {need(k):.0f} MiB of {total_mib:.0f} MiB"
        expected = f"swap.max_resident = {k} engines on the card at once, each its share + {ENGINE_CONTEXT_MARGIN / MIB:.0f} MiB"
    if need(k) <= limit:
        return CheckResult(name, Status.OK, measured, expected)
    fitting = max((j for j in range(1, k) if need(j) <= limit), default=1)
    return CheckResult(name, Status.FAIL, measured, expected,
                       f"lower the models' gpu_memory_utilization (their profiles, or --gpu-memory-utilization) until {k} fit "
                       f"together, or set swap.max_resident = {fitting}")  # fmt: skip


def _model_config(cfg: Config, model) -> Config:
    """A [[models]] entry's engine as far as its share of the card and checkpointing go: its profile
    (else the top-level one) and its extra args."""
    engine = replace(cfg.engine, extra_args=list(getattr(model, "extra_args", ())))
    return replace(cfg, profile=getattr(model, "profile", "") or cfg.profile, engine=engine)


def check_swap_budget(facts: PreflightFacts, cfg: Config) -> CheckResult:
    """Swap mode: how many engines the host memory budget can hold parked, each costing its share of the
    card (its gpu_memory_utilization x the card's memory) plus an estimated base RSS, before any has run."""
    models = tuple(getattr(cfg, "models", ()))
    swap = getattr(cfg, "swap", None)
    if not cfg.gpu.required:
        return CheckResult("swap_budget", Status.SKIP, "no GPU: nothing is parked, a swap is a drained stop and a cold start",
                           "", "gpu.required = false")  # fmt: skip
    max_resident = getattr(swap, "max_resident", 1)
    card = CARDS.get(cfg.gpu.card)
    card_mib = card.memory_mib if card is not None else (facts.gpu.memory_total or 0) // MIB or None
    costs: list[tuple[str, int]] = []
    cold_only: list[str] = []
    for model in models:
        engine = _model_config(cfg, model)
        if unavailable_here(engine) is not None:
            cold_only.append(model.name)
        elif card_mib is not None:
            share = int(gpu_memory_utilization(engine) * card_mib)
            costs.append((model.name, share + ESTIMATED_BASE_RSS_MIB))
    budget, source = _swap_budget(facts.host_memory, swap)
    out_at_once = len(models) - max_resident
    return judge_swap_budget(budget, source, tuple(costs), out_at_once, tuple(cold_only), card_mib is None)


def _swap_budget(memory: HostMemory | None, swap) -> tuple[int | None, str]:
    """The budget for parked engines and where it comes from: swap.host_memory_budget_mib, else the
    host's reading (nothing is parked before the daemon runs, so nothing is added back)."""
    configured = getattr(swap, "host_memory_budget_mib", 0)
    if configured:
        return configured, "swap.host_memory_budget_mib"
    if memory is None:
        return None, "not read"
    if memory.mem_available_mib is None and memory.cgroup_max_mib is None:
        return None, "; ".join(memory.errors) or "not read"
    margin = getattr(swap, "host_memory_margin_mib", DEFAULT_HOST_MARGIN_MIB)
    return memory.budget_mib(margin), _budget_source(memory, margin)


def _budget_source(memory: HostMemory, margin_mib: int) -> str:
    rooms = []
    if memory.mem_available_mib is not None:
        rooms.append(f"MemAvailable {memory.mem_available_mib} MiB")
    if memory.cgroup_max_mib is not None and memory.cgroup_current_mib is not None:
        rooms.append(f"the cgroup's {memory.cgroup_max_mib} - {memory.cgroup_current_mib} MiB")
    lower = rooms[0] if len(rooms) == 1 else f"the lower of {' and '.join(rooms)}"
    return f"{lower}, less the {margin_mib} MiB margin"


def judge_swap_budget(
    budget_mib: int | None,
    source: str,
    costs: tuple[tuple[str, int], ...],
    out_at_once: int,
    cold_only: tuple[str, ...] = (),
    card_unknown: bool = False,
) -> CheckResult:
    """How many of the engines that can be parked (name, estimated cost in MiB) the budget holds at once,
    against how many are out of the GPU at once (the models beyond swap.max_resident).
    `cold_only`: models that can never be checkpointed (a swap stops them and cold-starts them later)."""
    name = "swap_budget"
    expected = f"room to park {max(0, out_at_once)} engines at once (the models beyond swap.max_resident)"
    never = ""
    if cold_only:
        never = f"; {', '.join(cold_only)}: cannot be suspended, so a swap stops it drained and cold-starts it later"
    if not costs:
        why = "no engine can be suspended"
        if card_unknown:
            why = "the card's memory is unknown (gpu.card = any and no NVML reading)"
        return CheckResult(name, Status.SKIP, f"{why}{never}", expected)
    if budget_mib is None:
        return CheckResult(name, Status.SKIP, f"host memory not measured: {source}{never}", expected,
                           "set swap.host_memory_budget_mib")  # fmt: skip
    count = parkable_count(budget_mib, (cost for _, cost in costs))
    each = ", ".join(f"{n} {cost} MiB" for n, cost in costs)
    measured = (f"{budget_mib} MiB ({source}) holds {count} of {len(costs)} engines parked ({each}, "
                f"each its share of the card + {ESTIMATED_BASE_RSS_MIB} MiB base RSS){never}")  # fmt: skip
    if count >= min(len(costs), out_at_once):
        return CheckResult(name, Status.OK, measured, expected)
    return CheckResult(name, Status.WARN, measured, expected,
                       "a swap with no room to park stops the outgoing engine drained and cold-starts it later (slow): "
                       "add host memory, raise the unit's MemoryMax, or lower the models' gpu_memory_utilization")  # fmt: skip
