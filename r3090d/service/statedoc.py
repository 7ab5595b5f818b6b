"""The state document's types and its reader: what the daemon publishes each tick.

The daemon builds it with `report.report()` (or `report.preflight_report()` before
its loop runs), writes it to state.json and answers `r3090ctl status` with it.
Times in it are wall-clock (Unix) seconds.

Readers (the exporter, /healthz, `r3090ctl status`, `restart --wait`) read it
through `parse()`, into the same types: it fills in what a partial document
(written by preflight before the loop runs) or an older daemon's lacks, and
refuses only a format it cannot read.

FORMAT_VERSION grows when a field changes meaning or goes away. A reader accepts
every version in READABLE_FORMATS; after an upgrade, a daemon started before it
keeps writing its own (older) format until it is restarted.

Swap mode (several models, one engine each, behind the router) adds `models`, one
ModelDoc per model with its engine's own sections, and `swap`; the top-level
`engine` then describes no engine (its state is "swap"), while the sections of the
card and the daemon (gpu, xid_seen, thresholds, alerts, telemetry, the reset hold
and XIDs in `healing`) stay at the top level. Outside swap mode `models` is empty,
`swap` is None, and the document is what format 2 was.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from dataclasses import dataclass, field

from r3090d.config.schema import EngineKind
from r3090d.core.alerting import AlertEntry
from r3090d.core.arbiter import RESIDENT, Residency
from r3090d.core.room import Holder
from r3090d.core.snapshot import GpuSample, HealthSample, MetricsSample
from r3090d.core.suspension import Result, Stage
from r3090d.core.vocabulary import Phase, Severity
from r3090d.preflight.checks import CheckResult

FORMAT_VERSION = 3
# 1: before give-up kept the daemon up (no restarts.start_failures, no thresholds); 2: before swap mode (no models, no swap)
READABLE_FORMATS = (1, 2, 3)


class UnreadableFormat(ValueError):
    """A state document this r3090ctl cannot read: written by a newer daemon, or not a document at all."""


def check_format(doc: dict) -> dict:
    """The document itself if this version of r3090d can read it."""
    version = doc.get("format", 1)
    # bool is an int to Python, and True == 1: a JSON `true` is no format number.
    if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_FORMATS:
        shown = version if isinstance(version, int) and not isinstance(version, bool) else repr(version)[:40]
        raise UnreadableFormat(
            f"the state was written in format {shown}, this r3090ctl reads {', '.join(map(str, READABLE_FORMATS))}: "
            "restart the daemon (systemctl restart r3090d) or upgrade r3090ctl"
        )
    return doc


# Field metadata. KEY: the document's key where it differs from the field's name
# (a keyword such as "for"). DERIVED: filled in by parse() only and never written,
# so the document keeps its shape.
KEY = "r3090d.key"
DERIVED = "r3090d.derived"

# Every field has a default, so that parse() can fill in what a partial document
# (the one preflight writes before the loop runs) or an older daemon's lacks.


@dataclass(frozen=True)
class DaemonIdentity:
    """What does not change between ticks."""

    pid: int
    started_at: float
    version: str
    host: str


@dataclass(frozen=True)
class DaemonInfo:
    pid: int | None = None
    started_at: float | None = None
    version: str = ""
    instance: int | None = None
    config: str = ""
    host: str = ""
    tick_seconds: float | None = None
    poll_interval: float | None = None


@dataclass(frozen=True)
class EngineInfo:
    state: str = ""  # the phase, or "maintenance" while maintenance holds a ready engine
    phase: Phase | None = None  # None: absent, or a phase this r3090d does not know (phase_text has it)
    maintenance: bool = False
    since: float | None = None
    pid: int | None = None
    tree_pids: list[int] = field(default_factory=list)
    model: str = ""
    url: str = ""
    ready_since: float | None = None
    generation: int | None = None  # None: not in the document
    # The phase as written: a newer daemon's phase is named to the operator, not dropped.
    phase_text: str | None = field(default=None, metadata={KEY: "phase", DERIVED: True})

    @property
    def phase_name(self) -> str:
        """The phase's text for people; "unknown" when the document has none."""
        return self.phase.value if self.phase is not None else (self.phase_text or self.state or "unknown")


