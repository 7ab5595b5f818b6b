"""Pure parts of the control plane: request validation, status verdicts, /healthz, metric families."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from r3090d import exitcodes
from r3090d.service import control_protocol, exporter, statusview

NOW = 1_800_000_000.0


def doc(phase="ready", maintenance=False, health="ok", firing=None, silenced=None, written_at=NOW - 1, **extra):
    d = {
        "written_at": written_at,
        "daemon": {"pid": 1, "version": "0.1.0", "instance": None, "poll_interval": 2.0, "started_at": NOW - 100},
        "engine": {"phase": phase, "state": phase, "maintenance": maintenance, "model": "m", "since": NOW - 50, "ready_since": NOW - 50 if phase == "ready" else None, "pid": 42},
        "restarts": {"total": 2, "by_reason": {"kv": 1, "requested": 1}, "last_reason": "kv", "last_at": NOW - 60, "backoff_level": 1},
        "health": {"status": health},
        "metrics": {"kv_usage": 0.25, "free_blocks": 3978.75, "num_gpu_blocks": 5306, "running": 3.0, "waiting": 1.0},
        "gpu": {"status": "ok", "memory_used": 21 * 2**30, "memory_total": 24 * 2**30, "temperature_c": 71, "utilization_gpu": 87, "power_w": 301.0, "power_limit_w": 350.0, "pcie_width": 16, "pcie_gen": 4},
        "alerts": {"firing": firing or {}, "silenced": silenced or {}},
        "alert_book": {"entries": {k: {"severity": v["severity"], "firing": True} for k, v in (firing or {}).items()}},
        "give_up_reason": None,
        "telemetry": exporter.TickStats().to_json(),
    }
    d.update(extra)
    return d


# ------------------------------------------------------------------ requests


@pytest.mark.parametrize(
    "request_, problem",
    [
        ({"cmd": "status"}, None),
        ({"cmd": "restart"}, None),
        ({"cmd": "restart", "drain": False}, None),
        ({"cmd": "maintenance", "on": True}, None),
        ({"cmd": "silence", "alert": "gpu_memory", "seconds": 1800}, None),
        ({"cmd": "reload"}, None),
        ([], "JSON object"),
        ("status", "JSON object"),
        ({}, 'missing "cmd"'),
        ({"cmd": 7}, 'missing "cmd"'),
        ({"cmd": "explode"}, "unknown command 'explode'"),
        ({"cmd": "restart", "drain": "yes"}, "'drain' must be true or false"),
        ({"cmd": "restart", "force": True}, "unknown field 'force'"),
        ({"cmd": "maintenance"}, "missing 'on'"),
        ({"cmd": "maintenance", "on": 1}, "'on' must be true or false"),
        ({"cmd": "silence", "alert": "gpu_memory"}, "missing 'seconds'"),
        ({"cmd": "silence", "alert": "gpu memory", "seconds": 60}, "'alert' must be"),
        ({"cmd": "silence", "alert": "x" * 65, "seconds": 60}, "'alert' must be"),
        ({"cmd": "silence", "alert": "a", "seconds": True}, "'seconds' must be"),
        ({"cmd": "silence", "alert": "a", "seconds": 0}, "'seconds' must be"),
        ({"cmd": "silence", "alert": "a", "seconds": float("nan")}, "'seconds' must be"),
        ({"cmd": "silence", "alert": "a", "seconds": 31 * 86400}, "'seconds' must be"),
        ({"cmd": "status", "verbose": True}, "it takes none"),
        # Swap mode: the model a command acts on (whether the daemon serves it is its own answer).
        ({"cmd": "restart", "drain": True, "model": "chat"}, None),
        ({"cmd": "suspend", "model": "Qwen/Qwen2.5-7B-Instruct"}, None),
        ({"cmd": "resume", "model": "x" * 128}, None),
        ({"cmd": "swap", "model": "coder"}, None),
        ({"cmd": "swap"}, "swap: missing 'model'"),
        ({"cmd": "swap", "model": "coder", "wait": True}, "unknown field 'wait'"),
        ({"cmd": "swap", "model": ""}, "'model' must be a served model name"),
        ({"cmd": "resume", "model": "x" * 129}, "'model' must be a served model name"),
        ({"cmd": "suspend", "model": "chat\n{\"cmd\": \"reload\"}"}, "'model' must be a served model name"),
        ({"cmd": "restart", "model": 7}, "'model' must be a served model name"),
        ({"cmd": "restart", "model": None}, "'model' must be a served model name"),
        ({"cmd": "maintenance", "on": True, "model": "chat"}, "unknown field 'model'"),
    ],
)
def test_validate(request_, problem):
    got = control_protocol.validate(request_)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got, got


# ------------------------------------------------------------------ status verdicts


@pytest.mark.parametrize(
    "d, running, code, reason",
    [
        (doc(), True, exitcodes.OK, "engine ready"),
        (doc("starting"), True, exitcodes.WARNING, "engine starting"),
        (doc("draining"), True, exitcodes.WARNING, "engine draining (kv)"),
        (doc("restarting"), True, exitcodes.WARNING, "engine restarting"),
        (doc("backoff"), True, exitcodes.WARNING, "engine backoff"),
        (doc(maintenance=True), True, exitcodes.WARNING, "maintenance mode"),
        (doc(firing={"gpu_memory": {"severity": "warning"}}), True, exitcodes.WARNING, "gpu_memory firing"),
        (doc(firing={"gpu_xid": {"severity": "critical"}}), True, exitcodes.CRITICAL, "gpu_xid firing"),
        (doc("backoff", firing={"gpu_lost": {"severity": "critical"}}), True, exitcodes.CRITICAL, "gpu_lost firing"),
        (doc("given-up", give_up_reason="6 failures in 1800 s"), True, exitcodes.CRITICAL, "gave up: 6 failures"),
        (doc("shutting-down"), True, exitcodes.CRITICAL, "engine shutting-down"),
        (doc(), False, exitcodes.UNKNOWN, "not running"),
        (None, True, exitcodes.WARNING, "starting"),
    ],
)
def test_status_verdicts(d, running, code, reason):
    v = statusview.verdict_of(d, running=running, now=NOW)
    assert v.code == code
    assert any(reason in r for r in v.reasons), v.reasons


def test_silenced_alert_is_shown_but_does_not_raise_the_code():
    d = doc(firing={"gpu_temperature": {"severity": "warning", "summary": "GPU at 88 C", "since": NOW - 30}}, silenced={"gpu_temperature": NOW + 600})
    v = statusview.verdict_of(d, running=True, now=NOW)
    assert v.code == exitcodes.OK
    text = "\n".join(statusview.panel(d, v, NOW))
    assert "gpu_temperature (warning, 30 s) [silenced]: GPU at 88 C" in text
    assert "Silenced   gpu_temperature until" in text and "(10 min left)" in text
    # An expired silence no longer counts.
    assert statusview.verdict_of(d, running=True, now=NOW + 601).code == exitcodes.WARNING


def test_panel_shows_every_field():
    d = doc()
    text = "\n".join(statusview.panel(d, statusview.verdict_of(d, running=True, now=NOW), NOW))
    for want in ("ready for 50 s, pid 42", "25% used, 3979 free blocks of 5306; running 3, waiting 1", "memory 21.0/24.0 GiB", "util 87%", "71 C", "301/350 W", "PCIe Gen4 x16", "Restarts   2 (kv 1, requested 1); last: kv, 60 s ago", "Status     OK"):
        assert want in text, (want, text)


def test_not_running_lines_name_the_give_up_reason_and_how_to_start():
    d = doc("given-up", give_up_reason="6 failures in 1800 s (last: exited: engine exited with code 1)")
    lines = statusview.not_running_lines(d, "pid 1 is gone", "/var/lib/r3090d/state.json", "systemctl start r3090d", NOW)
    text = "\n".join(lines)
    assert "r3090d is not running (pid 1 is gone)" in text
    assert "because 6 failures in 1800 s (last: exited: engine exited with code 1)" in text
    assert text.endswith("Start it with: systemctl start r3090d")


@pytest.mark.parametrize("text, seconds", [("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("90s", 90), ("1d", 86400), ("1.5h", 5400), ("2 h", 7200)])
def test_parse_duration(text, seconds):
    assert statusview.parse_duration(text) == seconds


@pytest.mark.parametrize("text, hint", [("30", "no unit"), ("", "empty"), ("soon", "not a duration"), ("5x", "not a duration"), ("0m", "positive"), ("m30", "not a duration")])
def test_parse_duration_refuses(text, hint):
    with pytest.raises(ValueError, match=hint):
        statusview.parse_duration(text)


# ------------------------------------------------------------------ /healthz


@pytest.mark.parametrize(
    "d, code, why",
    [
        (doc(), 200, "ready"),
        (doc("draining"), 503, "engine draining (kv restart)"),
        (doc("starting"), 503, "engine starting"),
        (doc("given-up", give_up_reason="too many"), 503, "engine given-up: too many"),
        (doc(maintenance=True), 503, "maintenance mode"),
        (doc(health="refused"), 503, "engine /health refused"),
        (doc(written_at=NOW - 11), 503, "state is 11 s old"),
        (None, 503, "no state yet"),
    ],
)
def test_healthz(d, code, why):
    got_code, got_why = exporter.healthz(d, NOW)
    assert got_code == code
    assert why in got_why
    assert "\n" not in got_why


def test_staleness_follows_the_poll_interval():
    d = doc(written_at=NOW - 40)
    d["daemon"]["poll_interval"] = 10.0
    assert exporter.healthz(d, NOW)[0] == 200  # 5 polls of 10 s
    assert exporter.healthz(d, NOW + 11)[0] == 503


# ------------------------------------------------------------------ metrics


def scrape(d) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter.StateCollector(lambda: d, clock=lambda: NOW))
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_from_a_state_document():
    stats = exporter.TickStats()
    for t in (0.004, 0.02, 0.02, 0.3, 12.0):
        stats.observe(t)
    stats.observe(0.01)
    d = doc(firing={"gpu_memory": {"severity": "warning"}}, telemetry=stats.to_json())
    d["healing"] = {"xid_by_class": {"application": 2, "reset": 1}, "detector_scale": {"gpu_idle": 4}, "reset_hold": "XID 79"}
    d["alert_book"]["entries"]["kv_pressure"] = {"severity": "warning", "firing": False}
    m = scrape(d)
    assert m[("r3090d_engine_up", ())] == 1
    assert m[("r3090d_serving", ())] == 1
    assert m[("r3090d_engine_state", (("state", "ready"),))] == 1
    assert sum(v for (name, _), v in m.items() if name == "r3090d_engine_state") == 1
    assert m[("r3090d_restarts_total", (("reason", "kv"),))] == 1
    assert m[("r3090d_restarts_total", (("reason", "hung"),))] == 0
    assert m[("r3090d_kv_free_blocks", ())] == 3978.75
    assert m[("r3090d_kv_usage_ratio", ())] == 0.25
    assert m[("r3090d_gpu_memory_used_bytes", ())] == 21 * 2**30
    assert m[("r3090d_gpu_temperature_celsius", ())] == 71
    assert m[("r3090d_gpu_utilization_ratio", ())] == 0.87
    assert m[("r3090d_xid_errors_total", (("class", "application"),))] == 2
    assert m[("r3090d_xid_errors_total", (("class", "reset"),))] == 1
    assert m[("r3090d_xid_errors_total", (("class", "unknown"),))] == 0
    assert m[("r3090d_gpu_reset_needed", ())] == 1
    assert m[("r3090d_detector_window_scale", (("detector", "gpu_idle"),))] == 4
    assert m[("r3090d_detector_window_scale", (("detector", "stalled"),))] == 1
    assert m[("r3090d_engine_given_up", ())] == 0
    assert m[("r3090d_alerts_firing", (("alert", "gpu_memory"), ("severity", "warning")))] == 1
    assert m[("r3090d_alerts_firing", (("alert", "kv_pressure"), ("severity", "warning")))] == 0
    assert m[("r3090d_poll_duration_seconds_count", ())] == 6
    assert m[("r3090d_poll_duration_seconds_bucket", (("le", "0.005"),))] == 1
    assert m[("r3090d_poll_duration_seconds_bucket", (("le", "0.025"),))] == 4
    assert m[("r3090d_poll_duration_seconds_bucket", (("le", "10.0"),))] == 5
    assert m[("r3090d_poll_duration_seconds_bucket", (("le", "+Inf"),))] == 6
    assert m[("r3090d_poll_duration_seconds_sum", ())] == pytest.approx(12.354)


def test_unknown_values_are_absent_not_zero():
    d = doc("starting")
    d["metrics"] = {}
    d["gpu"] = {"status": "disabled"}
    m = scrape(d)
    names = {name for name, _ in m}
    assert "r3090d_kv_free_blocks" not in names
    assert "r3090d_gpu_memory_used_bytes" not in names
    assert m[("r3090d_engine_up", ())] == 0
    assert m[("r3090d_serving", ())] == 0
    assert m[("r3090d_engine_state", (("state", "starting"),))] == 1


def test_no_document_yet():
    m = scrape(None)
    assert m == {("r3090d_serving", ()): 0, ("r3090d_engine_up", ()): 0}
