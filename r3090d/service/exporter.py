"""The Prometheus exporter, /healthz and /livez, all read from the daemon's latest state document.

`/metrics` is prometheus_client's exposition of a custom collector: collect()
builds every r3090d family from the latest state document (read through
statedoc.parse, into the types the daemon wrote it from), so a scrape never
touches the engine, NVML or the loop; prometheus_client's ProcessCollector adds
the daemon's own CPU, memory and file descriptors. Points in time are Unix
timestamps (`*_timestamp_seconds`), so a rule computes ages with time() and a
sample does not change between two scrapes of one document.

`/healthz` answers 200 only while the engine is ready, its last /health was OK,
the daemon is not in maintenance and its state is fresh; otherwise 503 with a
one-line reason. A load balancer that checks it takes the node out when a
drained restart starts: the policy holds the engine's SIGTERM for
watchdog.lb_grace after publishing DRAINING.

In swap mode (several models behind the router) `/healthz` answers 200 while
the router is up and linked to the daemon and at least one model has not failed:
the router can serve, or queue a request for a model while it is swapped in.
`/healthz/<served_model>` answers for one model: 200 while it can be served now
or after a swap (ready, parked, cold, ...), 503 once it has failed or given up,
404 for a model r3090d does not serve.

`/livez` answers 200 while the daemon's loop ticks, whatever the engine does
(starting, in maintenance, given up), and 503 once the state has gone stale: a
liveness probe restarts the supervisor only when the supervisor itself is stuck.

The tick-duration histogram and the XID counter are kept by TickStats, which
the loop feeds once per tick; its numbers travel in the state document too.
"""

from __future__ import annotations

import logging
import socket
import time
import urllib.parse
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

from r3090d.core.arbiter import Residency
from r3090d.core.snapshot import CLOCK_EVENT_REASONS, GpuSample, GpuStatus, HealthStatus
from r3090d.core.vocabulary import FAST_DETECTORS, Phase, RestartReason
from r3090d.core.xid import XidClass
from r3090d.service.httpserver import HttpReply, HttpRequest, _HttpServer, text_reply
from r3090d.service.statedoc import (
    SWAP_BUCKETS,
    Histogram,
    ModelDoc,
    StateDocument,
    SuspendInfo,
    SwapInfo,
    view,
)

log = logging.getLogger("r3090d.service.exporter")

POLL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STALE_MIN_S = 10.0  # /healthz: state older than max(this, STALE_POLLS x poll_interval) means a stuck loop
STALE_POLLS = 5
# Every reason the policy restarts for, exported at 0 from the start so that
# increase() sees the first restart of each (a new series starts unseen).
RESTART_REASONS = tuple(r.value for r in RestartReason)
PHASES = tuple(p.value for p in Phase)


class TickStats:
    """Fed by the loop once per tick; read through the state document."""

    def __init__(self, buckets: tuple[float, ...] = POLL_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, tick_s: float) -> None:
        for i, upper in enumerate(self.buckets):
            if tick_s <= upper:
                self.counts[i] += 1
                break
        self.count += 1
        self.sum += tick_s

    def to_json(self) -> dict:
        cumulative, running = [], 0
        for upper, n in zip(self.buckets, self.counts, strict=True):
            running += n
            cumulative.append([upper, running])
        return {
            "poll_duration_seconds": {"buckets": cumulative, "count": self.count, "sum": round(self.sum, 6)},
        }


# ------------------------------------------------------------------ verdicts


def stale_after(doc: StateDocument | dict) -> float:
    d = view(doc)
    poll = d.daemon.poll_interval if d is not None else None
    return max(STALE_MIN_S, STALE_POLLS * (poll or 2.0))


NO_STATE = "r3090d is starting: no state yet"
# Phases of a restart under way: /healthz names the restart's reason.
RESTART_PHASES = frozenset({Phase.DRAINING, Phase.RESTARTING, Phase.BACKOFF})