@dataclass(frozen=True)
class RestartsInfo:
    total: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    last_reason: str | None = None
    last_at: float | None = None
    last_root_cause: str | None = None
    backoff_level: int | None = None  # None: not in the document (the exporter leaves its gauge out)
    start_failures: int = 0
    same_cause_run: int = 0  # how many of the start_failures in a row had last_root_cause
    recent: int = 0  # unrequested restarts within watchdog.restart_storm_window
    recent_at: list[float] = field(default_factory=list)  # when they happened: a restarted daemon counts on from them


@dataclass(frozen=True)
class HealingInfo:
    """What keeps the engine from starting, and how the daemon heals by itself."""

    reset_hold: str | None = None  # the card needs a reset: why (an XID, the driver's recovery action)
    reset_hold_since: float | None = None  # wall clock
    gpu_wait_holders: list[Holder] = field(default_factory=list)  # waiting-for-gpu: who holds the card
    gpu_wait_need_bytes: int | None = None
    gpu_wait_free_bytes: int | None = None
    give_up_retry_s: float = 0.0  # watchdog.give_up_retry (0: none)
    retry_attempts: int = 0  # automatic attempts since the give-up
    next_retry_at: float | None = None  # wall clock of the next one
    given_up: bool = False  # the give-up stands, automatic attempts included (PolicyState.given_up)
    start_succeeded: bool = False  # this engine served, or was ready for min_uptime
    xid_by_class: dict[str, int] = field(default_factory=dict)
    detector_scale: dict[str, int] = field(default_factory=dict)  # widened fast detectors (absent: 1x)


@dataclass(frozen=True)
class CanaryInfo:
    """The known-answer canary (core.canary): its counters, and when it last matched."""

    enabled: bool = False
    interval_s: float = 0.0
    baseline_tokens: int | None = None  # the baseline's confident prefix; None: no baseline yet
    checks: int = 0
    mismatches: int = 0
    inconclusive: int = 0
    errors: int = 0
    last_verdict: str | None = None
    last_match_at: float | None = None  # wall clock
    last_ok_at: float | None = None  # wall clock of the last match or inconclusive comparison
    last_margin: float | None = None  # nats: the baseline's margin where the last comparison was decided
    last_mismatch: str | None = None
    last_mismatch_at: float | None = None


@dataclass(frozen=True)
class ProbeInfo:
    ok: bool | None = None
    latency_s: float | None = None
    finished_at: float | None = None
    detail: str = ""
    consecutive_failures: int = 0


@dataclass(frozen=True)
class Thresholds:
    # None: an older daemon's document, which has no thresholds
    gpu_memory_alert_bytes: int | None = None
    kv_min_free_blocks: int | None = None
    restart_storm_restarts: int | None = None  # restart_storm fires at this many recent restarts...
    restart_storm_window_s: float | None = None  # ... within this many seconds (RestartsInfo.recent counts them)


@dataclass(frozen=True)
class FiringAlert:
    severity: Severity = Severity.WARNING
    summary: str = ""
    since: float | None = None


@dataclass(frozen=True)
class AlertsInfo:
    firing: dict[str, FiringAlert] = field(default_factory=dict)
    silenced: dict[str, float] = field(default_factory=dict)  # key -> until (wall)

    def active_silences(self, now: float) -> dict[str, float]:
        return {k: until for k, until in self.silenced.items() if until > now}


@dataclass(frozen=True)
class AlertBookInfo:
    """The policy's alert book, its times in wall-clock seconds: a restarted daemon rebuilds its book from it."""

    entries: dict[str, AlertEntry] = field(default_factory=dict)
    silenced: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WatchInfo:
    gpu_signal_off: str | None = None  # why the GPU's signals are not used to find freezes (None: they are)


@dataclass(frozen=True)
class WaitingInfo:
    """Written by preflight while it waits for something transient, before the loop runs."""

    what: str | None = field(default=None, metadata={KEY: "for"})
    since: float | None = None


@dataclass(frozen=True)
class PreflightSummary:
    exit_code: int | None = None
    checks: tuple[CheckResult, ...] = ()
    at: float | None = None


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[tuple[float, int], ...] = ()  # (upper bound, cumulative count)
    count: int = 0
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        """No observation yet, in buckets with these upper bounds (ascending)."""
        return cls(tuple((float(upper), 0) for upper in bounds))

    def observed(self, value: float) -> Histogram:
        """This histogram with one more observation (the buckets are cumulative: every one at or above it counts it)."""
        buckets = tuple((upper, n + 1 if value <= upper else n) for upper, n in self.buckets)
        return Histogram(buckets, self.count + 1, self.sum + value)


# The swap-latency histogram's upper bounds, in seconds: a resume of a small model to a cold start of a large one.
SWAP_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class Telemetry:
    poll_duration_seconds: Histogram | None = None


