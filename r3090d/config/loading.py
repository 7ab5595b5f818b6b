"""Loading the configuration: TOML to a checked Config.

Every error is a ConfigError carrying the file, the dotted key and the fix.
Types, ranges and unknown keys are checked against the dataclasses of
r3090d.config.schema; removed keys are carried over to their successors with a
warning; then the checks that span keys (_validate).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from r3090d.cards import ANY_CARD, CARDS
from r3090d.config.errors import ConfigError, format_message, show, toml_key
from r3090d.config.models import model_dir_name, port_for, socket_path
from r3090d.config.schema import (
    ARGV_BUDGET,
    DERIVED_FIELDS,
    MAX_GPU_INDEX,
    MAX_MODEL_NAME,
    MAX_MODELS,
    MAX_PORT,
    MAX_TEXT,
    NAME_MAX,
    NO_PROFILE,
    PORTS_PER_INSTANCE,
    UNIX_PATH_MAX,
    AlertmanagerConfig,
    Config,
    EngineKind,
    EngineListen,
    ModelConfig,
    ParkMode,
    Profile,
    Spec,
    WatchdogConfig,
    resolve_profiles,
    spec_of,
)
from r3090d.config.secret import read_api_key, read_secret
from r3090d.engineflags import canonical_flag, flag_occurrence

DEFAULT_PATH = Path("/etc/r3090d/r3090d.toml")
ENV_CONFIG = "R3090D_CONFIG"
ENV_INSTANCE = "R3090D_INSTANCE"


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
        raise ConfigError(None, ENV_INSTANCE, f"instance {show(raw)} is not a GPU index from 0 to {MAX_GPU_INDEX}", "use r3090d@0, r3090d@1, ...")
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
    cfg = _check_mode(cfg, data, path)
    _check_instance(cfg, instance, path)
    _check_engine_ports(cfg, instance, path)
    cfg = _apply_instance(cfg, instance)
    cfg = _place_socket(cfg, path)
    cfg = dataclasses.replace(cfg, source=str(path), instance=instance, warnings=warnings)
    _validate(cfg, path, check_files=check_files)
    return _read_api_keys(cfg, path) if check_files else cfg


def _read_api_keys(cfg: Config, path) -> Config:
    """The keys from their files: each engine's, and the one of what listens at engine.host:engine.port."""
    if not cfg.models:
        return dataclasses.replace(cfg, api_key=read_api_key(path, cfg.engine.api_key_file)) if cfg.engine.api_key_file else cfg
    models = tuple(
        dataclasses.replace(m, api_key=read_api_key(path, m.api_key_file, f"models[{i}].api_key_file")) if m.api_key_file else m
        for i, m in enumerate(cfg.models)
    )
    router_key = read_api_key(path, cfg.swap.api_key_file, "swap.api_key_file") if cfg.swap.api_key_file else ""
    return dataclasses.replace(cfg, models=models, api_key=router_key)


# [engine] keys that belong to one model in swap mode, and where each goes.
_KEYS_OF_A_MODEL = {
    "model": "move it into a [[models]] entry (model = ...)",
    "served_model_name": "move it into a [[models]] entry as its name (name = ...)",
    "extra_args": "move it into the [[models]] entries that need it (extra_args = [...])",
    "kind": "set kind in each [[models]] entry",
    "api_key_file": "set swap.api_key_file for the router's key, and models[N].api_key_file for an engine's",
}


