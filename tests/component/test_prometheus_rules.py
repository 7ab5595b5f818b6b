"""etc/prometheus-rules.yml against what the exporter really exports.

Every metric a rule names must be one r3090d exports. Then promtool (from
Debian's prometheus package) checks the file and:

- for every alert, evaluates a case that makes it fire and a near miss that
  must not: one evaluation before its `for:` has elapsed it is not firing yet,
  at that evaluation it fires, with its labels and rendered annotations;
- evaluates the rules over series scraped from a real daemon: a healthy one
  fires nothing; one in maintenance with a leaking KV cache fires the KV alert
  and, after 4 h, the forgotten-maintenance one, but never "not serving".
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from r3090d import control, exporter

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "etc" / "prometheus-rules.yml"
RULE_BY_ALERT = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
ALERTS = list(RULE_BY_ALERT)
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt-get install prometheus)")


def exported_names() -> set[str]:
    """Every sample name the exporter can produce, from a document with every field filled in."""
    stats = exporter.TickStats()
    stats.observe(0.01, (79,))
    doc = {
        "written_at": 0.0,
        "daemon": {"version": "x", "poll_interval": 2.0},
        "engine": {"phase": "ready", "maintenance": False, "ready_since": 0.0, "model": "m"},
        "restarts": {"by_reason": {"kv": 1}, "backoff_level": 0},
        "health": {"status": "ok"},
        "inference": {"ok": True, "latency_s": 0.5, "finished_at": 0.5},
        "thresholds": {"gpu_memory_alert_bytes": 2, "kv_min_free_blocks": 100},
        "metrics": {"kv_usage": 0.5, "free_blocks": 1.0, "num_gpu_blocks": 3, "running": 1, "waiting": 1},
        "gpu": {
            "status": "ok",
            "memory_used": 1,
            "memory_total": 2,
            "utilization_gpu": 1,
            "temperature_c": 1,
            "power_w": 1.0,
            "power_limit_w": 2.0,
            "pcie_width": 16,
            "clock_event_reasons": ["gpu_idle"],
        },
        "alerts": {"firing": {"a": {"severity": "critical"}}, "silenced": {"a": 10.0}},
        "telemetry": stats.to_json(),
    }
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter.StateCollector(lambda: doc, clock=lambda: 1.0))
    return {s.name for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples}


def test_every_metric_in_the_rules_is_exported():
    names = exported_names()
    used = set()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            used |= set(re.findall(r"\br3090d_[a-z0-9_]+", rule["expr"]))
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert used, "the rules name no r3090d metric"
    assert used - names == set(), f"rules use metrics the exporter does not export: {sorted(used - names)}"


def _series(exporter_url: str, instance: str) -> list[tuple[str, float]]:
    """The scrape of a live exporter as (series selector, value), with the labels Prometheus would add."""
    text = httpx.get(exporter_url + "/metrics", timeout=5.0, trust_env=False).text
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = {**s.labels, "job": "r3090d", "instance": instance}
            sel = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            out.append((sel, s.value))
    return out


def _promtool_test(tmp_path: Path, series: list[tuple[str, str]], expected: dict[str, list[dict]], eval_time: str) -> subprocess.CompletedProcess:
    # promtool compares annotations too; the templates are checked by `check rules`,
    # so the evaluation runs on a copy without them.
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    bare = tmp_path / "rules.yml"
    bare.write_text(yaml.safe_dump(rules))
    test = {
        "rule_files": [str(bare)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": sel, "values": values} for sel, values in series],
                "alert_rule_test": [{"eval_time": eval_time, "alertname": name, "exp_alerts": expected.get(name, [])} for name in ALERTS],
            }
        ],
    }
    path = tmp_path / "rules-test.yml"
    path.write_text(yaml.safe_dump(test))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_checks_the_rules_file():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in check.stdout


@pytest.mark.component
@needs_promtool
def test_rules_fire_on_scrapes_of_a_real_daemon(make_daemon, tmp_path):
    d = make_daemon(watchdog={"poll_interval": 0.2, "kv_cooldown": 0.0, "kv_low_polls": 2})
    d.start()
    d.wait_ready()
    time.sleep(0.5)
    healthy = _series(d.exporter_url, "gpu0")

    # Maintenance, then a KV leak the daemon must not remediate: low free blocks, node out of the balancer.
    assert control.request(d.runtime_dir, {"cmd": "maintenance", "on": True})["ok"]
    d.fake("POST", "/fake/control", json={"metrics": "leak", "kv_usage": 0.999})
    deadline = time.monotonic() + 10
    while not ((d.state()["metrics"].get("free_blocks") or 1e9) < 100 and d.state()["engine"]["maintenance"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    leaking = _series(d.exporter_url, "gpu1")
    assert any(sel.startswith("r3090d_kv_free_blocks{") and v < 100 for sel, v in leaking)

    # Points in time and the tick histogram move on a live daemon: they are written out below, as a live one's would.
    constant = [(sel, f"{v:g}+0x300") for sel, v in healthy + leaking if "_timestamp_seconds{" not in sel and not sel.startswith("r3090d_poll_duration")]
    synthetic = [
        ('up{job="r3090d",instance="gpu0"}', "1+0x300"),
        ('up{job="r3090d",instance="gpu1"}', "1+0x300"),
        ('r3090d_state_written_timestamp_seconds{job="r3090d",instance="gpu0"}', "0+60x300"),  # a tick just before every scrape
        ('r3090d_state_written_timestamp_seconds{job="r3090d",instance="gpu1"}', "0+60x300"),
        ('up{job="r3090d",instance="gpu2"}', "1 1 0+0x298"),  # a third daemon that went away
        ('r3090d_restarts_total{job="r3090d",instance="gpu3",reason="kv"}', "0 1 2 3+0x297"),
        ('r3090d_restarts_total{job="r3090d",instance="gpu4",reason="requested"}', "0 5 10 15+0x297"),
    ]
    gpu1 = {"job": "r3090d", "instance": "gpu1"}
    expected = {
        "R3090dKvCacheLow": [{"exp_labels": {**gpu1, "severity": "warning"}}],
        "R3090dMaintenanceForgotten": [{"exp_labels": {**gpu1, "severity": "info"}}],
        "R3090dDown": [{"exp_labels": {"job": "r3090d", "instance": "gpu2", "severity": "critical"}}],
    }
    # At 4 h 10 min: the 1 h restart window has moved past the restarts, so only the lasting conditions fire.
    out = _promtool_test(tmp_path, constant + synthetic, expected, "250m")
    assert out.returncode == 0, out.stdout + out.stderr
    # At 30 min: the restart loop is seen for gpu3 (kv) but not gpu4 (operator restarts); maintenance is young.
    expected = {
        "R3090dKvCacheLow": [{"exp_labels": {**gpu1, "severity": "warning"}}],
        "R3090dDown": [{"exp_labels": {"job": "r3090d", "instance": "gpu2", "severity": "critical"}}],
        "R3090dRestartLoop": [{"exp_labels": {"instance": "gpu3", "severity": "warning"}}],
    }
    out = _promtool_test(tmp_path, constant + synthetic, expected, "30m")
    assert out.returncode == 0, out.stdout + out.stderr