# A suspension stands in these stages: the engine's GPU memory is in its host memory (or, cold, there is no
# engine), and a resume has not got past its room check (a refused one changes nothing). As suspended_long counts.
STANDING_STAGES = (Stage.SUSPENDED, Stage.CHECKING)
DONE_RESULTS = (Result.SUSPENDED, Result.RESUMED, Result.STARTED_COLD)  # the request did what was asked


@dataclass(frozen=True)
class LastRequest:
    """How the operator's last suspend or resume ended."""

    request: int = 0
    op: str = ""  # "suspend" | "resume"
    result: Result | None = None  # None: a result this r3090d does not know
    detail: str = ""
    at: float | None = None

    @property
    def failed(self) -> bool:
        return self.result not in DONE_RESULTS


@dataclass(frozen=True)
class WorkerStep:
    step: str = ""  # a suspend_types.Step value
    ok: bool = False
    took_s: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class WorkerInfo:
    """The suspend worker's latest operation, with the driver's own step timings."""

    op: str | None = None
    pid: int | None = None
    in_flight: bool = False
    overdue: bool = False
    step: str | None = None
    steps: tuple[WorkerStep, ...] = ()
    outcome: str | None = None
    state: str | None = None
    error: str = ""
    duration_s: float | None = None


@dataclass(frozen=True)
class SuspendInfo:
    """What status shows of a suspension, the exporter's suspended gauges, and what suspend --wait follows."""

    stage: Stage | None = None  # None: no suspension
    since: float | None = None  # when the engine became suspended
    cold: bool = False  # no engine process behind the suspension: resume starts a new one
    pid: int | None = None  # the checkpointed process
    gpu_bytes: int = 0  # GPU memory it held: what resuming needs free (plus the margin)
    host_rss_bytes: int | None = None  # its resident host memory now (grown by gpu_bytes); None: unmeasured
    frozen_requests: int = 0  # requests frozen with the engine at the drain deadline
    error: str = ""  # the last refusal or failure, one line
    how_to_resume: str | None = None
    last: LastRequest | None = None
    worker: WorkerInfo | None = None
    remind_after_s: float = 0.0  # the suspended_long alert's delay (suspend.remind_after)
    parked: bool = False  # swap mode: the arbiter parked the engine to bring another model in, not the operator

    @property
    def standing(self) -> bool:
        return self.stage in STANDING_STAGES

    @property
    def by_operator(self) -> bool:
        """A suspension the operator asked for (r3090ctl suspend) is under way or stands: not a parked engine."""
        return self.stage is not None and not self.parked


# ------------------------------------------------------------------ swap mode


@dataclass(frozen=True)
class ModelDoc:
    """One model of swap mode: where its engine is, how it is used, and its engine's own sections.

    The sections from `engine` to `healing` are what the top level holds for the one
    engine of single mode, for this model's engine; `StateDocument.for_model` puts
    them back at the top level, so a reader of one engine reads them unchanged.
    """

    name: str = ""  # the served model name: what clients send as "model"
    kind: EngineKind | None = None  # None: absent, or a kind this r3090d does not know
    residency: Residency | None = None  # None: absent, or a word this r3090d does not know (residency_text has it)
    port: int | None = None  # the engine's own port on 127.0.0.1
    last_used: float | None = None  # wall clock of its last request through the router; None: never used
    host_bytes: int = 0  # host memory it holds parked (its GPU memory plus its base RSS); 0 when not parked
    gpu_bytes: int = 0  # GPU memory it holds resident, or held before it was parked
    swaps_in: int = 0  # times it was brought onto the GPU (resumed or cold-started) for its model
    swaps_out: int = 0  # times it was parked or stopped to make room
    inflight: int = 0  # requests open at the router toward it; for a parked engine, those frozen with it
    waiting: int = 0  # requests queued at the router until it is resident
    frozen: int = 0  # requests frozen with it when it was parked, to finish when it comes back
    engine: EngineInfo = field(default_factory=EngineInfo)
    restarts: RestartsInfo = field(default_factory=RestartsInfo)
    health: HealthSample | None = None
    inference: ProbeInfo = field(default_factory=ProbeInfo)
    canary: CanaryInfo = field(default_factory=CanaryInfo)
    suspend: SuspendInfo | None = None
    metrics: MetricsSample = field(default_factory=MetricsSample)
    watch: WatchInfo = field(default_factory=WatchInfo)
    give_up_reason: str | None = None
    next_action: str | None = None
    healing: HealingInfo = field(default_factory=HealingInfo)
    fleet: ModelFleetState = field(default_factory=lambda: ModelFleetState())
    # The residency as written: a newer daemon's word is named to the operator, not dropped.
    residency_text: str | None = field(default=None, metadata={KEY: "residency", DERIVED: True})

    @property
    def residency_name(self) -> str:
        return self.residency.value if self.residency is not None else (self.residency_text or "unknown")

    @property
    def resident(self) -> bool:
        """On the GPU, or taking its place there (ready, starting, resuming)."""
        return self.residency in RESIDENT

    @property
    def failed(self) -> bool:
        """It cannot be served, now or after a swap: failed, given up, or no engine may start until the GPU is reset."""
        return self.residency is Residency.FAILED or self.engine.phase in (Phase.GIVEN_UP, Phase.RESET_NEEDED)

    @property
    def suspended_by_operator(self) -> bool:
        return self.suspend is not None and self.suspend.by_operator