def _check_mode(cfg: Config, data: dict, path) -> Config:
    """Swap mode ([[models]]) or one engine: the keys each allows; no canary where no engine is generative."""
    engine_table = data.get("engine", {})  # a table: _build checked it
    if cfg.models:
        for key, fix in _KEYS_OF_A_MODEL.items():
            if key in engine_table:
                raise ConfigError(path, f"engine.{key}", "is one model's setting, and [[models]] lists the models (swap mode)", fix)
        if "listen" not in engine_table:  # swap mode's engines serve on unix sockets unless the file says tcp
            cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, listen=EngineListen.UDS))
    elif "swap" in data:
        raise ConfigError(path, "swap", "is set but there is no [[models]] entry", "add [[models]] entries to serve several models through the router, or remove [swap]")
    kinds = {m.kind for m in cfg.models} if cfg.models else {cfg.engine.kind}
    if EngineKind.GENERATE in kinds:
        return cfg
    canary_table = data.get("canary", {})
    if canary_table.get("enabled") is True:
        raise ConfigError(path, "canary.enabled", "is true but no engine is generative: the canary is a completion, which an embedding engine refuses",
                          'remove it (embedding engines get no canary), or serve a kind = "generate" model')  # fmt: skip
    return dataclasses.replace(cfg, canary=dataclasses.replace(cfg.canary, enabled=False))


def _check_instance(cfg: Config, instance: int | None, path) -> None:
    """The instance offset must keep every port a port (and the index a GPU index)."""
    if instance is None:
        return
    if isinstance(instance, bool) or not isinstance(instance, int) or not 0 <= instance <= MAX_GPU_INDEX:
        raise ConfigError(path, "instance", f"{show(instance)} is not a GPU index from 0 to {MAX_GPU_INDEX}", f"use r3090d@0 to r3090d@{MAX_GPU_INDEX}")
    for key, port in (("engine.port", cfg.engine.port), ("daemon.exporter_port", cfg.daemon.exporter_port)):
        if port + instance > MAX_PORT:
            raise ConfigError(
                path,
                key,
                f"{port} + {instance} for instance r3090d@{instance} is {port + instance}, above {MAX_PORT}",
                f"set {key} to at most {MAX_PORT - instance}",
            )


def _check_engine_ports(cfg: Config, instance: int | None, path) -> None:
    """Swap mode: this instance's engine ports are ports, and none is a public or exporter port of any instance
    (on engine.listen = "tcp": unix sockets use no port)."""
    if not cfg.models:
        return
    count = len(cfg.models)
    if count > MAX_MODELS:
        raise ConfigError(path, "models", f"lists {count} models, more than the {MAX_MODELS} engine ports each instance has", f"keep at most {MAX_MODELS} [[models]] entries")
    if cfg.engine.listen is EngineListen.UDS:
        return  # the engines serve on unix sockets: their ports are not used
    n = instance or 0
    base = cfg.swap.engine_port_base
    first, last = port_for(base, instance, 0), port_for(base, instance, count - 1)
    if last > MAX_PORT:
        raise ConfigError(
            path,
            "swap.engine_port_base",
            f"the engine ports of r3090d@{n} ({base} + {PORTS_PER_INSTANCE} x {n} + 0..{count - 1}) end at {last}, above {MAX_PORT}",
            f"set swap.engine_port_base to at most {MAX_PORT - PORTS_PER_INSTANCE * n - count + 1}",
        )
    taken = [("engine.port", cfg.engine.port)]
    if cfg.daemon.exporter_enabled:
        taken.append(("daemon.exporter_port", cfg.daemon.exporter_port))
    for key, port in taken:
        lo, hi = port, min(port + MAX_GPU_INDEX, MAX_PORT)  # key + N for r3090d@N
        if first <= hi and lo <= last:
            clash = max(first, lo)
            name = cfg.models[clash - first].name
            raise ConfigError(
                path,
                "swap.engine_port_base",
                f"engine port {clash} (models[{clash - first}], {show(name)}, r3090d@{n}) is among the ports {key} takes ({lo}-{hi}: {key} + N for r3090d@N)",
                f"move swap.engine_port_base clear of {lo}-{hi} (engine i of r3090d@N listens on engine_port_base + {PORTS_PER_INSTANCE} x N + i)",
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


def _place_socket(cfg: Config, path) -> Config:
    """engine.listen = "uds": every engine's socket path fits a unix socket's; the one engine's is set here
    (swap mode's engines get theirs in r3090d.config.models)."""
    if cfg.engine.listen is not EngineListen.UDS:
        return cfg
    longest = socket_path(cfg.daemon.runtime_dir, max(len(cfg.models) - 1, 0))
    size = len(longest.encode("utf-8", "surrogateescape"))
    if size > UNIX_PATH_MAX:
        raise ConfigError(path, "daemon.runtime_dir", f"makes the engines' socket paths too long for a unix socket ({longest}: {size} bytes, "
                          f"the limit is {UNIX_PATH_MAX})", f"shorten daemon.runtime_dir by {size - UNIX_PATH_MAX} bytes or more")  # fmt: skip
    if cfg.models:
        return cfg
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, uds=socket_path(cfg.daemon.runtime_dir, 0)))


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
    return min(n + 1, spec_of(_field(WatchdogConfig, "start_failures")).hi)


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
        warnings.append(format_message(path, old_key, problem, fix))
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
        dotted = prefix + toml_key(key)
        if key not in fields:
            close = _closest(key, fields) if isinstance(key, str) else None
            fix = f"did you mean {prefix}{close}?" if close else f"remove it; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(path, dotted, "unknown key", fix)
        ftype = hints[key]
        if dataclasses.is_dataclass(ftype):
            kwargs[key] = _build(ftype, value, path, dotted + ".")
            continue
        entry_type = _entry_type(ftype)
        if entry_type is not None:
            kwargs[key] = _build_entries(entry_type, value, path, dotted)
            continue
        kwargs[key] = _check_value(value, ftype, spec_of(fields[key]), path, dotted)
    return cls(**kwargs)