def _stale(doc: StateDocument, now: float) -> str | None:
    """Why the daemon's loop must be stuck (its state is older than stale_after), or None."""
    age = now - (doc.written_at or 0.0)
    bound = stale_after(doc)
    if age > bound:
        return f"r3090d state is {age:.0f} s old (stale after {bound:.0f} s): the daemon loop is stuck"
    return None


def livez(doc: StateDocument | dict | None, now: float) -> tuple[int, str]:
    """(200, "alive") while the loop ticks, else (503, why): pure. What the engine does is not its concern."""
    d = view(doc)
    if d is None:
        return 503, NO_STATE
    stuck = _stale(d, now)
    return (503, stuck) if stuck else (200, "alive")


def healthz(doc: StateDocument | dict | None, now: float) -> tuple[int, str]:
    """(200, "ready") or (503, why): pure, from the state document and the wall clock."""
    d = view(doc)
    if d is None:
        return 503, NO_STATE
    stuck = _stale(d, now)
    if stuck:
        return 503, stuck
    if d.swap_mode:
        return _swap_healthz(d)
    engine = d.engine
    if engine.phase is not Phase.READY:
        reason = d.restarts.last_reason if engine.phase in RESTART_PHASES else None
        why = f" ({reason} restart)" if reason else ""
        if engine.phase is Phase.GIVEN_UP:
            why = f": {d.give_up_reason or 'gave up'}"
        return 503, f"engine {engine.phase_name}{why}"
    if engine.maintenance:
        return 503, "maintenance mode"
    health = d.health.status if d.health is not None else None
    if health is not HealthStatus.OK:
        return 503, f"engine /health {health or 'unknown'}"
    return 200, "ready"


def _router_down(d: StateDocument) -> str | None:
    """Why nothing can be served through the router now, or None: maintenance, the router down or unlinked."""
    router = (d.swap or SwapInfo()).router
    if d.maintenance:
        return "maintenance mode"
    if not router.up:
        return "the router is down"
    if not router.linked:
        return "the router has no link to the daemon"
    return None


def _swap_healthz(d: StateDocument) -> tuple[int, str]:
    """Swap mode: 200 while the router can serve or queue, for at least one model that has not failed."""
    down = _router_down(d)
    if down:
        return 503, down
    able = [m for m in d.models if not m.failed]
    if not able:
        return 503, "no model can be served: " + (", ".join(f"{m.name} {m.residency_name}" for m in d.models) or "none configured")
    ready = [m.name for m in able if m.residency is Residency.READY]
    return 200, f"serving: {', '.join(ready) or 'none'} ready; {len(able) - len(ready)} more after a swap"


MODEL_HEALTH = {
    Residency.READY: "ready",
    Residency.STARTING: "starting: served once ready",
    Residency.WAITING: "waiting for GPU memory held outside r3090d: served once they let go",
    Residency.RESUMING: "resuming: served once back on the GPU",
    Residency.PARKING: "parking: served after a swap",
    Residency.PARKED: "parked: served after a swap",
    Residency.STOPPING: "stopping: served after a cold start",
    Residency.COLD: "cold: served after a cold start",
}


def model_healthz(doc: StateDocument | dict | None, name: str, now: float) -> tuple[int, str]:
    """/healthz/<served_model>, pure: 200 while the model can be served now or after a swap; 503 when it has
    failed or nothing can be served; 404 for a model r3090d does not serve (or in single mode: /healthz is the one)."""
    d = view(doc)
    if d is None:
        return 503, NO_STATE
    stuck = _stale(d, now)
    if stuck:
        return 503, stuck
    if not d.swap_mode:
        return 404, "not found: r3090d serves one model here; its health is /healthz"
    model = d.model(name)
    if model is None:
        return 404, f"not found: no model {name[:128]!r}; served: {', '.join(m.name for m in d.models)}"
    down = _router_down(d)
    if down:
        return 503, down
    if model.failed:
        reason = model.give_up_reason or model.healing.reset_hold
        return 503, f"{model.residency_name}" + (f": {reason}" if reason else "")
    if model.residency is None:
        return 503, f"in a state this r3090d does not know: {model.residency_name}"
    return 200, MODEL_HEALTH.get(model.residency, model.residency_name)


