"""The exporter of a running daemon: /metrics parses, /healthz leads a drained restart.

/healthz must turn 503 before the engine gets its SIGTERM (by lb_grace), so a
load balancer has taken the node out by then; it turns 200 again once the new
engine is ready. The SIGTERM time comes from the double itself: the moment its
port stops answering (it closes its listener on SIGTERM), and its "Shutting
down" line, stamped when the daemon relayed it into its log (so no earlier than
the SIGTERM).
"""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
import time
from datetime import datetime

import httpx
import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from r3090d.core.vocabulary import Phase, RestartReason
from r3090d.probes.nvml import clock_reason_table, load_pynvml
from r3090d.service import control_client, exporter
from tests.waiting import wait_until

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
    wait_until(lambda: (scrape(d)[1].get(("r3090d_requests_running", ())) == 3) and scrape(d)[1][("r3090d_poll_duration_seconds_count", ())] >= 3, 10, what="the new readings exported")
    r, m = scrape(d)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert m[("r3090d_engine_up", ())] == 1
    assert m[("r3090d_serving", ())] == 1
    assert m[("r3090d_engine_state", (("state", "ready"),))] == 1
    assert m[("r3090d_kv_total_blocks", ())] == 777
    assert m[("r3090d_kv_usage_ratio", ())] == 0.5
    assert m[("r3090d_kv_free_blocks", ())] == 388.0  # (777 - 1) x (1 - 0.5)
    assert m[("r3090d_requests_running", ())] == 3 and m[("r3090d_requests_waiting", ())] == 2
    assert m[("r3090d_info", (("host", socket.gethostname()), ("model", "fake-model"), ("unit_instance", ""), ("version", "0.1.0")))] == 1
    ticks = m[("r3090d_poll_duration_seconds_count", ())]
    assert ticks >= 3 and m[("r3090d_poll_duration_seconds_bucket", (("le", "+Inf"),))] == ticks
    assert 0 < m[("r3090d_poll_duration_seconds_sum", ())] < ticks  # each tick well under a second
    assert m[("r3090d_restarts_total", (("reason", "requested"),))] == 0
    wait_until(lambda: scrape(d)[1][("r3090d_poll_duration_seconds_count", ())] > ticks, 10, what="the next tick observed")  # every tick is counted

    assert control_client.request(d.runtime_dir, {"cmd": "restart", "drain": False})["ok"]
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
    assert control_client.request(d.runtime_dir, {"cmd": "restart", "drain": True})["ok"]
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
    assert control_client.request(d.runtime_dir, {"cmd": "maintenance", "on": True})["ok"]
    deadline = time.monotonic() + 5
    while d.healthz()[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.healthz() == (503, "maintenance mode")
    livez = httpx.get(d.exporter_url + "/livez", timeout=2.0, trust_env=False)
    assert (livez.status_code, livez.text) == (200, "alive\n")  # the daemon is fine: no reason to restart it
    _, m = scrape(d)
    assert m[("r3090d_maintenance", ())] == 1 and m[("r3090d_serving", ())] == 0 and m[("r3090d_engine_up", ())] == 1

    off = make_daemon(exporter=False)
    off.exporter_port = d.exporter_port + 0  # nothing of `off` listens anywhere; check its log instead
    off.start()
    off.wait_ready()
    assert "exporter on" not in off.log() and "control socket" in off.log()


# ------------------------------------------------------------------ pure: /livez and the families

NOW = 1_800_000_000.0


def state_doc(phase: Phase = Phase.READY, *, age: float = 1.0, poll_interval: float = 2.0, maintenance: bool = False, **extra) -> dict:
    d = {
        "written_at": NOW - age,
        "daemon": {"pid": 1, "version": "0.1.0", "instance": 1, "poll_interval": poll_interval},
        "engine": {"phase": phase.value, "maintenance": maintenance, "model": "m", "ready_since": NOW - 50 if phase is Phase.READY else None},
        "health": {"status": "ok" if phase is Phase.READY else "refused"},
        "give_up_reason": "3 start failures in a row" if phase is Phase.GIVEN_UP else None,
    }
    d.update(extra)
    return d


@pytest.mark.parametrize(
    "phase, maintenance",
    [(Phase.READY, False), (Phase.READY, True), (Phase.STARTING, False), (Phase.BACKOFF, False), (Phase.GIVEN_UP, False), (Phase.STOPPED, False)],
)
def test_livez_is_200_while_the_loop_ticks_whatever_the_engine_does(phase, maintenance):
    d = state_doc(phase, maintenance=maintenance)
    assert exporter.livez(d, NOW) == (200, "alive")
    if phase is not Phase.READY or maintenance:
        assert exporter.healthz(d, NOW)[0] == 503  # unlike the load balancer's check


def test_livez_turns_503_once_the_loop_stalls_past_the_bound():
    assert exporter.stale_after(state_doc()) == exporter.STALE_MIN_S  # 5 polls of 2 s are under the floor
    assert exporter.livez(state_doc(age=exporter.STALE_MIN_S), NOW)[0] == 200
    code, why = exporter.livez(state_doc(Phase.GIVEN_UP, age=exporter.STALE_MIN_S + 2), NOW)
    assert code == 503
    assert why == "r3090d state is 12 s old (stale after 10 s): the daemon loop is stuck"
    # A slower poll stretches the bound: 5 polls of 10 s.
    assert exporter.livez(state_doc(age=49, poll_interval=10.0), NOW)[0] == 200
    assert exporter.livez(state_doc(age=51, poll_interval=10.0), NOW)[0] == 503
    code, why = exporter.livez(None, NOW)
    assert code == 503 and "no state yet" in why


def test_livez_and_healthz_over_http_follow_the_state_document():
    doc = {"current": state_doc(Phase.GIVEN_UP)}
    clock = {"now": NOW}
    ex = exporter.Exporter("127.0.0.1", 0, lambda: doc["current"], clock=lambda: clock["now"]).start()
    url = f"http://127.0.0.1:{ex.port}"
    try:
        with httpx.Client(trust_env=False, timeout=5.0) as c:
            r = c.get(url + "/livez")
            assert (r.status_code, r.text) == (200, "alive\n")
            assert r.headers["content-type"].startswith("text/plain")
            assert c.get(url + "/healthz").status_code == 503  # given up: out of the balancer, yet alive
            clock["now"] = NOW + 60  # no tick for a minute
            r = c.get(url + "/livez")
            assert r.status_code == 503
            assert r.text == "r3090d state is 61 s old (stale after 10 s): the daemon loop is stuck\n"
            assert c.head(url + "/livez").status_code == 503
            doc["current"] = {**state_doc(Phase.STARTING), "written_at": clock["now"] - 1}  # the loop ticks again
            assert c.get(url + "/livez").status_code == 200
            assert "/livez" in c.get(url + "/").text
    finally:
        ex.stop()


def test_model_health_over_http_answers_for_each_served_model():
    from tests import swapdocs

    qwen = dataclasses.replace(swapdocs.coder(NOW), name="Qwen/Qwen2.5-Coder 7B")  # a hub name: a slash and a space
    doc = {"current": swapdocs.as_json(swapdocs.swap_doc(NOW, models=[swapdocs.chat(NOW), qwen, swapdocs.embed(NOW)]))}
    ex = exporter.Exporter("127.0.0.1", 0, lambda: doc["current"], clock=lambda: NOW).start()
    url = f"http://127.0.0.1:{ex.port}"
    try:
        with httpx.Client(trust_env=False, timeout=5.0) as c:
            assert (c.get(url + "/healthz").status_code, c.get(url + "/healthz").text) == (200, "serving: chat ready; 2 more after a swap\n")
            r = c.get(url + "/healthz/chat")
            assert (r.status_code, r.text) == (200, "ready\n") and r.headers["content-type"].startswith("text/plain")
            for path in ("/healthz/Qwen/Qwen2.5-Coder%207B", "/healthz/Qwen%2FQwen2.5-Coder%207B"):
                r = c.get(url + path)
                assert (r.status_code, r.text) == (200, "parked: served after a swap\n"), path
            assert c.get(url + "/healthz/embed").text == "cold: served after a cold start\n"
            r = c.get(url + "/healthz/gpt-4")
            assert r.status_code == 404 and r.text.startswith("not found: no model 'gpt-4'; served: chat, Qwen/Qwen2.5-Coder 7B, embed")
            assert c.head(url + "/healthz/chat").status_code == 200
            # The router goes down: nothing can be served, whatever the model.
            doc["current"] = {**doc["current"], "swap": {**doc["current"]["swap"], "router": {"up": False}}}
            assert (c.get(url + "/healthz").status_code, c.get(url + "/healthz/chat").status_code) == (503, 503)
            r = c.get(url + "/metrics")
            assert 'r3090d_serving{served_model="chat"} 0.0' in r.text and "r3090d_router_up 0.0" in r.text
    finally:
        ex.stop()


def samples(doc: dict | None, now: float = NOW) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter.StateCollector(lambda: doc, clock=lambda: now))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def by_label(m: dict, name: str, label: str) -> dict:
    return {dict(labels)[label]: v for (n, labels), v in m.items() if n == name}


