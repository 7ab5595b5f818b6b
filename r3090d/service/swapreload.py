"""A reload in swap mode (r3090ctl reload, SIGHUP): per model where it can be, refused in one line where the change
needs a daemon restart.

What the daemon set up once at its start cannot change under it: the models' names and order (each engine's port and
state directory follow them), the router's address and its own settings, the engine's python, the daemon's
directories and exporter, the GPU it watches. A change there refuses the whole reload, naming the key; the running
config stays. Everything else is applied: the watchdog, alerts, canary and suspend settings to every engine and the
card, the arbiter's limits, and each [[models]] entry to its own engine. An engine whose settings changed restarts
(drained) if it is ready on the card; one that is cold takes them when the arbiter brings it in, and one parked,
starting, given up or lent takes them when it next starts (as in single mode): nothing is started off the card here.
"""

from __future__ import annotations

import dataclasses
import logging

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.config import Config, ConfigError
from r3090d.config.models import engine_configs
from r3090d.core.arbiter import Residency
from r3090d.core.vocabulary import Phase, RestartKind
from r3090d.service import commands
from r3090d.service.fleet import residency, unit_config

log = logging.getLogger("r3090d")

RESTART = "systemctl restart r3090d"
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


def reload(daemon) -> tuple[str, str]:
    """SwapDaemon.reload: apply a new config file to the daemon and its engines (in its loop), or refuse it and
    change nothing. ("ok" | "error", one line.)"""
    try:
        new = configmod.load(daemon.cfg.source, daemon.cfg.instance)
        keys = needs_daemon_restart(daemon.cfg, new)
        if keys:
            raise ConfigError(new.source, keys[0].split(" ")[0], f"{', '.join(keys)} changed, which a reload cannot apply in swap mode",
                              f"{RESTART} to apply it")  # fmt: skip
        running = daemon.fleet.units
        units = {name: _unit_config(new, ucfg, running[name].cfg) for name, ucfg in engine_configs(new).items()}
        argvs = {name: argvmod.build_argv(ucfg, daemon.engine_version) for name, ucfg in units.items()}
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
    outcomes = [_apply(daemon, name, units[name], argvs[name]) for name in daemon.fleet.units]
    changed = [text for text in outcomes if text]
    text = f"applied ({applied}); " + "; ".join(changed) if changed else f"applied without an engine restart ({applied})"
    log.info("reload: %s", text)
    return "ok", text


def _unit_config(new: Config, ucfg: Config, running: Config) -> Config:
    """The model's engine config as swap mode runs it; an engine without a key of its own keeps the one it runs with
    (a new generated key would be a change of settings at every reload)."""
    out = unit_config(new, ucfg)
    return out if ucfg.api_key else dataclasses.replace(out, api_key=running.api_key)


def _apply(daemon, name: str, ucfg: Config, argv: list[str]) -> str:
    """Give one engine its new settings; what became of a changed one, in words ("" when nothing changed)."""
    unit = daemon.fleet.units[name]
    changed = argv != unit.argv or ucfg.engine.env != unit.cfg.engine.env or ucfg.api_key != unit.cfg.api_key
    unit.cfg, unit.argv = ucfg, argv
    unit.sampler.configure(ucfg)
    unit.suspend.cfg = ucfg
    if not changed:
        return ""
    phase, where = unit.st.phase, residency(unit.st)
    if phase is Phase.READY and daemon.fleet.card.reset_hold is None:
        unit.pending.restart = RestartKind.CONFIG  # on the card already: restarted in place, drained, as in single mode
        return f"{name}: settings changed, drained restart"
    if where is Residency.COLD:
        return f"{name}: settings changed, taken when it is next brought in"
    return f"{name}: settings changed, taken when it next starts ({phase.value} now)"