@dataclass(frozen=True)
class SwapProgress:
    """The swap under way."""

    from_model: str | None = None  # None: nothing had to leave the GPU
    to_model: str = ""
    stage: str = ""  # what it does now, for people: "draining chat", "restoring coder", ...
    since: float | None = None  # wall clock of the swap's start


@dataclass(frozen=True)
class ModelFleetState:
    """What the swap daemon holds of one model beyond its engine (service/fleet.py's ModelRecord): what moves it,
    or holds it, now."""

    closing: bool = False  # the current plan closes it: the router sends it nothing new
    leave_decided: bool = False  # a park or stop decided, not yet taken up: the router holds its requests
    coming: bool = False  # on its way onto the GPU
    leaving: bool = False  # on its way off the GPU
    wanted: bool = False  # asked for by the operator (r3090ctl swap or restart) until it is ready
    park_request: int | None = None  # the park or unpark asked of its engine and not yet answered
    unpark_retry_in: float | None = None  # seconds until a refused resume is asked again
    no_checkpoint: bool = False  # it cannot be parked here: stopped drained instead
    sleep_failures: int = 0  # parks or wakes by sleep that failed in a row ([[models]].park = "sleep")
    sleep_off: bool = False  # two in a row: parked as park = "auto" until a daemon restart or r3090ctl restart --model

    def words(self) -> list[str]:
        out = [w for w, on in (("closing (its new requests wait)", self.closing), ("leaving decided", self.leave_decided and not self.closing),
                               ("coming in", self.coming), ("leaving", self.leaving and not self.closing),
                               ("asked for by the operator", self.wanted), ("stopped, not parked, when it leaves", self.no_checkpoint)) if on]  # fmt: skip
        if self.sleep_off:
            out.append("sleep failed twice in a row: parked by checkpoint or stopped until r3090ctl restart --model")
        if self.park_request is not None:
            out.append(f"park/unpark request {self.park_request} under way")
        if self.unpark_retry_in is not None:
            out.append(f"resume asked again in {self.unpark_retry_in:.0f} s")
        return out


@dataclass(frozen=True)
class SwapRecord:
    """The last swap that ended, with its time and where the time went (None: a step it did not take)."""

    from_model: str | None = None  # None: nothing had to leave the GPU
    to_model: str = ""
    cold: bool = False  # the target started cold (it was cold, or the card cannot checkpoint), not resumed
    ok: bool = False  # the target serves
    seconds: float | None = None  # the whole swap: from its decision until the router routes to the target
    drain_s: float | None = None  # the outgoing engine's drain
    checkpoint_s: float | None = None  # the outgoing engine's GPU memory to host RAM
    stop_s: float | None = None  # the outgoing engine's drained stop, where it could not be parked
    restore_s: float | None = None  # the target's GPU memory back from host RAM
    start_s: float | None = None  # the target's cold start, where it was not resumed
    canary_s: float | None = None  # the target's known-answer check (generative models)
    routing_s: float | None = None  # until the router had the new table
    frozen_requests: int = 0  # requests frozen with the outgoing engine
    error: str = ""  # why it failed, one line
    at: float | None = None  # wall clock of its end
    abandoned: bool = False  # ended before its target came in: nobody asked for it any more


@dataclass(frozen=True)
class RouterInfo:
    """The router process: the public port's listener, supervised by the daemon like an engine."""

    pid: int | None = None
    up: bool = False  # its process runs and listens
    linked: bool = False  # it is connected to the daemon's link socket and has the current table
    restarts: int = 0  # since the daemon started
    last_restart_at: float | None = None  # wall clock
    address: str = ""  # where it listens: the public host:port


