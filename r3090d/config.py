"""The configuration file: TOML in, frozen dataclasses out.

Every error is a ConfigError carrying the file, the dotted key and the fix, so
the CLI can print one line and exit 78 (EX_CONFIG). The schema lives in the
dataclasses themselves: a field's type and metadata drive type checking, range
checking and the unknown-key check, so there is one place to add a key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
import reprlib
import stat
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r3090d.cards import ANY_CARD, CARDS

DEFAULT_PATH = Path("/etc/r3090d/r3090d.toml")
ENV_CONFIG = "R3090D_CONFIG"
ENV_INSTANCE = "R3090D_INSTANCE"
MIB = 1024 * 1024

# Linux limits: a path component (NAME_MAX) and a whole path (PATH_MAX, with its NUL).
NAME_MAX = 255
PATH_MAX = 4095
MAX_TEXT = 4096  # any string without a tighter limit of its own
MAX_HOST = 253  # a DNS name
# extra_args and env together, in bytes as execve counts them. Linux allows
# 128 KiB per string and about 2 MiB in all (shared with the inherited
# environment); this leaves room for both.
ARGV_BUDGET = 64 * 1024
SECRET_MAX_BYTES = 64 * 1024  # an API key or password file; anything bigger is the wrong file
MAX_PORT = 65535
MAX_GPU_INDEX = 63

# The clock-event reason names r3090d.probes.nvml derives from pynvml's
# nvmlClocksEventReason*/nvmlClocksThrottleReason* constants (CamelCase to
# snake_case). Listed here so that loading a config needs no NVML; a unit test
# keeps the two in step.
CLOCK_EVENT_REASONS = frozenset(
    {
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
    }
)


def _printable(text: str) -> str:
    """Control characters escaped, so that a message stays one line whatever the file holds."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii") for ch in text)


def _format(path: str, key: str | None, problem: str, fix: str) -> str:
    where = f"{path}: {key}" if key else path
    text = f"{where}: {problem}"
    if fix:
        text += f" (fix: {fix})"
    return _printable(text)


class ConfigError(Exception):
    """A user mistake in the configuration: file, key and how to fix it."""

    def __init__(self, path: Path | str | None, key: str | None, problem: str, fix: str = ""):
        self.path = str(path) if path is not None else "<config>"
        self.key = key
        self.problem = problem
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return _format(self.path, self.key, self.problem, self.fix)


class _ShortRepr(reprlib.Repr):
    """repr() for values quoted in messages: bounded in length and depth, and
    safe on integers too long for str() (over 4300 digits raise ValueError)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict, self.maxstring, self.maxother = 3, 6, 4, 60, 60

    def repr_int(self, x, level):
        if x.bit_length() > 128:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_show = _ShortRepr().repr

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: object) -> str:
    """One part of a dotted key as TOML writes it: bare if it can be, else quoted; long ones cut."""
    text = key if isinstance(key, str) else _show(key)
    cut = len(text) > 60
    text = text[:60]
    quoted = text if _BARE_KEY.fullmatch(text) else json.dumps(text)
    return quoted + "..." if cut else quoted


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


def _spec(f: dataclasses.Field) -> Spec:
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


def alertmanager_url_problem(url: str) -> str | None:
    """What is wrong with an Alertmanager base URL, or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range
    except ValueError as exc:
        return f"{_show(url)} is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{_show(url)} is not an http:// or https:// URL with a host"
    if parts.username is not None or parts.password is not None:
        return "holds credentials, which would be logged; put a token in alerts.alertmanager.bearer_token_file"
    if parts.query or parts.fragment:
        return f"{_show(url)} has a query or fragment; give the base URL (r3090d adds /api/v2/alerts)"
    return None


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
    profiles: dict = opt({}, items=dict)  # name -> table of Profile keys, overriding or adding
    # Derived, never read from the file:
    source: str = ""
    instance: int | None = None
    api_key: str = field(default="", repr=False)  # read from engine.api_key_file
    warnings: tuple[str, ...] = ()  # one line per deprecated key still in the file

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


