"""The configuration's schema: one frozen dataclass per section, and the built-in profiles.

A field's type and metadata (`opt`) drive type checking, range checking and
the unknown-key check in r3090d.config.loading, so there is one place to add a
key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum

from r3090d.units import MIB as MIB  # re-exported by r3090d.config

# Linux limits: a path component (NAME_MAX) and a whole path (PATH_MAX, with its NUL).
NAME_MAX = 255
PATH_MAX = 4095
MAX_TEXT = 4096  # any string without a tighter limit of its own
MAX_HOST = 253  # a DNS name
# extra_args and env together, in bytes as execve counts them. Linux allows
# 128 KiB per string and about 2 MiB in all (shared with the inherited
# environment); this leaves room for both.
ARGV_BUDGET = 64 * 1024
MAX_PORT = 65535
MAX_GPU_INDEX = 63
# Swap mode: each r3090d@N instance owns a block of this many engine ports from
# swap.engine_port_base + PORTS_PER_INSTANCE * N, one per [[models]] entry.
PORTS_PER_INSTANCE = 100
MAX_MODELS = PORTS_PER_INSTANCE
MAX_MODEL_NAME = 128  # a served model name: what clients send as "model"
UNIX_PATH_MAX = 107  # a unix socket's path: sun_path is 108 bytes with the trailing NUL

# NVML's clock event (throttle) reasons as probes.nvml.clock_reason_table names them
# (pynvml's nvmlClocksEventReason* constants, CamelCase to snake_case), in bit order.
# A unit test keeps this list and the probe's in step.
CLOCK_EVENT_REASON_NAMES = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
    "board_limit",
    "reliability",
)
CLOCK_EVENT_REASONS = frozenset(CLOCK_EVENT_REASON_NAMES)


@dataclass(frozen=True)
class Spec:
    """What a field accepts beyond its type. Numbers: lo..hi. Strings: max_len
    bytes, no NUL, and as a path each component within NAME_MAX. Lists and
    tables: the type, length and names of their items."""

    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] | None = None
    max_len: int = MAX_TEXT
    path: bool = False
    items: type | None = None
    item_choices: frozenset[str] | None = None
    item_max_len: int = ARGV_BUDGET


def opt(default, lo=None, hi=None, *, choices=None, max_len=MAX_TEXT, path=False, items=None, item_choices=None):
    meta = {"spec": Spec(lo, hi, choices, PATH_MAX if path else max_len, path, items, item_choices)}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def spec_of(f: dataclasses.Field) -> Spec:
    return f.metadata.get("spec") or Spec()


# ----------------------------------------------------------------- sections


@dataclass(frozen=True)
class Profile:
    gpu_memory_utilization: float = opt(0.90, 0.05, 0.99)
    max_model_len: int = opt(4096, 16, 1 << 22)
    max_num_seqs: int = opt(16, 1, 65536)
    enable_prefix_caching: bool = opt(True)
    enable_chunked_prefill: bool = opt(True)


BUILTIN_PROFILES: dict[str, Profile] = {
    # Interactive use: few sequences, short queue, headroom under the memory alert.
    "realtime": Profile(0.90, 4096, 16, True, True),
    # Throughput: more sequences, at the cost of latency per request. 0.92, not the
    # 0.95 often quoted: on a 24 GiB card 0.95 budgets 23,347 MiB, within 500 MiB of
    # the 23,500 MiB memory alert, which would then fire for ever.
    "batch": Profile(0.92, 4096, 64, True, True),
}
NO_PROFILE = "none"  # pass no profile flags at all (vLLM's own defaults)


class EngineKind(StrEnum):
    """What an engine serves, and so how it is probed: a 1-token completion, or a 1-input embedding."""

    GENERATE = "generate"
    EMBED = "embed"  # embedding or pooling: /v1/completions refuses it; no canary


class EngineListen(StrEnum):
    """Where an engine serves HTTP. vLLM checks its API key only under /v1, /v2, /inference and /cohere, so
    a loopback port lets any local user use the rest (/invocations, /pooling, /pause, ...) without one."""

    TCP = "tcp"  # engine.host:engine.port (in swap mode 127.0.0.1 and a port from swap.engine_port_base)
    UDS = "uds"  # a unix socket in daemon.runtime_dir/engines, a directory only the daemon's user may enter


@dataclass(frozen=True)
class EngineConfig:
    python: str = opt("/opt/r3090d-engine/bin/python", path=True)
    model: str = opt("", path=True)  # a directory, or a hub name (org/name) already in the cache
    served_model_name: str = opt("", max_len=1024)  # empty: the model path, as vLLM names it
    host: str = opt("127.0.0.1", max_len=MAX_HOST)
    port: int = opt(8000, 1, MAX_PORT)
    api_key_file: str = opt("", path=True)
    shutdown_timeout: int = opt(30, 0, 3600)
    startup_timeout: int = opt(900, 10, 86400)
    extra_args: list = opt([], items=str)
    env: dict = opt({}, items=str)
    kind: EngineKind = opt(EngineKind.GENERATE)
    # Not set in the file: uds in swap mode, tcp for the one engine (the loader decides).
    listen: EngineListen = opt(EngineListen.TCP)
    # Derived, never read from the file: the engine's socket when listen is uds (r3090d.config.models.socket_path).
    uds: str = ""


class ParkMode(StrEnum):
    """How swap mode parks a model's engine to bring another in ([[models]].park)."""

    AUTO = "auto"  # a checkpoint where the card and driver can, else a drained stop
    SLEEP = "sleep"  # vLLM's sleep mode (level 1); the canary after every wake; a failure falls back to checkpoint or stop
    CHECKPOINT = "checkpoint"  # as auto
    STOP = "stop"  # never parked: stopped drained, started cold


