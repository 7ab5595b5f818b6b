"""What the control plane asks of the loop, and what a reload loads and applies.

The control server validates each request (control_protocol.validate) in its
own thread and queues it; the loop answers it here, between ticks, so that
every change of state happens in one thread. Requests that change the policy's state (restart,
maintenance, silence, suspend, resume) are not applied here: they wait in
`Pending` and go through decide() with the next snapshot, on the policy's own clock.

Suspend and resume are answered at once ("accepted", with a request number)
once what can be judged now allows them; the work then runs over many ticks,
and the state document's `suspend.last` says how the request of that number
ended (`r3090ctl suspend|resume --wait` follows it). While suspended: restart is
refused ("resume first": a new engine would need the lent memory too); a reload
applies the config but restarts nothing (engine settings take effect when the
engine next starts); maintenance only sets its flag; silence works as always.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.config import Config, ConfigError
from r3090d.core import suspension
from r3090d.core.snapshot import Snapshot
from r3090d.core.vocabulary import SUSPEND_PHASES, Phase, RestartKind

log = logging.getLogger("r3090d")


@dataclass
class Pending:
    """Requests for the next snapshot; taken (and cleared) once per tick."""

    restart: RestartKind | None = None
    maintenance: bool | None = None
    silences: list[tuple[str, float]] = field(default_factory=list)
    suspend: int | None = None  # the accepted request's number
    resume: int | None = None
    requests: int = 0  # suspend/resume requests numbered so far (never cleared)
    # Swap mode, the arbiter's word (r3090d.core.arbiter): the suspend above is a park; a start; a stop to cold.
    park: bool = False
    park_by_sleep: bool = False  # the park is by vLLM's sleep mode
    start: bool = False
    stop_cold: str | None = None

    def take(self) -> tuple[RestartKind | None, bool | None, tuple[tuple[str, float], ...]]:
        taken = (self.restart, self.maintenance, tuple(self.silences))
        self.restart, self.maintenance, self.silences = None, None, []
        return taken

    def take_suspend(self) -> tuple[int | None, int | None]:
        taken = (self.suspend, self.resume)
        self.suspend, self.resume = None, None
        return taken

    def take_swap(self) -> tuple[bool, bool, str | None, bool]:
        taken = (self.park, self.start, self.stop_cold, self.park_by_sleep)
        self.park, self.start, self.stop_cold, self.park_by_sleep = False, False, None, False
        return taken

    def number(self) -> int:
        """The next request number (an operator's suspend or resume, or the arbiter's park or unpark)."""
        self.requests += 1
        return self.requests


def answer(request: dict, pending: Pending, *, phase: Phase, generation: int, exit_on_give_up: bool) -> dict:
    """The reply to an already validated request other than status and reload; records what decide() must do."""
    cmd = request["cmd"]
    if cmd == "restart":
        if phase is Phase.GIVEN_UP and not exit_on_give_up:
            pending.restart = RestartKind.FAST  # nothing is serving: nothing to drain
            return {"ok": True, "message": "starting the engine again after the give-up, from zero failures", "generation": generation}
        if phase is Phase.RESET_NEEDED:
            pending.restart = RestartKind.FAST  # the operator says the card is reset: clear the hold and start
            return {"ok": True, "message": "clearing the GPU reset hold and starting the engine", "generation": generation}
        if phase is Phase.WAITING_FOR_GPU:
            pending.restart = RestartKind.FAST  # start now, without waiting for the room
            return {"ok": True, "message": "starting the engine now, without waiting for the GPU memory", "generation": generation}
        if phase in SUSPEND_PHASES:
            return {"ok": False, "error": f"the engine is {phase.value}: r3090ctl resume first (a new engine needs the lent GPU memory too)"}
        if phase is not Phase.READY:
            return {"ok": False, "error": f"engine is {phase.value}, not ready; nothing to restart"}
        pending.restart = RestartKind.DRAIN if request.get("drain", True) else RestartKind.FAST
        return {"ok": True, "message": f"{pending.restart.value} restart requested", "generation": generation}
    if cmd == "maintenance":
        pending.maintenance = request["on"]
        return {"ok": True, "message": f"maintenance {'on' if request['on'] else 'off'}"}
    if cmd == "silence":
        pending.silences.append((request["alert"], float(request["seconds"])))
        return {"ok": True, "message": f"{request['alert']} silenced for {request['seconds']:.0f} s"}
    return {"ok": False, "error": f"unknown command {cmd!r}"}


def answer_suspend(request: dict, pending: Pending, cfg: Config, *, phase: Phase, suspended: suspension.Suspension | None,
                   snap: Snapshot | None) -> dict:  # fmt: skip
    """`suspend` or `resume`: refused in one line now if it cannot be done, else accepted with a request number.

    "unavailable": true marks a refusal no retry can change (no GPU, a multi-GPU engine):
    r3090ctl exits 69 (EX_UNAVAILABLE) for it, 1 for the others.
    """
    cmd = request["cmd"]
    if cmd == "suspend":
        if snap is None:
            return {"ok": False, "error": "the daemon has not sampled the engine yet: try again in a moment"}
        refusal = suspension.suspend_refusal(cfg, phase, snap)
    else:
        refusal = suspension.resume_refusal(phase, suspended)
    if refusal is not None:
        return {"ok": False, "error": refusal.text, "unavailable": refusal.unavailable}
    if (pending.suspend if cmd == "suspend" else pending.resume) is not None:
        return {"ok": False, "error": f"a {cmd} is already accepted: wait for it (r3090ctl status)"}
    pending.requests += 1
    if cmd == "suspend":
        pending.suspend = pending.requests
        message = "accepted: draining, then suspending the engine"
    else:
        pending.resume = pending.requests
        message = "accepted: checking the GPU has room, then resuming" + (" (a new engine: none was left)" if suspended and suspended.cold else "")
    return {"ok": True, "message": message, "request": pending.requests}


def reload_outcome(phase: Phase, engine_changed: bool, applied: str) -> tuple[RestartKind | None, str]:
    """What an accepted reload does to the engine, and the reply's text."""
    if engine_changed and phase is Phase.GIVEN_UP:
        return None, "applied; the engine stays stopped after the give-up until r3090ctl restart"
    if engine_changed and phase in SUSPEND_PHASES:
        return None, f"applied ({applied}); the engine is {phase.value}: its new settings take effect when it next starts"
    if engine_changed:
        return RestartKind.CONFIG, "applied; engine settings changed, drained restart"
    return None, f"applied without an engine restart ({applied})"


