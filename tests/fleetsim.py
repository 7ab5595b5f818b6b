"""Swap mode simulated: a clock, one card, each model's engine process, its probes and checkpoint worker, and
the router with its queues, so that Fleet's whole logic (each engine's policy, the card, the arbiter, the
swaps, the router's table) runs over them, tick by tick, on simulated time (tests/unit/test_fleet_liveness.py).

What is simulated, and how (each a boundary the daemon reads through a sample):

- an engine process (SimEngine): a spawn holds its share of the card at once and answers /health 200 after
  `latency` ticks; a spawn without room on the card dies at its first sample, as vLLM refuses to start; a stop
  ends it after one tick; a death ends it in any phase;
- its probes: an inference probe or a canary sent in one tick is answered in the next if the engine runs (the
  canary always with the same confident answer), refused if it is dead, unanswered while it is locked;
- the checkpoint worker (SimWorker): a lock, checkpoint, restore or state query finishes after `latency` ticks;
  a checkpoint frees the engine's GPU memory, a restore takes it back;
- the card (SimCard): the engines' and a foreign holder's memory, read fresh at every sample;
- the router (SimRouter, with SimLink): per model, the requests waiting and those in flight; a table that makes
  a model routable sends its waiters at once; a request finishes after `latency` ticks of its engine running; a
  request sent to a dead engine waits again for a newer table (as the real router's retry); a waiting request
  past swap.queue_timeout is dropped; a router that dies loses its queues and comes back empty, as the real one.

Everything the sampler would read (r3090d/service/sampling.py) is built here into a Snapshot, and the
arbiter's and the operator's requests go from Pending into it exactly as Sampler.take does.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path

from r3090d import config
from r3090d.config import Config
from r3090d.config.models import engine_configs
from r3090d.core import policy
from r3090d.core.actions import (
    Exit,
    QueryEngineState,
    ResetProbes,
    ResumeEngine,
    SendCanary,
    SendInferenceProbe,
    StartEngine,
    StopEngine,
    SuspendEngine,
)
from r3090d.core.room import ENGINE_CONTEXT_MARGIN
from r3090d.core.snapshot import (
    CanaryAnswer,
    CanarySample,
    ChildSample,
    GpuProcess,
    GpuSample,
    GpuStatus,
    HealthSample,
    HealthStatus,
    InferenceProbeSample,
    MetricsSample,
    Snapshot,
)
from r3090d.core.suspend_types import Op, Outcome, ProcessState, SuspendSample
from r3090d.core.vocabulary import Phase
from r3090d.effectors.routerproc import RouterSample
from r3090d.router.link import Demand, ModelDemand, Table
from r3090d.service.commands import Pending
from r3090d.service.fleet import Fleet, unit_config
from r3090d.units import MIB

CARD_MIB = 24576  # an RTX 3090
SHARE = 0.9  # each engine's --gpu-memory-utilization
ENGINE_MIB = int(SHARE * CARD_MIB)  # what a loaded engine holds
START_NEED_MIB = ENGINE_MIB + ENGINE_CONTEXT_MARGIN // MIB  # free memory vLLM needs to start (core.room)
MODELS = ("chat", "coder", "embed")
CANARY = CanaryAnswer(tuple(range(16)), (5.0,) * 16, (None,) * 16, "one two three")
REFUSED_START = "ValueError: Free memory on device is less than desired GPU memory utilization"
FAILED_START = "RuntimeError: engine core initialization failed"


def swap_config(max_resident: int = 1, parked: int = 1, min_residency: float = 10) -> Config:
    """Three models, two generative and one embedding, on one card; small timeouts so that bounds are small.
    host_memory_budget_mib holds `parked` parked engines (nothing reads the real host)."""
    models = [
        {"name": name, "model": f"/m/{name}", "kind": "embed" if name == "embed" else "generate",
         "extra_args": ["--gpu-memory-utilization", str(SHARE)]}
        for name in MODELS
    ]  # fmt: skip
    return config.from_dict(
        {
            "profile": "none",
            "models": models,
            "engine": {"startup_timeout": 10, "shutdown_timeout": 5},
            "gpu": {"required": True},
            "watchdog": {
                "min_uptime": 5,
                "give_up_retry": 30,
                "start_failures": 3,
                "same_cause_failures": 2,
                "backoff_initial": 1,
                "backoff_max": 5,
                "probe_idle_seconds": 20,
            },
            "canary": {"timeout": 2, "interval": 60},
            "suspend": {"verify_timeout": 10},
            "swap": {
                "max_resident": max_resident,
                "queue_timeout": 600,
                "min_residency": min_residency,
                "drain_timeout": 5,
                "host_memory_budget_mib": parked * (ENGINE_MIB + 2048) + 1000,
            },
            "daemon": {
                "state_dir": "/nonexistent/r3090d-sim/state",
                "runtime_dir": "/nonexistent/r3090d-sim/run",
            },
        },
        check_files=False,
    )


class SimClock:
    """The daemon's monotonic clock, moved only by the test."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class SimCard:
    """One GPU: the memory each live engine holds, and a foreign holder's."""

    def __init__(self, clock: SimClock, total_mib: int = CARD_MIB):
        self.clock = clock
        self.total_mib = total_mib
        self.engines: list[SimEngine] = []
        self.foreign: dict[int, int] = {}  # pid -> MiB

    def holders(self) -> dict[int, int]:
        held = {e.pid: e.held_mib for e in self.engines if e.held_mib > 0}
        return {**held, **self.foreign}

    def used_mib(self) -> int:
        return sum(self.holders().values())

    def free_mib(self) -> int:
        return self.total_mib - self.used_mib()

    def sample(self) -> GpuSample:
        used = self.used_mib()
        return GpuSample(
            GpuStatus.OK, index=0, taken_at=self.clock(), name="Simulated GPU", memory_total=self.total_mib * MIB,
            memory_used=used * MIB, memory_free=(self.total_mib - used) * MIB,
            processes=tuple(GpuProcess(pid, mib * MIB) for pid, mib in sorted(self.holders().items())), graphics_processes=(),
            xid_monitored=True,
        )  # fmt: skip