@dataclass(frozen=True)
class SwapInfo:
    """Swap mode's card-level view: the swap under way and the last one, host memory for parked engines, the router."""

    in_progress: SwapProgress | None = None
    total: int = 0  # swaps that ended since the daemon started, failed and abandoned ones included
    failed: int = 0
    abandoned: int = 0  # ended before the target came in: its requests left
    last: SwapRecord | None = None
    latency: Histogram = field(default_factory=lambda: Histogram.empty(SWAP_BUCKETS))  # SwapRecord.seconds of each swap
    host_budget_bytes: int | None = None  # host memory parked engines may hold; None: not known yet
    host_parked_bytes: int = 0  # what they hold now
    router: RouterInfo = field(default_factory=RouterInfo)
    max_resident: int = 1  # swap.max_resident
    queue_timeout: float = 0.0  # swap.queue_timeout: a request waits this long for its model, then 503


@dataclass(frozen=True)
class StateDocument:
    written_at: float | None = None
    daemon: DaemonInfo = field(default_factory=DaemonInfo)
    engine: EngineInfo = field(default_factory=EngineInfo)
    restarts: RestartsInfo = field(default_factory=RestartsInfo)
    next_action: str | None = None
    watch: WatchInfo = field(default_factory=WatchInfo)
    give_up_reason: str | None = None
    xid_seen: list[int] = field(default_factory=list)
    health: HealthSample | None = None
    inference: ProbeInfo = field(default_factory=ProbeInfo)
    thresholds: Thresholds = field(default_factory=Thresholds)
    metrics: MetricsSample = field(default_factory=MetricsSample)
    gpu: GpuSample | None = None
    alerts: AlertsInfo = field(default_factory=AlertsInfo)
    alert_book: AlertBookInfo = field(default_factory=AlertBookInfo)
    preflight: PreflightSummary | None = None
    telemetry: Telemetry = field(default_factory=Telemetry)
    format: int = FORMAT_VERSION
    waiting: WaitingInfo | None = None
    suspend: SuspendInfo | None = None  # None: written by preflight, or by a daemon without suspend
    healing: HealingInfo = field(default_factory=HealingInfo)
    canary: CanaryInfo = field(default_factory=CanaryInfo)
    models: list[ModelDoc] = field(default_factory=list)  # swap mode: one per model; empty otherwise
    swap: SwapInfo | None = None  # swap mode's card-level view; None otherwise

    def to_json(self) -> dict:
        return _to_json(self)

    @property
    def swap_mode(self) -> bool:
        return bool(self.models) or self.swap is not None

    @property
    def maintenance(self) -> bool:
        """Maintenance mode holds: the daemon's, which in swap mode every engine carries (any one of them says so)."""
        return self.engine.maintenance or any(m.engine.maintenance for m in self.models)

    def model(self, name: str) -> ModelDoc | None:
        return next((m for m in self.models if m.name == name), None)

    def for_model(self, model: ModelDoc) -> StateDocument:
        """The document of single mode, for one model's engine: its sections at the top level, no swap sections.

        What every reader of one engine (the status panel, restart --wait, suspend --wait)
        reads, for the model a command names."""
        return dataclasses.replace(
            self,
            engine=model.engine,
            restarts=model.restarts,
            health=model.health,
            inference=model.inference,
            canary=model.canary,
            suspend=model.suspend,
            metrics=model.metrics,
            watch=model.watch,
            give_up_reason=model.give_up_reason,
            next_action=model.next_action,
            # The card's reset hold and XIDs are the card's, at the top level; the rest is the engine's.
            healing=dataclasses.replace(
                model.healing,
                reset_hold=model.healing.reset_hold or self.healing.reset_hold,
                reset_hold_since=model.healing.reset_hold_since if model.healing.reset_hold else self.healing.reset_hold_since,
                xid_by_class=model.healing.xid_by_class or self.healing.xid_by_class,
            ),
            models=[],
            swap=None,
        )


# ------------------------------------------------------------------ reading

T = typing.TypeVar("T")


