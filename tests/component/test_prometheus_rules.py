"""etc/prometheus-rules.yml against what the exporter really exports.

Every metric a rule names must be one r3090d exports. Then promtool (from
Debian's prometheus package) checks the file and:

- for every alert, evaluates a case that makes it fire and a near miss that
  must not: one evaluation before its `for:` has elapsed it is not firing yet,
  at that evaluation it fires, with its labels and rendered annotations;
- evaluates the rules over series scraped from a real daemon: a healthy one
  fires nothing; one in maintenance with a leaking KV cache fires the KV alert
  and, after 4 h, the forgotten-maintenance one, but never "not serving";
- evaluates them over the exporter's series of swap-mode documents: a model
  parked for hours (stale canary, stale KV readings, a suspension of the
  arbiter's) fires nothing and masks nothing; a failed model fires for itself.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from r3090d.core.arbiter import Residency
from r3090d.core.snapshot import GpuSample, GpuStatus
from r3090d.core.suspension import Stage
from r3090d.core.vocabulary import Phase
from r3090d.service import control_client, exporter
from r3090d.service.statedoc import CanaryInfo, HealingInfo, SuspendInfo
from r3090d.units import GIB, MIB
from tests import swapdocs
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "etc" / "prometheus-rules.yml"
RULE_BY_ALERT = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
ALERTS = list(RULE_BY_ALERT)
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt-get install prometheus)")


def exported_names() -> set[str]:
    """Every sample name the exporter can produce, from a document with every field filled in."""
    stats = exporter.TickStats()
    stats.observe(0.01)
    doc = {
        "written_at": 0.0,
        "daemon": {"version": "x", "poll_interval": 2.0},
        "engine": {"phase": "ready", "maintenance": False, "ready_since": 1.0, "model": "m"},
        "restarts": {"by_reason": {"kv": 1}, "backoff_level": 0, "recent": 1},
        "health": {"status": "ok"},
        "inference": {"ok": True, "latency_s": 0.5, "finished_at": 0.5},
        "thresholds": {"gpu_memory_alert_bytes": 2, "kv_min_free_blocks": 100, "restart_storm_restarts": 3, "restart_storm_window_s": 3600.0},
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
        "suspend": {"stage": "suspended", "since": 0.0, "gpu_bytes": 1, "host_rss_bytes": 2},
        "healing": {"reset_hold": "XID 79", "retry_attempts": 1, "next_retry_at": 5.0, "xid_by_class": {"reset": 1}},
        "canary": {"enabled": True, "interval_s": 600.0, "baseline_tokens": 16, "last_match_at": 1.0, "last_ok_at": 1.0, "last_margin": 2.0},
    }
    names = set()
    for d in (doc, swapdocs.as_json(swapdocs.swap_doc(1.0))):  # single mode's, and swap mode's
        registry = CollectorRegistry(auto_describe=False)
        registry.register(exporter.StateCollector(lambda d=d: d, clock=lambda: 1.0))
        names |= {s.name for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples}
    return names


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
    return _selectors(httpx.get(exporter_url + "/metrics", timeout=5.0, trust_env=False).text, instance)


def _selectors(text: str, instance: str) -> list[tuple[str, float]]:
    """An exposition as (series selector, value), with the labels Prometheus would add (an empty label is none)."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = {**{k: v for k, v in s.labels.items() if v}, "job": "r3090d", "instance": instance}
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
    wait_until(lambda: any(sel.startswith("r3090d_kv_free_blocks{") for sel, _ in _series(d.exporter_url, "gpu0")), 10, what="the first /metrics reading exported")
    healthy = _series(d.exporter_url, "gpu0")

    # Maintenance, then a KV leak the daemon must not remediate: low free blocks, node out of the balancer.
    assert control_client.request(d.runtime_dir, {"cmd": "maintenance", "on": True})["ok"]
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
        # gpu3's daemon counts 3 restarts in its window until minute 60; gpu4's operator restarts count for nothing.
        ('r3090d_restarts_total{job="r3090d",instance="gpu3",reason="kv"}', "0 1 2 3+0x297"),
        ('r3090d_engine_recent_restarts{job="r3090d",instance="gpu3"}', "0 1 2 3+0x57 0+0x240"),
        ('r3090d_engine_restart_storm_threshold{job="r3090d",instance="gpu3"}', "3+0x300"),
        ('r3090d_restarts_total{job="r3090d",instance="gpu4",reason="requested"}', "0 5 10 15+0x297"),
        ('r3090d_engine_recent_restarts{job="r3090d",instance="gpu4"}', "0+0x300"),
        ('r3090d_engine_restart_storm_threshold{job="r3090d",instance="gpu4"}', "3+0x300"),
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
        "R3090dRestartLoop": [{"exp_labels": {"job": "r3090d", "instance": "gpu3", "severity": "warning"}}],
    }
    out = _promtool_test(tmp_path, constant + synthetic, expected, "30m")
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------ swap mode, from the exporter's own series