def test_points_in_time_are_unix_timestamps_that_do_not_move_between_scrapes():
    d = state_doc(alerts={"firing": {}, "silenced": {"gpu_memory": NOW + 600, "kv_pressure": NOW - 5}})
    for now in (NOW, NOW + 30):
        m = samples(d, now)
        assert m[("r3090d_state_written_timestamp_seconds", ())] == NOW - 1
        assert m[("r3090d_engine_ready_timestamp_seconds", ())] == NOW - 50
        assert by_label(m, "r3090d_alert_silenced_until_timestamp_seconds", "alert") == {"gpu_memory": NOW + 600}  # the lapsed one is gone
    names = {n for n, _ in samples(d)}
    assert not names & {"r3090d_state_age_seconds", "r3090d_engine_ready_seconds", "r3090d_alert_silenced_until_seconds"}
    assert "r3090d_engine_ready_timestamp_seconds" not in {n for n, _ in samples(state_doc(Phase.BACKOFF))}


def test_info_labels_leave_instance_to_prometheus():
    m = samples(state_doc())
    [labels] = [dict(labels) for n, labels in m if n == "r3090d_info"]
    assert "instance" not in labels and labels["unit_instance"] == "1" and (labels["model"], labels["version"]) == ("m", "0.1.0")


def test_every_restart_reason_and_phase_is_exported_from_the_start():
    m = samples(state_doc(restarts={"by_reason": {"kv": 2}, "backoff_level": 0}))
    assert by_label(m, "r3090d_restarts_total", "reason") == {r.value: 0 for r in RestartReason} | {"kv": 2}
    assert by_label(m, "r3090d_engine_state", "state") == {p.value: 0 for p in Phase} | {"ready": 1}


