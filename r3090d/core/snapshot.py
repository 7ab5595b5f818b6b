"""Frozen data passed between probes, policy and effectors.

Everything here is plain data: no live handles, no callbacks into a device or a
socket. A probe returns one of these samples; an expected failure (timeout,
connection refused, NotSupported, GPU lost) is a field, never an exception.
`None` in a measurement field means "not measured".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from r3090d.config.schema import CLOCK_EVENT_REASON_NAMES
from r3090d.core.xid import RecoveryAction

if TYPE_CHECKING:
    from r3090d.core.suspend_types import SleepSample, SuspendSample
    from r3090d.core.vocabulary import RestartKind
    from r3090d.measure.modelinfo import ModelFacts


# --------------------------------------------------------------------------- GPU


class GpuStatus(enum.StrEnum):
    OK = "ok"
    NO_LIBRARY = "no_library"  # libnvidia-ml.so (or the pynvml module) is absent
    NO_DRIVER = "no_driver"  # the library loads, the kernel driver does not answer
    NO_GPU = "no_gpu"  # driver fine, no device at the configured index
    LOST = "lost"  # GpuIsLost / Unknown: the card fell off the bus, reboot needed
    ERROR = "error"  # any other NVML failure, see detail
    DISABLED = "disabled"  # gpu.required = false: nothing was asked of NVML
    PENDING = "pending"  # the worker has not produced its first sample yet


# NVML's clock event (throttle) reasons, in bit order: named once, in the config's schema (the lowest layer that uses them).
CLOCK_EVENT_REASONS = CLOCK_EVENT_REASON_NAMES


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuSample:
    status: GpuStatus
    detail: str = ""
    index: int | None = None
    taken_at: float | None = None  # time.monotonic() when the worker finished the read
    age_s: float | None = None  # filled in by the reader: now - taken_at
    hung: bool = False  # the worker has been inside one NVML call past the bound
    lost: bool = False
    name: str | None = None
    uuid: str | None = None
    driver_version: str | None = None
    cuda_driver_version: int | None = None  # NVML's encoding, e.g. 12040 for 12.4
    compute_capability: tuple[int, int] | None = None
    memory_total: int | None = None  # bytes
    memory_used: int | None = None  # bytes, excluding driver-reserved (v2)
    memory_free: int | None = None
    memory_reserved: int | None = None
    utilization_gpu: int | None = None  # percent
    utilization_memory: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    clock_event_reasons: tuple[str, ...] | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    persistence_mode: bool | None = None
    processes: tuple[GpuProcess, ...] | None = None  # compute processes
    graphics_processes: tuple[GpuProcess, ...] | None = None  # a desktop's Xorg, a game
    xid_errors: tuple[int, ...] = ()  # XID codes seen since the previous sample
    xid_monitored: bool = False  # XID event registration succeeded (NotSupported on some boards)
    recovery_action: RecoveryAction | None = None  # the driver's verdict (driver 565+); None: not reported
    field_errors: tuple[str, ...] = ()  # "call: error" for reads that failed other than NotSupported

    @property
    def usable(self) -> bool:
        return self.status is GpuStatus.OK and not self.hung


# -------------------------------------------------------------------------- host


@dataclass(frozen=True)
class PortHolder:
    pid: int | None  # None: the socket's owner is not visible to this user
    name: str | None = None


@dataclass(frozen=True)
class PortFacts:
    host: str
    port: int
    free: bool | None  # None: could not be checked, see error
    detail: str = ""  # how it was judged ("listening", "bound, not listening", ...)
    error: str | None = None  # the check itself failed (unresolvable host, privileged port, ...)
    holders: tuple[PortHolder, ...] = ()


@dataclass(frozen=True)
class HostFacts:
    """The host as preflight sees it. None in a field means "not measured"."""

    swap_total_bytes: int | None = None  # active swap, summed over /proc/swaps
    mem_available_bytes: int | None = None  # /proc/meminfo MemAvailable: room for a suspended engine's GPU memory
    swap_devices: tuple[str, ...] = ()
    swappiness: int | None = None
    governors: tuple[str, ...] | None = None  # distinct cpufreq governors across CPUs
    port: PortFacts | None = None
    model: ModelFacts | None = None


@dataclass(frozen=True)
class HostLoad:
    """How busy the host's CPUs are, read each tick. None: not measured."""

    load_1m: float | None = None  # the kernel's 1-minute load average (runnable and uninterruptible tasks)
    cores: int | None = None  # CPUs this process may run on

    @property
    def saturated(self) -> bool:
        """More tasks want a CPU than there are CPUs: a request can wait its turn for seconds."""
        return self.load_1m is not None and bool(self.cores) and self.load_1m > self.cores


# ------------------------------------------------------------------------ engine


class HealthStatus(enum.StrEnum):
    OK = "ok"  # HTTP 200
    REFUSED = "refused"  # nothing listening (dead, or not yet loaded)
    TIMEOUT = "timeout"  # busy or hung
    HTTP = "http"  # any other HTTP status, see http_status (503 = EngineDeadError)
    ERROR = "error"  # other transport failure, see detail
    SKIPPED = "skipped"  # not probed (no engine process)