def _entry_type(ftype) -> type | None:
    """The section type of an array of tables (`tuple[ModelConfig, ...]`: [[models]]), else None."""
    if typing.get_origin(ftype) is tuple:
        args = typing.get_args(ftype)
        if len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _build_entries(cls, value, path, dotted: str) -> tuple:
    """An array of tables, each entry checked against `cls`; its keys are named as models[2].name."""
    if not isinstance(value, list | tuple):
        raise ConfigError(path, dotted, f"expected an array of tables, got {type(value).__name__} {show(value)}", f"write each entry as [[{dotted}]]")
    entries = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError(path, f"{dotted}[{i}]", f"expected a table, got {type(item).__name__} {show(item)}", f"write each entry as [[{dotted}]]")
        entries.append(_build(cls, item, path, f"{dotted}[{i}]."))
    return tuple(entries)


def _check_enum(value, enum_type: type[Enum], path, dotted: str):
    """A string naming one of the enum's values, as that value."""
    values = [member.value for member in enum_type]
    if not isinstance(value, str) or value not in values:
        raise ConfigError(path, dotted, f"{show(value)} is not one of {', '.join(map(repr, values))}", f"use one of {', '.join(values)}")
    return enum_type(value)


def _check_value(value, ftype, spec: Spec, path, dotted: str):
    if isinstance(ftype, type) and issubclass(ftype, Enum):
        return _check_enum(value, ftype, path, dotted)
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
            raise ConfigError(path, dotted, f"{show(value)} is out of range", _range_fix(spec)) from None
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        type_name = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in options)
        raise ConfigError(path, dotted, f"expected {type_name}, got {type(value).__name__} {show(value)}", f"write {name} = <{type_name}>")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path, dotted, f"{value} is not a finite number", _range_fix(spec))
    if isinstance(value, str):
        _check_text(value, spec.max_len, spec.path, path, dotted)
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(path, dotted, f"{show(value)} is not one of {', '.join(map(repr, spec.choices))}", f"use one of {', '.join(spec.choices)}")
    if (spec.lo is not None and value < spec.lo) or (spec.hi is not None and value > spec.hi):
        raise ConfigError(path, dotted, f"{show(value)} is out of range", _range_fix(spec))
    if spec.items is not None and spec.items is not dict and isinstance(value, list | dict):  # profiles: _profile_tables
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, item in items:
            _check_item(item, spec, path, f"{dotted}.{toml_key(k)}" if isinstance(value, dict) else f"{dotted}[{k}]", name)
    return value


