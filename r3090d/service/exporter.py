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

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

from r3090d.core.snapshot import CLOCK_EVENT_REASONS, GpuSample, GpuStatus, HealthStatus
from r3090d.core.vocabulary import FAST_DETECTORS, Phase, RestartReason
from r3090d.core.xid import XidClass
from r3090d.service.httpserver import HttpReply, HttpRequest, _HttpServer, text_reply
from r3090d.service.statedoc import StateDocument, view

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


# ------------------------------------------------------------------ metrics


def _healing_families(d: StateDocument) -> list:
    """What holds starts, and what heals by itself: gauges that stay put while a condition lasts."""
    heal, engine = d.healing, d.engine
    out = []
    for name, help_, value in (
        ("r3090d_engine_given_up", "1 from a give-up until an engine succeeds again (automatic attempts do not clear it)", 1 if heal.given_up else 0),
        ("r3090d_give_up_retry_attempts", "automatic start attempts since the give-up (watchdog.give_up_retry)", heal.retry_attempts),
        ("r3090d_give_up_next_attempt_timestamp_seconds", "Unix time of the next automatic start attempt (absent: none due)", heal.next_retry_at),
        ("r3090d_gpu_reset_needed", "1 while no engine may start until the GPU is reset (an XID, or the driver's recovery action)", 1 if heal.reset_hold else 0),
        ("r3090d_engine_waiting_for_gpu", "1 while an automatic start waits for other processes to free GPU memory", 1 if engine.phase is Phase.WAITING_FOR_GPU else 0),
    ):
        fam = GaugeMetricFamily(name, help_)
        if value is not None:
            fam.add_metric([], float(value))
        out.append(fam)
    xids = CounterMetricFamily("r3090d_xid_errors", "XID errors NVML reported since the daemon started, by class", labels=["class"])
    for cls in XidClass:
        xids.add_metric([cls.value], float(heal.xid_by_class.get(cls.value, 0)))
    out.append(xids)
    scale = GaugeMetricFamily("r3090d_detector_window_scale", "a fast freeze detector's window as a multiple of its setting (widened after repeated trips)", labels=["detector"])
    for reason in FAST_DETECTORS:
        scale.add_metric([reason.value], float(heal.detector_scale.get(reason.value, 1)))
    out.append(scale)
    return out


def _canary_families(d: StateDocument) -> list:
    """The known-answer canary: when it last matched, and what it found (absent while it is off)."""
    c = d.canary
    if not c.enabled:
        return []
    out = []
    for name, help_, value in (
        ("r3090d_canary_last_match_timestamp_seconds", "Unix time the canary last matched the engine's baseline (absent: never)", c.last_match_at),
        ("r3090d_canary_last_ok_timestamp_seconds", "Unix time of the last canary that matched or was inconclusive (nothing wrong seen; absent: never)", c.last_ok_at),
        ("r3090d_canary_last_margin_nats", "the baseline's top-1 minus top-2 log-probability where the last comparison was decided", c.last_margin),
        ("r3090d_canary_interval_seconds", "how often the canary compares while the engine is ready (canary.interval)", c.interval_s),
        ("r3090d_canary_baseline_tokens", "tokens of the baseline compared (its confident prefix; absent: no baseline yet)", c.baseline_tokens),
    ):
        fam = GaugeMetricFamily(name, help_)
        if value is not None:
            fam.add_metric([], float(value))
        out.append(fam)
    for name, help_, value in (
        ("r3090d_canary_checks", "canary comparisons that ended since the daemon started", c.checks),
        ("r3090d_canary_mismatches", "canary comparisons that found wrong output", c.mismatches),
        ("r3090d_canary_inconclusive", "canary comparisons that differed only at a near tie, twice", c.inconclusive),
        ("r3090d_canary_errors", "canaries that got no answer (never a restart)", c.errors),
    ):
        fam = CounterMetricFamily(name, help_)
        fam.add_metric([], float(value))
        out.append(fam)
    return out


# Stands in for a GPU that cannot be read (or is not watched): every measurement unknown, so its gauges are left out.
NO_READING = GpuSample(GpuStatus.DISABLED)