@dataclass
class World:
    """What every simulated part shares: the clock, the card, the pid counter and the latency (ticks) of what takes time."""

    clock: SimClock
    card: SimCard
    pids: itertools.count = field(default_factory=lambda: itertools.count(1000))
    latency: int = 1


class SimEngine:
    """One model's engine process tree (a single process)."""

    def __init__(self, world: World):
        self.world = world
        world.card.engines.append(self)
        self.generation = 0
        self.pid: int | None = None
        self.alive = False
        self.started_at: float | None = None
        self.exit_code: int | None = None
        self.exited_at: float | None = None
        self.stop_requested = False
        self.stopping = 0  # samples until a stop ends it
        self.loading = 0  # samples until /health answers 200
        self.doomed: str | None = None  # a start that fails: it dies at its next sample, with this root cause
        self.failing_starts = 0  # the next starts that fail so (the engine core cannot initialize)
        self.root_cause: str | None = None
        self.root_cause_certain = False
        self.held_mib = 0
        self.locked = False  # its CUDA calls block (locked for a checkpoint, or checkpointed)
        self.served = 0  # client requests completed
        self.tokens = 0

    @property
    def running(self) -> bool:
        return self.alive and self.loading == 0 and not self.locked

    def spawn(self) -> None:
        now = self.world.clock()
        fits = self.world.card.free_mib() >= START_NEED_MIB
        self.generation += 1
        self.pid = next(self.world.pids)
        self.alive, self.started_at, self.exit_code, self.exited_at = True, now, None, None
        self.stop_requested, self.stopping, self.locked = False, 0, False
        self.root_cause, self.root_cause_certain = None, False
        self.loading = self.world.latency
        self.doomed = None if fits else REFUSED_START
        if fits and self.failing_starts:
            self.failing_starts -= 1
            self.doomed = FAILED_START
        self.held_mib = ENGINE_MIB if fits else 0

    def stop(self) -> None:
        if self.alive and not self.stopping:
            self.stop_requested, self.stopping = True, 1

    def die(self, cause: str | None = None, certain: bool = False, code: int = -9) -> None:
        if not self.alive:
            return
        self.alive, self.exit_code, self.exited_at = False, code, self.world.clock()
        self.stopping, self.loading, self.locked, self.held_mib, self.doomed = 0, 0, False, 0, None
        self.root_cause, self.root_cause_certain = cause, certain

    def step(self) -> None:
        """One sample's worth of time for the process."""
        if self.doomed is not None:
            self.die(self.doomed, certain=True, code=1)
        elif self.stopping:
            self.stopping -= 1
            if not self.stopping:
                self.die(code=0)
        elif self.loading:
            self.loading -= 1
        if self.running:
            self.tokens += 10  # progress: the passive stall detector has nothing to say

    def sample(self) -> ChildSample:
        return ChildSample(
            pid=self.pid, alive=self.alive, started_at=self.started_at, exit_code=self.exit_code, exited_at=self.exited_at,
            stop_requested=self.stop_requested, stopping=self.stopping > 0, tree_pids=(self.pid,) if self.alive else (),
            generation=self.generation, root_cause=self.root_cause, root_cause_certain=self.root_cause_certain,
        )  # fmt: skip

    def health(self) -> HealthSample:
        if self.loading:
            return HealthSample(HealthStatus.REFUSED)
        if self.locked:
            return HealthSample(HealthStatus.TIMEOUT)
        return HealthSample(HealthStatus.OK, 200)