def test_thresholds_are_exported_when_the_document_carries_them():
    m = samples(state_doc(thresholds={"gpu_memory_alert_bytes": 23500 * 2**20, "kv_min_free_blocks": 100}))
    assert m[("r3090d_gpu_memory_alert_threshold_bytes", ())] == 23500 * 2**20
    assert m[("r3090d_kv_free_blocks_threshold", ())] == 100
    names = {n for n, _ in samples(state_doc())}  # an older daemon's document: absent, not zero
    assert "r3090d_gpu_memory_alert_threshold_bytes" not in names and "r3090d_kv_free_blocks_threshold" not in names
    assert "r3090d_engine_restart_storm_threshold" not in names and "r3090d_engine_restart_storm_window_seconds" not in names


def test_recent_restarts_are_exported_with_the_daemons_storm_threshold_and_window():
    m = samples(state_doc(restarts={"recent": 4, "by_reason": {"exited": 4}}, thresholds={"restart_storm_restarts": 3, "restart_storm_window_s": 3600.0}))
    assert m[("r3090d_engine_recent_restarts", ())] == 4
    assert m[("r3090d_engine_restart_storm_threshold", ())] == 3
    assert m[("r3090d_engine_restart_storm_window_seconds", ())] == 3600.0


def test_inference_probe_latency_and_time():
    m = samples(state_doc(inference={"ok": True, "latency_s": 0.25, "finished_at": NOW - 3, "detail": "", "consecutive_failures": 0}))
    assert m[("r3090d_inference_probe_latency_seconds", ())] == 0.25
    assert m[("r3090d_inference_probe_timestamp_seconds", ())] == NOW - 3
    names = {n for n, _ in samples(state_doc(inference={"ok": None, "latency_s": None, "finished_at": None}))}
    assert not {"r3090d_inference_probe_latency_seconds", "r3090d_inference_probe_timestamp_seconds"} & names