# ------------------------------------------------------------------ metrics


@dataclass(frozen=True)
class _Engine:
    """One engine's series: its label values (none in single mode; its served model in swap mode) and its sections."""

    labels: tuple[str, ...]
    doc: StateDocument  # the engine's sections at the top level (StateDocument.for_model in swap mode)
    model: ModelDoc | None = None  # swap mode: the model it serves

    @property
    def on_gpu(self) -> bool:
        """Its readings are current: the only engine of single mode, or a resident one (a parked engine's are from before)."""
        return self.model is None or self.model.resident


class _Families:
    """The families of one collect(), each built once: a family named twice would be exported twice."""

    def __init__(self, engines: list[_Engine], engine_labels: list[str]):
        self.out: list = []
        self.engines = engines
        self.engine_labels = engine_labels  # ["served_model"] in swap mode

    def gauge(self, name: str, help_: str, value, labels: list[str] | None = None, label_values: list[str] | None = None):
        fam = GaugeMetricFamily(name, help_, labels=labels)
        if value is not None:
            fam.add_metric(label_values or [], float(value))
        self.out.append(fam)
        return fam

    def per_engine(self, name: str, help_: str, value_of, family=GaugeMetricFamily, engines: list[_Engine] | None = None):
        """A family with a sample per engine (labelled served_model in swap mode); an engine's None is left out."""
        fam = family(name, help_, labels=self.engine_labels)
        for e in self.engines if engines is None else engines:
            value = value_of(e)
            if value is not None:
                fam.add_metric(list(e.labels), float(value))
        self.out.append(fam)
        return fam

    def per_engine_by(self, name: str, help_: str, label: str, values_of, family=GaugeMetricFamily, engines: list[_Engine] | None = None):
        """A family with a sample per engine and value of `label`: values_of(engine) gives (label value, value) pairs."""
        fam = family(name, help_, labels=[*self.engine_labels, label])
        for e in self.engines if engines is None else engines:
            for key, value in values_of(e):
                fam.add_metric([*e.labels, key], float(value))
        self.out.append(fam)
        return fam


