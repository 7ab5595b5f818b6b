"""The exporter of a running daemon: /metrics parses, /healthz leads a drained restart.

/healthz must turn 503 before the engine gets its SIGTERM (by lb_grace), so a
load balancer has taken the node out by then; it turns 200 again once the new
engine is ready. The SIGTERM time comes from the double itself: the moment its
port stops answering (it closes its listener on SIGTERM), and its "Shutting
down" line, stamped when the daemon relayed it into its log (so no earlier than
the SIGTERM).
"""

from __future__ import annotations

import re
import threading
import time
from datetime import datetime

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from r3090d import control

pytestmark = pytest.mark.component


def scrape(d, accept: str | None = None) -> tuple[httpx.Response, dict]:
    r = httpx.get(d.exporter_url + "/metrics", headers={"Accept": accept} if accept else {}, timeout=5.0, trust_env=False)
    parse = parse_openmetrics if accept and "openmetrics" in accept else text_string_to_metric_families
    samples = {}
    for fam in parse(r.text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return r, samples


def test_metrics_scrape_parses_and_matches_the_engine(make_daemon):
    d = make_daemon(extra_args=["--fake-num-gpu-blocks", "777"], watchdog={"poll_interval": 0.2, "lb_grace": 0.2})
    d.start()
    st = d.wait_ready()
    d.fake("POST", "/fake/control", json={"metrics_values": {"running": 3, "waiting": 2, "kv_cache_usage_perc": 0.5}})
    time.sleep(0.6)
    r, m = scrape(d)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert m[("r3090d_engine_up", ())] == 1
    assert m[("r3090d_serving", ())] == 1
    assert m[("r3090d_engine_state", (("state", "ready"),))] == 1
    assert m[("r3090d_kv_total_blocks", ())] == 777
    assert m[("r3090d_kv_usage_ratio", ())] == 0.5
    assert m[("r3090d_kv_free_blocks", ())] == 388.0  # (777 - 1) x (1 - 0.5)
    assert m[("r3090d_requests_running", ())] == 3 and m[("r3090d_requests_waiting", ())] == 2
    assert m[("r3090d_info", (("instance", ""), ("model", "fake-model"), ("version", "0.1.0")))] == 1
    ticks = m[("r3090d_poll_duration_seconds_count", ())]
    assert ticks >= 3 and m[("r3090d_poll_duration_seconds_bucket", (("le", "+Inf"),))] == ticks
    assert 0 < m[("r3090d_poll_duration_seconds_sum", ())] < ticks  # each tick well under a second
    assert m[("r3090d_restarts_total", (("reason", "requested"),))] == 0
    time.sleep(0.5)
    _, m2 = scrape(d)
    assert m2[("r3090d_poll_duration_seconds_count", ())] > ticks  # the loop observes every tick

    assert control.request(d.runtime_dir, {"cmd": "restart", "drain": False})["ok"]
    d.wait_ready(old_pid=st["engine"]["pid"])
    r, m = scrape(d, accept="application/openmetrics-text; version=1.0.0")
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert m[("r3090d_restarts_total", (("reason", "requested"),))] == 1

    assert httpx.get(d.exporter_url + "/nope", trust_env=False).status_code == 404
    assert httpx.head(d.exporter_url + "/healthz", trust_env=False).status_code == 200


LOG_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\[vllm\] INFO:\s+Shutting down$", re.M)


def test_healthz_turns_503_before_the_sigterm_and_200_after_ready(make_daemon):
    grace = 1.5
    d = make_daemon(watchdog={"poll_interval": 0.2, "lb_grace": grace}, engine={"shutdown_timeout": 2})
    d.start()
    old = d.wait_ready()["engine"]["pid"]
    assert d.healthz() == (200, "ready")

    health_log: list[tuple[float, int, str]] = []
    engine_gone: list[float] = []
    stop = threading.Event()

    def watch_healthz():
        with httpx.Client(trust_env=False, timeout=2.0) as c:
            while not stop.is_set():
                t = time.time()
                try:
                    r = c.get(d.exporter_url + "/healthz")
                    health_log.append((t, r.status_code, r.text.strip()))
                except httpx.TransportError as exc:
                    health_log.append((t, 0, str(exc)))
                time.sleep(0.01)

    def watch_engine():
        with httpx.Client(trust_env=False, timeout=1.0) as c:
            while not stop.is_set() and not engine_gone:
                t = time.time()
                try:
                    c.get(d.engine_url + "/health", headers={"Connection": "close"})
                except httpx.TransportError:
                    engine_gone.append(t)
                time.sleep(0.005)

    threads = [threading.Thread(target=watch_healthz), threading.Thread(target=watch_engine)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    t_request = time.time()
    assert control.request(d.runtime_dir, {"cmd": "restart", "drain": True})["ok"]
    st = d.wait_ready(timeout=30, old_pid=old)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(10)

    first_503 = next(t for t, code, _ in health_log if code == 503)
    reasons = {why for _, code, why in health_log if code == 503}
    stamps = LOG_STAMP.findall(d.log())
    assert len(stamps) == 1, d.log()[-3000:]
    sigterm_logged = datetime.strptime(stamps[0], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    first_200_after = next(t for t, code, _ in health_log if code == 200 and t > first_503)
    print(
        f"\nrestart asked +0.000 s; /healthz 503 +{first_503 - t_request:.3f} s; engine logged SIGTERM "
        f"+{sigterm_logged - t_request:.3f} s; engine port closed +{engine_gone[0] - t_request:.3f} s; "
        f"/healthz 200 again +{first_200_after - t_request:.3f} s; 503 reasons: {sorted(reasons)}"
    )
    assert all(code in (200, 503) for _, code, _ in health_log), [h for h in health_log if h[1] not in (200, 503)][:3]
    assert first_503 - t_request < 1.0  # published at the next tick (the request wakes the loop)
    # The engine got its SIGTERM only after lb_grace of 503s (the log has millisecond stamps),
    # counted from the deciding tick's own stamp; as a poller saw it, loosely, since a loaded
    # machine may delay its first look at the 503.
    assert sigterm_logged - st["restarts"]["last_at"] >= grace - 0.05, (st["restarts"]["last_at"], sigterm_logged)
    assert sigterm_logged - first_503 >= grace - 1.0, (first_503, sigterm_logged)
    assert engine_gone[0] - first_503 >= grace - 1.0
    # No 200 between the first 503 and the new engine's readiness.
    assert first_200_after >= st["engine"]["ready_since"] - 0.05
    assert "engine draining (requested restart)" in reasons
    assert {code for t, code, _ in health_log if first_503 <= t < first_200_after} == {503}
    assert d.healthz() == (200, "ready")


def test_healthz_503_in_maintenance_and_when_disabled_nothing_listens(make_daemon):
    d = make_daemon(watchdog={"poll_interval": 0.2})
    d.start()
    d.wait_ready()
    assert control.request(d.runtime_dir, {"cmd": "maintenance", "on": True})["ok"]
    deadline = time.monotonic() + 5
    while d.healthz()[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.healthz() == (503, "maintenance mode")
    _, m = scrape(d)
    assert m[("r3090d_maintenance", ())] == 1 and m[("r3090d_serving", ())] == 0 and m[("r3090d_engine_up", ())] == 1

    off = make_daemon(exporter=False)
    off.exporter_port = d.exporter_port + 0  # nothing of `off` listens anywhere; check its log instead
    off.start()
    off.wait_ready()
    assert "exporter on" not in off.log() and "control socket" in off.log()