def test_clock_event_reasons_one_hot_over_the_known_ones():
    gpu = {"status": "ok", "clock_event_reasons": ["gpu_idle", "sw_power_cap", "unknown_0x800"]}
    got = by_label(samples(state_doc(gpu=gpu)), "r3090d_gpu_clock_event_reason", "reason")
    assert got == {r: 0 for r in exporter.CLOCK_EVENT_REASONS} | {"gpu_idle": 1, "sw_power_cap": 1, "unknown_0x800": 1}
    assert by_label(samples(state_doc(gpu={"status": "disabled"})), "r3090d_gpu_clock_event_reason", "reason") == {}


def test_known_clock_event_reasons_cover_the_installed_nvml_binding():
    nvml = load_pynvml()
    if nvml is None:
        pytest.skip("pynvml (nvidia-ml-py) is not installed")
    missing = set(clock_reason_table(nvml).values()) - set(exporter.CLOCK_EVENT_REASONS)
    assert not missing, f"add {sorted(missing)} to exporter.CLOCK_EVENT_REASONS"


def test_process_metrics_are_the_daemons_own():
    ex = exporter.Exporter("127.0.0.1", 0, lambda: state_doc())
    m = {}
    for fam in text_string_to_metric_families(generate_latest(ex.registry).decode()):
        for s in fam.samples:
            m[s.name] = s.value
    assert m["process_start_time_seconds"] == pytest.approx(psutil.Process().create_time(), abs=1.0)
    assert m["process_resident_memory_bytes"] > 0 and m["process_open_fds"] > 0 and "process_cpu_seconds_total" in m
    assert m["r3090d_engine_up"] == 1


def test_a_suspension_is_exported_while_it_stands_and_absent_otherwise():
    gib = 2**30
    standing = {"stage": "suspended", "since": NOW - 3600, "pid": 6, "gpu_bytes": 15 * gib, "host_rss_bytes": 16 * gib}
    m = samples(state_doc(Phase.SUSPENDED, suspend=standing))
    assert m[("r3090d_suspended_since_timestamp_seconds", ())] == NOW - 3600
    assert m[("r3090d_suspended_host_bytes", ())] == 16 * gib
    assert m[("r3090d_suspended_gpu_bytes", ())] == 15 * gib
    assert m[("r3090d_engine_state", (("state", "suspended"),))] == 1
    # A resume checking for room leaves the suspension standing (a refusal changes nothing), as suspended_long counts it.
    checking = samples(state_doc(Phase.RESUMING, suspend={**standing, "stage": "checking"}))
    assert checking[("r3090d_suspended_since_timestamp_seconds", ())] == NOW - 3600
    # Cold: no engine process holds host memory, and resuming needs the GPU bytes free all the same.
    cold = samples(state_doc(Phase.SUSPENDED, suspend={**standing, "cold": True, "host_rss_bytes": None}))
    assert ("r3090d_suspended_host_bytes", ()) not in cold and cold[("r3090d_suspended_gpu_bytes", ())] == 15 * gib
    suspended = {"r3090d_suspended_since_timestamp_seconds", "r3090d_suspended_host_bytes", "r3090d_suspended_gpu_bytes"}
    for phase, section in [
        (Phase.SUSPENDING, {**standing, "stage": "checkpointing", "since": None}),
        (Phase.RESUMING, {**standing, "stage": "restoring"}),
        (Phase.READY, {"stage": None, "last": {"request": 2, "op": "resume", "result": "resumed"}}),
        (Phase.READY, None),  # an older daemon's document: no section at all
    ]:
        names = {n for n, _ in samples(state_doc(phase, suspend=section))}
        assert not names & suspended, (phase, section)