DERIVED_FIELDS = {"source", "instance", "api_key", "warnings"}


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
    # isascii: str.isdigit() also accepts digits such as "²" that int() refuses.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 2 and int(raw) <= MAX_GPU_INDEX):
        raise ConfigError(None, ENV_INSTANCE, f"instance {_show(raw)} is not a GPU index from 0 to {MAX_GPU_INDEX}", "use r3090d@0, r3090d@1, ...")
    return int(raw)


CONFIG_MAX_BYTES = 1 << 20  # the annotated example is 9 KiB; /dev/zero must not fill memory
_BOM = b"\xef\xbb\xbf"


def load(path: Path | str, instance: int | None = None, *, check_files: bool = True) -> Config:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(path, None, "file not found", "create it from etc/r3090d.toml or pass --config") from None
    except OSError as exc:
        raise ConfigError(path, None, f"cannot read: {exc.strerror}", "check the path and its permissions") from None
    except ValueError:
        raise ConfigError(path, None, "the path contains a NUL byte", "pass the path of the config file") from None
    if len(raw) > CONFIG_MAX_BYTES:
        raise ConfigError(path, None, f"is over {CONFIG_MAX_BYTES} bytes, too big for a config file", "pass the path of the r3090d TOML file")
    # Some editors start UTF-8 files with a byte-order mark, which TOML does not allow.
    raw = raw.removeprefix(_BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(path, None, f"not UTF-8 text (byte {exc.start})", "save the file as UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, None, f"TOML syntax error: {exc}", "correct the syntax at that line") from None
    except RecursionError:
        raise ConfigError(path, None, "arrays or tables nested too deeply to read", "flatten the nesting; no r3090d key takes nested arrays") from None
    except ValueError as exc:  # an integer literal over 4300 digits
        raise ConfigError(path, None, f"a value cannot be read: {str(exc).split(':')[0]}", "shorten the number") from None
    return from_dict(data, path, instance, check_files=check_files)


def from_dict(data: dict, path: Path | str = "<config>", instance: int | None = None, *, check_files: bool = True) -> Config:
    data, warnings = _migrate(data, str(path))
    cfg = _build(Config, data, path, "")
    cfg = dataclasses.replace(cfg, profiles=_profile_tables(cfg.profiles, path))
    _check_instance(cfg, instance, path)
    cfg = _apply_instance(cfg, instance)
    cfg = dataclasses.replace(cfg, source=str(path), instance=instance, warnings=warnings)
    _validate(cfg, path, check_files=check_files)
    if check_files and cfg.engine.api_key_file:
        cfg = dataclasses.replace(cfg, api_key=_api_key(path, cfg.engine.api_key_file))
    return cfg


def _check_instance(cfg: Config, instance: int | None, path) -> None:
    """The instance offset must keep every port a port (and the index a GPU index)."""
    if instance is None:
        return
    if isinstance(instance, bool) or not isinstance(instance, int) or not 0 <= instance <= MAX_GPU_INDEX:
        raise ConfigError(path, "instance", f"{_show(instance)} is not a GPU index from 0 to {MAX_GPU_INDEX}", f"use r3090d@0 to r3090d@{MAX_GPU_INDEX}")
    for key, port in (("engine.port", cfg.engine.port), ("daemon.exporter_port", cfg.daemon.exporter_port)):
        if port + instance > MAX_PORT:
            raise ConfigError(
                path,
                key,
                f"{port} + {instance} for instance r3090d@{instance} is {port + instance}, above {MAX_PORT}",
                f"set {key} to at most {MAX_PORT - instance}",
            )


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


# ---------------------------------------------------------------- migration


@dataclass(frozen=True)
class _RemovedKey:
    """A [watchdog] key that no longer exists, and how an old file's value carries over."""

    key: str
    type: type
    spec: Spec  # its old type and range: the value is checked before it carries over
    successor: str  # the key that took over its job
    carry: Callable[[Any], Any] | None  # old value -> the successor's; None: the value is ignored
    rule: str  # why, for the warning


def _start_failures_from_give_up_restarts(n: int) -> int:
    # The old rule gave up after MORE than N failures: N + 1 failures, within the new range.
    return min(n + 1, _spec(_field(WatchdogConfig, "start_failures")).hi)


_REMOVED_WATCHDOG_KEYS = (
    _RemovedKey(
        "give_up_restarts", int, Spec(1, 1000), "start_failures", _start_failures_from_give_up_restarts,
        "give-up came after more than give_up_restarts failures",
    ),
    _RemovedKey(
        "give_up_window", float, Spec(1, 7 * 86400), "restart_storm_window", float,
        "give-up no longer counts failures in a window; the window now bounds the restart_storm alert",
    ),
    _RemovedKey(
        "stable_after", float, Spec(1, 86400), "min_uptime", None,
        "the backoff now resets on the first failure after min_uptime seconds of readiness",
    ),
)


def _migrate(data: Any, path: str) -> tuple[Any, tuple[str, ...]]:
    """Removed keys carried over to their successors, one warning each. The caller's dict is not changed."""
    watchdog = data.get("watchdog") if isinstance(data, dict) else None
    if not isinstance(watchdog, dict) or not any(r.key in watchdog for r in _REMOVED_WATCHDOG_KEYS):
        return data, ()
    watchdog = dict(watchdog)
    warnings = []
    for removed in _REMOVED_WATCHDOG_KEYS:
        if removed.key not in watchdog:
            continue
        old_key, new_key = f"watchdog.{removed.key}", f"watchdog.{removed.successor}"
        value = _check_value(watchdog.pop(removed.key), removed.type, removed.spec, path, old_key)
        if removed.carry is None:
            problem, fix = f"is no longer used and is ignored: {removed.rule}", f"remove {removed.key}; see {new_key}"
        elif removed.successor in watchdog:
            problem, fix = f"is no longer used; {new_key} is also set and wins", f"remove {removed.key}"
        else:
            carried = removed.carry(value)
            watchdog[removed.successor] = carried
            problem = f"is no longer used; read as {new_key} = {carried} ({removed.rule})"
            fix = f"replace it with {removed.successor} = {carried}"
        warnings.append(_format(path, old_key, problem, fix))
    return {**data, "watchdog": watchdog}, tuple(warnings)


# ------------------------------------------------------------ schema checks


_TYPE_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}


def _field(cls, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _build(cls, data, path, prefix):
    if not isinstance(data, dict):
        name = prefix.rstrip(".")
        raise ConfigError(path, name or None, "must be a table", f"write it as [{name}]" if name else "write the file as TOML tables")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in DERIVED_FIELDS}
    kwargs = {}
    for key, value in data.items():
        dotted = prefix + _key(key)
        if key not in fields:
            close = _closest(key, fields) if isinstance(key, str) else None
            fix = f"did you mean {prefix}{close}?" if close else f"remove it; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(path, dotted, "unknown key", fix)
        ftype = hints[key]
        if dataclasses.is_dataclass(ftype):
            kwargs[key] = _build(ftype, value, path, dotted + ".")
            continue
        kwargs[key] = _check_value(value, ftype, _spec(fields[key]), path, dotted)
    return cls(**kwargs)


def _check_value(value, ftype, spec: Spec, path, dotted: str):
    options = [ftype]
    if isinstance(ftype, types.UnionType):
        options = [t for t in typing.get_args(ftype) if t is not type(None)]
    # The option the value is (str | list: one URL or several), else the first.
    base = next((t for t in options if isinstance(value, t)), options[0])
    name = dotted.rsplit(".", 1)[-1]
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(path, dotted, f"{_show(value)} is out of range", _range_fix(spec)) from None
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        type_name = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in options)
        raise ConfigError(path, dotted, f"expected {type_name}, got {type(value).__name__} {_show(value)}", f"write {name} = <{type_name}>")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path, dotted, f"{value} is not a finite number", _range_fix(spec))
    if isinstance(value, str):
        _check_text(value, spec.max_len, spec.path, path, dotted)
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(path, dotted, f"{_show(value)} is not one of {', '.join(map(repr, spec.choices))}", f"use one of {', '.join(spec.choices)}")
    if (spec.lo is not None and value < spec.lo) or (spec.hi is not None and value > spec.hi):
        raise ConfigError(path, dotted, f"{_show(value)} is out of range", _range_fix(spec))
    if spec.items is not None and spec.items is not dict and isinstance(value, list | dict):  # profiles: _profile_tables
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, item in items:
            _check_item(item, spec, path, f"{dotted}.{_key(k)}" if isinstance(value, dict) else f"{dotted}[{k}]", name)
    return value


