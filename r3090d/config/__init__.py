"""The configuration file: TOML in, frozen dataclasses out.

Every error is a ConfigError carrying the file, the dotted key and the fix, so
the CLI can print one line and exit 78 (EX_CONFIG). The schema lives in the
dataclasses themselves: a field's type and metadata drive type checking, range
checking and the unknown-key check, so there is one place to add a key.

The package: `schema` (the sections as dataclasses, their limits and the
built-in profiles), `loading` (TOML to a checked Config: types, ranges,
migration of removed keys, the checks across keys), `secret` (secret files,
and the configuration as printed, secrets redacted), `errors` (ConfigError),
`models` (swap mode: each [[models]] entry as its engine's own Config).
Callers import from `r3090d.config`, which re-exports what they use: the
schema at once, the rest (the loader and its file and environment reading) on
first use, so the pure core can import the schema without loading the loader.
"""

from r3090d.config.schema import (
    BUILTIN_PROFILES,
    CLOCK_EVENT_REASONS,
    DERIVED_FIELDS,
    MAX_GPU_INDEX,
    MAX_PORT,
    MIB,
    NO_PROFILE,
    AlertmanagerConfig,
    AlertsConfig,
    CanaryConfig,
    Config,
    DaemonConfig,
    EmailConfig,
    EngineConfig,
    EngineKind,
    EngineListen,
    GpuConfig,
    ModelConfig,
    PreflightConfig,
    Profile,
    SuspendConfig,
    SwapConfig,
    SyslogConfig,
    WatchdogConfig,
    resolve_profiles,
)

# Re-exported on first use: each name, and the submodule that defines it.
_ON_FIRST_USE = {
    "ConfigError": "errors",
    **dict.fromkeys(
        ("CONFIG_MAX_BYTES", "DEFAULT_PATH", "ENV_CONFIG", "ENV_INSTANCE", "MIN_ALERT_HEADROOM_MIB",
         "alertmanager_url_problem", "from_dict", "instance_from_env", "load", "resolve_path"),
        "loading",
    ),
    **dict.fromkeys(("SECRET_MAX_BYTES", "read_secret", "redacted"), "secret"),
    **dict.fromkeys(("engine_configs", "engine_port", "socket_path"), "models"),
}  # fmt: skip


def __getattr__(name: str):
    """A loader's name, imported when first asked for (PEP 562) and kept as an attribute."""
    home = _ON_FIRST_USE.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from r3090d.config import errors, loading, models, secret

    value = getattr({"errors": errors, "loading": loading, "models": models, "secret": secret}[home], name)
    globals()[name] = value
    return value


__all__ = [
    "BUILTIN_PROFILES",
    "CLOCK_EVENT_REASONS",
    "DERIVED_FIELDS",
    "MAX_GPU_INDEX",
    "MAX_PORT",
    "MIB",
    "NO_PROFILE",
    "AlertmanagerConfig",
    "AlertsConfig",
    "Config",
    "DaemonConfig",
    "EmailConfig",
    "EngineConfig",
    "EngineKind",
    "EngineListen",
    "GpuConfig",
    "ModelConfig",
    "PreflightConfig",
    "Profile",
    "SuspendConfig",
    "SwapConfig",
    "CanaryConfig",
    "SyslogConfig",
    "WatchdogConfig",
    "resolve_profiles",
    *_ON_FIRST_USE,
]