@dataclass(frozen=True)
class ModelConfig:
    """One [[models]] entry: an engine of its own in swap mode, on its own 127.0.0.1 port."""

    name: str = opt("", max_len=MAX_MODEL_NAME)  # the served model name, required and unique
    model: str = opt("", path=True)  # as engine.model: a directory, or a hub name already in the cache
    kind: EngineKind = opt(EngineKind.GENERATE)
    profile: str = opt("", max_len=255)  # empty: the top-level profile
    extra_args: list = opt([], items=str)
    env: dict = opt({}, items=str)  # over engine.env, which every engine shares
    api_key_file: str = opt("", path=True)  # this engine's key (vLLM's VLLM_API_KEY); the router holds it too
    park: ParkMode = opt(ParkMode.AUTO)
    # Derived, never read from the file:
    api_key: str = field(default="", repr=False)  # read from api_key_file


@dataclass(frozen=True)
class SwapConfig:
    """Swap mode ([[models]] set): one engine per model, the router on [engine].host:port, the arbiter's limits."""

    max_resident: int = opt(1, 1, 16)  # engines on the GPU at once
    queue_timeout: float = opt(120.0, 1, 3600)  # a request for a model being swapped in waits this long, then 503
    min_residency: float = opt(30.0, 0, 86400)  # an engine with work stays resident at least this long
    # A swap waits this long for the outgoing engine's running requests, then freezes them with it.
    drain_timeout: float = opt(10.0, 0, 3600)
    engine_port_base: int = opt(18100, 1, MAX_PORT)  # engine i of r3090d@N: engine_port_base + 100 * N + i
    host_memory_budget_mib: int = opt(0, 0, 1 << 30)  # host RAM for parked engines; 0: automatic
    host_memory_margin_mib: int = opt(4096, 0, 1 << 30)  # left free by the automatic budget
    max_body_mib: int = opt(32, 1, 4096)  # the router refuses a larger request body
    api_key_file: str = opt("", path=True)  # the router's public key; empty: none (engine.host must be loopback)
    sleep_timeout: float = opt(60.0, 1, 3600)  # a park by sleep's pause + sleep, or its wake, must answer within this


@dataclass(frozen=True)
class GpuConfig:
    required: bool = opt(True)
    index: int = opt(0, 0, MAX_GPU_INDEX)
    card: str = opt("rtx3090", max_len=64)
    min_driver: str = opt("580.0", max_len=64)
    expect_persistence: str = opt("report", choices=("report", "on", "off"))


@dataclass(frozen=True)
class PreflightConfig:
    max_swappiness: int = opt(10, 0, 200)
    governor: str = opt("performance", max_len=64)
    transient_retry_s: float = opt(5.0, 0.5, 600)
    transient_give_up_s: float = opt(300.0, 1, 86400)