def _exported(doc: dict, instance: str) -> list[tuple[str, float]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter.StateCollector(lambda: doc, clock=lambda: doc["written_at"]))
    return _selectors(generate_latest(registry).decode(), instance)


@needs_promtool
def test_rules_judge_each_served_model_on_its_own(tmp_path):
    """Five hours into a swap-mode node's life (minute 300 of the evaluation), its series held since minute 0."""
    now = 300 * 60.0
    chat, coder, embed = swapdocs.chat(now), swapdocs.coder(now), swapdocs.embed(now)
    ready_since_start = dataclasses.replace(chat.engine, since=0.0, ready_since=0.0)
    # swap0: coder parked since minute 0, its canary and KV readings as old; embed given up; the card's memory high.
    parked_long = dataclasses.replace(
        coder, suspend=dataclasses.replace(coder.suspend, since=0.0),
        canary=CanaryInfo(enabled=True, interval_s=600.0, baseline_tokens=16, checks=3, last_verdict="match", last_match_at=0.0, last_ok_at=0.0),
    )  # fmt: skip
    given_up = dataclasses.replace(embed, residency=Residency.FAILED, engine=dataclasses.replace(embed.engine, phase=Phase.GIVEN_UP),
                                   give_up_reason="6 failures in 1800 s", healing=HealingInfo(given_up=True))  # fmt: skip
    card = GpuSample(GpuStatus.OK, index=0, name="RTX 3090", memory_total=24 * GIB, memory_used=23 * GIB + 512 * MIB)
    # chat, resident, is short of KV cache with requests queued, and restarted as often as the storm threshold: judged
    # against the daemon's one threshold, with its served_model kept.
    busy = dataclasses.replace(chat, engine=ready_since_start, metrics=coder.metrics, restarts=dataclasses.replace(chat.restarts, recent=3))
    swap0 = swapdocs.swap_doc(now, models=[busy, parked_long, given_up], gpu=card)
    # swap1: chat suspended by the operator since minute 0 (off the router's table, as a parked one), coder serving.
    by_operator = dataclasses.replace(
        chat, residency=Residency.PARKED, engine=dataclasses.replace(chat.engine, phase=Phase.SUSPENDED, ready_since=None),
        suspend=SuspendInfo(stage=Stage.SUSPENDED, since=0.0, gpu_bytes=15 * GIB, host_rss_bytes=16 * GIB, how_to_resume="r3090ctl resume --model chat"),
    )  # fmt: skip
    serving = dataclasses.replace(coder, residency=Residency.READY, suspend=None, engine=chat.engine, metrics=chat.metrics, canary=chat.canary)
    swap1 = swapdocs.swap_doc(now, models=[by_operator, serving, embed])

    series = []
    for instance, doc in (("swap0", swap0), ("swap1", swap1)):
        scraped = _exported(swapdocs.as_json(doc), instance)
        if instance == "swap0":  # the parked engine's phase is suspended: what must mask no other model
            assert any(s.startswith("r3090d_engine_state{") and 'served_model="coder"' in s and 'state="suspended"' in s and v == 1 for s, v in scraped)
        series += [(sel, f"{v:g}+0x300") for sel, v in scraped if not sel.startswith("r3090d_state_written_timestamp_seconds")]
        series += [(f'up{{job="r3090d",instance="{instance}"}}', "1+0x300"),
                   (f'r3090d_state_written_timestamp_seconds{{job="r3090d",instance="{instance}"}}', "0+60x300")]  # fmt: skip
    swap0_labels = {"job": "r3090d", "instance": "swap0"}
    expected = {
        # The failed model fires for itself, though another one is parked (its phase suspended).
        "R3090dEngineNotServing": [{"exp_labels": {**swap0_labels, "served_model": "embed", "severity": "critical"}}],
        "R3090dEngineGaveUp": [{"exp_labels": {**swap0_labels, "served_model": "embed", "severity": "critical"}}],
        # A parked model lent the card to nobody: the card's memory is judged.
        "R3090dGpuMemoryHigh": [{"exp_labels": {**swap0_labels, "severity": "warning"}}],
        "R3090dKvCacheLow": [{"exp_labels": {**swap0_labels, "served_model": "chat", "severity": "warning"}}],
        "R3090dRequestsQueued": [{"exp_labels": {**swap0_labels, "served_model": "chat", "severity": "warning"}}],
        "R3090dRestartLoop": [{"exp_labels": {**swap0_labels, "served_model": "chat", "severity": "warning"}}],
        # The operator's suspension of a model is one; the arbiter's parking never is (no canary, KV or suspension alert for coder).
        "R3090dSuspendedLong": [{"exp_labels": {"job": "r3090d", "instance": "swap1", "served_model": "chat", "severity": "info"}}],
    }
    out = _promtool_test(tmp_path, series, expected, "300m")
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------ one case per alert