def _engine_families(f: _Families) -> None:
    """What each engine has: its phase, restarts, give-up and freeze detectors, suspension, canary, KV cache, probe."""
    ready = lambda e: e.doc.engine.phase is Phase.READY  # noqa: E731
    f.per_engine("r3090d_engine_up", "1 when the engine is ready", lambda e: 1 if ready(e) else 0)
    f.per_engine_by("r3090d_engine_state", "the engine's phase, one-hot", "state", lambda e: ((p, 1 if e.doc.engine.phase == p else 0) for p in PHASES))
    f.per_engine(
        "r3090d_engine_ready_timestamp_seconds",
        "Unix time the engine became ready (absent while not ready)",
        lambda e: e.doc.engine.ready_since if ready(e) and e.doc.engine.ready_since else None,
    )
    # Absent, not 0, while no suspension stands (as the ready time is while not ready): a rule on the
    # suspension's age then needs no guard. A resume's room check leaves it standing, as suspended_long counts.
    # Only the operator's suspensions: an engine parked for another model (swap mode) is no card lent and forgotten.
    def held(e: _Engine) -> SuspendInfo | None:
        s = e.doc.suspend
        return s if s is not None and s.standing and not s.parked else None

    f.per_engine("r3090d_suspended_since_timestamp_seconds", "Unix time the engine's current suspension began (absent while not suspended)",
                 lambda e: held(e).since if held(e) else None)  # fmt: skip
    f.per_engine("r3090d_suspended_host_bytes", "host memory (RSS) the suspended engine holds, its GPU memory included (absent while not suspended)",
                 lambda e: held(e).host_rss_bytes if held(e) else None)  # fmt: skip
    f.per_engine("r3090d_suspended_gpu_bytes", "GPU memory the suspended engine held, checkpointed: what a resume needs free (absent while not suspended)",
                 lambda e: held(e).gpu_bytes if held(e) else None)  # fmt: skip

    f.per_engine_by("r3090d_restarts", "engine restarts by reason (one engine: counted on across daemon restarts)", "reason",
                    lambda e: sorted(({reason: 0 for reason in RESTART_REASONS} | e.doc.restarts.by_reason).items()), family=CounterMetricFamily)  # fmt: skip
    f.per_engine("r3090d_restart_backoff_level", "consecutive restarts without a stable period", lambda e: e.doc.restarts.backoff_level)
    # The daemon's own count, which its restart_storm alert judges: unlike increase() over the counter, it
    # holds restarts from before Prometheus' first scrape (or a daemon restart) for the whole window.
    f.per_engine("r3090d_engine_recent_restarts", "unrequested engine restarts within the last r3090d_engine_restart_storm_window_seconds",
                 lambda e: e.doc.restarts.recent)  # fmt: skip

    # What holds starts, and what heals by itself: gauges that stay put while a condition lasts.
    f.per_engine("r3090d_engine_given_up", "1 from a give-up until an engine succeeds again (automatic attempts do not clear it)",
                 lambda e: 1 if e.doc.healing.given_up else 0)  # fmt: skip
    f.per_engine("r3090d_give_up_retry_attempts", "automatic start attempts since the give-up (watchdog.give_up_retry)", lambda e: e.doc.healing.retry_attempts)
    f.per_engine("r3090d_give_up_next_attempt_timestamp_seconds", "Unix time of the next automatic start attempt (absent: none due)",
                 lambda e: e.doc.healing.next_retry_at)  # fmt: skip
    f.per_engine("r3090d_engine_waiting_for_gpu", "1 while an automatic start waits for other processes to free GPU memory",
                 lambda e: 1 if e.doc.engine.phase is Phase.WAITING_FOR_GPU else 0)  # fmt: skip
    f.per_engine_by("r3090d_detector_window_scale", "a fast freeze detector's window as a multiple of its setting (widened after repeated trips)", "detector",
                    lambda e: ((reason.value, e.doc.healing.detector_scale.get(reason.value, 1)) for reason in FAST_DETECTORS))  # fmt: skip

    _canary_families(f)

    # A parked engine's last readings are from before it left the GPU: left out, not shown as current.
    current = [e for e in f.engines if e.on_gpu]
    f.per_engine("r3090d_kv_free_blocks", "free KV cache blocks: (num_gpu_blocks - 1) x (1 - usage)", lambda e: e.doc.metrics.free_blocks, engines=current)
    f.per_engine("r3090d_kv_usage_ratio", "vLLM's KV cache usage, 0..1", lambda e: e.doc.metrics.kv_usage, engines=current)
    f.per_engine("r3090d_kv_total_blocks", "KV cache blocks vLLM allocated", lambda e: e.doc.metrics.num_gpu_blocks, engines=current)
    f.per_engine("r3090d_requests_running", "requests the engine is running", lambda e: e.doc.metrics.running, engines=current)
    f.per_engine("r3090d_requests_waiting", "requests waiting in the engine's queue", lambda e: e.doc.metrics.waiting, engines=current)
    f.per_engine("r3090d_inference_probe_latency_seconds", "how long the last finished inference probe took", lambda e: e.doc.inference.latency_s)
    f.per_engine("r3090d_inference_probe_timestamp_seconds", "Unix time the last inference probe finished", lambda e: e.doc.inference.finished_at)