def _range_fix(spec: Spec) -> str:
    return f"use a value from {spec.lo} to {spec.hi}" if spec.lo is not None and spec.hi is not None else "write a finite number"


def _check_item(item, spec: Spec, path, dotted: str, name: str) -> None:
    """One list item or table value: its type, size and, where the names are fixed, its name."""
    if not isinstance(item, spec.items) or (spec.items is not bool and isinstance(item, bool)):
        type_name = _TYPE_NAMES.get(spec.items, spec.items.__name__)
        fix = f'quote it: {name} = ["..."]' if spec.items is str else f"write each item of {name} as {type_name}"
        raise ConfigError(path, dotted, f"expected {type_name}, got {type(item).__name__} {_show(item)}", fix)
    if isinstance(item, str):
        _check_text(item, spec.item_max_len, False, path, dotted)
    if spec.item_choices is not None and item not in spec.item_choices:
        close = _closest(item, sorted(spec.item_choices))
        fix = f"did you mean {close}?" if close else f"use one of {', '.join(sorted(spec.item_choices))}"
        raise ConfigError(path, dotted, f"unknown name {_show(item)}", fix)


def _check_text(text: str, max_len: int, is_path: bool, path, dotted: str) -> None:
    """A string that reaches argv, the environment or a path: no NUL, bounded, encodable."""
    if "\0" in text:
        raise ConfigError(path, dotted, "contains a NUL byte", "remove it: no path, argument or name can hold one")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(path, dotted, "is not valid Unicode text (a lone surrogate)", "write it as UTF-8 text") from None
    if len(data) > max_len:
        raise ConfigError(path, dotted, f"is {len(data)} bytes long, over the limit of {max_len}", f"shorten it to at most {max_len} bytes")
    if is_path:
        for part in data.split(b"/"):
            if len(part) > NAME_MAX:
                raise ConfigError(
                    path,
                    dotted,
                    f"has a path component longer than {NAME_MAX} bytes ({_show(part.decode())}, {len(part)} bytes)",
                    f"shorten each directory or file name to at most {NAME_MAX} bytes",
                )