def _range_fix(spec: Spec) -> str:
    return f"use a value from {spec.lo} to {spec.hi}" if spec.lo is not None and spec.hi is not None else "write a finite number"


def _check_item(item, spec: Spec, path, dotted: str, name: str) -> None:
    """One list item or table value: its type, size and, where the names are fixed, its name."""
    if not isinstance(item, spec.items) or (spec.items is not bool and isinstance(item, bool)):
        type_name = _TYPE_NAMES.get(spec.items, spec.items.__name__)
        fix = f'quote it: {name} = ["..."]' if spec.items is str else f"write each item of {name} as {type_name}"
        raise ConfigError(path, dotted, f"expected {type_name}, got {type(item).__name__} {show(item)}", fix)
    if isinstance(item, str):
        _check_text(item, spec.item_max_len, False, path, dotted)
    if spec.item_choices is not None and item not in spec.item_choices:
        close = _closest(item, sorted(spec.item_choices))
        fix = f"did you mean {close}?" if close else f"use one of {', '.join(sorted(spec.item_choices))}"
        raise ConfigError(path, dotted, f"unknown name {show(item)}", fix)


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
                    f"has a path component longer than {NAME_MAX} bytes ({show(part.decode())}, {len(part)} bytes)",
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
        prefix = f"profiles.{toml_key(name)}"
        if not isinstance(name, str):
            raise ConfigError(path, prefix, "a profile name must be a string", "write [profiles.NAME]")
        _check_text(name, spec_of(_field(Config, "profile")).max_len, False, path, prefix)
        if not isinstance(table, dict):
            raise ConfigError(path, prefix, "must be a table", f"write [{prefix}]")
        built = _build(Profile, table, path, prefix + ".")
        tables[name] = {k: getattr(built, k) for k in table}
    return tables


# --------------------------------------------------------------- validation

# Flags r3090d owns: setting them through extra_args would fight the daemon.
_OWNED_FLAGS = {
    "--host": "engine.host",
    "--port": "engine.port",
    "--model": "engine.model",
    "--served-model-name": "engine.served_model_name",
    "--api-key": "engine.api_key_file (the key must never be in argv)",
    "--shutdown-timeout": "engine.shutdown_timeout",
    "--uds": 'engine.listen = "uds"',
}


_OWNED_FLAG_FIXES = {flag: f"use {key} instead" for flag, key in _OWNED_FLAGS.items()}


def _owned_flag_fixes_of_model(where: str) -> dict[str, str]:
    """The same flags for a [[models]] entry's engine, and what to do instead."""
    return {
        "--host": "remove it: each engine listens on 127.0.0.1, and the router on engine.host",
        "--port": "remove it: each engine gets its own port from swap.engine_port_base",
        "--model": f"use {where}.model instead",
        "--served-model-name": f"use {where}.name instead",
        "--api-key": f"use {where}.api_key_file instead (the key must never be in argv)",
        "--shutdown-timeout": "use engine.shutdown_timeout instead",
        "--uds": "remove it: each engine serves on its own socket in daemon.runtime_dir/engines (engine.listen)",
    }