def _canary_families(f: _Families) -> None:
    """The known-answer canary: when it last matched, and what it found (absent while it is off)."""
    on = [e for e in f.engines if e.doc.canary.enabled]
    if not on:
        return
    for name, help_, value_of in (
        ("r3090d_canary_last_match_timestamp_seconds", "Unix time the canary last matched the engine's baseline (absent: never)", lambda c: c.last_match_at),
        ("r3090d_canary_last_ok_timestamp_seconds", "Unix time of the last canary that matched or was inconclusive (nothing wrong seen; absent: never)", lambda c: c.last_ok_at),
        ("r3090d_canary_last_margin_nats", "the baseline's top-1 minus top-2 log-probability where the last comparison was decided", lambda c: c.last_margin),
        ("r3090d_canary_interval_seconds", "how often the canary compares while the engine is ready (canary.interval)", lambda c: c.interval_s),
        ("r3090d_canary_baseline_tokens", "tokens of the baseline compared (its confident prefix; absent: no baseline yet)", lambda c: c.baseline_tokens),
    ):  # fmt: skip
        f.per_engine(name, help_, lambda e, value_of=value_of: value_of(e.doc.canary), engines=on)
    for name, help_, value_of in (
        ("r3090d_canary_checks", "canary comparisons that ended since the daemon started", lambda c: c.checks),
        ("r3090d_canary_mismatches", "canary comparisons that found wrong output", lambda c: c.mismatches),
        ("r3090d_canary_inconclusive", "canary comparisons that differed only at a near tie, twice", lambda c: c.inconclusive),
        ("r3090d_canary_errors", "canaries that got no answer (never a restart)", lambda c: c.errors),
    ):
        f.per_engine(name, help_, lambda e, value_of=value_of: value_of(e.doc.canary), family=CounterMetricFamily, engines=on)


RESIDENCIES = tuple(r.value for r in Residency)


def _swap_families(f: _Families, d: StateDocument) -> None:
    """Swap mode: where each model is and how it is used, the swaps, the router, host memory for parked engines."""
    swap = d.swap or SwapInfo()
    models = f.engines
    f.per_engine("r3090d_model_resident", "1 while the model's engine is on the GPU or taking its place there (ready, starting, resuming)",
                 lambda e: 1 if e.model.resident else 0)  # fmt: skip
    f.per_engine_by("r3090d_model_state", "the model's residency (cold, starting, ready, parking, parked, resuming, stopping, failed), one-hot", "state",
                    lambda e: ((r, 1 if e.model.residency == r else 0) for r in RESIDENCIES))  # fmt: skip
    f.per_engine("r3090d_model_host_memory_bytes", "host memory the parked engine holds: its GPU memory plus its base RSS (0 when not parked)",
                 lambda e: e.model.host_bytes)  # fmt: skip
    f.per_engine("r3090d_model_gpu_memory_bytes", "GPU memory the model's engine holds resident, or held before it was parked", lambda e: e.model.gpu_bytes)
    f.per_engine("r3090d_model_last_used_timestamp_seconds", "Unix time of the model's last request through the router (absent: never used)",
                 lambda e: e.model.last_used)  # fmt: skip
    f.per_engine("r3090d_model_requests_waiting", "requests queued at the router until the model is on the GPU", lambda e: e.model.waiting)
    f.per_engine("r3090d_model_requests_inflight", "requests open at the router toward the model's engine (frozen ones included)", lambda e: e.model.inflight)
    f.per_engine("r3090d_model_requests_frozen", "requests frozen with the parked engine, to finish when it is back", lambda e: e.model.frozen)
    f.per_engine("r3090d_swaps", "times the model was brought onto the GPU (resumed or cold-started) for its requests", lambda e: e.model.swaps_in,
                 family=CounterMetricFamily, engines=models)  # fmt: skip
    failures = CounterMetricFamily("r3090d_swap_failures", "swaps that ended without the target model serving, by outcome: failed "
                                   "(the target could not come in) or abandoned (nobody asked for it any more)", labels=["outcome"])  # fmt: skip
    failures.add_metric(["failed"], float(swap.failed))
    failures.add_metric(["abandoned"], float(swap.abandoned))
    f.out.append(failures)
    hist = swap.latency if swap.latency.buckets else Histogram.empty(SWAP_BUCKETS)
    h = HistogramMetricFamily("r3090d_swap_seconds", "a swap's duration: from its decision until the router routes to the target model")
    h.add_metric([], [(_le(upper), float(n)) for upper, n in hist.buckets] + [("+Inf", float(hist.count))], hist.sum)
    f.out.append(h)
    f.gauge("r3090d_swap_in_progress", "1 while a swap is under way", 1 if swap.in_progress is not None else 0)
    f.gauge("r3090d_router_up", "1 while the router's process runs and listens on the public port", 1 if swap.router.up else 0)
    restarts = CounterMetricFamily("r3090d_router_restarts", "router restarts since the daemon started")
    restarts.add_metric([], float(swap.router.restarts))
    f.out.append(restarts)
    f.gauge("r3090d_host_memory_budget_bytes", "host memory parked engines may hold (absent: not known yet)", swap.host_budget_bytes)
    f.gauge("r3090d_host_memory_parked_bytes", "host memory parked engines hold now", swap.host_parked_bytes)