def sel(metric: str, instance: str, **labels: str) -> str:
    """A series selector with the labels a scrape of job r3090d adds."""
    body = ",".join(f'{k}="{v}"' for k, v in {"job": "r3090d", "instance": instance, **labels}.items())
    return f"{metric}{{{body}}}"


FIRING, QUIET = "gpu0", "gpu9"


@dataclass(frozen=True)
class AlertCase:
    """An alert's expression turns true at minute `start` for the FIRING instance; QUIET's series are a near miss.

    With the rule's `for:` of F minutes (evaluated every minute), the alert is
    not firing at minute start + F - 1 (pending, or not yet true when F is 0)
    and fires at start + F, with `labels` (the rule's own labels added) and
    `annotations` as rendered then. QUIET never fires. `resolved`, for rules
    over a window, is the minute at which the FIRING alert clears as the window
    moves past the change (it still fires, as rendered above, one minute before).
    """

    alert: str
    series: tuple[tuple[str, str], ...]
    quiet: tuple[tuple[str, str], ...]
    start: int
    labels: dict[str, str]
    annotations: dict[str, str]  # the templated ones; a text without a template is the rule's own
    resolved: int | None = None


FIRING_JOB = {"job": "r3090d", "instance": FIRING}
CASES = [
    AlertCase(
        "R3090dDown",
        series=((sel("up", FIRING), "1 1 0+0x30"),),
        quiet=((sel("up", QUIET), "1 1 0 1+0x30"),),  # one failed scrape: shorter than `for`
        start=2,
        labels=FIRING_JOB,
        annotations={"summary": "r3090d on gpu0 does not answer"},
    ),
    AlertCase(
        "R3090dStuck",
        # A tick every minute up to minute 4, then none: 60 s old at minute 5 (not over), 120 s at 6.
        series=((sel("r3090d_state_written_timestamp_seconds", FIRING), "0+60x4 240+0x30"),),
        quiet=((sel("r3090d_state_written_timestamp_seconds", QUIET), "0+60x4 240 240 360+60x30"),),  # once exactly 60 s old
        start=6,
        labels=FIRING_JOB,
        annotations={"summary": "r3090d on gpu0 has not completed a tick for 3m 0s"},
    ),
    AlertCase(
        "R3090dSlowTicks",
        # Every tick in the (1 s, 10 s] bucket: p99 interpolates to 1 + 9 x 0.99 = 9.91 s.
        series=(
            (sel("r3090d_poll_duration_seconds_bucket", FIRING, le="1.0"), "0+0x40"),
            (sel("r3090d_poll_duration_seconds_bucket", FIRING, le="10.0"), "0+60x40"),
            (sel("r3090d_poll_duration_seconds_bucket", FIRING, le="+Inf"), "0+60x40"),
        ),
        quiet=(
            (sel("r3090d_poll_duration_seconds_bucket", QUIET, le="1.0"), "0+60x40"),
            (sel("r3090d_poll_duration_seconds_bucket", QUIET, le="10.0"), "0+60x40"),
            (sel("r3090d_poll_duration_seconds_bucket", QUIET, le="+Inf"), "0+60x40"),
        ),
        start=1,  # rate() needs two samples
        labels={"instance": FIRING},
        annotations={"summary": "r3090d ticks on gpu0 take 9.91 s (p99)"},
    ),
    AlertCase(
        "R3090dEngineGaveUp",
        # Through an automatic attempt the phase leaves given-up for minutes; the gauge stays 1.
        series=((sel("r3090d_engine_given_up", FIRING), "0 0 1+0x30"), (sel("r3090d_engine_state", FIRING, state="given-up"), "0 0 1 1 0 0 0 1+0x30")),
        quiet=((sel("r3090d_engine_given_up", QUIET), "0+0x30"), (sel("r3090d_engine_state", QUIET, state="backoff"), "0 0 1+0x30")),
        start=2,
        labels=FIRING_JOB,
        annotations={"summary": "r3090d on gpu0 gave up on the engine"},
    ),
    AlertCase(
        "R3090dEngineNotServing",
        series=((sel("r3090d_serving", FIRING), "1 0+0x40"), (sel("r3090d_maintenance", FIRING), "0+0x40")),
        quiet=((sel("r3090d_serving", QUIET), "1 0+0x40"), (sel("r3090d_maintenance", QUIET), "0 1+0x40")),  # out on purpose
        start=1,
        labels=FIRING_JOB,
        annotations={"summary": "the engine on gpu0 has not been ready for 20 minutes"},
    ),
    AlertCase(
        "R3090dRestartLoop",
        # The daemon's count of restarts in its window reaches its threshold at minute 3 and holds until the
        # window passes the first of them at minute 61.
        series=(
            (sel("r3090d_engine_recent_restarts", FIRING), "0 1 2 3+0x57 2+0x20"),
            (sel("r3090d_engine_restart_storm_threshold", FIRING), "3+0x80"),
            (sel("r3090d_engine_restart_storm_window_seconds", FIRING), "3600+0x80"),
        ),
        quiet=(
            (sel("r3090d_engine_recent_restarts", QUIET), "0 1 2 3 4+0x76"),
            (sel("r3090d_engine_restart_storm_threshold", QUIET), "5+0x80"),  # a daemon configured for more
            (sel("r3090d_engine_restart_storm_window_seconds", QUIET), "3600+0x80"),
        ),
        start=3,
        labels=FIRING_JOB,
        annotations={"summary": "the engine on gpu0 restarted 3 times in 1h 0m 0s"},
        resolved=61,
    ),
    AlertCase(
        "R3090dMaintenanceForgotten",
        series=((sel("r3090d_maintenance", FIRING), "0 1+0x300"),),
        quiet=((sel("r3090d_maintenance", QUIET), "0 1+0x238 0 1+0x60"),),  # off for one minute just before 4 h
        start=1,
        labels=FIRING_JOB,
        annotations={"summary": "r3090d on gpu0 has been in maintenance mode for 4 hours"},
    ),
    AlertCase(
        "R3090dSuspendedLong",
        # Suspended at minute 0: 4 h (14,400 s) old at minute 240, not over; over at 241.
        series=((sel("r3090d_suspended_since_timestamp_seconds", FIRING), "0+0x260"),),
        # Suspended at minute 0 too, resumed and suspended again at minute 200: the current suspension is young.
        quiet=((sel("r3090d_suspended_since_timestamp_seconds", QUIET), "0+0x199 12000+0x60"),),
        start=241,
        labels=FIRING_JOB,
        annotations={"summary": "the engine on gpu0 has been suspended for 4h 1m 0s"},
    ),
    AlertCase(
        "R3090dKvCacheLow",
        # The bound is the daemon's (watchdog.min_free_blocks), not the default of 100.
        series=((sel("r3090d_kv_free_blocks", FIRING), "500 250+0x30"), (sel("r3090d_kv_free_blocks_threshold", FIRING), "300+0x30")),
        quiet=((sel("r3090d_kv_free_blocks", QUIET), "500 100+0x30"), (sel("r3090d_kv_free_blocks_threshold", QUIET), "100+0x30")),  # at the bound
        start=1,
        labels=FIRING_JOB,
        annotations={"summary": "250 free KV cache blocks on gpu0"},
    ),
    AlertCase(
        "R3090dRequestsQueued",
        series=((sel("r3090d_requests_waiting", FIRING), "0 3+0x30"), (sel("r3090d_kv_usage_ratio", FIRING), "0.95+0x30")),
        quiet=((sel("r3090d_requests_waiting", QUIET), "0 3+0x30"), (sel("r3090d_kv_usage_ratio", QUIET), "0.9+0x30")),
        start=1,
        labels=FIRING_JOB,
        annotations={"summary": "requests waiting on gpu0 with the KV cache over 90 %"},
    ),
    AlertCase(
        "R3090dCanaryNoMatch",
        # Ready since minute 0, canary.interval 10 min: the last match at minute 10, then mismatches only.
        # 31 min without one at minute 41.
        series=(
            (sel("r3090d_engine_ready_timestamp_seconds", FIRING), "0+0x60"),
            (sel("r3090d_canary_interval_seconds", FIRING), "600+0x60"),
            (sel("r3090d_canary_last_ok_timestamp_seconds", FIRING), "0+0x9 600+0x50"),
            (sel("r3090d_canary_baseline_tokens", FIRING), "16+0x60"),
        ),
        # A busy box: every comparison inconclusive, each one seen as nothing wrong, every 10 min.
        quiet=(
            (sel("r3090d_engine_ready_timestamp_seconds", QUIET), "0+0x60"),
            (sel("r3090d_canary_interval_seconds", QUIET), "600+0x60"),
            (sel("r3090d_canary_last_ok_timestamp_seconds", QUIET), "0+0x9 600+0x9 1200+0x9 1800+0x9 2400+0x9 3000+0x9 3600+0x9"),
            (sel("r3090d_canary_baseline_tokens", QUIET), "16+0x60"),
        ),
        start=41,
        labels=FIRING_JOB,
        annotations={"summary": "the canary on gpu0 has not matched for 31m 0s"},
    ),
    AlertCase(
        "R3090dCanaryNoBaseline",
        # Ready since minute 0, canary.interval 10 min, never a baseline: 31 min at minute 31.
        series=(
            (sel("r3090d_engine_ready_timestamp_seconds", FIRING), "0+0x60"),
            (sel("r3090d_canary_interval_seconds", FIRING), "600+0x60"),
        ),
        # The baseline taken at minute 25 (under load, an interval after the last one that disagreed).
        quiet=(
            (sel("r3090d_engine_ready_timestamp_seconds", QUIET), "0+0x60"),
            (sel("r3090d_canary_interval_seconds", QUIET), "600+0x60"),
            (sel("r3090d_canary_baseline_tokens", QUIET), "_x25 16+0x35"),
        ),
        start=31,
        labels=FIRING_JOB,
        annotations={"summary": "the canary on gpu0 has no baseline after 31m 0s ready: nothing is compared"},
    ),
    AlertCase(
        "R3090dRouterDown",
        series=((sel("r3090d_router_up", FIRING), "1 1 0+0x30"),),
        quiet=((sel("r3090d_router_up", QUIET), "1 1 0 1+0x30"),),  # died and was restarted within the minute
        start=2,
        labels=FIRING_JOB,
        annotations={"summary": "the router on gpu0 is down: no model is served"},
    ),
    AlertCase(
        "R3090dSwapFailing",
        series=((sel("r3090d_swap_failures_total", FIRING, outcome="failed"), "0 0 0 1+0x40"),),
        quiet=(
            (sel("r3090d_swap_failures_total", QUIET, outcome="failed"), "2+0x40"),  # failures from before the window
            (sel("r3090d_swap_failures_total", QUIET, outcome="abandoned"), "0 0 0 1 2 3+0x40"),  # nobody asked any more
        ),
        start=3,
        labels=FIRING_JOB,
        annotations={"summary": "a model swap failed on gpu0 in the last 10 minutes"},
        resolved=13,  # 10 min after the failure's first sample
    ),
    AlertCase(
        "R3090dSwapFailingRepeatedly",
        # Failures at minutes 2, 3 and 4: three within 30 minutes until the window passes the first at minute 32.
        series=((sel("r3090d_swap_failures_total", FIRING, outcome="failed"), "0 0 1 2 3+0x60"),),
        # Three failures too, 38 minutes apart from first to last: never three within 30.
        quiet=((sel("r3090d_swap_failures_total", QUIET, outcome="failed"), "0 0 1+0x17 2+0x19 3+0x40"),),
        start=4,
        labels=FIRING_JOB,
        annotations={"summary": "model swaps keep failing on gpu0: 3 or more in 30 minutes"},
        resolved=32,
    ),
    AlertCase(
        "R3090dGpuLost",
        series=((sel("r3090d_gpu_lost", FIRING), "0 0 1+0x30"),),
        quiet=((sel("r3090d_gpu_lost", QUIET), "0+0x30"),),
        start=2,
        labels=FIRING_JOB,
        annotations={"summary": "the GPU behind gpu0 fell off the bus"},
    ),
    AlertCase(
        "R3090dGpuXidErrors",
        series=((sel("r3090d_xid_errors_total", FIRING, **{"class": "application"}), "0 0 0 1+0x40"),),
        quiet=(  # errors from before the window, and the reset class (R3090dGpuResetNeeded's)
            (sel("r3090d_xid_errors_total", QUIET, **{"class": "application"}), "5+0x40"),
            (sel("r3090d_xid_errors_total", QUIET, **{"class": "reset"}), "0 0 0 1+0x40"),
        ),
        start=3,
        labels={"instance": FIRING},
        annotations={"summary": "XID errors on the GPU behind gpu0 (no reset needed)"},
        resolved=18,  # 15 min after the error's first sample
    ),
    AlertCase(
        "R3090dGpuResetNeeded",
        series=((sel("r3090d_gpu_reset_needed", FIRING), "0 0 1+0x30"),),
        quiet=((sel("r3090d_gpu_reset_needed", QUIET), "0+0x30"),),
        start=2,
        labels=FIRING_JOB,
        annotations={"summary": "the GPU behind gpu0 needs a reset; no engine starts until then"},
    ),
    AlertCase(
        "R3090dGpuMemoryHigh",
        # The bound is the daemon's (watchdog.gpu_memory_alert_mib), not the default of 23,500 MiB.
        series=(
            (sel("r3090d_gpu_memory_used_bytes", FIRING), f"{20 * GIB} {20 * GIB + 512 * MIB}+0x30"),
            (sel("r3090d_gpu_memory_alert_threshold_bytes", FIRING), f"{20 * GIB}+0x30"),
        ),
        quiet=(
            (sel("r3090d_gpu_memory_used_bytes", QUIET), f"{23500 * MIB}+0x30"),
            (sel("r3090d_gpu_memory_alert_threshold_bytes", QUIET), f"{23500 * MIB}+0x30"),  # at the bound
        ),
        start=1,
        labels=FIRING_JOB,
        annotations={
            "summary": "GPU memory used on gpu0 is 20.5GiB",
            "description": "Above the alert threshold of 20GiB (watchdog.gpu_memory_alert_mib): the next allocation may fail. "
            "Look for other processes on the GPU, or lower gpu_memory_utilization.",
        },
    ),
    AlertCase(
        "R3090dGpuHot",
        series=((sel("r3090d_gpu_temperature_celsius", FIRING), "80 85+0x30"),),
        quiet=((sel("r3090d_gpu_temperature_celsius", QUIET), "80 84+0x30"),),
        start=1,
        labels=FIRING_JOB,
        annotations={"summary": "the GPU behind gpu0 is at 85 C"},
    ),
    AlertCase(
        "R3090dCriticalCondition",
        series=(
            (sel("r3090d_alerts_firing", FIRING, alert="gpu_lost", severity="critical"), "0 1+0x30"),
            (sel("r3090d_info", FIRING, version="0.1.0", model="m", unit_instance="", host="box"), "1+0x31"),
        ),
        quiet=(
            (sel("r3090d_alerts_firing", QUIET, alert="gpu_memory", severity="warning"), "0 1+0x30"),
            (sel("r3090d_info", QUIET, version="0.1.0", model="m", unit_instance="", host="box"), "1+0x31"),
        ),
        start=1,
        labels={**FIRING_JOB, "alert": "gpu_lost", "host": "box"},  # an empty unit_instance is no label at all
        annotations={"summary": "r3090d on gpu0: gpu_lost is firing"},
    ),
]