def parse(doc: dict) -> StateDocument:
    """The typed view of a state document: from the daemon, its state file, or preflight's partial one.

    Unknown keys are ignored; a missing or malformed section or field takes its
    default (a section of a type that needs a value it lacks becomes None), and
    a phase this version does not know leaves `engine.phase` None with its text
    in `engine.phase_text`. Raises UnreadableFormat, and nothing else, for a
    newer format or something that is not a JSON object.
    """
    if not isinstance(doc, dict):
        raise UnreadableFormat(f"the state is a JSON {type(doc).__name__}, not an object: the file is damaged; restart the daemon to rewrite it")
    check_format(doc)
    parsed = _converter(StateDocument)(doc)
    assert isinstance(parsed, StateDocument)  # every field has a default: building cannot fail
    return dataclasses.replace(parsed, format=doc.get("format", 1))


def view(doc: StateDocument | dict | None) -> StateDocument | None:
    """A document as readers want it: parsed when given the published dict; None (or an empty dict) is none yet."""
    if isinstance(doc, StateDocument):
        return doc
    return parse(doc) if doc else None


def parse_section(cls: type[T], raw) -> T | None:
    """One section (any of the dataclasses above, or a sample it holds) from JSON data; None when unusable."""
    built = _converter(cls)(raw)
    return None if built is _BAD else built


_BAD = object()  # a value that does not fit its field


@functools.cache
def _converter(tp) -> typing.Callable:
    """A function from JSON data to a value of type tp, or _BAD when it does not fit: built once per type.

    Containers keep the items that fit and drop the others; a dataclass takes the
    default of each field that is missing or does not fit, and is _BAD only when
    a field without a default is.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is types.UnionType or origin is typing.Union:
        nullable = type(None) in args
        choices = tuple(_converter(a) for a in args if a is not type(None))

        def union(raw):
            if raw is None:
                return None if nullable else _BAD
            for choice in choices:
                value = choice(raw)
                if value is not _BAD:
                    return value
            return _BAD

        return union
    if origin is dict:
        key_of, value_of = _converter(args[0]), _converter(args[1])

        def mapping(raw):
            if not isinstance(raw, dict):
                return _BAD
            pairs = ((key_of(k), value_of(v)) for k, v in raw.items())
            return {k: v for k, v in pairs if k is not _BAD and v is not _BAD}

        return mapping
    if origin is tuple and args[-1] is not Ellipsis:  # fixed length: (upper, count), (major, minor)
        members = tuple(_converter(a) for a in args)

        def record(raw):
            if not isinstance(raw, list | tuple) or len(raw) != len(members):
                return _BAD
            items = tuple(member(r) for member, r in zip(members, raw, strict=True))
            return _BAD if any(v is _BAD for v in items) else items

        return record
    if origin is list or origin is tuple:
        item_of, make = _converter(args[0]), origin

        def sequence(raw):
            if not isinstance(raw, list | tuple):
                return _BAD
            return make(v for v in map(item_of, raw) if v is not _BAD)

        return sequence
    if tp is bool:
        return lambda raw: raw if isinstance(raw, bool) else _BAD
    if tp is int:
        return _integer
    if tp is float:
        return _real
    if tp is str:
        return lambda raw: raw if isinstance(raw, str) else _BAD
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = {m.value: m for m in tp}  # every enum in the document is str-valued

        return lambda raw: members.get(raw, _BAD) if isinstance(raw, str) else _BAD
    if dataclasses.is_dataclass(tp):
        return _dataclass_converter(tp)
    raise TypeError(f"no reader for {tp!r} in the state document")  # a programming error, found at import


def _dataclass_converter(cls: type) -> typing.Callable:
    hints = typing.get_type_hints(cls)
    plan = []  # (field name, document key, converter, required)
    for f in dataclasses.fields(cls):
        if f.init:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            plan.append((f.name, f.metadata.get(KEY, f.name), _converter(hints[f.name]), required))

    def build(raw):
        if not isinstance(raw, dict):
            return _BAD
        values = {}
        for name, key, convert, required in plan:
            value = convert(raw[key]) if key in raw else _BAD
            if value is not _BAD:
                values[name] = value
            elif required:
                return _BAD
        return cls(**values)

    return build


def _integer(raw):
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else _BAD


def _real(raw):
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return _BAD
    try:
        value = float(raw)
    except OverflowError:  # an int past float's range
        return _BAD
    return value if math.isfinite(value) else _BAD


_converter(StateDocument)  # at import: a field of a type with no reader fails here, not in a reader


def _to_json(value):
    """JSON-ready data: dataclasses as objects under their document keys (DERIVED fields left out), enums as their values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.metadata.get(KEY, f.name): _to_json(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not f.metadata.get(DERIVED)
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(_to_json(k)): _to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    return value