class SimWorker:
    """The checkpoint worker of one engine: one driver operation at a time, done after `latency` samples."""

    def __init__(self, world: World, engine: SimEngine):
        self.world = world
        self.engine = engine
        self.sample = SuspendSample()
        self.left = 0
        self.fail_next = False  # the next checkpoint is undone by the driver (kept_running)

    def start(self, op: Op, pid: int) -> None:
        self.sample = SuspendSample(op=op, pid=pid, in_flight=True, started_at=self.world.clock())
        self.left = self.world.latency
        if op is Op.SUSPEND and self.engine.alive:
            self.engine.locked = True  # the lock comes first: nothing runs in it from now on

    def step(self) -> None:
        if not self.sample.in_flight:
            return
        self.left -= 1
        if self.left > 0:
            return
        e, op = self.engine, self.sample.op
        state = None
        if not e.alive:
            outcome, error = Outcome.FAILED, f"pid {self.sample.pid}: no such process"
        elif op is Op.SUSPEND and self.fail_next:
            self.fail_next = False
            e.locked = False
            outcome, error, state = (
                Outcome.KEPT_RUNNING,
                "checkpoint: CUDA_ERROR_OUT_OF_MEMORY (undone)",
                ProcessState.RUNNING,
            )
        elif op is Op.SUSPEND:
            e.held_mib = 0
            outcome, error, state = Outcome.SUSPENDED, "", ProcessState.CHECKPOINTED
        elif op is Op.RESUME:
            if self.world.card.free_mib() >= ENGINE_MIB:
                e.held_mib, e.locked = ENGINE_MIB, False
                outcome, error, state = Outcome.RESUMED, "", ProcessState.RUNNING
            else:
                outcome, error, state = (
                    Outcome.KEPT_RUNNING,
                    "restore: CUDA_ERROR_OUT_OF_MEMORY",
                    ProcessState.CHECKPOINTED,
                )
        else:
            state = ProcessState.CHECKPOINTED if e.locked and not e.held_mib else ProcessState.RUNNING
            outcome, error = Outcome.REPORTED, ""
        self.sample = SuspendSample(op=op, pid=self.sample.pid, in_flight=False, started_at=self.sample.started_at,
                                    finished_at=self.world.clock(), outcome=outcome, state=state, error=error)  # fmt: skip


class SimSuspend:
    """What Fleet reads of the unit's SuspendService."""

    def publish(self, st, snap, offset):
        return None


