"""A real Prometheus (Debian's `prometheus` package) scrapes a real daemon with etc/prometheus-rules.yml loaded.

promtool's unit tests (test_prometheus_rules.py) evaluate the rules over series
written by hand; here the series are what Prometheus itself scrapes, every
second, from a daemon supervising the vLLM double. An engine that dies 1 s
after every start makes the restart loop fire, then the give-up, which keeps
firing while the daemon stays up and scraped. Every Grafana panel's query
returns data from such a scrape.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from r3090d.service import control_client
from tests.server_binary import ServerBinary

pytestmark = pytest.mark.component

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "etc" / "prometheus-rules.yml"
FAKE_NVML = REPO / "tests" / "fakenvml"
DASHBOARD_TEST = REPO / "tests" / "unit" / "test_grafana_dashboard.py"  # dashboard_queries(): every panel's PromQL
PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed (apt-get install prometheus)")
# Fails 1 s after every start: a start failure each time (inside min_uptime).
DYING_ENGINE = ["--fake-exit-after", "1.0", "0", "--fake-dead-exit-delay", "0"]
START_FAILURES = 4  # 3 restarts, then the 4th failure gives up (a give-up is not counted as a restart)


class Prometheus(ServerBinary):
    """One Prometheus server on 127.0.0.1, scraping `target` as job r3090d every second, rules evaluated every second."""

    def __init__(self, workdir: Path, target: str):
        super().__init__("Prometheus", workdir)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "r3090d", "static_configs": [{"targets": [target]}]}],
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))

    def argv(self) -> list[str]:
        return [
            PROMETHEUS,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]

    def wait_scraping(self, timeout: float = 30.0) -> None:
        """Until the first scrape of the target, answered or not: Prometheus applies its targets some seconds after it is ready."""
        self.wait(lambda: self.query('up{job="r3090d"}'), timeout, "the first scrape")

    def query(self, expr: str) -> list[dict]:
        r = self.client.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single sample `expr` returns now, or None when it returns nothing."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr}: {result}"
        return float(result[0]["value"][1]) if result else None

    def firing(self, alertname: str) -> list[dict]:
        alerts = self.client.get("/api/v1/alerts").json()["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == alertname and a["state"] == "firing"]


@pytest.fixture
def prometheus(tmp_path):
    """start(target) -> a Prometheus scraping target (host:port); each is stopped at teardown."""
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        workdir = tmp_path / f"prometheus{len(started)}"
        workdir.mkdir()
        server = Prometheus(workdir, target)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def unrequested_restarts(st: dict | None) -> int:
    by_reason = ((st or {}).get("restarts") or {}).get("by_reason") or {}
    return sum(n for reason, n in by_reason.items() if reason != "requested")


@needs_prometheus
def test_restart_loop_then_give_up_keeps_firing_while_the_daemon_is_scraped(make_daemon, prometheus):
    d = make_daemon(
        extra_args=DYING_ENGINE,
        watchdog={"start_failures": START_FAILURES, "same_cause_failures": 100, "min_uptime": 60, "backoff_initial": 0.2, "backoff_max": 0.5},
    )
    # Prometheus first, so that its first answered scrape sees every restart counter at 0.
    prom = prometheus(f"127.0.0.1:{d.exporter_port}")
    prom.wait_scraping()
    t0 = time.time()
    d.start()

    third = prom.wait(lambda: (st := d.state()) and (unrequested_restarts(st) >= 3 or st["engine"]["phase"] == "given-up") and st, 60, "the third restart", interval=0.05)
    assert unrequested_restarts(third) >= 3, f"gave up after {unrequested_restarts(third)} restarts: {third['give_up_reason']}"
    third_at = third["restarts"]["last_at"]
    (loop,) = prom.wait(lambda: prom.firing("R3090dRestartLoop"), 30, "R3090dRestartLoop firing")
    loop_seen = time.time()
    assert loop["labels"]["instance"] == f"127.0.0.1:{d.exporter_port}"
    assert float(loop["value"]) >= 3
    assert loop["annotations"]["summary"].startswith(f"the engine on 127.0.0.1:{d.exporter_port} restarted ")

    gave_up = d.wait_phase("given-up", timeout=60)
    gave_up_at = gave_up["engine"]["since"]
    (alert,) = prom.wait(lambda: prom.firing("R3090dEngineGaveUp"), 30, "R3090dEngineGaveUp firing")
    gave_up_seen = time.time()
    assert alert["labels"]["severity"] == "critical" and "state" not in alert["labels"]  # on the gauge, not the phase
    assert alert["annotations"]["summary"] == f"r3090d on 127.0.0.1:{d.exporter_port} gave up on the engine"
    assert prom.firing("R3090dRestartLoop"), "the restarts are still within the hour"

    # Given up, the daemon stays: scraped (up 1), alive (/livez 200), out of the balancer (/healthz 503).
    hold = 5.0  # time passing on purpose: the alert must not stop firing within it
    end = time.monotonic() + hold
    polls = 0
    while time.monotonic() < end:
        assert prom.firing("R3090dEngineGaveUp"), "R3090dEngineGaveUp stopped firing while the daemon is given up"
        assert prom.value('up{job="r3090d"}') == 1
        polls += 1
        time.sleep(0.25)
    window = f"{hold:.0f}s"
    assert prom.value(f'min_over_time(up{{job="r3090d"}}[{window}])') == 1
    assert prom.value(f'count_over_time(ALERTS{{alertname="R3090dEngineGaveUp",alertstate="firing"}}[{window}])') >= hold - 1
    assert d.proc.proc.poll() is None, "the daemon exited on give-up"
    assert d.state()["engine"]["phase"] == "given-up"
    assert httpx.get(d.exporter_url + "/livez", trust_env=False, timeout=2.0).status_code == 200
    assert d.healthz()[0] == 503
    assert not prom.firing("R3090dDown") and not prom.firing("R3090dStuck")

    print(
        f"\ndaemon started +0.0 s; 3rd restart +{third_at - t0:.1f} s, R3090dRestartLoop firing +{loop_seen - t0:.1f} s "
        f"({loop_seen - third_at:.1f} s later); given up +{gave_up_at - t0:.1f} s, R3090dEngineGaveUp firing "
        f"+{gave_up_seen - t0:.1f} s ({gave_up_seen - gave_up_at:.1f} s later); held firing with up=1 for {hold:.0f} s ({polls} polls)"
    )


@needs_prometheus
@pytest.mark.skipif(not DASHBOARD_TEST.exists(), reason=f"no {DASHBOARD_TEST.relative_to(REPO)} to take the dashboard's queries from")
def test_every_grafana_panel_gets_data_from_a_scraped_daemon(make_daemon, prometheus, monkeypatch, tmp_path):
    from tests.unit.test_grafana_dashboard import dashboard_queries

    card = tmp_path / "card.json"
    # A busy card: clock reasons to plot (power cap, one absent reason at 0), memory under the alert line.
    card.write_text(json.dumps({"memory_used_mib": 20000, "util": 87, "temperature": 71, "power_w": 301, "clock_event_reasons": 0x4}))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(FAKE_NVML), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("R3090D_FAKE_NVML", str(card))
    d = make_daemon(watchdog={"probe_idle_seconds": 1}, args=("--skip-preflight",))
    d.rewrite(gpu={"required": True, "card": "any"})
    prom = prometheus(f"127.0.0.1:{d.exporter_port}")
    prom.wait_scraping()
    d.start()
    first = d.wait_ready()
    assert d.state()["gpu"]["name"] == "NVIDIA GeForce RTX 3090", "the daemon does not read the fake card"
    # A restart, so the restart panels (increase over the last minute) have one to show; after a
    # scrape that saw none, or Prometheus would take the counter's first sample for its start.
    prom.wait(lambda: prom.value('r3090d_restarts_total{reason="requested"}') == 0, 30, "a scrape of the ready daemon")
    assert control_client.request(d.runtime_dir, {"cmd": "restart", "drain": False})["ok"]
    d.wait_ready(old_pid=first["engine"]["pid"])
    d.fake("POST", "/fake/control", json={"metrics_values": {"running": 2, "waiting": 1, "kv_cache_usage_perc": 0.5}})

    queries = dashboard_queries()
    empty: list[str] = list(queries)

    def all_have_data() -> bool:
        empty[:] = [q for q in queries if not prom.query(q)]
        return not empty

    t0 = time.monotonic()
    try:
        prom.wait(all_have_data, 45, "every panel's query to return data", interval=0.5)
    except AssertionError:
        raise AssertionError(f"{len(empty)} of {len(queries)} dashboard queries return nothing:\n" + "\n".join(empty)) from None
    print(f"\n{len(queries)} dashboard queries all return data {time.monotonic() - t0:.1f} s after the engine's second start")


@needs_prometheus
@pytest.mark.skipif(not DASHBOARD_TEST.exists(), reason=f"no {DASHBOARD_TEST.relative_to(REPO)} to take the dashboard's queries from")
def test_swap_panels_and_swap_alert_on_a_scraped_swap_mode_exporter(prometheus):
    """The exporter of a swap-mode document, scraped every second: a swap in and a failed one after the first scrape."""
    import dataclasses

    from r3090d.service.exporter import Exporter
    from tests import swapdocs
    from tests.unit.test_grafana_dashboard import swap_queries

    state = {"swap": swapdocs.swap_info(time.time()), "coder_in": 3}

    def current() -> dict:
        now = time.time()  # a fresh document at each scrape, as the daemon's ticks give
        coder = dataclasses.replace(swapdocs.coder(now), swaps_in=state["coder_in"])
        return swapdocs.as_json(swapdocs.swap_doc(now, models=[swapdocs.chat(now), coder, swapdocs.embed(now)], swap=state["swap"]))

    ex = Exporter("127.0.0.1", 0, current).start()
    try:
        prom = prometheus(f"127.0.0.1:{ex.port}")
        prom.wait_scraping()
        prom.wait(lambda: prom.value('r3090d_swaps_total{served_model="coder"}') == 3, 30, "a scrape of the first document")
        # coder swapped in in 12 s, then a swap that failed.
        swap = state["swap"]
        state["swap"] = dataclasses.replace(swap, total=swap.total + 2, failed=swap.failed + 1, latency=swap.latency.observed(12.0))
        state["coder_in"] = 4
        queries = swap_queries()
        empty: list[str] = list(queries)

        def all_have_data() -> bool:
            empty[:] = [q for q in queries if not prom.query(q)]
            return not empty

        try:
            prom.wait(all_have_data, 30, "every swap panel's query to return data", interval=0.5)
        except AssertionError:
            raise AssertionError(f"{len(empty)} of {len(queries)} swap panel queries return nothing:\n" + "\n".join(empty)) from None
        (alert,) = prom.wait(lambda: prom.firing("R3090dSwapFailing"), 30, "R3090dSwapFailing firing")
        assert alert["labels"]["severity"] == "warning" and "served_model" not in alert["labels"]
        assert not prom.firing("R3090dSwapFailingRepeatedly") and not prom.firing("R3090dRouterDown")
        # The one swap since the first scrape took 12 s: in the (10, 15] bucket, whatever the interpolation.
        (p50,) = [q for q in queries if q.startswith("histogram_quantile(0.5,")]
        assert 10 < prom.value(p50) <= 15
    finally:
        ex.stop()
