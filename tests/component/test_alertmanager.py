"""The Alertmanager channel against a real Alertmanager (Debian's prometheus-alertmanager).

Alertmanager runs on 127.0.0.1 with clustering off, routing everything to a
webhook receiver this test runs, with the inhibit rules of
etc/alertmanager/alertmanager.yml. Covers: a firing alert in GET
/api/v2/alerts with its labels and annotations and at the webhook; re-sends
keeping it active past its first endsAt; a resolve ending it; exit-mode alerts
six hours ahead, resolved by the next start; a down Alertmanager (closed port,
or a listener that never answers) never slowing submit(); the inhibit rule
suppressing Prometheus' R3090dCriticalCondition copy while r3090d's own alert
fires; and `r3090ctl alerts test`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from r3090d import exitcodes
from r3090d.config import AlertmanagerConfig, AlertsConfig, SyslogConfig
from r3090d.core.actions import SendAlert
from r3090d.effectors.alertformat import AlertContext
from r3090d.effectors.alerts import AlertDispatcher
from tests.daemon_harness import free_port
from tests.server_binary import ServerBinary
from tests.silent_server import SilentServer
from tests.waiting import wait_until

pytestmark = pytest.mark.component

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "etc" / "alertmanager" / "alertmanager.yml"
BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
needs_alertmanager = pytest.mark.skipif(
    BINARY is None,
    reason="no Alertmanager binary (prometheus-alertmanager or alertmanager) on PATH: apt-get install prometheus-alertmanager",
)
UUID = "GPU-5f2e1c7a-0b3d-4e8f-9a61-2c7d3e4f5a6b"
CTX = AlertContext(hostname="gpu-host", gpu_index=0, gpu_name="NVIDIA GeForce RTX 3090", instance=1, gpu_uuid=UUID)
CAUSE = "torch.OutOfMemoryError: CUDA out of memory"
GAVE_UP = SendAlert(
    "gave_up",
    "critical",
    "firing",
    f"gave up: 2 start failures in a row with the same cause; root cause: {CAUSE}; the engine stays stopped until r3090ctl restart",
)
EXPECTED_LABELS = {
    "alertname": "gave_up",
    "alert": "gave_up",
    "severity": "critical",
    "host": "gpu-host",
    "gpu": "gpu0 NVIDIA GeForce RTX 3090",
    "unit_instance": "1",
}


def parse_time(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# ----------------------------------------------------------------- servers


class Webhook:
    """Alertmanager's receiver: records each notification's alerts as (status, labels)."""

    def __init__(self):
        self.notifications: list[dict] = []
        self._lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook._lock:
                    hook.notifications.append(data)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self) -> list[dict]:
        with self._lock:
            return [a for n in self.notifications for a in n["alerts"]]

    def wait(self, predicate, timeout: float, what: str) -> list[dict]:
        """Until an alert matching `predicate` was notified; returns every alert notified so far."""
        wait_until(
            lambda: any(predicate(a) for a in self.alerts()),
            timeout,
            what=f"{what} at the webhook",
            details=lambda: f"got {self.alerts()}",
        )
        return self.alerts()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Alertmanager(ServerBinary):
    """One Alertmanager on 127.0.0.1, clustering off, every alert to the webhook, the shipped inhibit rules."""

    def __init__(self, workdir: Path, webhook_url: str):
        super().__init__("Alertmanager", workdir)
        shipped = yaml.safe_load(SHIPPED.read_text())
        config = {
            "route": {
                "receiver": "hook",
                "group_by": ["alertname", "host", "unit_instance"],
                "group_wait": "1s",
                "group_interval": "1s",
                "repeat_interval": "1h",
            },
            "receivers": [{"name": "hook", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
            "inhibit_rules": shipped["inhibit_rules"],
        }
        self.config = workdir / "alertmanager.yml"
        self.config.write_text(yaml.safe_dump(config))

    def argv(self) -> list[str]:
        return [
            BINARY,
            f"--config.file={self.config}",
            f"--storage.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ]

    def alerts(self, **filters) -> list[dict]:
        """GET /api/v2/alerts: the alerts not yet resolved (active, suppressed or unprocessed)."""
        response = self.client.get("/api/v2/alerts", params=filters)
        response.raise_for_status()
        return response.json()

    def find(self, alertname: str, **labels) -> dict | None:
        found = [a for a in self.alerts() if a["labels"].get("alertname") == alertname and labels.items() <= a["labels"].items()]
        assert len(found) <= 1, found
        return found[0] if found else None

    def post(self, alerts: list[dict]) -> None:
        self.client.post("/api/v2/alerts", json=alerts).raise_for_status()


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()


@pytest.fixture
def alertmanager(tmp_path, webhook):
    server = Alertmanager(tmp_path, webhook.url).start()
    yield server
    server.stop()


@contextmanager
def dispatcher(url, *, resend: float = 1.0, state_dir: Path | None = None, exit_on_give_up: bool = False, **kw):
    cfg = AlertsConfig(
        syslog=SyslogConfig(enabled=False),
        alertmanager=AlertmanagerConfig(enabled=True, url=url, resend_interval=resend, timeout=kw.pop("timeout", 2.0)),
    )
    d = AlertDispatcher(cfg, CTX, state_dir=state_dir, exit_on_give_up=exit_on_give_up, retry_initial=0.2, retry_max=1.0, **kw)
    try:
        yield d
    finally:
        d.close()


# -------------------------------------------------------------------- tests


@needs_alertmanager
def test_firing_alert_has_its_labels_reaches_the_webhook_and_resends_keep_it_past_its_first_end(alertmanager, webhook):
    with dispatcher(alertmanager.url, resend=1.0) as d:
        before = time.time()
        d.submit(GAVE_UP)
        got = wait_until(lambda: alertmanager.find("gave_up"), 10, what="gave_up in GET /api/v2/alerts")
        assert got["labels"] == EXPECTED_LABELS  # the UUID is no label: a label names the alert
        assert got["annotations"] == {"summary": GAVE_UP.summary, "root_cause": CAUSE, "gpu_uuid": UUID}
        assert got["status"]["state"] == "active"
        starts, first_end = parse_time(got["startsAt"]), parse_time(got["endsAt"])
        assert before - 0.01 <= starts <= time.time()
        assert first_end == pytest.approx(starts + 4.0, abs=0.5)  # 4 x resend_interval
        webhook.wait(lambda a: a["labels"] == EXPECTED_LABELS and a["status"] == "firing", 15, "gave_up FIRING")

        # Re-sent every second: active at every look until 8 s after it started (twice its first endsAt).
        while time.time() < starts + 8.0:
            now = alertmanager.find("gave_up")
            assert now is not None and now["status"]["state"] == "active", f"gave_up lapsed at +{time.time() - starts:.1f} s"
            assert parse_time(now["startsAt"]) == starts  # the same episode, never restarted
            time.sleep(0.2)
        assert parse_time(alertmanager.find("gave_up")["endsAt"]) > first_end + 3.0

        d.submit(SendAlert("gave_up", "critical", "resolved", "the engine is ready again after a give-up"))
        wait_until(lambda: alertmanager.find("gave_up") is None, 10, what="gave_up resolved in Alertmanager")
        resolved = webhook.wait(lambda a: a["labels"] == EXPECTED_LABELS and a["status"] == "resolved", 15, "gave_up RESOLVED")
        # As instants: the webhook and the API write the same time with different digits (.86Z, .860Z).
        assert parse_time([a["startsAt"] for a in resolved if a["status"] == "resolved"][-1]) == starts
        assert d.flush(5)
        assert d.status()["alertmanager"]["dropped"] == 0 and d.status()["alertmanager"]["failing"] is None


@needs_alertmanager
def test_an_event_lasts_five_minutes_and_a_condition_held_back_by_the_lifecycle_still_arrives(alertmanager):
    with dispatcher(alertmanager.url, resend=60.0) as d:
        d.submit(SendAlert("engine_restarted", "warning", "firing", f"engine restarting (exited): code 1; root cause: {CAUSE}, next start in 2 s"))
        event = wait_until(lambda: alertmanager.find("engine_restarted"), 10, what="engine_restarted")
        assert parse_time(event["endsAt"]) - parse_time(event["startsAt"]) == pytest.approx(300.0, abs=1.0)
        assert event["annotations"]["root_cause"] == CAUSE

        # The lifecycle's table says gpu_memory fires (its FIRING was held back by a silence): sync() sends it.
        held = type("Entry", (), {"severity": "warning", "summary": "GPU memory used 23600 MiB", "since": 5.0})()
        d.sync({"gpu_memory": held}, wall_offset=time.time() - 10.0)
        got = wait_until(lambda: alertmanager.find("gpu_memory"), 10, what="gpu_memory from sync()")
        assert parse_time(got["startsAt"]) == pytest.approx(time.time() - 5.0, abs=1.0)  # its since, not now
        d.sync({}, wall_offset=0.0)  # no longer in the lifecycle's table: resolved
        wait_until(lambda: alertmanager.find("gpu_memory") is None, 10, what="gpu_memory resolved by sync()")


@needs_alertmanager
def test_exit_mode_alerts_run_six_hours_ahead_and_the_next_start_resolves_them(alertmanager, webhook, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    with dispatcher(alertmanager.url, resend=60.0, state_dir=state, exit_on_give_up=True) as d:
        d.submit(GAVE_UP)
        d.submit(SendAlert("preflight_failed", "critical", "firing", "preflight failed: driver: 470.0 (expected >= 535.0)"))
        assert d.flush(10)
    for name in ("gave_up", "preflight_failed"):
        got = wait_until(lambda n=name: alertmanager.find(n), 10, what=name)
        assert parse_time(got["endsAt"]) - time.time() == pytest.approx(6 * 3600, abs=60)
    saved = json.loads((state / "alertmanager.json").read_text())
    assert sorted(a["key"] for a in saved["alerts"]) == ["gave_up", "preflight_failed"]
    webhook.wait(lambda a: a["labels"] == EXPECTED_LABELS and a["status"] == "firing", 15, "gave_up FIRING")

    # The next start: the daemon knows no GPU name yet, and resolves both with their first labels.
    later = AlertsConfig(syslog=SyslogConfig(enabled=False), alertmanager=AlertmanagerConfig(enabled=True, url=alertmanager.url))
    d2 = AlertDispatcher(later, AlertContext(hostname="gpu-host", gpu_index=0, instance=1), state_dir=state)
    try:
        wait_until(
            lambda: alertmanager.find("gave_up") is None and alertmanager.find("preflight_failed") is None,
            10,
            what="both resolved",
        )
        webhook.wait(lambda a: a["labels"] == EXPECTED_LABELS and a["status"] == "resolved", 15, "gave_up RESOLVED")
        assert d2.flush(10)
        wait_until(
            lambda: json.loads((state / "alertmanager.json").read_text())["alerts"] == [],
            10,
            what="an empty table on disk",
        )
    finally:
        d2.close()


@pytest.mark.parametrize("down", ["closed port", "never answers"])
def test_a_down_alertmanager_never_slows_submit(down):
    listener = SilentServer() if down == "never answers" else None
    url = listener.url if listener else f"http://127.0.0.1:{free_port()}"
    keys = [f"condition_{i}" for i in range(10)]
    times = []
    try:
        with dispatcher(url, resend=1.0, timeout=3.0) as d:
            for round_ in range(50):
                for key in keys:
                    state = "resolved" if round_ % 2 else "firing"
                    started = time.perf_counter()
                    d.submit(SendAlert(key, "warning", state, f"{key} round {round_}"))
                    times.append(time.perf_counter() - started)
            times.sort()
            worst, median = times[-1], times[len(times) // 2]
            print(f"\n[alertmanager {down}] {len(times)} submits: max {worst * 1000:.3f} ms, median {median * 1000:.3f} ms")
            # A submit that waited on the network would take the 3 s timeout; one that waited
            # out the 0.2 s backoff would do so every time, which the median shows. The worst
            # case leaves room for a loaded 2-core machine's scheduling (159 ms seen).
            assert worst < 1.0, f"a submit() took {worst * 1000:.1f} ms"
            assert median < 0.001, f"the median submit() took {median * 1000:.2f} ms"
            wait_until(
                lambda: d.status()["alertmanager"]["failing"], 10, what="the channel to report the failure"
            )
            # One POST per key waits, the newest, however many states were submitted (plus one in flight).
            assert d.status()["alertmanager"]["pending"] <= len(keys) + 1
            started = time.perf_counter()
            assert d.flush(0.3) is False
            assert time.perf_counter() - started < 2.0
    finally:
        if listener:
            listener.close()


@needs_alertmanager
def test_inhibit_rule_suppresses_the_prometheus_copy_while_r3090d_own_alert_fires(alertmanager, webhook):
    def prometheus_copy(host: str) -> dict:
        """R3090dCriticalCondition as Prometheus sends it, with host and unit_instance as the shipped config asks."""
        return {
            "labels": {
                "alertname": "R3090dCriticalCondition",
                "alert": "gave_up",
                "severity": "critical",
                "job": "r3090d",
                "instance": f"{host}:9401",
                "host": host,
                "unit_instance": "1",
            },
            "annotations": {"summary": f"r3090d on {host}:9401: gave_up is firing"},
            "endsAt": dt.datetime.fromtimestamp(time.time() + 600, dt.UTC).isoformat(),
        }

    with dispatcher(alertmanager.url, resend=1.0) as d:
        d.submit(GAVE_UP)
        wait_until(lambda: alertmanager.find("gave_up"), 10, what="r3090d's own gave_up")
        alertmanager.post([prometheus_copy("gpu-host"), prometheus_copy("other-host")])

        copy = wait_until(
            lambda: (a := alertmanager.find("R3090dCriticalCondition", host="gpu-host")) and a["status"]["inhibitedBy"] and a,
            15,
            what="the copy for gpu-host to be inhibited",
        )
        assert copy["status"]["state"] == "suppressed"
        other = alertmanager.find("R3090dCriticalCondition", host="other-host")
        assert other["status"]["state"] == "active" and not other["status"]["inhibitedBy"]  # another host: not a duplicate
        # The other host's copy is notified; by then gpu-host's, in a group of its own, would have been too.
        webhook.wait(lambda a: a["labels"].get("host") == "other-host", 15, "the other host's copy")
        assert not [a for a in webhook.alerts() if a["labels"]["alertname"] == "R3090dCriticalCondition" and a["labels"]["host"] == "gpu-host"]

        d.submit(SendAlert("gave_up", "critical", "resolved", "the engine is ready again after a give-up"))
        # r3090d's own alert resolved: the copy (Prometheus still firing it) is no longer inhibited.
        webhook.wait(
            lambda a: a["labels"]["alertname"] == "R3090dCriticalCondition" and a["labels"]["host"] == "gpu-host",
            15,
            "the gpu-host copy once r3090d's alert resolved",
        )
        assert alertmanager.find("R3090dCriticalCondition", host="gpu-host")["status"]["state"] == "active"


CTL = [sys.executable, "-c", "import sys; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()"]


def ctl(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("R3090D_CONFIG", "R3090D_INSTANCE", "CREDENTIALS_DIRECTORY")}
    return subprocess.run([*CTL, *args], capture_output=True, text=True, timeout=60, env=env)


def write_config(path: Path, urls: list[str], token_file: Path | None = None) -> Path:
    lines = [
        "[engine]",
        'model = "/nonexistent/models/qwen"',  # `alerts test` needs neither the engine nor the model
        'python = "/nonexistent/venv/bin/python"',
        "[alerts.syslog]",
        "enabled = false",
        "[alerts.alertmanager]",
        "enabled = true",
        f"url = {json.dumps(urls)}",
        "timeout = 2",
    ]
    if token_file:
        lines.append(f'bearer_token_file = "{token_file}"')
    path.write_text("\n".join(lines) + "\n")
    return path


@needs_alertmanager
def test_cli_alerts_test_posts_to_each_alertmanager_and_reports_a_dead_one(alertmanager, tmp_path):
    token = tmp_path / "am-token"
    token.write_text("t0ken-never-shown\n")
    dead = f"http://127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "r3090d.toml", [alertmanager.url, dead], token)
    proc = ctl("alerts", "test", "--config", str(config), "--json")
    assert proc.returncode == exitcodes.CRITICAL, proc.stdout + proc.stderr
    report = {c["channel"]: c for c in json.loads(proc.stdout)["channels"]}
    assert report["alertmanager[0]"]["ok"] is True and report["alertmanager[0]"]["target"] == alertmanager.url
    assert report["alertmanager[1]"]["ok"] is False and "Connection refused" in report["alertmanager[1]"]["detail"]
    got = wait_until(lambda: alertmanager.find("test"), 10, what="the test alert")
    assert got["labels"]["severity"] == "info" and got["labels"]["host"] == socket.gethostname()
    assert "t0ken" not in proc.stdout + proc.stderr

    one = write_config(tmp_path / "one.toml", [alertmanager.url])
    proc = ctl("alerts", "test", "--config", str(one), "--channel", "alertmanager")
    assert proc.returncode == exitcodes.OK, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"alertmanager -> {alertmanager.url}: sending test alert ... ok (")


@pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool is not installed (apt-get install prometheus-alertmanager)")
def test_shipped_alertmanager_config_is_valid():
    proc = subprocess.run(["amtool", "check-config", str(SHIPPED)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 inhibit rules" in proc.stdout