class SimUnit:
    """Duck-types r3090d.service.unit.EngineUnit as Fleet and SwapDaemon use it."""

    def __init__(self, name: str, cfg: Config, world: World, router: SimRouter):
        self.name = name
        self.cfg = cfg
        self.world = world
        self.router = router
        self.engine = SimEngine(world)
        self.worker = SimWorker(world, self.engine)
        self.suspend = SimSuspend()
        self.pending = Pending()
        self.st = policy.initial_state(world.clock(), cold=True)
        self.last_snap: Snapshot | None = None
        self.inference = InferenceProbeSample()
        self.probes_sent = 0
        self.canary = CanarySample()
        self.canaries_sent = 0

    def _answer_probes(self, now: float) -> None:
        e, inf, can = self.engine, self.inference, self.canary
        if inf.sent_at is not None and (inf.finished_at is None or inf.finished_at < inf.sent_at):
            if e.running:
                self.inference = InferenceProbeSample(inf.sent_at, now, True, "", 0, self.probes_sent)
            elif not e.alive:
                self.inference = InferenceProbeSample(
                    inf.sent_at,
                    now,
                    False,
                    "connection refused",
                    inf.consecutive_failures + 1,
                    self.probes_sent,
                )
        if can.sent_at is not None and (can.finished_at is None or can.finished_at < can.sent_at):
            if e.running:
                self.canary = CanarySample(can.sent_at, now, CANARY, "", self.canaries_sent)
            elif not e.alive:
                self.canary = CanarySample(can.sent_at, now, None, "connection refused", self.canaries_sent)

    def _metrics(self) -> MetricsSample:
        e = self.engine
        inflight = len(self.router.inflight.get(self.name, ()))
        return MetricsSample(running=float(inflight), waiting=0.0, served_total=float(e.served + self.probes_sent + self.canaries_sent),
                             generation_tokens_total=float(e.tokens), engines=1)  # fmt: skip

    def snapshot(self, *, shutdown: bool) -> Snapshot:
        """As Sampler.take: the child, /health and /metrics when asked, NVML, the probes, and the pending requests."""
        now = self.world.clock()
        self.engine.step()
        self.worker.step()
        self._answer_probes(now)
        child = self.engine.sample()
        phase = self.st.phase
        health, metrics = HealthSample(HealthStatus.SKIPPED), MetricsSample()
        if child.alive and policy.probes_engine(self.st):
            health = self.engine.health()
            if health.status is not HealthStatus.TIMEOUT and (
                phase in (Phase.READY, Phase.SUSPENDING) or health.status is HealthStatus.OK
            ):
                metrics = self._metrics()
        restart, maintenance, silences = self.pending.take()
        suspend, resume = self.pending.take_suspend()
        park, start, stop_cold, park_by_sleep = self.pending.take_swap()
        snap = Snapshot(
            now=now, wall=now, child=child, health=health, metrics=metrics, gpu=self.world.card.sample(), inference=self.inference,
            canary=self.canary, shutdown_requested=shutdown, restart_requested=restart, maintenance=maintenance, silences=silences,
            suspend_requested=suspend, resume_requested=resume, park=park, start_requested=start, stop_cold_requested=stop_cold,
            park_by_sleep=park_by_sleep, suspender=self.worker.sample, process_names=(),
        )  # fmt: skip
        self.last_snap = snap
        return snap

    def execute(self, actions, snap: Snapshot, *, alerts, gpu_name: str | None) -> int | None:
        now = self.world.clock()
        code = None
        for action in actions:
            if isinstance(action, StartEngine):
                self.inference, self.canary = (
                    InferenceProbeSample(sent_total=self.probes_sent),
                    CanarySample(sent_total=self.canaries_sent),
                )
                self.engine.spawn()
            elif isinstance(action, StopEngine):
                self.engine.stop()
            elif isinstance(action, SendInferenceProbe):
                self.probes_sent += 1
                self.inference = InferenceProbeSample(sent_at=now, finished_at=self.inference.finished_at, ok=None,
                                                      consecutive_failures=self.inference.consecutive_failures, sent_total=self.probes_sent)  # fmt: skip
            elif isinstance(action, SendCanary):
                self.canaries_sent += 1
                self.canary = CanarySample(sent_at=now, sent_total=self.canaries_sent)
            elif isinstance(action, ResetProbes):
                self.inference = InferenceProbeSample(sent_total=self.probes_sent)
            elif isinstance(action, SuspendEngine):
                self.worker.start(Op.SUSPEND, action.pid)
            elif isinstance(action, ResumeEngine):
                self.worker.start(Op.RESUME, action.pid)
            elif isinstance(action, QueryEngineState):
                self.worker.start(Op.STATE, action.pid)
            elif isinstance(action, Exit):
                code = action.code
            # Alerts, restart records, baselines, the suspension's record, NVML re-reads: nothing to simulate.
        return code

    def log_transitions(self, old_phase: Phase, snap: Snapshot, status: str) -> bool:
        return self.st.phase is Phase.READY and old_phase not in (Phase.READY, Phase.RESUMING)

    def kill_if_running(self) -> None:
        self.engine.die()


@dataclass
class Request:
    model: str
    arrived: float
    left: int = 0  # ticks of work left once in flight
    after_seq: int = -1  # sent to a dead engine: waits for a newer table