# Stands in for a GPU that cannot be read (or is not watched): every measurement unknown, so its gauges are left out.
NO_READING = GpuSample(GpuStatus.DISABLED)


def families(doc: StateDocument | dict | None, now: float) -> list:
    """Every metric family, from one state document (pure). Unknown values are left out, not zeroed.

    In swap mode each engine's series carry the label served_model, and /healthz's
    r3090d_serving has a series per model too (its /healthz/<served_model>);
    what is the card's or the daemon's (r3090d_info, the GPU, the thresholds,
    maintenance, alerts, ticks) is exported once, without it.
    """
    d = view(doc)
    if d is None:
        f = _Families([], [])
        f.gauge("r3090d_serving", "1 when /healthz answers 200 (the load balancer may send traffic)", 0)
        f.gauge("r3090d_engine_up", "1 when the engine is ready", 0)
        return f.out
    if d.swap_mode:
        # Each served name once, and never empty (the node's own series has none): a damaged document must not
        # export a series twice, which would make the whole scrape unreadable.
        named = {m.name: m for m in reversed(d.models) if m.name}
        f = _Families([_Engine((m.name,), d.for_model(m), m) for m in d.models if named.get(m.name) is m], ["served_model"])
    else:
        f = _Families([_Engine((), d)], [])
    code, _ = healthz(d, now)
    serving = f.gauge("r3090d_serving", "1 when /healthz answers 200 (the load balancer may send traffic); in swap mode also per model, from /healthz/<served_model>",
                      1 if code == 200 else 0, labels=f.engine_labels, label_values=[""] * len(f.engine_labels))  # fmt: skip
    for e in f.engines if d.swap_mode else ():
        serving.add_metric(list(e.labels), 1.0 if model_healthz(d, e.model.name, now)[0] == 200 else 0.0)
    daemon, engine = d.daemon, d.engine
    thresholds = d.thresholds  # all None in an older daemon's document

    # Not `instance`: Prometheus sets that label to the target, and would rename ours exported_instance.
    # host and unit_instance are also labels of the alerts r3090d sends Alertmanager itself, so a rule can
    # join them onto its own copy of a condition and Alertmanager's inhibit rule can match the two.
    info = GaugeMetricFamily("r3090d_info", "r3090d and the model it serves", labels=["version", "model", "unit_instance", "host"])
    info.add_metric([daemon.version, engine.model, "" if daemon.instance is None else str(daemon.instance), daemon.host], 1.0)
    f.out.append(info)
    f.gauge("r3090d_state_written_timestamp_seconds", "Unix time the daemon last wrote its state (once per tick)", d.written_at)
    f.gauge("r3090d_maintenance", "1 while maintenance mode pauses remediation", 1 if d.maintenance else 0)
    _engine_families(f)
    if d.swap_mode:
        _swap_families(f, d)
    f.gauge("r3090d_engine_restart_storm_threshold", "recent restarts at which r3090d's restart_storm alert fires (watchdog.restart_storm_restarts)", thresholds.restart_storm_restarts)
    f.gauge("r3090d_engine_restart_storm_window_seconds", "the window recent restarts are counted in (watchdog.restart_storm_window)", thresholds.restart_storm_window_s)
    f.gauge("r3090d_kv_free_blocks_threshold", "the KV rule's bound (watchdog.min_free_blocks): fewer free blocks than this is low", thresholds.kv_min_free_blocks)

    # The card: its reset hold and XIDs (swap mode judges the card once, for every engine on it).
    heal = d.healing
    reset_hold = heal.reset_hold or next((m.healing.reset_hold for m in d.models if m.healing.reset_hold), None)
    f.gauge("r3090d_gpu_reset_needed", "1 while no engine may start until the GPU is reset (an XID, or the driver's recovery action)", 1 if reset_hold else 0)
    xids = CounterMetricFamily("r3090d_xid_errors", "XID errors NVML reported since the daemon started, by class", labels=["class"])
    for cls in XidClass:
        xids.add_metric([cls.value], float(heal.xid_by_class.get(cls.value, 0)))
    f.out.append(xids)

    gpu = d.gpu or NO_READING
    g = gpu if gpu.status is GpuStatus.OK else NO_READING
    gauge = f.gauge
    gauge("r3090d_gpu_lost", "1 when NVML reports the GPU lost (reboot needed)", 1 if gpu.lost or gpu.status is GpuStatus.LOST else 0)
    gauge("r3090d_gpu_memory_used_bytes", "GPU memory used (NVML v2, without driver-reserved)", g.memory_used)
    gauge("r3090d_gpu_memory_total_bytes", "GPU memory in total", g.memory_total)
    gauge("r3090d_gpu_memory_alert_threshold_bytes", "GPU memory used above which r3090d alerts (watchdog.gpu_memory_alert_mib)", thresholds.gpu_memory_alert_bytes)
    gauge("r3090d_gpu_utilization_ratio", "GPU utilization, 0..1", g.utilization_gpu / 100.0 if g.utilization_gpu is not None else None)
    gauge("r3090d_gpu_temperature_celsius", "GPU temperature", g.temperature_c)
    gauge("r3090d_gpu_power_watts", "GPU power draw", g.power_w)
    gauge("r3090d_gpu_power_limit_watts", "GPU power limit", g.power_limit_w)
    gauge("r3090d_gpu_pcie_link_width", "current PCIe link width (lanes)", g.pcie_width)
    clocks = GaugeMetricFamily("r3090d_gpu_clock_event_reason", "1 for each reason NVML gives for holding the clocks down (throttling), 0 for the others", labels=["reason"])
    present = g.clock_event_reasons
    if present is not None:
        # Each known reason is exported, 0 when absent, so a panel or a rule sees a reason start rather
        # than a series appear; one the probe reports that is not listed (unknown_0x...) is exported too.
        for reason in CLOCK_EVENT_REASONS + tuple(r for r in present if r not in CLOCK_EVENT_REASONS):
            clocks.add_metric([reason], 1.0 if reason in present else 0.0)
    f.out.append(clocks)

    firing, book = d.alerts.firing, d.alert_book.entries
    fam = GaugeMetricFamily("r3090d_alerts_firing", "1 while an alert is firing (0: known, not firing)", labels=["alert", "severity"])
    for key in sorted(set(firing) | set(book)):
        severity = firing[key].severity if key in firing else book[key].severity
        fam.add_metric([key, severity], 1.0 if key in firing else 0.0)
    f.out.append(fam)
    silenced = GaugeMetricFamily("r3090d_alert_silenced_until_timestamp_seconds", "Unix time until which an alert's notifications are silenced", labels=["alert"])
    for key, until in sorted(d.alerts.active_silences(now).items()):
        silenced.add_metric([key], until)
    f.out.append(silenced)

    hist = d.telemetry.poll_duration_seconds
    if hist is not None:
        buckets = [(_le(upper), float(n)) for upper, n in hist.buckets] + [("+Inf", float(hist.count))]
        h = HistogramMetricFamily("r3090d_poll_duration_seconds", "duration of the daemon's ticks (probes, policy, effectors)")
        h.add_metric([], buckets, hist.sum)
        f.out.append(h)
    return f.out