def families(doc: StateDocument | dict | None, now: float) -> list:
    """Every metric family, from one state document (pure). Unknown values are left out, not zeroed."""
    out = []

    def gauge(name, doc_, value, labels=None, label_values=None):
        fam = GaugeMetricFamily(name, doc_, labels=labels)
        if value is not None:
            fam.add_metric(label_values or [], float(value))
        out.append(fam)
        return fam

    d = view(doc)
    code, _ = healthz(d, now)
    gauge("r3090d_serving", "1 when /healthz answers 200 (the load balancer may send traffic)", 1 if code == 200 else 0)
    if d is None:
        gauge("r3090d_engine_up", "1 when the engine is ready", 0)
        return out
    daemon, engine, metrics, restarts = d.daemon, d.engine, d.metrics, d.restarts
    thresholds = d.thresholds  # all None in an older daemon's document
    ready = engine.phase is Phase.READY

    # Not `instance`: Prometheus sets that label to the target, and would rename ours exported_instance.
    # host and unit_instance are also labels of the alerts r3090d sends Alertmanager itself, so a rule can
    # join them onto its own copy of a condition and Alertmanager's inhibit rule can match the two.
    info = GaugeMetricFamily("r3090d_info", "r3090d and the model it serves", labels=["version", "model", "unit_instance", "host"])
    info.add_metric([daemon.version, engine.model, "" if daemon.instance is None else str(daemon.instance), daemon.host], 1.0)
    out.append(info)
    gauge("r3090d_state_written_timestamp_seconds", "Unix time the daemon last wrote its state (once per tick)", d.written_at)
    gauge("r3090d_engine_up", "1 when the engine is ready", 1 if ready else 0)
    states = GaugeMetricFamily("r3090d_engine_state", "the engine's phase, one-hot", labels=["state"])
    for p in PHASES:
        states.add_metric([p], 1.0 if engine.phase == p else 0.0)
    out.append(states)
    gauge("r3090d_maintenance", "1 while maintenance mode pauses remediation", 1 if engine.maintenance else 0)
    gauge("r3090d_engine_ready_timestamp_seconds", "Unix time the engine became ready (absent while not ready)", engine.ready_since if ready and engine.ready_since else None)
    # Absent, not 0, while no suspension stands (as the ready time is while not ready): a rule on the
    # suspension's age then needs no guard. A resume's room check leaves it standing, as suspended_long counts.
    held = d.suspend if d.suspend is not None and d.suspend.standing else None
    gauge("r3090d_suspended_since_timestamp_seconds", "Unix time the engine's current suspension began (absent while not suspended)", held.since if held else None)
    gauge("r3090d_suspended_host_bytes", "host memory (RSS) the suspended engine holds, its GPU memory included (absent while not suspended)", held.host_rss_bytes if held else None)
    gauge("r3090d_suspended_gpu_bytes", "GPU memory the suspended engine held, checkpointed: what a resume needs free (absent while not suspended)", held.gpu_bytes if held else None)

    counter = CounterMetricFamily("r3090d_restarts", "engine restarts since the daemon started, by reason", labels=["reason"])
    by_reason = {reason: 0 for reason in RESTART_REASONS} | restarts.by_reason
    for reason, n in sorted(by_reason.items()):
        counter.add_metric([reason], float(n))
    out.append(counter)
    gauge("r3090d_restart_backoff_level", "consecutive restarts without a stable period", restarts.backoff_level)
    # The daemon's own count, which its restart_storm alert judges: unlike increase() over the counter, it
    # holds restarts from before Prometheus' first scrape (or a daemon restart) for the whole window.
    gauge("r3090d_engine_recent_restarts", "unrequested engine restarts within the last r3090d_engine_restart_storm_window_seconds", restarts.recent)
    gauge("r3090d_engine_restart_storm_threshold", "recent restarts at which r3090d's restart_storm alert fires (watchdog.restart_storm_restarts)", thresholds.restart_storm_restarts)
    gauge("r3090d_engine_restart_storm_window_seconds", "the window recent restarts are counted in (watchdog.restart_storm_window)", thresholds.restart_storm_window_s)
    out.extend(_healing_families(d))
    out.extend(_canary_families(d))

    gauge("r3090d_kv_free_blocks", "free KV cache blocks: (num_gpu_blocks - 1) x (1 - usage)", metrics.free_blocks)
    gauge("r3090d_kv_free_blocks_threshold", "the KV rule's bound (watchdog.min_free_blocks): fewer free blocks than this is low", thresholds.kv_min_free_blocks)
    gauge("r3090d_kv_usage_ratio", "vLLM's KV cache usage, 0..1", metrics.kv_usage)
    gauge("r3090d_kv_total_blocks", "KV cache blocks vLLM allocated", metrics.num_gpu_blocks)
    gauge("r3090d_requests_running", "requests the engine is running", metrics.running)
    gauge("r3090d_requests_waiting", "requests waiting in the engine's queue", metrics.waiting)
    gauge("r3090d_inference_probe_latency_seconds", "how long the last finished inference probe took", d.inference.latency_s)
    gauge("r3090d_inference_probe_timestamp_seconds", "Unix time the last inference probe finished", d.inference.finished_at)

    gpu = d.gpu or NO_READING
    g = gpu if gpu.status is GpuStatus.OK else NO_READING
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
    out.append(clocks)

    firing, book = d.alerts.firing, d.alert_book.entries
    fam = GaugeMetricFamily("r3090d_alerts_firing", "1 while an alert is firing (0: known, not firing)", labels=["alert", "severity"])
    for key in sorted(set(firing) | set(book)):
        severity = firing[key].severity if key in firing else book[key].severity
        fam.add_metric([key, severity], 1.0 if key in firing else 0.0)
    out.append(fam)
    silenced = GaugeMetricFamily("r3090d_alert_silenced_until_timestamp_seconds", "Unix time until which an alert's notifications are silenced", labels=["alert"])
    for key, until in sorted(d.alerts.active_silences(now).items()):
        silenced.add_metric([key], until)
    out.append(silenced)

    hist = d.telemetry.poll_duration_seconds
    if hist is not None:
        buckets = [(_le(upper), float(n)) for upper, n in hist.buckets] + [("+Inf", float(hist.count))]
        h = HistogramMetricFamily("r3090d_poll_duration_seconds", "duration of the daemon's ticks (probes, policy, effectors)")
        h.add_metric([], buckets, hist.sum)
        out.append(h)
    return out


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