# vLLM's --runner against the kind: a generative engine answers the completion probe, a pooling one the embedding probe.
_RUNNERS_OF_KIND = {EngineKind.GENERATE: ("auto", "generate"), EngineKind.EMBED: ("auto", "pooling")}
_MODEL_NAME = re.compile(r"[A-Za-z0-9._:/-]+")
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
    if not cfg.models:
        _check_model(e.model, "engine.model", path, check_files=check_files)
    try:
        loopback = ipaddress.ip_address(e.host).is_loopback
    except ValueError:
        loopback = e.host == "localhost"
    # What listens at engine.host:engine.port: the engine, or in swap mode the router.
    public_key = "swap.api_key_file" if cfg.models else "engine.api_key_file"
    if not loopback and not (cfg.swap.api_key_file if cfg.models else e.api_key_file):
        raise ConfigError(path, "engine.host", f"{e.host} is not loopback and {public_key} is empty", f"set {public_key}, or bind to 127.0.0.1 behind a proxy")
    if cfg.models:
        _check_env(e.env, "engine.env", path)
        _validate_models(cfg, path, check_files=check_files)
    else:
        _check_extra_args(e.extra_args, "engine.extra_args", cfg.profile, "profile", _OWNED_FLAG_FIXES, e.kind, "engine.kind", path)
        _check_env(e.env, "engine.env", path)
        _check_argv_budget(e.extra_args, e.env, "engine.extra_args", "engine.env", path)
    if check_files and e.python and not os.access(e.python, os.X_OK):
        raise ConfigError(path, "engine.python", f"{e.python} is not an executable file", "point it at the python of the venv vLLM is installed in (make engine)")
    if not cfg.models:
        _validate_profile(cfg, cfg.profile, "profile", path)
    w = cfg.watchdog
    if w.health_timeout + w.metrics_timeout > 30.0 / 4:
        raise ConfigError(path, "watchdog.metrics_timeout", "health_timeout + metrics_timeout exceed a quarter of WatchdogSec=30", "keep their sum at or below 7.5 s")
    if w.backoff_max < w.backoff_initial:
        raise ConfigError(path, "watchdog.backoff_max", "is below watchdog.backoff_initial", "raise backoff_max")
    if cfg.daemon.exit_on_give_up and w.give_up_retry > 0:
        raise ConfigError(path, "watchdog.give_up_retry",
                          f"is {w.give_up_retry:g} s while daemon.exit_on_give_up is true: a daemon that exits cannot retry",
                          "set watchdog.give_up_retry = 0, or daemon.exit_on_give_up = false")  # fmt: skip
    if cfg.alerts.email.enabled and not cfg.alerts.email.recipients:
        raise ConfigError(path, "alerts.email.recipients", "email is enabled but no recipient is set", 'add recipients = ["ops@example.org"]')
    if cfg.gpu.card not in CARDS and cfg.gpu.card != ANY_CARD:
        raise ConfigError(path, "gpu.card", f"unknown card {show(cfg.gpu.card)}", f"use one of {', '.join(sorted(CARDS))} or {ANY_CARD}")
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
            raise ConfigError(path, where, f"{show(url)} is listed twice", "list each Alertmanager once")
        seen.add(url.strip().rstrip("/"))
    if am.enabled and not am.urls:
        raise ConfigError(path, key, "Alertmanager is enabled but no URL is set", f"{fix}, or set enabled = false")
    if check_files and am.enabled and am.bearer_token_file:
        read_secret(path, "alerts.alertmanager.bearer_token_file", am.bearer_token_file)  # readable now