@dataclass(frozen=True)
class WatchdogConfig:
    poll_interval: float = opt(2.0, 0.05, 60)
    health_timeout: float = opt(2.0, 0.05, 60)
    metrics_timeout: float = opt(3.0, 0.05, 60)
    # restarts
    backoff_initial: float = opt(1.0, 0, 3600)
    backoff_max: float = opt(300.0, 0, 86400)
    # A failure within min_uptime of becoming ready (or before ready) is a start
    # failure: only those grow the backoff and count toward give-up.
    min_uptime: float = opt(60.0, 0, 86400)
    start_failures: int = opt(5, 1, 1000)  # consecutive start failures before giving up
    same_cause_failures: int = opt(2, 1, 1000)  # ... or this many in a row with one root cause
    give_up_retry: float = opt(1800.0, 0, 7 * 86400)  # after a give-up, one start attempt this often (0: wait for r3090ctl restart)
    restart_storm_restarts: int = opt(3, 1, 100000)  # the restart_storm alert: this many restarts
    restart_storm_window: float = opt(3600.0, 1, 7 * 86400)  # ... within this many seconds
    lb_grace: float = opt(5.0, 0, 600)  # drained restart: /healthz 503 this long before SIGTERM
    # liveness
    dead_refused_polls: int = opt(3, 1, 1000)
    hang_timeout: float = opt(8.0, 1, 3600)
    # KV cache
    min_free_blocks: int = opt(100, 0, 1 << 31)
    kv_low_polls: int = opt(5, 1, 10000)
    kv_restart_under_load: bool = opt(False)
    kv_cooldown: float = opt(300.0, 0, 86400)
    # frozen engine
    stall_seconds: float = opt(10.0, 1, 86400)
    probe_idle_seconds: float = opt(6.0, 1, 86400)
    probe_timeout: float = opt(3.0, 0.5, 600)
    probe_failures: int = opt(2, 1, 100)
    # GPU
    nvml_hung_after: float = opt(10.0, 0.5, 600)
    gpu_memory_alert_mib: int = opt(23500, 1, 1 << 24)
    temperature_warn_c: int = opt(85, 30, 120)
    power_warn_ratio: float = opt(0.98, 0.1, 2.0)
    throttle_warn_reasons: list = opt(
        ["hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"],
        items=str,
        item_choices=CLOCK_EVENT_REASONS,
    )
    growth_window: float = opt(3600.0, 60, 7 * 86400)
    growth_horizon: float = opt(86400.0, 60, 365 * 86400)
    # /metrics or NVML failing this many polls in a row: status WARNING and watchdog_blind
    blind_polls: int = opt(5, 1, 100000)
    # The GPU's own view (used only when the engine is the GPU's sole user):
    # requests running while the GPU reads 0% busy for this long is a freeze.
    gpu_idle_stall_seconds: float = opt(5.0, 0.5, 3600)
    # GPU busy counts as progress for at most this long without a token or a KV block moving
    # (a hung collective or a runaway kernel reads 100%).
    gpu_busy_cap_seconds: float = opt(30.0, 1, 86400)
    # Memory used on the card beyond the engine's own processes' share, above which
    # another user is assumed (another container's process is invisible by pid).
    gpu_foreign_margin_mib: int = opt(512, 0, 1 << 20)


@dataclass(frozen=True)
class SyslogConfig:
    enabled: bool = opt(True)
    address: str = opt("/dev/log")  # a unix socket path, or host:port for UDP
    facility: str = opt("daemon", max_len=64)
    ident: str = opt("r3090d", max_len=255)


@dataclass(frozen=True)
class EmailConfig:
    enabled: bool = opt(False)
    smtp_host: str = opt("localhost", max_len=MAX_HOST)
    smtp_port: int = opt(587, 1, MAX_PORT)
    security: str = opt("starttls", choices=("starttls", "ssl", "none"))
    username: str = opt("", max_len=1024)
    password_file: str = opt("", path=True)  # else $CREDENTIALS_DIRECTORY/smtp-password
    sender: str = opt("r3090d@localhost", max_len=1024)
    recipients: list = opt([], items=str)
    timeout: float = opt(10.0, 0.5, 300)
    max_attempts: int = opt(8, 1, 100)


@dataclass(frozen=True)
class AlertmanagerConfig:
    enabled: bool = opt(False)
    # A base URL ("http://alertmanager:9093"), or a list: every alert goes to each
    # member of an Alertmanager cluster, as Prometheus sends them.
    url: str | list = opt("", items=str)
    bearer_token_file: str = opt("", path=True)  # the token is read from here, never written in this file
    resend_interval: float = opt(60.0, 1, 3600)  # a firing alert's endsAt is 4 of these ahead
    timeout: float = opt(5.0, 0.5, 60)

    @property
    def urls(self) -> tuple[str, ...]:
        listed = [self.url] if isinstance(self.url, str) else self.url
        return tuple(u.strip().rstrip("/") for u in listed if u.strip())


@dataclass(frozen=True)
class AlertsConfig:
    hysteresis_polls: int = opt(3, 1, 1000)
    reminder_interval: float = opt(3600.0, 0, 30 * 86400)
    min_interval: float = opt(60.0, 0, 86400)  # per key rate limit
    # A condition must stay clear this long before RESOLVED goes out (as
    # Prometheus' keep_firing_for); kv_pressure flaps with load, so it holds longer.
    resolve_hold: float = opt(0.0, 0, 86400)
    kv_pressure_resolve_hold: float = opt(180.0, 0, 86400)
    syslog: SyslogConfig = field(default_factory=SyslogConfig)
    email: EmailConfig = field(default_factory=EmailConfig)
    alertmanager: AlertmanagerConfig = field(default_factory=AlertmanagerConfig)