def _le(upper: float) -> str:
    return repr(float(upper))


class LatestDocument:
    """get_doc's latest document, parsed once.

    The daemon publishes a new dict each tick and never changes one it has
    published, so every scrape and probe between two ticks reads the same one:
    it is parsed at its first read, not at each.
    """

    def __init__(self, get_doc):
        self._get_doc = get_doc
        self._last: tuple[object, StateDocument | None] = (None, None)  # (the dict, parsed)

    def __call__(self) -> StateDocument | None:
        raw = self._get_doc()
        seen, parsed = self._last
        if raw is not seen:
            parsed = view(raw)
            self._last = (raw, parsed)  # one assignment: the HTTP thread and a scrape may both be here
        return parsed


class StateCollector:
    """prometheus_client's collector protocol: collect() yields the families of the latest document."""

    def __init__(self, get_doc, clock=time.time):
        self._get_doc = get_doc if isinstance(get_doc, LatestDocument) else LatestDocument(get_doc)
        self._clock = clock

    def collect(self):
        yield from families(self._get_doc(), self._clock())


# ------------------------------------------------------------------ HTTP
#
# One thread around a selector, with non-blocking sockets, like the control
# socket: a client that sends its request a byte at a time costs a buffer, never
# a thread or a slot that /healthz needs. A request head must arrive whole within
# HEADER_TIMEOUT_S of the connect (a deadline, not a timeout per read that each
# dribbled byte would renew); the reply is computed right here from the latest
# state document (about a millisecond), so it needs no worker; and once
# MAX_HTTP_CONNECTIONS are open, the oldest is closed to make room for the newest,
# so no crowd of slow clients can hold every connection.


