"""Swap mode: several models on one card, one engine each, one public endpoint.

Each model's engine is an EngineUnit going through today's policy on its own, with
`card=False`: the card itself (XIDs, the reset hold, the GPU's alerts) is judged once per
tick by core.card, and its reset hold handed to every engine. The arbiter
(core.arbiter) decides which engines are resident from what the units say of
themselves and what the router says of its queues; its moves reach each engine's
policy the way an operator's requests do (Pending: a park is a suspend that is not the
operator's, an unpark a resume, a cold start, a drained stop to cold).

The router (r3090d.router, its own process) holds the public port. It learns each
model's state from the table this module publishes on the link at every change, in
the tick the change happens; it reports its queues back, which wakes the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from dataclasses import dataclass

from r3090d import argv as argvmod
from r3090d import exitcodes
from r3090d.config import Config
from r3090d.config.models import engine_configs
from r3090d.config.schema import ParkMode
from r3090d.core import arbiter, policy, suspension
from r3090d.core.actions import Exit, SendAlert
from r3090d.core.arbiter import ArbiterConfig, Close, ColdStart, EngineView, Park, Residency, StopCold, Unpark
from r3090d.core.card import CardState, cleared, decide_card
from r3090d.core.hostmemory import ESTIMATED_BASE_RSS_MIB
from r3090d.core.snapshot import Snapshot
from r3090d.core.suspension import Result
from r3090d.core.vocabulary import Phase, RestartKind
from r3090d.effectors import alertformat
from r3090d.effectors.alertmanager_payload import model_key
from r3090d.effectors.routerproc import RouterProcess, router_argv, router_env
from r3090d.probes.hostmem import read_host_memory
from r3090d.router.link import UNIX_PREFIX, EngineState, ModelDemand, ModelEntry, ModelKind, Table
from r3090d.service.report import book_info, model_doc, report, swap_document
from r3090d.service.routerlink import LinkServer
from r3090d.service.statedoc import HealingInfo, ModelFleetState, RouterInfo, StateDocument, SwapInfo
from r3090d.service.swaps import SwapTracker
from r3090d.service.unit import EngineUnit
from r3090d.units import MIB

log = logging.getLogger("r3090d")

SWAP_POLL_S = 0.1  # the loop's interval while a swap is under way: each stage is timed, and routed at once
HOST_MEMORY_EVERY_S = 5.0  # how often the automatic host-memory budget is read again
UNPARK_RETRY_S = 5.0  # a resume refused for room is asked again after this, not at every tick
SLEEP_FAILURES_OFF = 2  # parks or wakes by sleep failed in a row before the model is parked as park = "auto"

# Phases of an engine's policy as the arbiter sees them.
_RESIDENCY = {
    Phase.COLD: Residency.COLD,
    Phase.STOPPED: Residency.COLD,
    Phase.STARTING: Residency.STARTING,
    Phase.WAITING_FOR_GPU: Residency.WAITING,
    Phase.RESTARTING: Residency.STARTING,
    Phase.BACKOFF: Residency.STARTING,
    Phase.READY: Residency.READY,
    Phase.SUSPENDING: Residency.PARKING,
    Phase.SUSPENDED: Residency.PARKED,
    Phase.RESUMING: Residency.RESUMING,
    Phase.GIVEN_UP: Residency.FAILED,
    Phase.RESET_NEEDED: Residency.FAILED,
    Phase.SHUTTING_DOWN: Residency.STOPPING,
}


def residency(st: policy.PolicyState) -> Residency:
    if st.phase is Phase.DRAINING:
        return Residency.STOPPING if st.cold_after else Residency.STARTING  # a drained restart comes back by itself
    return _RESIDENCY.get(st.phase, Residency.STARTING)


@dataclass
class ModelRecord:
    """What the fleet knows of one model beyond its engine's policy state, in one place: a combination that would
    hold the model (or the card) for ever shows here, and in `r3090ctl status --model NAME`."""

    gpu_mib: int = 0  # its engine's GPU memory, last seen ready: its cost when parked
    no_checkpoint: bool = False  # its park was undone by the driver, or cannot be done: stopped drained from now on
    sleep_failures: int = 0  # its parks or wakes by sleep that failed in a row (a wrong answer after a wake counts)
    sleep_off: bool = False  # SLEEP_FAILURES_OFF in a row: parked as park = "auto" until a daemon restart or restart --model
    park_request: int | None = None  # the number of the park or unpark asked of its engine, until the engine answers it
    unpark_retry_at: float | None = None  # a resume refused for room: not asked again before then
    wanted_at: float | None = None  # brought in by hand (r3090ctl swap or restart): a waiting request, until ready
    closing: bool = False  # the current plan closes it: the router sends it nothing new; stopped once nothing runs
    leave_decided: bool = False  # a park or stop decided and not yet taken up by its policy: unroutable meanwhile
    coming: bool = False  # on its way in by the arbiter's move: counted as swapped in once ready
    leaving: bool = False  # on its way out by the arbiter's move: counted as swapped out once parked or cold
    ready_at: float | None = None  # when it was first seen ready
    ready_canary_errors: int = 0  # its canary's errors then: its first canary has had its chance once they grow
    swaps_in: int = 0
    swaps_out: int = 0
    exited: bool = False  # shutting down: its engine is gone

    def state(self, now: float) -> ModelFleetState:
        """What an operator reads of it (status --model, --json)."""
        retry = self.unpark_retry_at
        return ModelFleetState(
            closing=self.closing, leave_decided=self.leave_decided, coming=self.coming, leaving=self.leaving,
            wanted=self.wanted_at is not None, park_request=self.park_request,
            unpark_retry_in=round(retry - now, 1) if retry is not None and retry > now else None, no_checkpoint=self.no_checkpoint,
            sleep_failures=self.sleep_failures, sleep_off=self.sleep_off,
        )  # fmt: skip


def unit_config(cfg: Config, ucfg: Config) -> Config:
    """A model's engine config as swap mode runs it: the swap's drain, never the daemon's exit on one give-up,
    and an API key of its own (generated when the model has none), so that only the router and the daemon
    can use its /v1 routes."""
    return dataclasses.replace(
        ucfg,
        suspend=dataclasses.replace(ucfg.suspend, drain_timeout=cfg.swap.drain_timeout),
        daemon=dataclasses.replace(ucfg.daemon, exit_on_give_up=False),
        api_key=ucfg.api_key or secrets.token_urlsafe(32),
    )


class Fleet:
    def __init__(self, cfg: Config, wake, *, gpu_monitor=None, engine_version=None, units=None, link=None, router=None,
                 clock=time.monotonic):  # fmt: skip
        """`units`, `link`, `router` and `clock` are the real ones unless given: the liveness test runs the fleet's
        whole logic over simulated engines, router and time (tests/fleetsim.py)."""
        self.cfg = cfg
        self.wake = wake
        self.clock = clock
        if units is None:
            units = {}
            for name, ucfg in engine_configs(cfg).items():
                ucfg = unit_config(cfg, ucfg)
                argv = argvmod.build_argv(ucfg, engine_version)
                units[name] = EngineUnit(ucfg, argv, wake, gpu_monitor=gpu_monitor, engine_version=engine_version, name=name, cold=True)
        self.units: dict[str, EngineUnit] = units
        self.card = CardState()
        self.link = link if link is not None else LinkServer(cfg.daemon.runtime_dir, wake, router_pid=lambda: self.router.running_pid())
        self.router = router if router is not None else RouterProcess(
            router_argv(cfg.engine.host, cfg.engine.port, str(self.link.path), cfg.swap.queue_timeout, cfg.swap.max_body_mib * MIB,
                        cfg.swap.api_key_file),
            router_env(dict(os.environ)), wake,
        )  # fmt: skip
        self.swaps = SwapTracker()
        self.snaps: dict[str, Snapshot] = {}
        self.models: dict[str, ModelRecord] = {name: ModelRecord() for name in self.units}
        self.plan = arbiter.Plan()
        self.budget_mib = cfg.swap.host_memory_budget_mib or None
        self._budget_read_at = -HOST_MEMORY_EVERY_S
        self.seq = 0
        self.table: Table | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.link.start()
        self.router.keep_running(self.clock())

    def close(self) -> None:
        """The router last: the streams it holds toward draining engines end with them."""
        for unit in self.units.values():
            unit.kill_if_running()
        self.router.stop()
        self.link.close()

    @property
    def swapping(self) -> bool:
        return self.swaps.current is not None

    # ------------------------------------------------------------------ one tick

    def tick(self, *, shutdown: bool, alerts, gpu_name: str | None) -> int | None:
        now = self.clock()
        if not shutdown:
            self.router.keep_running(now)
        self.snaps = {name: unit.snapshot(shutdown=shutdown) for name, unit in self.units.items()}
        first = next(iter(self.snaps.values()))
        if self.card.reset_hold is not None and any(s.restart_requested is not None for s in self.snaps.values()):
            log.warning("the GPU reset hold is cleared by the operator (r3090ctl restart)")
            self.card = cleared(self.card)
        serving = any(u.st.phase is Phase.READY for u in self.units.values())
        card_actions, self.card = decide_card(first, self.card, self.cfg, now, serving=serving)
        for action in card_actions:
            self._alert(action, alerts)
        for name, unit in self.units.items():
            snap, rec = self.snaps[name], self.models[name]
            was_ready = unit.st.phase is Phase.READY
            actions, unit.st = policy.decide(snap, dataclasses.replace(unit.st, reset_hold=self.card.reset_hold), unit.cfg, now, card=False,
                                             arbitrated=True)  # fmt: skip
            actions = [self._labelled(a, name) if isinstance(a, SendAlert) else a for a in actions]
            code = unit.execute([a for a in actions if not isinstance(a, Exit)], snap, alerts=alerts, gpu_name=gpu_name)
            if any(isinstance(a, Exit) for a in actions) or code is not None:
                rec.exited = True
            rec.leave_decided = False  # its policy has taken the park or stop up (or refused it: routable again)
            self._remember_gpu(rec, unit, snap)
            if unit.st.phase is not Phase.READY:
                rec.closing = False
                rec.ready_at = None
            elif not was_ready:
                rec.ready_at, rec.ready_canary_errors = now, unit.st.canary.errors
            self._count_swaps(rec, residency(unit.st))
        if shutdown:
            self._publish(now)
            return exitcodes.OK if all(rec.exited for rec in self.models.values()) else None
        # A swap whose target has just become ready ends before the next one can begin in this tick.
        decided_at = self.clock()
        routable = {n for n, u in self.units.items() if self.routable(n, u, now)}
        ended = self.swaps.observe(self.units, decided_at, routable=routable, closing={n for n, r in self.models.items() if r.closing})
        self._arbitrate(now)
        self._abandon_unwanted_swap(now)
        self._publish(now)
        if ended:
            self.swaps.routed(self.clock() - decided_at)  # the table with the target routable has gone out
        return None

    def _alert(self, action: SendAlert, alerts) -> None:
        log.log(alertformat.log_level(action), "alert %s %s: %s", action.key, action.state, action.summary)
        if alerts is not None:
            alerts.submit(action)

    @staticmethod
    def _labelled(action: SendAlert, name: str) -> SendAlert:
        """An engine's alert names its model: two models' `dead` alerts are two alerts."""
        return dataclasses.replace(action, key=model_key(action.key, name), summary=f"{name}: {action.summary}")

    @staticmethod
    def _count_swaps(rec: ModelRecord, where: Residency) -> None:
        """Counted once it gets there: a refused park or resume asked again is one swap, not two."""
        if rec.coming and where in (Residency.READY, Residency.FAILED, Residency.COLD):
            rec.coming = False  # cold again: its start gave its place up, or it died on the way
            rec.swaps_in += where is Residency.READY
        if rec.leaving and where in (Residency.PARKED, Residency.COLD, Residency.FAILED):
            rec.leaving = False
            rec.swaps_out += where is not Residency.FAILED
        elif rec.leaving and where is Residency.READY and not rec.closing:
            rec.leaving = False  # its park was refused, or the plan no longer closes it: it stays

    @staticmethod
    def _remember_gpu(rec: ModelRecord, unit: EngineUnit, snap: Snapshot) -> None:
        processes = snap.gpu.processes if snap.gpu.usable else None
        if unit.st.phase is Phase.READY and processes:
            tree = set(snap.child.tree_pids) | ({snap.child.pid} if snap.child.pid else set())
            held = sum(p.used_bytes or 0 for p in processes if p.pid in tree)
            if held:
                rec.gpu_mib = held // MIB

    # ------------------------------------------------------------------ the arbiter

    def _host_budget(self, now: float, parked_mib: int) -> int:
        if self.cfg.swap.host_memory_budget_mib:
            return self.cfg.swap.host_memory_budget_mib
        if self.budget_mib is None or now - self._budget_read_at >= HOST_MEMORY_EVERY_S:
            self._budget_read_at = now
            self.budget_mib = read_host_memory().budget_mib(self.cfg.swap.host_memory_margin_mib, held_by_parked_mib=parked_mib)
        return self.budget_mib

    def views(self, now: float) -> tuple[EngineView, ...]:
        demand = self.link.latest().models
        out = []
        for name, unit in self.units.items():
            st, snap, rec = unit.st, self.snaps.get(name), self.models[name]
            d = demand.get(name)
            where = residency(st)
            if rec.wanted_at is not None and (self.routable(name, unit, now) or (where is Residency.FAILED and st.phase_since >= rec.wanted_at)):
                rec.wanted_at = None  # routed (its first canary answered); or it failed after it was asked for (a restart asks again)
            if rec.wanted_at is not None:
                oldest = min(t for t in (rec.wanted_at, d.oldest_waiting_at if d else None) if t is not None)
                d = ModelDemand(max(1, d.waiting if d else 0), oldest, d.inflight if d else 0, d.last_used_at if d else None)
            s = st.suspension
            cold_parked = where is Residency.PARKED and s is not None and s.cold
            gpu_mib = (s.bytes // MIB if s is not None and s.bytes else rec.gpu_mib) if not cold_parked else 0
            out.append(EngineView(
                name=name,
                residency=where,
                gpu_mib=gpu_mib,
                base_rss_mib=0 if cold_parked else ESTIMATED_BASE_RSS_MIB,
                inflight=d.inflight if d else 0,
                waiting=d.waiting if d else 0,
                oldest_waiting_at=d.oldest_waiting_at if d else None,
                last_used_at=d.last_used_at if d else None,
                resident_since=st.ready_since if where is Residency.READY else None,
                parked_at=(s.since if s is not None else None) if where is Residency.PARKED else None,
                can_checkpoint=self._can_checkpoint(name, unit, snap),
                failed=where is Residency.FAILED,
            ))  # fmt: skip
        return tuple(out)

    def parks_by_sleep(self, name: str) -> bool:
        """Its park = "sleep", and sleep has not failed SLEEP_FAILURES_OFF times in a row."""
        return self.units[name].cfg.park_mode is ParkMode.SLEEP and not self.models[name].sleep_off

    def _can_checkpoint(self, name: str, unit: EngineUnit, snap: Snapshot | None) -> bool:
        """Whether it can be parked (by checkpoint, or by sleep), or must be stopped drained to leave the card."""
        if unit.cfg.park_mode is ParkMode.STOP:
            return False
        if self.parks_by_sleep(name):
            return True  # no checkpoint driver needed: vLLM keeps its weights in pinned host memory
        if self.models[name].no_checkpoint or not unit.cfg.gpu.required:
            return False
        if snap is None or unit.st.phase is not Phase.READY:
            return True
        refusal = suspension.suspend_refusal(unit.cfg, Phase.READY, snap)
        return refusal is None or not refusal.unavailable

    def _arbitrate(self, now: float) -> None:
        self._learn_from_parks(now)
        lent = [name for name, u in self.units.items() if u.st.suspension is not None and not u.st.suspension.parked]
        if lent:
            # The operator lent the GPU (r3090ctl suspend --model): nothing comes onto it until they resume.
            why = f"the GPU is lent ({', '.join(lent)} suspended by the operator): no swap until r3090ctl resume --model {lent[0]}"
            if why != self.plan.why:
                log.warning("swap: %s", why)
            self.plan = arbiter.Plan(why=why)
            return
        views = self.views(now)
        parked = sum(v.parked_cost_mib for v in views if v.residency in arbiter.IN_HOST_MEMORY)
        cfg = ArbiterConfig(self.cfg.swap.max_resident, self.cfg.swap.min_residency, self._host_budget(now, parked))
        plan = arbiter.plan(views, cfg, now)
        if plan.moves and plan.why != self.plan.why:
            log.info("swap: %s", plan.why)
        self.plan = plan
        self._reclose(plan)
        by_name = {v.name: v for v in views}
        asked = [self._request(move, by_name[move.name], now) for move in plan.moves]
        if any(asked):
            self.wake.set()  # the next tick takes the request up now, not a poll later

    def _reclose(self, plan: arbiter.Plan) -> None:
        """Closing is the current plan's decision, made again at every plan: an engine the plan no longer closes
        (the target's requests left, or came after the closed engine's own) is routable again."""
        closed = {m.name for m in plan.moves if isinstance(m, Close | StopCold)}  # a stop ends the close
        for name, rec in self.models.items():
            if rec.closing and name not in closed:
                rec.closing = False
                rec.leaving = False
                log.info("swap: %s is routable again: the plan no longer closes it (%s)", name, plan.why)

    def _abandon_unwanted_swap(self, now: float) -> None:
        """A swap whose target is out of the GPU, or leaving it, and no longer the plan's target (its requests left
        before it was routed) ends as abandoned: the next target begins a swap of its own."""
        s = self.swaps.current
        if s is None or s.to_model is None or s.to_model == self.plan.target:
            return
        unit = self.units.get(s.to_model)
        if unit is None or residency(unit.st) in (Residency.COLD, Residency.PARKED, Residency.PARKING, Residency.STOPPING):
            self.swaps.abandon(now, f"{s.to_model} is no longer asked for ({self.plan.why})")

    def _learn_from_parks(self, now: float) -> None:
        """A park the driver undid (kept_running) or cannot do (unavailable): that engine is stopped drained from now on.
        A resume refused (the card has no room yet: someone else took it) is asked again after UNPARK_RETRY_S."""
        for name, unit in self.units.items():
            rec = self.models[name]
            last, request = unit.st.suspend_last, rec.park_request
            if request is None:
                continue
            if last is None or last.request != request:
                if unit.st.suspension is None and unit.pending.suspend is None and unit.pending.resume is None:
                    # Its policy holds no suspension and has nothing to take up: the request can have no answer
                    # (the engine left its phases some other way). Never let it hold the model's parks for ever.
                    log.warning("swap: %s's %s request %d ended without an answer (%s); it is dropped", name,
                                "park" if residency(unit.st) is not Residency.PARKED else "unpark", request, unit.st.phase.value)  # fmt: skip
                    rec.park_request = None
                continue
            rec.park_request = None
            if last.by_sleep:
                self._count_sleep(name, rec, last)
            if last.op == "resume" and last.result is Result.REFUSED:
                rec.unpark_retry_at = now + UNPARK_RETRY_S
                log.warning("swap: %s cannot come back yet (%s); asked again in %.0f s", name, last.detail, UNPARK_RETRY_S)
            if last.op == "suspend" and last.result in (Result.KEPT_RUNNING, Result.UNAVAILABLE, Result.REFUSED):
                if last.result is not Result.REFUSED:
                    rec.no_checkpoint = True
                log.warning("swap: %s could not be parked (%s: %s); %s", name, last.result.value, last.detail,
                            "it is stopped drained instead" if rec.no_checkpoint else "the arbiter tries again")  # fmt: skip

    @staticmethod
    def _count_sleep(name: str, rec: ModelRecord, last: suspension.SuspendResult) -> None:
        """A park or wake by sleep that failed (it fell back: stopped drained, or restarted cold; or the engine died under
        it, as vLLM's cumem allocator's double free kills it); two in a row and the
        model is parked as park = "auto" from then on. One that worked clears the count."""
        if last.result in (Result.SUSPENDED, Result.RESUMED) and not last.lost:
            rec.sleep_failures = 0
            return
        if last.result is not Result.FAILED and not last.lost:
            return  # refused for room: nothing was tried
        rec.sleep_failures += 1
        what = "park by sleep" if last.op == "suspend" else "wake"
        log.warning("swap: %s's %s failed (%s); %d in a row", name, what, last.detail, rec.sleep_failures)
        if rec.sleep_failures >= SLEEP_FAILURES_OFF and not rec.sleep_off:
            rec.sleep_off = True
            log.warning("swap: %s: sleep failed %d times in a row: it is parked by checkpoint where the card can, else stopped, until the "
                        "daemon restarts or r3090ctl restart --model %s", name, rec.sleep_failures, name)  # fmt: skip

    def _request(self, move, view: EngineView, now: float) -> bool:
        """Hand a move to its engine's policy (once: a move planned again while under way asks nothing new).
        True when something new was asked."""
        unit, rec = self.units[move.name], self.models[move.name]
        pending = unit.pending
        if isinstance(move, Park):
            if pending.suspend is not None or rec.park_request is not None:
                return False
            pending.suspend = rec.park_request = pending.number()
            pending.park = True
            pending.park_by_sleep = self.parks_by_sleep(move.name)
            rec.leaving = rec.leave_decided = True
            self.swaps.begin(self.plan.target, move.name, now, parked=True)
        elif isinstance(move, Unpark):
            if pending.resume is not None or rec.park_request is not None or now < (rec.unpark_retry_at or 0.0):
                return False
            pending.resume = rec.park_request = pending.number()
            rec.coming = True
            self.swaps.begin(move.name, None, now, parked=True, bring_in=True)
        elif isinstance(move, ColdStart):
            if pending.start:
                return False
            pending.start = True
            rec.coming = True
            self.swaps.begin(move.name, None, now, parked=False, bring_in=True)
        elif isinstance(move, Close):
            if rec.closing:
                return False
            rec.closing = rec.leaving = True
            self.swaps.begin(self.plan.target, move.name, now, parked=False)
        elif isinstance(move, StopCold):
            if pending.stop_cold is not None:
                return False
            pending.stop_cold = move.detail or f"stopped to cold ({move.why.value})"
            rec.leave_decided = True
            if move.why not in (arbiter.StopWhy.EVICT, arbiter.StopWhy.YIELD) and not rec.closing:
                rec.leaving = True
                self.swaps.begin(self.plan.target, move.name, now, parked=False)
        return True

    # ------------------------------------------------------------------ the router's table

    def routable(self, name: str, unit: EngineUnit, now: float) -> bool:
        """Ready, not closing, and (a generative engine) its first canary done: a model is served only once it has
        given its known answer (compared with an earlier engine's, where one is on record), or the canary has had
        its chance (an error, or its timeout) and the periodic check takes over."""
        rec = self.models[name]
        if unit.st.phase is not Phase.READY or rec.closing or rec.leave_decided:
            return False  # leaving by the plan's decision: the router holds its requests from that moment on
        cc = unit.cfg.canary
        if not cc.enabled or unit.st.canary.baseline is not None:
            return True
        since = rec.ready_at if rec.ready_at is not None else now
        return unit.st.canary.errors > rec.ready_canary_errors or now - since >= cc.timeout

    def _publish(self, now: float) -> None:
        models = tuple(self._entry(name, unit, self.routable(name, unit, now)) for name, unit in self.units.items())
        if self.table is None or self.table.models != models:
            self.seq += 1
            self.table = Table(self.seq, models)
        self.link.publish(self.table)

    @staticmethod
    def _entry(name: str, unit: EngineUnit, routable: bool) -> ModelEntry:
        st = unit.st
        state = EngineState(residency(st).value)
        return ModelEntry(
            name=name,
            kind=ModelKind(unit.cfg.engine.kind.value),
            state=state,
            routable=routable,
            upstream=f"{UNIX_PREFIX}{os.path.abspath(unit.cfg.engine.uds)}" if unit.cfg.engine.uds else unit.cfg.engine_url,
            upstream_key=unit.cfg.api_key,
            reason=(st.give_up_reason or "") if state is EngineState.FAILED else "",
        )

    # ------------------------------------------------------------------ for the operator

    def bring_in(self, name: str) -> dict:
        """r3090ctl swap NAME: the model counts as asked for, in its turn, until it is ready."""
        unit = self.units[name]
        where = residency(unit.st)
        if where is Residency.READY:
            return {"ok": True, "message": f"{name} is already resident and ready"}
        if where is Residency.FAILED:
            return {"ok": False, "error": f"{name} is {unit.st.phase.value}: r3090ctl restart --model {name} first"}
        rec = self.models[name]
        if rec.wanted_at is None:
            rec.wanted_at = self.clock()
        self.wake.set()
        return {"ok": True, "message": f"accepted: bringing {name} in ({where.value} now)"}

    def restart(self, name: str) -> dict | None:
        """r3090ctl restart --model NAME of an engine that is not on the card: the arbiter brings it in, in its turn
        (a start of its own could find the card held by the resident engine, and wait there for ever). None: the
        engine is on the card, and its own policy takes the restart."""
        unit, rec = self.units[name], self.models[name]
        if rec.sleep_off or rec.sleep_failures:
            log.info("swap: %s's park by sleep is tried again (r3090ctl restart --model)", name)
            rec.sleep_off, rec.sleep_failures = False, 0
        where = residency(unit.st)
        if where is Residency.WAITING:
            held = unit.st.gpu_wait.text() if unit.st.gpu_wait is not None else "memory held outside r3090d"
            return {"ok": True, "message": f"{name} already waits to start: {held}; it starts once they let go"}
        if where is Residency.COLD:
            return self.bring_in(name)
        if where is Residency.FAILED:
            # Its policy leaves it cold and no longer failed (a reset hold cleared, a give-up forgotten); asked for
            # from now on, it comes in in its turn.
            unit.pending.restart = RestartKind.FAST
            if rec.wanted_at is None:
                rec.wanted_at = self.clock()
            self.wake.set()
            return {"ok": True, "message": f"accepted: {name} ({unit.st.phase.value}) is started again through the arbiter, from zero failures"}
        return None

    def status_line(self) -> str:
        """systemd's STATUS=: each model's residency, and the swap under way."""
        models = ", ".join(f"{name} {residency(u.st).value}" for name, u in self.units.items())
        progress = self.swaps.progress()
        return f"{models}; swapping to {progress.to_model} ({progress.stage or 'deciding'})" if progress else models

    def document(self, cfg: Config, *, identity, offset: float, written_at: float, tick_s: float, preflight, telemetry: dict,
                 firing: dict) -> StateDocument:  # fmt: skip
        demand = self.link.latest().models
        models = []
        parked_bytes = 0
        for name, unit in self.units.items():
            snap = self.snaps.get(name)
            if snap is None:
                continue
            engine_doc = report(unit.st, snap, unit.cfg, identity=identity, offset=offset, written_at=written_at, tick_s=tick_s,
                                preflight=None, telemetry={}, suspend=unit.suspend.publish(unit.st, snap, offset))  # fmt: skip
            where = residency(unit.st)
            s = unit.st.suspension
            rec = self.models[name]
            gpu_bytes = s.bytes if s is not None and s.bytes else rec.gpu_mib * MIB
            host_bytes = gpu_bytes + ESTIMATED_BASE_RSS_MIB * MIB if where is Residency.PARKED and not (s and s.cold) else 0
            parked_bytes += host_bytes
            d = demand.get(name)
            last_used = d.last_used_at + offset if d and d.last_used_at is not None else None
            models.append(model_doc(
                name, engine_doc, kind=unit.cfg.engine.kind, residency=where, port=None if unit.cfg.engine.uds else unit.cfg.engine.port,
                last_used=last_used,
                host_bytes=host_bytes, gpu_bytes=gpu_bytes, swaps_in=rec.swaps_in, swaps_out=rec.swaps_out,
                inflight=d.inflight if d else 0, waiting=d.waiting if d else 0, frozen=s.frozen_requests if s else 0,
                fleet=rec.state(self.clock()),
            ))  # fmt: skip
        router = self.router.sample()
        swap = SwapInfo(
            in_progress=self.swaps.progress(), total=self.swaps.total, failed=self.swaps.failed, abandoned=self.swaps.abandoned,
            last=self.swaps.last,
            latency=self.swaps.latency,
            host_budget_bytes=self.budget_mib * MIB if self.budget_mib is not None else None, host_parked_bytes=parked_bytes,
            router=RouterInfo(pid=router.pid, up=router.alive, linked=self.link.linked, restarts=router.restarts,
                              last_restart_at=router.last_restart_at, address=f"{cfg.engine.host}:{cfg.engine.port}"),
            max_resident=cfg.swap.max_resident, queue_timeout=cfg.swap.queue_timeout,
        )  # fmt: skip
        hold = self.card.reset_hold
        healing = HealingInfo(reset_hold=hold.reason if hold else None, reset_hold_since=hold.since_wall if hold else None,
                              xid_by_class={cls.value: n for cls, n in self.card.xid_counts})  # fmt: skip
        first = next(iter(self.snaps.values()), None)
        return swap_document(models, swap, first.gpu if first else None, cfg, identity=identity, firing=firing,
                             xid_seen=list(self.card.xid_seen), healing=healing, written_at=written_at, tick_s=tick_s,
                             preflight=preflight, telemetry=telemetry, alert_book=book_info(self.card.alerts, offset))  # fmt: skip

    # ------------------------------------------------------------------ for the loop

    def tick_interval(self, base: float) -> float:
        if self.swapping or any(u.st.phase is Phase.STARTING for u in self.units.values()):
            return min(base, SWAP_POLL_S)
        if self.plan.recheck_at is not None:
            return max(0.0, min(base, self.plan.recheck_at - self.clock()))
        return base

    def pids(self) -> tuple[int, ...]:
        """Processes the reaper must leave alone: each engine's and the router's."""
        out = [u.engine.sample().pid for u in self.units.values()]
        out.append(self.router.sample().pid)
        return tuple(p for p in out if p)

    def unit(self, name: str | None) -> EngineUnit | None:
        if name is None:
            return None
        return self.units.get(name)