def reload(daemon) -> tuple[str, str]:
    """Daemon.reload: apply a new config file to `daemon` (in its loop), or refuse it and change nothing."""
    try:
        new, new_argv = load_for_reload(daemon.cfg, daemon.engine_version)
    except Exception as exc:  # any failure, even one nobody foresaw, must leave the engine running
        text = reload_error(exc)
        log.error("reload refused, keeping the running config: %s", text)
        return "error", f"refused, the running config stays: {text}"
    old = daemon.cfg
    engine_changed = new_argv != daemon.argv or new.engine.env != old.engine.env or new.api_key != old.api_key
    daemon.cfg, daemon.argv = new, new_argv
    unit = daemon.unit  # the engine's own copy: its next start runs the new argv
    unit.cfg, unit.argv = new, new_argv
    unit.sampler.configure(new)
    unit.suspend.cfg = new
    for warning in new.warnings:
        log.warning("%s", warning)
    applied = "watchdog settings"
    if new.alerts != old.alerts and daemon.alerts is not None:
        replace_alert_dispatcher(daemon, new)
        applied = "watchdog and alert settings"
    restart, text = reload_outcome(daemon.st.phase, engine_changed, applied)
    daemon.pending.restart = restart or daemon.pending.restart
    log.info("reload: %s", text)
    return "ok", text


def replace_alert_dispatcher(daemon, cfg: Config) -> None:
    """New channels for new alert settings; the old dispatcher delivers what it holds, off the loop."""
    from r3090d.effectors.alerts import AlertDispatcher

    old, daemon.alerts = daemon.alerts, AlertDispatcher.from_config(cfg)
    if daemon.gpu_identity is not None:
        daemon.alerts.set_gpu(*daemon.gpu_identity)
    threading.Thread(target=old.close, name="alerts-retire", daemon=True).start()


def load_for_reload(running: Config, engine_version) -> tuple[Config, list[str]]:
    """The new config and the engine argv it gives; raises on anything wrong with it."""
    new = configmod.load(running.source, running.instance)
    if new.engine.python != running.engine.python:
        # Asking a new python for its vLLM version can take seconds, and the loop
        # must keep its watchdog pings: switching engines is a daemon restart.
        raise ConfigError(new.source, "engine.python", "a reload cannot switch the engine's python",
                          "restart the daemon (systemctl restart r3090d) to switch engines")  # fmt: skip
    version = engine_version or argvmod.engine_version(new.engine.python)
    return new, argvmod.build_argv(new, version)


def reload_error(exc: Exception) -> str:
    """One line for any failure of a reload, expected or not."""
    if isinstance(exc, ConfigError):
        return exc.one_line()
    if isinstance(exc, argvmod.EngineNotInstalled):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