class SimRouter:
    """The router process and its queues (r3090d/router/waitroom.py), and RouterProcess's face to the fleet."""

    def __init__(self, world: World, queue_timeout: float):
        self.world = world
        self.queue_timeout = queue_timeout
        self.units: dict[str, SimUnit] = {}
        self.alive = False
        self.pid: int | None = None
        self.starts = 0
        self.table: Table | None = None
        self.waiting: dict[str, list[Request]] = {}
        self.inflight: dict[str, list[Request]] = {}
        self.last_used: dict[str, float] = {}
        self.timed_out: list[tuple[str, float, float]] = []  # (model, arrived, dropped at)
        self.failed: int = 0  # requests cut by their engine's death or the router's
        self.finished: int = 0

    # RouterProcess
    def keep_running(self, now: float) -> None:
        if not self.alive:
            self.alive, self.pid, self.table = True, next(self.world.pids), None
            self.starts += 1

    def sample(self) -> RouterSample:
        return RouterSample(self.pid, self.alive, max(0, self.starts - 1), None, "")

    def stop(self) -> None:
        self.die()

    def die(self) -> None:
        """Its clients' connections are cut: what waited or ran is lost; the daemon's link sees no demand."""
        self.failed += sum(map(len, self.waiting.values())) + sum(map(len, self.inflight.values()))
        self.alive, self.table, self.waiting, self.inflight = False, None, {}, {}

    # clients
    def routable(self, model: str) -> bool:
        entry = self.table.get(model) if self.table is not None else None
        return entry is not None and entry.routable

    def arrive(self, model: str, work: int) -> bool:
        if not self.alive:
            return False  # connection refused
        req = Request(model, self.world.clock(), left=work)
        self.waiting.setdefault(model, []).append(req)
        self._release(model)
        return True

    def leave(self, model: str, count: int) -> None:
        """The newest `count` waiting clients give up."""
        lane = self.waiting.get(model, [])
        del lane[max(0, len(lane) - count) :]

    def _release(self, model: str) -> None:
        if not self.routable(model):
            return
        seq = self.table.seq
        keep = []
        for req in self.waiting.get(model, []):
            if req.after_seq >= seq:
                keep.append(req)
            elif self.units[model].engine.alive:
                self.inflight.setdefault(model, []).append(req)
                self.last_used[model] = self.world.clock()
            else:
                req.after_seq = seq  # refused: it waits for a newer table
                keep.append(req)
        self.waiting[model] = keep

    def apply(self, table: Table) -> None:
        self.table = table
        for model in list(self.waiting):
            self._release(model)

    def step(self, now: float) -> None:
        """The time between two of the daemon's ticks: requests run, finish, fail, or time out waiting."""
        if not self.alive:
            return
        for model, reqs in self.inflight.items():
            engine = self.units[model].engine
            keep = []
            for req in reqs:
                if not engine.alive:
                    self.failed += 1
                    continue
                if engine.running:
                    req.left -= 1
                if req.left <= 0:
                    engine.served += 1
                    self.finished += 1
                    self.last_used[model] = now
                    continue
                keep.append(req)
            self.inflight[model] = keep
        for model, lane in self.waiting.items():
            late = [r for r in lane if now - r.arrived > self.queue_timeout]
            self.timed_out += [(model, r.arrived, now) for r in late]
            self.waiting[model] = [r for r in lane if now - r.arrived <= self.queue_timeout]

    def demand(self) -> dict[str, ModelDemand]:
        if not self.alive:
            return {}
        out = {}
        for model in set(self.waiting) | set(self.inflight) | set(self.last_used):
            lane = self.waiting.get(model, [])
            out[model] = ModelDemand(len(lane), min((r.arrived for r in lane), default=None), len(self.inflight.get(model, [])),
                                     self.last_used.get(model))  # fmt: skip
        return out


class SimLink:
    """The daemon's end of the router link (LinkServer): the router's demand, and the table sent when it changed."""

    def __init__(self, router: SimRouter):
        self.router = router
        self.path = Path("/nonexistent/r3090d-sim/run/router.sock")
        self.published: Table | None = None

    @property
    def linked(self) -> bool:
        return self.router.alive

    def start(self):
        return self

    def close(self) -> None:
        pass

    def latest(self) -> Demand:
        return Demand(models=self.router.demand())

    def publish(self, table: Table) -> None:
        self.published = table
        r = self.router
        if r.alive and (r.table is None or r.table.models != table.models):
            r.apply(table)


class Sim:
    """The fleet over simulated engines, card, router and time."""

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or swap_config()
        self.clock = SimClock()
        self.world = World(self.clock, SimCard(self.clock))
        self.router = SimRouter(self.world, self.cfg.swap.queue_timeout)
        self.units = {
            name: SimUnit(name, unit_config(self.cfg, ucfg), self.world, self.router)
            for name, ucfg in engine_configs(self.cfg).items()
        }
        self.router.units = self.units
        self.link = SimLink(self.router)
        self.fleet = Fleet(
            self.cfg,
            threading.Event(),
            units=self.units,
            link=self.link,
            router=self.router,
            clock=self.clock,
        )
        self.fleet.start()

    def tick(self, dt: float) -> None:
        self.clock.advance(dt)
        self.router.step(self.clock())
        self.fleet.tick(shutdown=False, alerts=None, gpu_name=None)
