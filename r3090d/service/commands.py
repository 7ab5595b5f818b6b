"""What the control plane asks of the loop, and what a reload loads.

The control server validates each request (control.validate) in its own thread
and queues it; the loop answers it here, between ticks, so that every change of
state happens in one thread. Requests that change the policy's state (restart,
maintenance, silence) are not applied here: they wait in `Pending` and go
through decide() with the next snapshot, on the policy's own clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.config import Config, ConfigError
from r3090d.core.vocabulary import Phase, RestartKind


@dataclass
class Pending:
    """Requests for the next snapshot; taken (and cleared) once per tick."""

    restart: RestartKind | None = None
    maintenance: bool | None = None
    silences: list[tuple[str, float]] = field(default_factory=list)

    def take(self) -> tuple[RestartKind | None, bool | None, tuple[tuple[str, float], ...]]:
        taken = (self.restart, self.maintenance, tuple(self.silences))
        self.restart, self.maintenance, self.silences = None, None, []
        return taken


def answer(request: dict, pending: Pending, *, phase: Phase, generation: int, exit_on_give_up: bool) -> dict:
    """The reply to an already validated request other than status and reload; records what decide() must do."""
    cmd = request["cmd"]
    if cmd == "restart":
        if phase is Phase.GIVEN_UP and not exit_on_give_up:
            pending.restart = RestartKind.FAST  # nothing is serving: nothing to drain
            return {"ok": True, "message": "starting the engine again after the give-up, from zero failures", "generation": generation}
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
