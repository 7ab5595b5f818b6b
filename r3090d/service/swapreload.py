"""A reload in swap mode (r3090ctl reload, SIGHUP): per model where it can be, refused in one line where the change
needs a daemon restart.

What the daemon set up once at its start cannot change under it: the models' names and order (each engine's port and
state directory follow them), the router's address and its own settings, the engine's python, the daemon's
directories and exporter, the GPU it watches. A change there refuses the whole reload, naming the key; the running
config stays. Everything else is applied: the watchdog, alerts, canary and suspend settings to every engine and the
card, the arbiter's limits, and each [[models]] entry to its own engine. An engine whose settings changed restarts
(drained) if it is ready on the card; a parked one is stopped (it would come back with its old settings); one that is
cold takes them when the arbiter brings it in, and one starting, given up, lent by the operator, holding frozen
requests or in a swap takes them when it next starts (as in single mode). Nothing is started off the card here:
the arbiter brings a stopped engine in when its model is asked for.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.config import Config, ConfigError
from r3090d.config.models import engine_configs
from r3090d.core.arbiter import Residency
from r3090d.core.suspension import Stage
from r3090d.core.vocabulary import Phase, RestartKind
from r3090d.service import commands
from r3090d.service.fleet import residency, unit_config

log = logging.getLogger("r3090d")

RESTART = "systemctl restart r3090d"
STOPPED_FOR_RELOAD = "stopped to cold by a reload: its settings changed"
ROUTER_KEYS = ("queue_timeout", "max_body_mib", "api_key_file", "engine_port_base")  # swap.*: the router's, set at its start


def needs_daemon_restart(old: Config, new: Config) -> list[str]:
    """The keys whose change a reload cannot apply in swap mode (empty: it can apply them all)."""
    keys = []
    if not new.models:
        keys.append("models (none left: leaving swap mode)")
    elif [m.name for m in old.models] != [m.name for m in new.models]:
        keys.append("models (names or order: each engine's port and state directory follow them)")
    keys += [f"engine.{k}" for k in ("host", "port", "python") if getattr(old.engine, k) != getattr(new.engine, k)]
    keys += [f"swap.{k}" for k in ROUTER_KEYS if getattr(old.swap, k) != getattr(new.swap, k)]
    if old.api_key != new.api_key and old.swap.api_key_file == new.swap.api_key_file:
        keys.append("swap.api_key_file (the key in it)")
    for section in ("daemon", "gpu"):
        before, after = getattr(old, section), getattr(new, section)
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)]
    return keys


@dataclass(frozen=True)
class EngineChange:
    """One engine's part of an accepted reload."""

    cfg: Config
    argv: list[str]
    restart: bool = False  # restarted now, drained, in place on the card
    stop_cold: bool = False  # parked: stopped now, cold-started with its new settings when the arbiter brings it in
    text: str = ""  # what becomes of its changed settings; "" when nothing changed


def reload(daemon) -> tuple[str, str]:
    """SwapDaemon.reload: apply a new config file to the daemon and its engines (in its loop), or refuse it and
    change nothing. ("ok" | "error", one line.)"""
    try:
        new = configmod.load(daemon.cfg.source, daemon.cfg.instance)
        keys = needs_daemon_restart(daemon.cfg, new)
        if keys:
            key, _, why = keys[0].partition(" ")
            also = f", and so did {', '.join(keys[1:])}" if keys[1:] else ""
            raise ConfigError(new.source, key, f"changed{' ' + why if why else ''}{also}: a reload cannot apply that in swap mode",
                              f"{RESTART} to apply it")  # fmt: skip
        changes = {name: _change(daemon, new, index, name, ucfg) for index, (name, ucfg) in enumerate(engine_configs(new).items())}
    except Exception as exc:  # any failure, even one nobody foresaw, must leave the engines running
        text = commands.reload_error(exc)
        log.error("reload refused, keeping the running config: %s", text)
        return "error", f"refused, the running config stays: {text}"
    old = daemon.cfg
    daemon.cfg = daemon.fleet.cfg = new
    for warning in new.warnings:
        log.warning("%s", warning)
    applied = "watchdog settings"
    if new.alerts != old.alerts and daemon.alerts is not None:
        commands.replace_alert_dispatcher(daemon, new)
        applied = "watchdog and alert settings"
    for name, change in changes.items():
        unit = daemon.fleet.units[name]
        unit.cfg, unit.argv = change.cfg, change.argv
        unit.sampler.configure(change.cfg)
        unit.suspend.cfg = change.cfg
        if change.restart:
            unit.pending.restart = RestartKind.CONFIG  # on the card already: restarted in place, drained, as in single mode
        if change.stop_cold:
            unit.pending.stop_cold = STOPPED_FOR_RELOAD
    changed = [c.text for c in changes.values() if c.text]
    text = f"applied ({applied}); " + "; ".join(changed) if changed else f"applied without an engine restart ({applied})"
    log.info("reload: %s", text)
    return "ok", text


def _change(daemon, new: Config, index: int, name: str, ucfg: Config) -> EngineChange:
    """What the reload does to one model's engine; raises ConfigError when its running engine cannot take it."""
    unit, rec, fleet = daemon.fleet.units[name], daemon.fleet.models[name], daemon.fleet
    cfg = unit_config(new, ucfg)
    if not ucfg.api_key:  # no key of its own: it keeps the generated one it runs with (a new one would be a change)
        cfg = dataclasses.replace(cfg, api_key=unit.cfg.api_key)
    argv = argvmod.build_argv(cfg, daemon.engine_version)
    key_changed = cfg.api_key != unit.cfg.api_key
    if argv == unit.argv and cfg.engine.env == unit.cfg.engine.env and not key_changed:
        return EngineChange(cfg, argv)
    phase = unit.st.phase
    # In the middle of a swap, or with the card held for a reset, the engine is left to the arbiter as it is.
    moving = fleet.swapping or rec.closing or rec.leave_decided or rec.park_request is not None
    if phase is Phase.READY and not moving and fleet.card.reset_hold is None:
        return EngineChange(cfg, argv, restart=True, text=f"{name}: settings changed, drained restart")
    parked = unit.st.suspension
    if parked is not None and parked.parked and parked.stage is Stage.SUSPENDED and not parked.frozen_requests and not moving:
        # Resumed, it would come back with its old settings; stopped, the arbiter cold-starts it when it is asked for.
        return EngineChange(cfg, argv, stop_cold=True, text=f"{name}: settings changed, its parked engine stopped (cold-started with them "
                                                            "when next brought in)")  # fmt: skip
    if key_changed and unit.engine.sample().alive:
        # The router would send the new key to the engine that still runs with the old one.
        raise ConfigError(new.source, f"models[{index}].api_key_file", f"the key changed while {name}'s engine runs ({phase.value})",
                          f"reload again once {name} is ready or cold, or {RESTART}")  # fmt: skip
    if residency(unit.st) is Residency.COLD:
        return EngineChange(cfg, argv, text=f"{name}: settings changed, taken when it is next brought in")
    return EngineChange(cfg, argv, text=f"{name}: settings changed, taken when it next starts ({phase.value} now)")
