"""The configuration file: TOML in, frozen dataclasses out.

Every error is a ConfigError carrying the file, the dotted key and the fix, so
the CLI can print one line and exit 78 (EX_CONFIG). The schema lives in the
dataclasses themselves: a field's type and metadata drive type checking, range
checking and the unknown-key check, so there is one place to add a key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from r3090d.cards import ANY_CARD, CARDS

DEFAULT_PATH = Path("/etc/r3090d/r3090d.toml")
ENV_CONFIG = "R3090D_CONFIG"
ENV_INSTANCE = "R3090D_INSTANCE"
MIB = 1024 * 1024


class ConfigError(Exception):
    """A user mistake in the configuration: file, key and how to fix it."""

    def __init__(self, path: Path | str | None, key: str | None, problem: str, fix: str = ""):
        self.path = str(path) if path is not None else "<config>"
        self.key = key
        self.problem = problem
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = f"{self.path}: {self.key}" if self.key else self.path
        text = f"{where}: {self.problem}"
        if self.fix:
            text += f" (fix: {self.fix})"
        return text


def _range(lo=None, hi=None, *, choices=None, doc=""):
    return {"lo": lo, "hi": hi, "choices": choices, "doc": doc}


def opt(default, lo=None, hi=None, *, choices=None):
    meta = _range(lo, hi, choices=choices)
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


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
    # Throughput: more sequences and memory, at the cost of latency per request.
    "batch": Profile(0.95, 4096, 64, True, True),
}
NO_PROFILE = "none"  # pass no profile flags at all (vLLM's own defaults)


@dataclass(frozen=True)
class EngineConfig:
    python: str = opt("/opt/r3090d-engine/bin/python")
    model: str = opt("")
    served_model_name: str = opt("")  # empty: the model path, as vLLM names it
    host: str = opt("127.0.0.1")
    port: int = opt(8000, 1, 65535)
    api_key_file: str = opt("")
    shutdown_timeout: int = opt(30, 0, 3600)
    startup_timeout: int = opt(900, 10, 86400)
    extra_args: list = opt([])
    env: dict = opt({})


@dataclass(frozen=True)
class GpuConfig:
    required: bool = opt(True)
    index: int = opt(0, 0, 63)
    card: str = opt("rtx3090")
    min_driver: str = opt("535.0")
    expect_persistence: str = opt("report", choices=("report", "on", "off"))


@dataclass(frozen=True)
class PreflightConfig:
    max_swappiness: int = opt(10, 0, 200)
    governor: str = opt("performance")
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
    restart_storm_restarts: int = opt(3, 1, 100000)  # the restart_storm alert: this many restarts
    restart_storm_window: float = opt(3600.0, 1, 7 * 86400)  # ... within this many seconds
    lb_grace: float = opt(5.0, 0, 600)  # drained restart: /healthz 503 this long before SIGTERM
    # liveness
    dead_refused_polls: int = opt(3, 1, 1000)
    hang_timeout: float = opt(30.0, 1, 3600)
    # KV cache
    min_free_blocks: int = opt(100, 0, 1 << 31)
    kv_low_polls: int = opt(5, 1, 10000)
    kv_restart_under_load: bool = opt(False)
    kv_cooldown: float = opt(300.0, 0, 86400)
    # frozen engine
    stall_seconds: float = opt(60.0, 1, 86400)
    probe_idle_seconds: float = opt(60.0, 1, 86400)
    probe_timeout: float = opt(20.0, 0.5, 600)
    probe_failures: int = opt(2, 1, 100)
    # GPU
    nvml_hung_after: float = opt(10.0, 0.5, 600)
    gpu_memory_alert_mib: int = opt(23500, 1, 1 << 24)
    temperature_warn_c: int = opt(85, 30, 120)
    power_warn_ratio: float = opt(0.98, 0.1, 2.0)
    throttle_warn_reasons: list = opt(["hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"])
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
    facility: str = opt("daemon")
    ident: str = opt("r3090d")


@dataclass(frozen=True)
class EmailConfig:
    enabled: bool = opt(False)
    smtp_host: str = opt("localhost")
    smtp_port: int = opt(587, 1, 65535)
    security: str = opt("starttls", choices=("starttls", "ssl", "none"))
    username: str = opt("")
    password_file: str = opt("")  # else $CREDENTIALS_DIRECTORY/smtp-password
    sender: str = opt("r3090d@localhost")
    recipients: list = opt([])
    timeout: float = opt(10.0, 0.5, 300)
    max_attempts: int = opt(8, 1, 100)


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


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: str = opt("/var/lib/r3090d")
    runtime_dir: str = opt("/run/r3090d")
    exporter_enabled: bool = opt(True)
    exporter_host: str = opt("127.0.0.1")
    exporter_port: int = opt(9400, 1, 65535)
    # After a give-up the daemon stays up with the engine stopped (alerting,
    # exporting, answering r3090ctl); true restores exit 79 for an orchestrator.
    exit_on_give_up: bool = opt(False)


@dataclass(frozen=True)
class Config:
    profile: str = opt("realtime")
    engine: EngineConfig = field(default_factory=EngineConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    profiles: dict = opt({})  # name -> table of Profile keys, overriding or adding
    # Derived, never read from the file:
    source: str = ""
    instance: int | None = None
    api_key: str = field(default="", repr=False)  # read from engine.api_key_file

    @property
    def active_profile(self) -> Profile | None:
        return resolve_profiles(self)[self.profile] if self.profile != NO_PROFILE else None

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name or self.engine.model

    @property
    def engine_url(self) -> str:
        host = self.engine.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.engine.port}"


DERIVED_FIELDS = {"source", "instance", "api_key"}


# ------------------------------------------------------------------ loading


def resolve_path(cli_path: str | None, instance: int | None = None) -> Path:
    """--config, then $R3090D_CONFIG, then the per-instance file, then the shared one."""
    if cli_path:
        return Path(cli_path)
    if os.environ.get(ENV_CONFIG):
        return Path(os.environ[ENV_CONFIG])
    if instance is not None:
        per_instance = DEFAULT_PATH.with_name(f"r3090d@{instance}.toml")
        if per_instance.exists():
            return per_instance
    return DEFAULT_PATH


def instance_from_env() -> int | None:
    raw = os.environ.get(ENV_INSTANCE, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(None, ENV_INSTANCE, f"instance {raw!r} is not a GPU index", "use r3090d@0, r3090d@1, ...")
    return int(raw)


def load(path: Path | str, instance: int | None = None, *, check_files: bool = True) -> Config:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(path, None, "file not found", "create it from etc/r3090d.toml or pass --config") from None
    except OSError as exc:
        raise ConfigError(path, None, f"cannot read: {exc.strerror}", "check the path and its permissions") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(path, None, "not UTF-8 text", "save the file as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, None, f"TOML syntax error: {exc}", "correct the syntax at that line") from None
    return from_dict(data, path, instance, check_files=check_files)


def from_dict(data: dict, path: Path | str = "<config>", instance: int | None = None, *, check_files: bool = True) -> Config:
    cfg = _build(Config, data, path, "")
    cfg = _apply_instance(cfg, instance)
    cfg = dataclasses.replace(cfg, source=str(path), instance=instance)
    _validate(cfg, path, check_files=check_files)
    if check_files and cfg.engine.api_key_file:
        cfg = dataclasses.replace(cfg, api_key=_read_secret(path, "engine.api_key_file", cfg.engine.api_key_file))
    return cfg


def _apply_instance(cfg: Config, instance: int | None) -> Config:
    """r3090d@N: GPU N, engine port base+N, exporter port base+N, own directories."""
    if instance is None:
        return cfg
    return dataclasses.replace(
        cfg,
        gpu=dataclasses.replace(cfg.gpu, index=instance),
        engine=dataclasses.replace(cfg.engine, port=cfg.engine.port + instance),
        daemon=dataclasses.replace(
            cfg.daemon,
            exporter_port=cfg.daemon.exporter_port + instance,
            state_dir=str(Path(cfg.daemon.state_dir) / str(instance)),
            runtime_dir=str(Path(cfg.daemon.runtime_dir) / str(instance)),
        ),
    )


_TYPE_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}


def _build(cls, data, path, prefix):
    if not isinstance(data, dict):
        raise ConfigError(path, prefix.rstrip(".") or None, "must be a table", f"write it as [{prefix.rstrip('.')}]")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in DERIVED_FIELDS}
    kwargs = {}
    for key, value in data.items():
        dotted = prefix + key
        if key not in fields:
            close = _closest(key, fields)
            fix = f"did you mean {prefix}{close}?" if close else f"remove it; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(path, dotted, "unknown key", fix)
        ftype = hints[key]
        if dataclasses.is_dataclass(ftype):
            kwargs[key] = _build(ftype, value, path, dotted + ".")
            continue
        kwargs[key] = _check_value(value, ftype, fields[key].metadata, path, dotted)
    return cls(**kwargs)


def _check_value(value, ftype, meta, path, dotted):
    base = ftype
    if isinstance(ftype, types.UnionType):
        base = next(t for t in typing.get_args(ftype) if t is not type(None))
    ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        got = type(value).__name__
        raise ConfigError(path, dotted, f"expected {_TYPE_NAMES.get(base, base.__name__)}, got {got} {value!r}", f"write {dotted.rsplit('.', 1)[-1]} = <{_TYPE_NAMES.get(base, base.__name__)}>")
    lo, hi, choices = meta.get("lo"), meta.get("hi"), meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(path, dotted, f"{value!r} is not one of {', '.join(map(repr, choices))}", f"use one of {', '.join(choices)}")
    if lo is not None and value < lo or hi is not None and value > hi:
        raise ConfigError(path, dotted, f"{value!r} is out of range", f"use a value from {lo} to {hi}")
    return value


def _closest(key, candidates):
    import difflib

    found = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def resolve_profiles(cfg: Config) -> dict[str, Profile]:
    profiles = dict(BUILTIN_PROFILES)
    for name, table in cfg.profiles.items():
        base = profiles.get(name, Profile())
        profiles[name] = dataclasses.replace(base, **table)
    return profiles


# --------------------------------------------------------------- validation

# Flags r3090d owns: setting them through extra_args would fight the daemon.
_OWNED_FLAGS = {
    "--host": "engine.host",
    "--port": "engine.port",
    "--model": "engine.model",
    "--served-model-name": "engine.served_model_name",
    "--api-key": "engine.api_key_file (the key must never be in argv)",
    "--shutdown-timeout": "engine.shutdown_timeout",
}
_PROFILE_FLAGS = {
    "--gpu-memory-utilization",
    "--max-model-len",
    "--max-num-seqs",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
}
MIN_ALERT_HEADROOM_MIB = 500


def _validate(cfg: Config, path, *, check_files: bool) -> None:
    e = cfg.engine
    if not e.model:
        raise ConfigError(path, "engine.model", "is required", "set it to the model directory (or a hub name already in the cache)")
    if check_files and e.model.startswith(("/", ".", "~")) and not Path(e.model).expanduser().exists():
        raise ConfigError(path, "engine.model", f"{e.model} does not exist", "point it at the model directory")
    try:
        loopback = ipaddress.ip_address(e.host).is_loopback
    except ValueError:
        loopback = e.host == "localhost"
    if not loopback and not e.api_key_file:
        raise ConfigError(path, "engine.host", f"{e.host} is not loopback and engine.api_key_file is empty", "set engine.api_key_file, or bind to 127.0.0.1 behind a proxy")
    for i, arg in enumerate(e.extra_args):
        key = f"engine.extra_args[{i}]"
        if not isinstance(arg, str):
            raise ConfigError(path, key, f"expected a string, got {arg!r}", 'quote it: extra_args = ["--flag", "value"]')
        flag = arg.split("=", 1)[0]
        if flag == "--disable-log-stats":
            raise ConfigError(path, key, "--disable-log-stats removes every vllm: metric and blinds the watchdog", "remove it")
        if flag in _OWNED_FLAGS:
            raise ConfigError(path, key, f"{flag} is set by r3090d", f"use {_OWNED_FLAGS[flag]} instead")
        if flag in _PROFILE_FLAGS and cfg.profile != NO_PROFILE:
            raise ConfigError(path, key, f"{flag} is set by profile {cfg.profile!r}", 'change the profile in [profiles.NAME], or set profile = "none"')
    for k, v in e.env.items():
        if not isinstance(v, str):
            raise ConfigError(path, f"engine.env.{k}", f"expected a string, got {v!r}", f'quote it: {k} = "{v}"')
        if k in ("VLLM_API_KEY", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            raise ConfigError(path, f"engine.env.{k}", "is managed by r3090d", "remove it (the API key comes from engine.api_key_file)")
    if check_files and e.python and not os.access(e.python, os.X_OK):
        raise ConfigError(path, "engine.python", f"{e.python} is not an executable file", "point it at the python of the venv vLLM is installed in (make engine)")
    _validate_profiles(cfg, path)
    w = cfg.watchdog
    if w.health_timeout + w.metrics_timeout > 30.0 / 4:
        raise ConfigError(path, "watchdog.metrics_timeout", "health_timeout + metrics_timeout exceed a quarter of WatchdogSec=30", "keep their sum at or below 7.5 s")
    if w.backoff_max < w.backoff_initial:
        raise ConfigError(path, "watchdog.backoff_max", "is below watchdog.backoff_initial", "raise backoff_max")
    if cfg.alerts.email.enabled and not cfg.alerts.email.recipients:
        raise ConfigError(path, "alerts.email.recipients", "email is enabled but no recipient is set", 'add recipients = ["ops@example.org"]')
    if cfg.gpu.card not in CARDS and cfg.gpu.card != ANY_CARD:
        raise ConfigError(path, "gpu.card", f"unknown card {cfg.gpu.card!r}", f"use one of {', '.join(sorted(CARDS))} or {ANY_CARD}")


def _validate_profiles(cfg: Config, path) -> None:
    for name, table in cfg.profiles.items():
        if not isinstance(table, dict):
            raise ConfigError(path, f"profiles.{name}", "must be a table", f"write [profiles.{name}]")
        _build(Profile, table, path, f"profiles.{name}.")
    known = resolve_profiles(cfg)
    if cfg.profile != NO_PROFILE and cfg.profile not in known:
        raise ConfigError(path, "profile", f"unknown profile {cfg.profile!r}", f"use one of {', '.join(sorted(known))}, none, or define [profiles.{cfg.profile}]")
    prof = cfg.active_profile
    card = CARDS.get(cfg.gpu.card)
    if prof is None or not cfg.gpu.required or card is None:
        return
    card_mib = card.memory_mib
    budget = prof.gpu_memory_utilization * card_mib
    headroom = cfg.watchdog.gpu_memory_alert_mib - budget
    if headroom < MIN_ALERT_HEADROOM_MIB:
        safe = (cfg.watchdog.gpu_memory_alert_mib - MIN_ALERT_HEADROOM_MIB) / card_mib
        raise ConfigError(
            path,
            f"profiles.{cfg.profile}.gpu_memory_utilization",
            f"budgets {budget:.0f} MiB of {card_mib} MiB, only {headroom:.0f} MiB under watchdog.gpu_memory_alert_mib={cfg.watchdog.gpu_memory_alert_mib}, so the memory alert would fire forever",
            f"lower gpu_memory_utilization to {safe:.3f} or less, or raise watchdog.gpu_memory_alert_mib",
        )


def _read_secret(path, key, secret_path) -> str:
    try:
        text = Path(secret_path).read_text().strip()
    except OSError as exc:
        raise ConfigError(path, key, f"cannot read {secret_path}: {exc.strerror}", "check the file exists and the service user can read it") from None
    if not text:
        raise ConfigError(path, key, f"{secret_path} is empty", "write the key into it")
    return text


def redacted(cfg: Config) -> dict:
    """The effective configuration as plain data, safe to print."""
    data = dataclasses.asdict(cfg)
    data["api_key"] = "<redacted>" if cfg.api_key else ""
    data["profiles"] = {k: dataclasses.asdict(v) for k, v in resolve_profiles(cfg).items()}
    return data
