"""The daemon in swap mode: the process's part (signals, control plane, preflight, alerts, NVML, the
state file) as for one engine; the engines, the card, the arbiter and the router in a Fleet.

Control requests name their model (`"model"`); with one model configured the name may be left
out. `swap` brings a model in by hand: it counts as a request waiting for it, in its turn.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from r3090d.core.actions import SaveSuspension
from r3090d.core.card import card_alerts
from r3090d.core.vocabulary import Phase
from r3090d.effectors.alertmanager_payload import model_key
from r3090d.service import commands, resethold, swapreload
from r3090d.service.daemon import STARTING_POLL_S, Daemon, collect_garbage
from r3090d.service.fleet import Fleet
from r3090d.service.report import status_line
from r3090d.service.state import carried_over
from r3090d.service.statedoc import FiringAlert

log = logging.getLogger("r3090d")


class SwapDaemon(Daemon):
    def make_engines(self, gpu_monitor):
        self.fleet = Fleet(self.cfg, self.wake, gpu_monitor=gpu_monitor, engine_version=self.engine_version)
        return None

    def kept_pids(self) -> tuple[int, ...]:
        return self.fleet.pids()

    # ------------------------------------------------------------------ before and after the loop

    def boot(self) -> int | None:
        for unit in self.fleet.units.values():
            suspended = unit.suspend.boot_state(self.offset)  # its engine did not outlive the earlier daemon
            if suspended is None:
                continue
            if suspended.suspension.parked:
                unit.suspend.execute(SaveSuspension(None), unit.engine.sample(), unit.sampler)  # parked is the arbiter's: cold now
            else:
                unit.st = suspended  # the operator lent the GPU: it stays lent until r3090ctl resume --model
        code = self.preflight_or_skip()
        if code is not None:
            return code
        # As in single mode, each engine goes on from its predecessor's alerts and restarts (each model's in its own
        # state directory), and the card from its alerts (in the state file, which preflight keeps them in).
        for unit in self.fleet.units.values():
            unit.carry_on(self.offset)
        card_book, _ = carried_over(self.state_path, self.offset)
        self.fleet.card = dataclasses.replace(self.fleet.card, alerts=card_alerts(card_book), reset_hold=self.load_reset_hold())
        return None

    def start_loop(self) -> None:
        self.fleet.start()

    def stop_engines(self) -> None:
        self.fleet.close()

    # ------------------------------------------------------------------ the loop

    def tick(self) -> int | None:
        tick_start = time.monotonic()
        old = {name: unit.st.phase for name, unit in self.fleet.units.items()}
        old_hold = self.fleet.card.reset_hold
        gpu_name = self.gpu_identity[0] if self.gpu_identity else None
        code = self.fleet.tick(shutdown=self.shutdown, alerts=self.alerts, gpu_name=gpu_name)
        for unit in self.fleet.units.values():
            unit.hand_on(self.offset)
        first = next(iter(self.fleet.snaps.values()))
        if first.gpu.usable:
            self.gpu_identity = (first.gpu.name, first.gpu.index, first.gpu.uuid)
            if self.alerts is not None:
                self.alerts.set_gpu(*self.gpu_identity)
        if self.fleet.card.reset_hold != old_hold:
            resethold.save(self.state_dir, self.fleet.card.reset_hold, boot=self.boot_id)
        if self.alerts is not None:
            self.alerts.sync(self.firing(), wall_offset=self.offset)
        ready = False
        for name, unit in self.fleet.units.items():
            snap = self.fleet.snaps[name]
            ready |= unit.log_transitions(old[name], snap, status_line(unit.st, snap))
        if ready:
            collect_garbage()
        self.publish(time.monotonic() - tick_start)
        return code

    def firing(self) -> dict:
        firing = dict(self.fleet.card.alerts.firing())
        for name, unit in self.fleet.units.items():
            firing.update({model_key(key, name): entry for key, entry in unit.st.alerts.firing().items()})
        return firing

    def publish(self, tick_s: float) -> None:
        phases = [u.st.phase for u in self.fleet.units.values()]
        status = self.fleet.status_line()
        busy = self.shutdown or self.fleet.swapping
        # Up once the router serves or queues: a cold or parked model is not an outage.
        active = self.fleet.router.sample().alive or any(p is Phase.READY for p in phases)
        self.notifier.tick(status, active=active, busy=busy)
        self.tick_stats.observe(tick_s)
        firing = {k: FiringAlert(e.severity, e.summary, e.since + self.offset) for k, e in self.firing().items()}
        doc = self.fleet.document(self.cfg, identity=self.identity, offset=self.offset, written_at=time.time(), tick_s=tick_s,
                                  preflight=self.preflight_summary, telemetry=self.tick_stats.to_json(), firing=firing).to_json()  # fmt: skip
        self.latest_doc = doc
        self.write_doc(doc)

    def tick_interval(self) -> float:
        interval = self.fleet.tick_interval(self.cfg.watchdog.poll_interval)
        if any(u.st.phase is Phase.STARTING for u in self.fleet.units.values()):
            interval = min(interval, STARTING_POLL_S)
        if self.notifier.watchdog_interval_s:
            interval = min(interval, self.notifier.watchdog_interval_s / 2)
        return interval

    # ------------------------------------------------------------------ control

    def reload(self) -> tuple[str, str]:
        return swapreload.reload(self)

    def control(self, request: dict) -> dict:
        cmd = request.get("cmd")
        if cmd == "reload":
            status, text = self.reload()
            return {"ok": status == "ok", "message" if status == "ok" else "error": text}
        if cmd == "silence":
            # An engine's alert is keyed KEY:MODEL outside it (Fleet labels them); its own book knows KEY.
            key, _, model = request["alert"].partition(":")
            for name, unit in self.fleet.units.items():
                if not model or model == name:
                    commands.answer({**request, "alert": key}, unit.pending, phase=unit.st.phase, generation=0, exit_on_give_up=False)
            return {"ok": True, "message": f"{request['alert']} silenced for {request['seconds']:.0f} s"}
        if cmd == "maintenance":
            for unit in self.fleet.units.values():
                commands.answer(request, unit.pending, phase=unit.st.phase, generation=0, exit_on_give_up=False)
            return {"ok": True, "message": f"maintenance {'on' if request['on'] else 'off'} for every model"}
        name = request.get("model")
        if name is None and len(self.fleet.units) == 1:
            name = next(iter(self.fleet.units))
        unit = self.fleet.unit(name)
        if unit is None:
            known = ", ".join(self.fleet.units)
            what = f"no model {name!r}" if name is not None else "which model? this daemon serves several"
            return {"ok": False, "error": f"{what}: give --model NAME, one of: {known}"}
        if cmd == "swap":
            return self.fleet.bring_in(name)
        if cmd == "restart":
            reply = self.fleet.restart(name)
            if reply is not None:
                return reply
        if cmd in ("suspend", "resume"):
            request = {k: v for k, v in request.items() if k != "model"}
            return commands.answer_suspend(request, unit.pending, unit.cfg, phase=unit.st.phase, suspended=unit.st.suspension,
                                           snap=unit.last_snap)  # fmt: skip
        return commands.answer(request, unit.pending, phase=unit.st.phase, generation=unit.engine.sample().generation, exit_on_give_up=False)