def minutes(duration: str | None) -> int:
    """A rule's `for:` in whole minutes ("90s" is refused: the cases evaluate once a minute)."""
    total = 0
    for n, unit in re.findall(r"(\d+)([smhd])", duration or ""):
        total += int(n) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    assert total % 60 == 0, f"for: {duration} is not whole minutes"
    return total // 60


def expected_annotations(case: AlertCase) -> dict[str, str]:
    rule = RULE_BY_ALERT[case.alert]
    out = {}
    for key, text in rule["annotations"].items():
        if "{{" in text:
            assert key in case.annotations, f"{case.alert}: its {key} is a template; the case must spell out how it renders"
            out[key] = case.annotations[key]
        else:
            out[key] = text
    return out


def promtool_group(case: AlertCase) -> dict:
    rule = RULE_BY_ALERT[case.alert]
    fire_at = case.start + minutes(rule.get("for"))
    alert = {"exp_labels": {**case.labels, **rule["labels"]}, "exp_annotations": expected_annotations(case)}
    checks = [
        {"eval_time": f"{fire_at - 1}m", "alertname": case.alert, "exp_alerts": []},
        {"eval_time": f"{fire_at}m", "alertname": case.alert, "exp_alerts": [alert]},
    ]
    if case.resolved is not None:
        checks.append({"eval_time": f"{case.resolved - 1}m", "alertname": case.alert, "exp_alerts": [alert]})
        checks.append({"eval_time": f"{case.resolved}m", "alertname": case.alert, "exp_alerts": []})
    return {
        "name": case.alert,
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in case.series + case.quiet],
        "alert_rule_test": checks,
    }


