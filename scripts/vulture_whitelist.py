"""Names vulture cannot see used, grouped by reason. `make lint` runs vulture with
this file. To review it, list what vulture finds without it
(`vulture r3090d scripts --exclude scripts/vulture_whitelist.py --make-whitelist`): each name
should be here under its reason, or be removed from the package as dead."""
# ruff: noqa

# Fields written to JSON (the state file, restart records, --json output) or read from it by
# the CLI and the exporter, never by name in the package itself.
memory_reserved, utilization_memory, sm_clock_mhz, mem_clock_mhz, field_errors, exited_at, stop_requested
step_started_at, finish_reason, size_on_disk, index_total_size, cache_dtype, engine_kv_bytes
tick_seconds, recent, remind_after_s, _.reaped_total

# Members of an enum that mirrors a driver's numbering (NVML's GPU recovery actions): each is
# mapped by position, and the ones nothing acts on are still values NVML may report.
NONE, DRAIN_P2P

# Read by the tests and the benchmarks, which vulture does not scan.
PERMANENT, sample_from_dict, ppid, start_succeeded

# Hooks that a library calls by name: click (the file= of echo, the default map), logging,
# the syslog handler, reprlib's limits, prometheus_client's collector, requests' session,
# the HTTP server's method enum, the tokenizers library in scripts/make_tiny_model.py.
file, json_option, _.default_map, _.handleError, _.mapPriority, _.append_nul, _.collect, _.trust_env, HEAD
_.maxdict, _.maxlevel, _.maxlist, _.maxother, _.maxstring, exc_info
_.pre_tokenizer, _.decoder, _.post_processor

# Python's own hooks: a module's __getattr__ (PEP 562), which r3090d.config's lazy re-exports use.
__getattr__

# Files shipped with the package, named for the packaging tests and `r3090ctl setup`.
PROMETHEUS_RULES, HAPROXY, DEFAULT_EXEC_START
