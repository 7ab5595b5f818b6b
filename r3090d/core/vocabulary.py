"""The core's vocabulary: phases, restart reasons, how a restart was asked for, alert severities and states.

str-valued, so the state file, the exporter's labels and the CLI keep their text,
and derive their lists from here instead of spelling the strings again.
"""

from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    """The engine's lifecycle as the policy tracks it; the values are the state file's and the exporter's text."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # a drained restart in progress: the engine still finishes its streams
    RESTARTING = "restarting"  # the old tree is being stopped
    BACKOFF = "backoff"
    GIVEN_UP = "given-up"
    WAITING_FOR_GPU = "waiting-for-gpu"  # an automatic start waits: processes outside the engine hold the card
    RESET_NEEDED = "reset-needed"  # no start: the card needs a reset or a reboot (r3090ctl restart once done)
    SHUTTING_DOWN = "shutting-down"
    # r3090ctl suspend / resume (r3090d.core.suspension): the engine lends the GPU.
    SUSPENDING = "suspending"  # draining, then the driver checkpoints the engine
    SUSPENDED = "suspended"  # the engine's GPU memory is in its host memory, or the engine is down
    RESUMING = "resuming"  # room checked, memory restored; /health and a probe must pass
    # Swap mode (several models on one card): no engine process, by the arbiter's choice. It starts
    # when its model is asked for; nothing judges it, and it is not an outage.
    COLD = "cold"


# While suspending, suspended or resuming, no liveness rule judges the engine.
SUSPEND_PHASES = (Phase.SUSPENDING, Phase.SUSPENDED, Phase.RESUMING)


class RestartKind(enum.StrEnum):
    """How a restart was asked for."""

    DRAIN = "drain"  # operator: let streams finish and the load balancer leave first
    FAST = "fast"  # operator: stop at once
    CONFIG = "config"  # a reload changed the engine's settings: drained, and never a cold start after a give-up


class RestartReason(enum.StrEnum):
    """Why the engine was restarted: the exporter's label values and the records' `reason`."""

    EXITED = "exited"  # the engine exited without being asked to
    SPAWN_FAILED = "spawn_failed"  # the engine's python could not be started
    STARTUP_TIMEOUT = "startup_timeout"  # /health never answered 200 within engine.startup_timeout
    DEAD = "dead"  # /health refused for dead_refused_polls polls, or answered 503
    HUNG = "hung"  # /health timing out for hang_timeout
    STALLED = "stalled"  # requests running and no progress (tokens, prompt tokens, KV blocks)
    PROBE_FAILED = "probe_failed"  # idle, and the 1-token inference probe failing with nothing moving
    KV = "kv"  # the KV cache ran out and did not recover
    GPU_IDLE = "gpu_idle"  # requests running, and the GPU (its sole user the engine) idle
    REQUESTED = "requested"  # r3090ctl restart, or a reload that changed the engine's settings
    SUSPEND_FAILED = "suspend_failed"  # the driver's checkpoint left the engine unable to serve
    RESUME_FAILED = "resume_failed"  # restore failed, or the resumed engine did not pass /health and a probe
    WRONG_OUTPUT = "wrong_output"  # the known-answer canary differs from the engine's baseline (core.canary)


class CanaryPurpose(enum.StrEnum):
    """What a canary is sent for."""

    BASELINE = "baseline"  # the engine's known answer, taken when nothing else runs (or twice under load, see core.canary)
    CHECK = "check"  # a comparison with the baseline


# The fast freeze detectors: their windows widen when they trip twice in a row (core.policy).
FAST_DETECTORS = (RestartReason.GPU_IDLE, RestartReason.STALLED)


class Severity(enum.StrEnum):
    """How bad an alert is: the syslog priority, the email's subject, Alertmanager's `severity` label."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"  # never rate-limited; status CRITICAL while it fires


class AlertState(enum.StrEnum):
    """Where a sent alert is in its lifecycle (SendAlert.state)."""

    FIRING = "firing"
    REMINDER = "reminder"
    RESOLVED = "resolved"