@dataclass(frozen=True)
class HealthSample:
    status: HealthStatus
    http_status: int | None = None
    latency_s: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class MetricsSample:
    """What vLLM's /metrics says about the served model. Counters are cumulative.

    With several data-parallel engines (`engine` label), the queue and token
    figures are summed over them. Engines may differ in size, so the KV figures
    are per engine: free_blocks is the engine with the fewest free blocks, and
    num_gpu_blocks, block_size, kv_cache_size_tokens and cache_config are that
    engine's; kv_usage is the highest usage of any engine, which need not be the
    same one. With a single engine, free_blocks = (num_gpu_blocks - 1) * (1 - kv_usage).
    """

    error: str | None = None  # why the text could not be read or parsed
    kv_usage: float | None = None  # 0..1, the fullest engine
    num_gpu_blocks: int | None = None  # of the engine with the fewest free blocks
    block_size: int | None = None
    free_blocks: float | None = None  # fewest of any engine: (its num_gpu_blocks - 1) * (1 - its usage)
    engines: int = 0  # engines serving the model (distinct engine labels); 0 when nothing was read
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None
    # vllm:request_success_total over the finish reasons stop, length and repetition:
    # requests the engine completed (the daemon's own probes among them).
    served_total: float | None = None
    kv_cache_size_tokens: int | None = None
    cache_config: tuple[tuple[str, str], ...] = ()  # labels of vllm:cache_config_info
    itl_sum: float | None = None  # vllm:inter_token_latency_seconds_sum
    itl_count: float | None = None

    @property
    def in_engine(self) -> int | None:
        """Requests running or waiting; None when this reading does not say (an error, no gauge)."""
        if self.error is not None or self.running is None:
            return None
        return round(self.running + (self.waiting or 0))


@dataclass(frozen=True)
class InferenceProbeSample:
    """Latest result of the active completion probe (run off the loop)."""

    sent_at: float | None = None  # monotonic
    finished_at: float | None = None
    ok: bool | None = None  # None while in flight or never sent
    detail: str = ""
    consecutive_failures: int = 0
    sent_total: int = 0  # probes sent since the daemon started, over all engines
    unanswered_total: int = 0  # of those, the ones that ended without an answer (refused, timed out, an HTTP error)
    timed_out: bool = False  # the failure was the deadline passing with no answer (not an error answer)
    timeout_s: float | None = None  # the deadline this probe was sent with (learned: core.probetime)


@dataclass(frozen=True)
class CanaryAnswer:
    """One canary completion: its tokens and, per position, the top-1 minus top-2 margin and the runner-up."""

    token_ids: tuple[int, ...]
    margins: tuple[float, ...]  # logprob(top-1) - logprob(top-2), nats
    runner_up: tuple[int | None, ...]  # the top-2 token at each position
    text: str = ""


@dataclass(frozen=True)
class CanarySample:
    """Latest result of the known-answer canary (run off the loop), and the persisted baseline it may meet."""

    sent_at: float | None = None  # monotonic
    finished_at: float | None = None
    answer: CanaryAnswer | None = None  # None: in flight, never sent, or failed (error)
    error: str = ""
    sent_total: int = 0  # canaries sent since the daemon started: never counted as the engine having served
    unanswered_total: int = 0  # of those, the ones that ended without an answer (refused, timed out, an HTTP error)
    persisted: CanaryAnswer | None = None  # an earlier engine's baseline with this engine's dependencies


# ------------------------------------------------------------------------- child


@dataclass(frozen=True)
class ChildSample:
    """The engine process tree as the supervisor sees it."""

    pid: int | None = None  # main pid of the current (or last) engine
    alive: bool = False  # the main pid has not exited
    started_at: float | None = None  # monotonic
    exit_code: int | None = None  # returncode of the main pid (negative = signal)
    exited_at: float | None = None
    stop_requested: bool = False  # r3090d asked it to stop; the exit is expected
    stopping: bool = False  # a stop sequence is in progress
    tree_pids: tuple[int, ...] = ()  # live processes of the engine's process group
    spawn_error: str | None = None  # the spawn itself failed (bad python path, ...)
    generation: int = 0  # increments at each spawn
    root_cause: str | None = None  # after an exit: why it died (rootcause.py); None when nothing says why
    root_cause_certain: bool = False  # root_cause says why (an OOM kill, a signal, an exception, an ERROR line)
    last_log_line: str | None = None  # after an exit: the engine's last line, where it stopped (not a cause)
    cpu_seconds: float | None = None  # user + system CPU time of the tree's live processes, cumulative; None: not read

    @property
    def tree_gone(self) -> bool:
        return not self.alive and not self.tree_pids and not self.stopping


# -------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class Snapshot:
    now: float  # monotonic seconds, the same clock as every *_at field
    wall: float  # time.time(), for records only
    child: ChildSample
    health: HealthSample
    metrics: MetricsSample  # /metrics; the engine's process is `child`
    gpu: GpuSample
    inference: InferenceProbeSample = field(default_factory=InferenceProbeSample)
    canary: CanarySample = field(default_factory=CanarySample)
    host_load: HostLoad = field(default_factory=HostLoad)
    shutdown_requested: bool = False
    # Requests from the control plane, consumed by this tick's decide().
    restart_requested: RestartKind | None = None
    maintenance: bool | None = None  # None = no change requested
    silences: tuple[tuple[str, float], ...] = ()  # (alert key, seconds from now)
    # r3090ctl suspend / resume, accepted under this request number (the reply's "request").
    suspend_requested: int | None = None
    resume_requested: int | None = None
    # Swap mode: the arbiter's word for this engine (r3090d.core.arbiter). A park is a suspend request
    # (suspend_requested) that is not the operator's; a start brings a COLD engine in; a stop to cold
    # stops a READY one drained and leaves it COLD (its reason here).
    park: bool = False
    park_by_sleep: bool = False  # the park is by vLLM's sleep mode ([[models]].park = "sleep", not fallen back)
    start_requested: bool = False
    stop_cold_requested: str | None = None
    suspender: SuspendSample | None = None  # the suspend worker's latest operation; None: no suspender
    sleeper: SleepSample | None = None  # the sleep worker's latest exchange; None: no sleep worker
    process_names: tuple[tuple[int, str], ...] = ()  # (pid, name) of the GPU's processes, read while suspended