def alertmanager_url_problem(url: str) -> str | None:
    """What is wrong with an Alertmanager base URL, or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range
    except ValueError as exc:
        return f"{show(url)} is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{show(url)} is not an http:// or https:// URL with a host"
    if parts.username is not None or parts.password is not None:
        return "holds credentials, which would be logged; put a token in alerts.alertmanager.bearer_token_file"
    if parts.query or parts.fragment:
        return f"{show(url)} has a query or fragment; give the base URL (r3090d adds /api/v2/alerts)"
    return None


def _exists(p: str) -> bool:
    try:
        return Path(p).expanduser().exists()
    except (OSError, ValueError, RuntimeError):  # RuntimeError: "~user" for no such user
        return False


def _check_model(model: str, key: str, path, *, check_files: bool) -> None:
    if not model:
        raise ConfigError(path, key, "is required", "set it to the model directory (or a hub name already in the cache)")
    if check_files and model.startswith(("/", ".", "~")) and not _exists(model):
        raise ConfigError(path, key, f"{model} does not exist", "point it at the model directory")


def _check_extra_args(args: list, key: str, profile: str, profile_key: str, owned: dict[str, str], kind: EngineKind, kind_key: str, path) -> None:
    """vLLM flags r3090d sets itself (`owned`: each one's fix), or the profile does, or that blind the watchdog,
    or that contradict the kind."""
    for i, arg in enumerate(args):  # strings: checked with the schema
        where = f"{key}[{i}]"
        flag = canonical_flag(arg)  # as vLLM reads it: --max_model_len is --max-model-len
        if flag == "--disable-log-stats":
            raise ConfigError(path, where, "--disable-log-stats removes every vllm: metric and blinds the watchdog", "remove it")
        if flag in owned:
            raise ConfigError(path, where, f"{flag} is set by r3090d", owned[flag])
        if flag in _PROFILE_FLAGS and profile != NO_PROFILE:
            fix = 'change the profile in [profiles.NAME], or set profile = "none"'
            if profile_key != "profile":
                fix = f'change the profile in [profiles.NAME], or set {profile_key} = "none"'
            raise ConfigError(path, where, f"{flag} is set by profile {profile!r}", fix)
    runner = flag_occurrence(args, "--runner")
    if runner is not None and runner[1] not in _RUNNERS_OF_KIND[kind]:
        raise ConfigError(path, f"{key}[{runner[0]}]", f"--runner {runner[1]} contradicts {kind_key} = {kind.value!r}",
                          f"use --runner {_RUNNERS_OF_KIND[kind][1]}, or set {kind_key} to the model's kind")  # fmt: skip


def _check_env(env: dict, key: str, path) -> None:
    for k in env:  # values: strings, checked with the schema
        where = f"{key}.{toml_key(k)}"
        # execve refuses a name with "=" or NUL; an empty name is no variable at all.
        if not isinstance(k, str) or not k or "=" in k:
            raise ConfigError(path, where, "is not an environment variable name", "use a name such as MY_VAR, without '='")
        _check_text(k, MAX_TEXT, False, path, where)
        if k in ("VLLM_API_KEY", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            raise ConfigError(path, where, "is managed by r3090d", "remove it (the API key comes from engine.api_key_file)")


def _validate_models(cfg: Config, path, *, check_files: bool) -> None:
    """Swap mode: each [[models]] entry as one engine's settings, and the limits across them."""
    seen: dict[str, int] = {}
    profile_used = False
    for i, m in enumerate(cfg.models):
        where = f"models[{i}]"
        _check_model_name(m, i, seen, path)
        _check_model(m.model, f"{where}.model", path, check_files=check_files)
        profile, profile_key = (m.profile, f"{where}.profile") if m.profile else (cfg.profile, "profile")
        profile_used |= not m.profile
        _validate_profile(cfg, profile, profile_key, path)
        _check_extra_args(m.extra_args, f"{where}.extra_args", profile, profile_key, _owned_flag_fixes_of_model(where), m.kind, f"{where}.kind", path)
        _check_env(m.env, f"{where}.env", path)
        _check_park(cfg, m, where, path)
        _check_argv_budget(m.extra_args, {**cfg.engine.env, **m.env}, f"{where}.extra_args", f"{where}.env" if m.env else "engine.env", path)
    if not profile_used and cfg.profile != NO_PROFILE and cfg.profile not in resolve_profiles(cfg):
        _validate_profile(cfg, cfg.profile, "profile", path)  # unused by any model, but a typo all the same
    if cfg.swap.max_resident > len(cfg.models):
        raise ConfigError(path, "swap.max_resident", f"is {cfg.swap.max_resident} but only {len(cfg.models)} models are listed",
                          f"set it to at most {len(cfg.models)}")  # fmt: skip


def _check_park(cfg: Config, m: ModelConfig, where: str, path) -> None:
    """A park by sleep is trusted only once the canary has checked the woken engine's answer."""
    if m.park is not ParkMode.SLEEP:
        return
    if m.kind is not EngineKind.GENERATE:
        raise ConfigError(path, f"{where}.park", f'is "sleep" but {where}.kind is {m.kind.value}: the canary that checks each wake needs a generative model',
                          f'set {where}.park = "auto"')  # fmt: skip
    if not cfg.gpu.required:
        raise ConfigError(path, f"{where}.park", 'is "sleep" but gpu.required is false: vLLM\'s sleep mode moves GPU memory',
                          f'set {where}.park = "auto" (a drained stop and a cold start without a GPU)')  # fmt: skip
    if not cfg.canary.enabled:
        raise ConfigError(path, f"{where}.park", 'is "sleep" but canary.enabled is false: nothing would check the woken engine\'s answer',
                          f'set canary.enabled = true, or {where}.park = "auto"')  # fmt: skip


def _check_model_name(m: ModelConfig, index: int, seen: dict[str, int], path) -> None:
    key = f"models[{index}].name"
    if not m.name:
        raise ConfigError(path, key, "is required", 'set it to the name clients send as "model", e.g. name = "chat"')
    if not _MODEL_NAME.fullmatch(m.name) or not m.name.strip("."):
        raise ConfigError(path, key, f"{show(m.name)} is not a model name", f"use 1 to {MAX_MODEL_NAME} letters, digits and . _ : / - (not only dots)")
    if len(model_dir_name(m.name)) > NAME_MAX:
        raise ConfigError(path, key, f"is too long as a directory name under daemon.state_dir/models ({len(model_dir_name(m.name))} bytes, with : and / as %3A and %2F)",
                          f"shorten it to {NAME_MAX} bytes so counted")  # fmt: skip
    if m.name in seen:
        raise ConfigError(path, key, f"{show(m.name)} is also models[{seen[m.name]}].name", "give each model its own name")
    seen[m.name] = index


def _check_argv_budget(extra_args: list, env: dict, args_key: str, env_key: str, path) -> None:
    """extra_args and env reach vLLM through execve, whose argv and environment are bounded (E2BIG)."""
    args = sum(len(a.encode()) + 1 for a in extra_args)
    env_bytes = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
    if args + env_bytes > ARGV_BUDGET:
        raise ConfigError(
            path,
            args_key if args >= env_bytes else env_key,
            f"{args_key} ({args} bytes) and {env_key} ({env_bytes} bytes) exceed the {ARGV_BUDGET}-byte budget for vLLM's command line and environment",
            "pass long values through files (most vLLM options take a path)",
        )


def _validate_profile(cfg: Config, name: str, key: str, path) -> None:
    """The profile `name` (set at `key`) exists, and its memory budget stays under the memory alert."""
    known = resolve_profiles(cfg)  # the tables were checked against Profile on the way in
    if name != NO_PROFILE and name not in known:
        raise ConfigError(path, key, f"unknown profile {show(name)}", f"use one of {', '.join(sorted(known))}, none, or define [profiles.{toml_key(name)}]")
    prof = known[name] if name != NO_PROFILE else None
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
            f"profiles.{name}.gpu_memory_utilization",
            f"budgets {budget:.0f} MiB of {card_mib} MiB, only {headroom:.0f} MiB under watchdog.gpu_memory_alert_mib={cfg.watchdog.gpu_memory_alert_mib}, so the memory alert would fire forever",
            f"lower gpu_memory_utilization to {safe:.3f} or less, or raise watchdog.gpu_memory_alert_mib",
        )
