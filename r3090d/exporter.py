"""The Prometheus exporter and /healthz, both read from the daemon's latest state document.

`/metrics` is prometheus_client's exposition of one custom collector: collect()
builds every family from the latest state document, so a scrape never touches
the engine, NVML or the loop. `/healthz` answers 200 only while the engine is
ready, its last /health was OK, the daemon is not in maintenance and its state
is fresh; otherwise 503 with a one-line reason. A load balancer that checks it
takes the node out when a drained restart starts: the policy holds the engine's
SIGTERM for watchdog.lb_grace after publishing DRAINING.

The tick-duration histogram and the XID counter are kept by TickStats, which
the loop feeds once per tick; its numbers travel in the state document too.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

from r3090d.policy import Phase

log = logging.getLogger("r3090d.exporter")

POLL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STALE_MIN_S = 10.0  # /healthz: state older than max(this, STALE_POLLS x poll_interval) means a stuck loop
STALE_POLLS = 5
MAX_HTTP_CONNECTIONS = 16
HTTP_TIMEOUT_S = 10.0
# Every reason the policy restarts for, exported at 0 from the start so that
# increase() sees the first restart of each (a new series starts unseen).
RESTART_REASONS = ("requested", "exited", "spawn_failed", "startup_timeout", "dead", "hung", "stalled", "kv")


class TickStats:
    """Fed by the loop once per tick; read through the state document."""

    def __init__(self, buckets: tuple[float, ...] = POLL_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0
        self.xid_errors_total = 0

    def observe(self, tick_s: float, xid_errors: tuple[int, ...] = ()) -> None:
        for i, upper in enumerate(self.buckets):
            if tick_s <= upper:
                self.counts[i] += 1
                break
        self.count += 1
        self.sum += tick_s
        self.xid_errors_total += len(xid_errors)

    def to_json(self) -> dict:
        cumulative, running = [], 0
        for upper, n in zip(self.buckets, self.counts, strict=True):
            running += n
            cumulative.append([upper, running])
        return {
            "poll_duration_seconds": {"buckets": cumulative, "count": self.count, "sum": round(self.sum, 6)},
            "xid_errors_total": self.xid_errors_total,
        }


# ------------------------------------------------------------------ verdicts


def stale_after(doc: dict) -> float:
    poll = (doc.get("daemon") or {}).get("poll_interval") or 2.0
    return max(STALE_MIN_S, STALE_POLLS * float(poll))


def healthz(doc: dict | None, now: float) -> tuple[int, str]:
    """(200, "ready") or (503, why): pure, from the state document and the wall clock."""
    if not doc:
        return 503, "r3090d is starting: no state yet"
    age = now - float(doc.get("written_at") or 0)
    if age > stale_after(doc):
        return 503, f"r3090d state is {age:.0f} s old: the daemon loop is stuck"
    engine = doc.get("engine") or {}
    phase = engine.get("phase")
    if phase != Phase.READY.value:
        reason = (doc.get("restarts") or {}).get("last_reason") if phase in ("draining", "restarting", "backoff") else None
        why = f" ({reason} restart)" if reason else ""
        if phase == Phase.GIVEN_UP.value:
            why = f": {doc.get('give_up_reason') or 'gave up'}"
        return 503, f"engine {phase}{why}"
    if engine.get("maintenance"):
        return 503, "maintenance mode"
    health = (doc.get("health") or {}).get("status")
    if health != "ok":
        return 503, f"engine /health {health}"
    return 200, "ready"


# ------------------------------------------------------------------ metrics


def families(doc: dict | None, now: float) -> list:
    """Every metric family, from one state document (pure). Unknown values are left out, not zeroed."""
    out = []

    def gauge(name, doc_, value, labels=None, label_values=None):
        fam = GaugeMetricFamily(name, doc_, labels=labels)
        if value is not None:
            fam.add_metric(label_values or [], float(value))
        out.append(fam)
        return fam

    code, _ = healthz(doc, now)
    gauge("r3090d_serving", "1 when /healthz answers 200 (the load balancer may send traffic)", 1 if code == 200 else 0)
    if not doc:
        gauge("r3090d_engine_up", "1 when the engine is ready", 0)
        return out
    daemon = doc.get("daemon") or {}
    engine = doc.get("engine") or {}
    metrics = doc.get("metrics") or {}
    gpu = doc.get("gpu") or {}
    restarts = doc.get("restarts") or {}
    alerts = doc.get("alerts") or {}
    telemetry = doc.get("telemetry") or {}
    phase = engine.get("phase")

    info = GaugeMetricFamily("r3090d_info", "r3090d and the model it serves", labels=["version", "model", "instance"])
    inst = daemon.get("instance")
    info.add_metric([str(daemon.get("version") or ""), str(engine.get("model") or ""), "" if inst is None else str(inst)], 1.0)
    out.append(info)
    gauge("r3090d_state_age_seconds", "seconds since the daemon last wrote its state", max(0.0, now - float(doc.get("written_at") or now)))
    gauge("r3090d_engine_up", "1 when the engine is ready", 1 if phase == Phase.READY.value else 0)
    states = GaugeMetricFamily("r3090d_engine_state", "the engine's phase, one-hot", labels=["state"])
    for p in Phase:
        states.add_metric([p.value], 1.0 if phase == p.value else 0.0)
    out.append(states)
    gauge("r3090d_maintenance", "1 while maintenance mode pauses remediation", 1 if engine.get("maintenance") else 0)
    ready_since = engine.get("ready_since")
    gauge("r3090d_engine_ready_seconds", "seconds since the engine became ready", max(0.0, now - ready_since) if phase == Phase.READY.value and ready_since else None)

    counter = CounterMetricFamily("r3090d_restarts", "engine restarts since the daemon started, by reason", labels=["reason"])
    by_reason = {reason: 0 for reason in RESTART_REASONS} | dict(restarts.get("by_reason") or {})
    for reason, n in sorted(by_reason.items()):
        counter.add_metric([reason], float(n))
    out.append(counter)
    gauge("r3090d_restart_backoff_level", "consecutive restarts without a stable period", restarts.get("backoff_level"))

    gauge("r3090d_kv_free_blocks", "free KV cache blocks: (num_gpu_blocks - 1) x (1 - usage)", metrics.get("free_blocks"))
    gauge("r3090d_kv_usage_ratio", "vLLM's KV cache usage, 0..1", metrics.get("kv_usage"))
    gauge("r3090d_kv_total_blocks", "KV cache blocks vLLM allocated", metrics.get("num_gpu_blocks"))
    gauge("r3090d_requests_running", "requests the engine is running", metrics.get("running"))
    gauge("r3090d_requests_waiting", "requests waiting in the engine's queue", metrics.get("waiting"))

    usable = gpu.get("status") == "ok"
    gauge("r3090d_gpu_lost", "1 when NVML reports the GPU lost (reboot needed)", 1 if gpu.get("lost") or gpu.get("status") == "lost" else 0)
    gauge("r3090d_gpu_memory_used_bytes", "GPU memory used (NVML v2, without driver-reserved)", gpu.get("memory_used") if usable else None)
    gauge("r3090d_gpu_memory_total_bytes", "GPU memory in total", gpu.get("memory_total") if usable else None)
    util = gpu.get("utilization_gpu")
    gauge("r3090d_gpu_utilization_ratio", "GPU utilization, 0..1", util / 100.0 if usable and util is not None else None)
    gauge("r3090d_gpu_temperature_celsius", "GPU temperature", gpu.get("temperature_c") if usable else None)
    gauge("r3090d_gpu_power_watts", "GPU power draw", gpu.get("power_w") if usable else None)
    gauge("r3090d_gpu_power_limit_watts", "GPU power limit", gpu.get("power_limit_w") if usable else None)
    gauge("r3090d_gpu_pcie_link_width", "current PCIe link width (lanes)", gpu.get("pcie_width") if usable else None)
    xid = CounterMetricFamily("r3090d_xid_errors", "XID critical-error events seen since the daemon started")
    xid.add_metric([], float(telemetry.get("xid_errors_total") or 0))
    out.append(xid)

    firing = alerts.get("firing") or {}
    book = ((doc.get("alert_book") or {}).get("entries")) or {}
    fam = GaugeMetricFamily("r3090d_alerts_firing", "1 while an alert is firing (0: known, not firing)", labels=["alert", "severity"])
    for key in sorted(set(firing) | set(book)):
        entry = firing.get(key) or book.get(key) or {}
        fam.add_metric([key, str(entry.get("severity") or "warning")], 1.0 if key in firing else 0.0)
    out.append(fam)
    silenced = GaugeMetricFamily("r3090d_alert_silenced_until_seconds", "unix time until which an alert's notifications are silenced", labels=["alert"])
    for key, until in sorted((alerts.get("silenced") or {}).items()):
        if until and until > now:
            silenced.add_metric([key], float(until))
    out.append(silenced)

    hist = telemetry.get("poll_duration_seconds")
    if hist:
        buckets = [(_le(upper), float(n)) for upper, n in hist["buckets"]] + [("+Inf", float(hist["count"]))]
        h = HistogramMetricFamily("r3090d_poll_duration_seconds", "duration of the daemon's ticks (probes, policy, effectors)")
        h.add_metric([], buckets, float(hist["sum"]))
        out.append(h)
    return out


def _le(upper: float) -> str:
    return repr(float(upper))


class StateCollector:
    """prometheus_client's collector protocol: collect() yields the families of the latest document."""

    def __init__(self, get_doc, clock=time.time):
        self._get_doc = get_doc
        self._clock = clock

    def collect(self):
        yield from families(self._get_doc(), self._clock())