def _closest(key, candidates):
    import difflib

    found = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def _profile_tables(profiles: dict, path) -> dict[str, dict]:
    """Each [profiles.NAME] table checked against Profile, its values as Profile holds them."""
    tables = {}
    for name, table in profiles.items():
        prefix = f"profiles.{_key(name)}"
        if not isinstance(name, str):
            raise ConfigError(path, prefix, "a profile name must be a string", "write [profiles.NAME]")
        _check_text(name, _spec(_field(Config, "profile")).max_len, False, path, prefix)
        if not isinstance(table, dict):
            raise ConfigError(path, prefix, "must be a table", f"write [{prefix}]")
        built = _build(Profile, table, path, prefix + ".")
        tables[name] = {k: getattr(built, k) for k in table}
    return tables


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
    if check_files and e.model.startswith(("/", ".", "~")) and not _exists(e.model):
        raise ConfigError(path, "engine.model", f"{e.model} does not exist", "point it at the model directory")
    try:
        loopback = ipaddress.ip_address(e.host).is_loopback
    except ValueError:
        loopback = e.host == "localhost"
    if not loopback and not e.api_key_file:
        raise ConfigError(path, "engine.host", f"{e.host} is not loopback and engine.api_key_file is empty", "set engine.api_key_file, or bind to 127.0.0.1 behind a proxy")
    for i, arg in enumerate(e.extra_args):  # strings: checked with the schema
        key = f"engine.extra_args[{i}]"
        flag = arg.split("=", 1)[0]
        if flag == "--disable-log-stats":
            raise ConfigError(path, key, "--disable-log-stats removes every vllm: metric and blinds the watchdog", "remove it")
        if flag in _OWNED_FLAGS:
            raise ConfigError(path, key, f"{flag} is set by r3090d", f"use {_OWNED_FLAGS[flag]} instead")
        if flag in _PROFILE_FLAGS and cfg.profile != NO_PROFILE:
            raise ConfigError(path, key, f"{flag} is set by profile {cfg.profile!r}", 'change the profile in [profiles.NAME], or set profile = "none"')
    for k in e.env:  # values: strings, checked with the schema
        key = f"engine.env.{_key(k)}"
        # execve refuses a name with "=" or NUL; an empty name is no variable at all.
        if not isinstance(k, str) or not k or "=" in k:
            raise ConfigError(path, key, "is not an environment variable name", "use a name such as MY_VAR, without '='")
        _check_text(k, MAX_TEXT, False, path, key)
        if k in ("VLLM_API_KEY", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            raise ConfigError(path, key, "is managed by r3090d", "remove it (the API key comes from engine.api_key_file)")
    _check_argv_budget(e, path)
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
        raise ConfigError(path, "gpu.card", f"unknown card {_show(cfg.gpu.card)}", f"use one of {', '.join(sorted(CARDS))} or {ANY_CARD}")
    email = cfg.alerts.email
    if check_files and email.enabled and email.password_file:
        read_secret(path, "alerts.email.password_file", email.password_file)  # readable now, not at the first alert
    _validate_alertmanager(cfg.alerts.alertmanager, path, check_files=check_files)


def _validate_alertmanager(am: AlertmanagerConfig, path, *, check_files: bool) -> None:
    key = "alerts.alertmanager.url"
    fix = 'write a base URL such as "http://alertmanager.example.org:9093"'
    listed = [am.url] if isinstance(am.url, str) else am.url
    seen = set()
    for i, url in enumerate(listed):
        where = key if isinstance(am.url, str) else f"{key}[{i}]"
        if not url.strip():
            if isinstance(am.url, str):
                continue  # the default: no URL (an error only if enabled, below)
            raise ConfigError(path, where, "is empty", f"remove it, or {fix}")
        problem = alertmanager_url_problem(url.strip())
        if problem:
            raise ConfigError(path, where, problem, fix)
        if url.strip().rstrip("/") in seen:
            raise ConfigError(path, where, f"{_show(url)} is listed twice", "list each Alertmanager once")
        seen.add(url.strip().rstrip("/"))
    if am.enabled and not am.urls:
        raise ConfigError(path, key, "Alertmanager is enabled but no URL is set", f"{fix}, or set enabled = false")
    if check_files and am.enabled and am.bearer_token_file:
        read_secret(path, "alerts.alertmanager.bearer_token_file", am.bearer_token_file)  # readable now


def _exists(p: str) -> bool:
    try:
        return Path(p).expanduser().exists()
    except (OSError, ValueError, RuntimeError):  # RuntimeError: "~user" for no such user
        return False


def _check_argv_budget(e: EngineConfig, path) -> None:
    """extra_args and env reach vLLM through execve, whose argv and environment are bounded (E2BIG)."""
    args = sum(len(a.encode()) + 1 for a in e.extra_args)
    env = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in e.env.items())
    if args + env > ARGV_BUDGET:
        raise ConfigError(
            path,
            "engine.extra_args" if args >= env else "engine.env",
            f"engine.extra_args ({args} bytes) and engine.env ({env} bytes) exceed the {ARGV_BUDGET}-byte budget for vLLM's command line and environment",
            "pass long values through files (most vLLM options take a path)",
        )