@needs_promtool
def test_a_canary_without_a_baseline_is_its_own_alert_never_one_of_wrong_output(tmp_path):
    """A box that never gave the canary a baseline has nothing compared: that is said, and not as a mismatch."""
    series = [
        (sel("r3090d_engine_ready_timestamp_seconds", FIRING), "0+0x60"),
        (sel("r3090d_canary_interval_seconds", FIRING), "600+0x60"),
        (sel("r3090d_canary_errors_total", FIRING), "0+1x60"),
    ]
    expected = {"R3090dCanaryNoBaseline": [{"exp_labels": {**FIRING_JOB, "severity": "warning"}}]}
    out = _promtool_test(tmp_path, series, expected, "41m")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_case():
    assert sorted(c.alert for c in CASES) == sorted(ALERTS)


@needs_promtool
def test_every_alert_fires_on_time_with_its_annotations_and_not_on_a_near_miss(tmp_path):
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [promtool_group(c) for c in CASES]}
    path = tmp_path / "alerts-test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_restart_loop_sees_every_restart_the_daemon_counts(tmp_path):
    """At a 15 s scrape: restarts from before Prometheus' first scrape count at once, and a burst of 4 in
    30 s keeps the alert firing for as long as the daemon's window holds them (3600 s, 240 scrapes)."""
    series = []
    for instance, counter, recent in (
        ("early", "4+0x300", "4+0x300"),  # 4 restarts before the first scrape; the daemon's window holds them
        ("burst", "0 2 4+0x300", "0 2 4+0x237 0+0x62"),  # 2 + 2 restarts within 30 s; out of the window at 60 min
    ):
        series += [
            (sel("r3090d_restarts_total", instance, reason="exited"), counter),
            (sel("r3090d_engine_recent_restarts", instance), recent),
            (sel("r3090d_engine_restart_storm_threshold", instance), "3+0x300"),
            (sel("r3090d_engine_restart_storm_window_seconds", instance), "3600+0x300"),
        ]

    def firing(*instances: str) -> list[dict]:
        return [{"exp_labels": {"job": "r3090d", "instance": i, "severity": "warning"}} for i in instances]

    expected = {
        "0s": firing("early"),
        "15s": firing("early"),
        "30s": firing("early", "burst"),
        "45s": firing("early", "burst"),
        "5m": firing("early", "burst"),
        "30m": firing("early", "burst"),
        "59m45s": firing("early", "burst"),
        "60m": firing("early"),
    }
    rules = yaml.safe_load(RULES.read_text())
    [group] = rules["groups"]
    group["rules"] = [{k: v for k, v in RULE_BY_ALERT["R3090dRestartLoop"].items() if k != "annotations"}]
    bare = tmp_path / "rules.yml"
    bare.write_text(yaml.safe_dump(rules))
    test = {
        "rule_files": [str(bare)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [{"eval_time": at, "alertname": "R3090dRestartLoop", "exp_alerts": alerts} for at, alerts in expected.items()],
            }
        ],
    }
    path = tmp_path / "restart-loop-test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