@dataclass(frozen=True)
class SuspendConfig:
    """`r3090ctl suspend`: lend the GPU by checkpointing the engine (r3090d.core.suspension)."""

    # After the load balancer's grace, wait this long for running and waiting requests
    # to reach zero; requests still running then are frozen with the engine and finish after resume.
    drain_timeout: float = opt(30.0, 0, 3600)
    lock_timeout: float = opt(10.0, 0.1, 600)  # cuCheckpointProcessLock: wait for in-flight GPU work
    # A driver call past this is reported (alert suspend_stuck); its late result still counts. Read at daemon start.
    operation_timeout: float = opt(120.0, 10, 3600)
    resume_margin_mib: int = opt(512, 0, 1 << 20)  # free GPU memory needed beyond what the engine held
    verify_timeout: float = opt(60.0, 5, 3600)  # after restore: /health and one inference probe must pass
    remind_after: float = opt(14400.0, 1, 30 * 86400)  # alert suspended_long after this long suspended


# The canary's default prompt: plain counting, which any tokenizer splits into many
# tokens and any trained model continues with confidence; longer than one KV block.
DEFAULT_CANARY_PROMPT = "Count on: " + ", ".join(str(i) for i in range(1, 49)) + ","


@dataclass(frozen=True)
class CanaryConfig:
    """The known-answer canary (r3090d.core.canary): a pinned greedy completion compared with the engine's baseline."""

    enabled: bool = opt(True)
    prompt: str = opt(DEFAULT_CANARY_PROMPT, max_len=8192)
    max_tokens: int = opt(16, 4, 256)
    seed: int = opt(3090, 0, 2**31 - 1)
    interval: float = opt(600.0, 10, 7 * 86400)  # one comparison this often while READY, under load too
    timeout: float = opt(60.0, 1, 3600)  # a canary with no answer by then is an error (never a restart)
    # Positions are compared only up to the baseline's first one whose top-1 minus top-2 margin is below this.
    margin_threshold: float = opt(0.5, 0.01, 20)
    min_prefix: int = opt(4, 1, 256)  # a baseline confident for fewer tokens says nothing: the prompt is not useful
    restart_on_mismatch: bool = opt(True)  # a periodic mismatch restarts the engine (after a resume it always does)


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: str = opt("/var/lib/r3090d", path=True)
    runtime_dir: str = opt("/run/r3090d", path=True)
    exporter_enabled: bool = opt(True)
    exporter_host: str = opt("127.0.0.1", max_len=MAX_HOST)
    exporter_port: int = opt(9400, 1, MAX_PORT)
    # After a give-up the daemon stays up with the engine stopped (alerting,
    # exporting, answering r3090ctl); true restores exit 79 for an orchestrator.
    exit_on_give_up: bool = opt(False)


@dataclass(frozen=True)
class Config:
    profile: str = opt("realtime", max_len=255)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    suspend: SuspendConfig = field(default_factory=SuspendConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    profiles: dict = opt({}, items=dict)  # name -> table of Profile keys, overriding or adding
    models: tuple[ModelConfig, ...] = opt(())  # [[models]]: non-empty is swap mode
    swap: SwapConfig = field(default_factory=SwapConfig)
    # Derived, never read from the file:
    source: str = ""
    instance: int | None = None
    # The key of what listens at engine_url: read from engine.api_key_file, or in swap mode
    # (where the router listens there) from swap.api_key_file.
    api_key: str = field(default="", repr=False)
    warnings: tuple[str, ...] = ()  # one line per deprecated key still in the file
    park_mode: ParkMode = ParkMode.AUTO  # swap mode: this engine's [[models]].park (r3090d.config.models)

    @property
    def swap_mode(self) -> bool:
        """Several models, one engine each, behind the router (r3090d.config.models derives each engine's Config)."""
        return bool(self.models)

    @property
    def active_profile(self) -> Profile | None:
        return resolve_profiles(self)[self.profile] if self.profile != NO_PROFILE else None

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name or self.engine.model

    @property
    def engine_url(self) -> str:
        """The base URL of the engine's requests; on a unix socket (engine.uds) the host is a placeholder
        (vLLM's uvicorn ignores it) and the client connects to the socket."""
        if self.engine.uds:
            return "http://localhost"
        host = self.engine.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.engine.port}"

    @property
    def engine_address(self) -> str:
        """Where the engine serves, for people: unix:PATH, or its URL."""
        return f"unix:{self.engine.uds}" if self.engine.uds else self.engine_url


DERIVED_FIELDS = {"source", "instance", "api_key", "warnings", "uds", "park_mode"}


def resolve_profiles(cfg: Config) -> dict[str, Profile]:
    profiles = dict(BUILTIN_PROFILES)
    for name, table in cfg.profiles.items():
        base = profiles.get(name, Profile())
        profiles[name] = dataclasses.replace(base, **table)
    return profiles