def _validate_profiles(cfg: Config, path) -> None:
    known = resolve_profiles(cfg)  # the tables were checked against Profile on the way in
    if cfg.profile != NO_PROFILE and cfg.profile not in known:
        raise ConfigError(path, "profile", f"unknown profile {_show(cfg.profile)}", f"use one of {', '.join(sorted(known))}, none, or define [profiles.{_key(cfg.profile)}]")
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


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _require_secret_file(st: os.stat_result, source, key: str, secret_path) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a plain file")
        raise ConfigError(source, key, f"{secret_path} is {kind}, not a regular file", "point it at a plain file holding only the secret")
    if st.st_size > SECRET_MAX_BYTES:
        raise ConfigError(source, key, f"{secret_path} is {st.st_size} bytes, over the {SECRET_MAX_BYTES}-byte limit for a secret", "point it at the file holding only the secret")


def read_secret(source, key: str, secret_path: str | Path) -> str:
    """The text of a secret file (API key, SMTP password), or ConfigError naming the file, never its text.

    Only a regular file of at most SECRET_MAX_BYTES of UTF-8 is read. It is
    stat()ed before it is opened, since opening a device can itself act (and
    /dev/zero never ends), and opened with O_NONBLOCK, since a FIFO swapped in
    after the stat would otherwise wait for a writer for ever.
    """
    fix = "check the file exists and the service user can read it"
    try:
        _require_secret_file(os.stat(secret_path), source, key, secret_path)
        fd = os.open(secret_path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(source, key, f"cannot read {secret_path}: {exc.strerror}", fix) from None
    except ValueError:
        raise ConfigError(source, key, "the path contains a NUL byte", "remove it") from None
    try:
        _require_secret_file(os.fstat(fd), source, key, secret_path)  # the file opened, in case it was swapped
        chunks, size = [], 0
        while size <= SECRET_MAX_BYTES:
            chunk = os.read(fd, SECRET_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(source, key, f"cannot read {secret_path}: {exc.strerror}", fix) from None
    finally:
        os.close(fd)
    if size > SECRET_MAX_BYTES:
        raise ConfigError(source, key, f"{secret_path} grew over the {SECRET_MAX_BYTES}-byte limit for a secret", "point it at the file holding only the secret")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(source, key, f"{secret_path} is not UTF-8 text", "write the secret as UTF-8 text") from None


def _api_key(path, secret_path: str) -> str:
    key = "engine.api_key_file"
    text = read_secret(path, key, secret_path).strip()
    if not text:
        raise ConfigError(path, key, f"{secret_path} is empty", "write the key into it")
    # It reaches vLLM as VLLM_API_KEY: execve refuses a NUL, and a key of several lines is the wrong file.
    if "\0" in text or "\n" in text or "\r" in text:
        raise ConfigError(path, key, f"{secret_path} holds more than the key (several lines or a NUL byte)", "keep only the key in it")
    return text


def redacted(cfg: Config) -> dict:
    """The effective configuration as plain data, safe to print."""
    data = dataclasses.asdict(cfg)
    data["api_key"] = "<redacted>" if cfg.api_key else ""
    data["profiles"] = {k: dataclasses.asdict(v) for k, v in resolve_profiles(cfg).items()}
    return data