# ------------------------------------------------------------------ HTTP


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, family):
        self.address_family = family
        self._slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # at capacity: drop, the scraper retries
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class Exporter:
    """HTTP on host:port: /metrics, /healthz, and a tiny index."""

    def __init__(self, host: str, port: int, get_doc, *, clock=time.time):
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StateCollector(get_doc, clock))
        self._get_doc = get_doc
        self._clock = clock
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Exporter:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._server = _Server((self.host, self.port), self._handler(), family)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5}, name="exporter", daemon=True)
        self._thread.start()
        log.info("exporter on http://%s:%d (/metrics, /healthz)", self.host if family == socket.AF_INET else f"[{self.host}]", self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)

    def _handler(self):
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            timeout = HTTP_TIMEOUT_S
            server_version = "r3090d"
            sys_version = ""

            def do_GET(self):
                self._answer(body=True)

            def do_HEAD(self):
                self._answer(body=False)

            def _answer(self, body: bool):
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        encoder, content_type = choose_encoder(self.headers.get("Accept"))
                        self._send(200, content_type, encoder(exporter.registry), body)
                    elif path == "/healthz":
                        code, why = healthz(exporter._get_doc(), exporter._clock())
                        self._send(code, "text/plain; charset=utf-8", (why + "\n").encode(), body)
                    elif path == "/":
                        page = b'<html><body><a href="/metrics">/metrics</a> <a href="/healthz">/healthz</a></body></html>\n'
                        self._send(200, "text/html", page, body)
                    else:
                        self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics or /healthz\n", body)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                except Exception:
                    log.exception("exporter: %s failed", path)
                    try:
                        self._send(500, "text/plain; charset=utf-8", b"internal error\n", body)
                    except OSError:
                        pass

            def _send(self, code: int, content_type: str, data: bytes, body: bool):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def log_message(self, format, *args):  # noqa: A002  (the base class's name)
                log.debug("%s %s", self.address_string(), format % args)

        return Handler
