"""The configuration file: TOML in, frozen dataclasses out.

Every error is a ConfigError carrying the file, the dotted key and the fix, so
the CLI can print one line and exit 78 (EX_CONFIG). The schema lives in the
dataclasses themselves: a field's type and metadata drive type checking, range
checking and the unknown-key check, so there is one place to add a key.

The package: `schema` (the sections as dataclasses, their limits and the
built-in profiles), `loading` (TOML to a checked Config: types, ranges,
migration of removed keys, the checks across keys), `secret` (secret files,
and the configuration as printed, secrets redacted), `errors` (ConfigError).
Callers import from `r3090d.config`, which re-exports what they use.
"""

from r3090d.config.errors import ConfigError
from r3090d.config.loading import (
    CONFIG_MAX_BYTES,
    DEFAULT_PATH,
    ENV_CONFIG,
    ENV_INSTANCE,
    MIN_ALERT_HEADROOM_MIB,
    alertmanager_url_problem,
    from_dict,
    instance_from_env,
    load,
    resolve_path,
)
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
    Config,
    DaemonConfig,
    EmailConfig,
    EngineConfig,
    GpuConfig,
    PreflightConfig,
    Profile,
    SuspendConfig,
    SyslogConfig,
    WatchdogConfig,
    resolve_profiles,
)
from r3090d.config.secret import SECRET_MAX_BYTES, read_secret, redacted

__all__ = [
    "BUILTIN_PROFILES",
    "CLOCK_EVENT_REASONS",
    "CONFIG_MAX_BYTES",
    "DEFAULT_PATH",
    "DERIVED_FIELDS",
    "ENV_CONFIG",
    "ENV_INSTANCE",
    "MAX_GPU_INDEX",
    "MAX_PORT",
    "MIB",
    "MIN_ALERT_HEADROOM_MIB",
    "NO_PROFILE",
    "SECRET_MAX_BYTES",
    "AlertmanagerConfig",
    "AlertsConfig",
    "Config",
    "ConfigError",
    "DaemonConfig",
    "EmailConfig",
    "EngineConfig",
    "GpuConfig",
    "PreflightConfig",
    "Profile",
    "SuspendConfig",
    "SyslogConfig",
    "WatchdogConfig",
    "alertmanager_url_problem",
    "from_dict",
    "instance_from_env",
    "load",
    "read_secret",
    "redacted",
    "resolve_path",
    "resolve_profiles",
]