MODEL_HEALTH_PREFIX = "/healthz/"  # then the served model's name, percent-encoded where it must be
INDEX_PAGE = b'<html><body><a href="/metrics">/metrics</a> <a href="/healthz">/healthz</a> <a href="/livez">/livez</a></body></html>\n'


class Exporter:
    """HTTP on host:port: /metrics, /healthz, /livez, and a tiny index."""

    def __init__(self, host: str, port: int, get_doc, *, clock=time.time):
        self.host = host
        self.port = port
        self._get_doc = LatestDocument(get_doc)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StateCollector(self._get_doc, clock))
        ProcessCollector(registry=self.registry)  # /proc/self: the exporter runs inside the daemon
        self._clock = clock
        self._server: _HttpServer | None = None

    def start(self) -> Exporter:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._server = _HttpServer(self.host, self.port, family, self.respond)
        self.port = self._server.start()
        log.info("exporter on http://%s:%d (/metrics, /healthz, /livez)", self.host if family == socket.AF_INET else f"[{self.host}]", self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    def respond(self, request: HttpRequest) -> HttpReply:
        """The reply to one request; never raises (a failure is a 500, logged)."""
        try:
            if request.path == "/metrics":
                encoder, content_type = choose_encoder(request.accept)
                reply = HttpReply(200, content_type, encoder(self.registry))
            elif request.path == "/healthz":
                code, why = healthz(self._get_doc(), self._clock())
                reply = text_reply(code, why)
            elif request.path.startswith(MODEL_HEALTH_PREFIX):
                name = urllib.parse.unquote(request.path.removeprefix(MODEL_HEALTH_PREFIX), errors="replace")
                code, why = model_healthz(self._get_doc(), name, self._clock())
                reply = text_reply(code, why)
            elif request.path == "/livez":
                code, why = livez(self._get_doc(), self._clock())
                reply = text_reply(code, why)
            elif request.path == "/":
                reply = HttpReply(200, "text/html", INDEX_PAGE)
            else:
                reply = text_reply(404, "not found: try /metrics, /healthz or /livez")
        except Exception:
            log.exception("exporter: %s failed", request.path)
            reply = text_reply(500, "internal error")
        log.debug("%s %s: %d", request.method.value, request.path, reply.code)
        return reply
