"""Process exit codes. systemd's RestartPreventExitStatus= lists the permanent ones."""

OK = 0
# Health-style commands (preflight, status) follow the monitoring-plugin scheme.
WARNING = 1
CRITICAL = 2
UNKNOWN = 3
USAGE = 64  # EX_USAGE: bad command-line arguments
PREFLIGHT_PERMANENT = 69  # EX_UNAVAILABLE: the host cannot run the engine until someone fixes it
TEMPFAIL = 75  # EX_TEMPFAIL: a transient preflight failure did not clear in time; systemd retries
CONFIG = 78  # EX_CONFIG: the configuration file is wrong
GAVE_UP = 79  # too many engine restarts in the give-up window; a human must look

PERMANENT = (CONFIG, PREFLIGHT_PERMANENT, GAVE_UP)
