"""The Alertmanager channel without a server: payloads, labels, root causes, config, and the feed's table."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import threading
import time
from pathlib import Path

import pytest

from r3090d import config
from r3090d.config import AlertmanagerConfig, AlertsConfig, ConfigError, SyslogConfig
from r3090d.core import alerting, policy
from r3090d.core.actions import SendAlert
from r3090d.core.rules import Condition
from r3090d.core.snapshot import ChildSample
from r3090d.effectors import alertmanager as am
from r3090d.effectors import alertmanager_payload as amp
from r3090d.effectors.alertformat import AlertContext, RaisedAlert
from r3090d.effectors.alerts import AlertDispatcher, _ChannelWorker
from r3090d.effectors.delivery import DeliveryError
from tests.configs import bare_config
from tests.snapshots import REFUSED, child, snap
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
CTX = AlertContext(hostname="box", gpu_index=1, gpu_name="NVIDIA GeForce RTX 3090", instance=1)
WALL = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
CAUSE = "torch.OutOfMemoryError: CUDA out of memory (GPU 0; 23.5 GiB total)"


def raised(key="kv_pressure", severity="warning", state="firing", summary="KV cache full", detail="", ctx=CTX, at=WALL):
    return RaisedAlert(SendAlert(key, severity, state, summary, detail), ctx, at)


# ------------------------------------------------------------------ payloads


def test_firing_condition_body_has_labels_annotations_start_and_end_four_resends_ahead():
    post = amp.AmPost(
        amp.AmAlert(
            "gave_up",
            amp.Kind.CONDITION,
            amp.alert_labels("gave_up", "critical", CTX),
            amp.alert_annotations(f"gave up: 2 start failures; root cause: {CAUSE}; the engine stays stopped until r3090ctl restart", "", CTX),
            WALL,
        ),
        amp.PostState.FIRING,
        None,
        amp.firing_ttl(amp.Kind.CONDITION, 60.0),
    )
    assert amp.body(post, WALL + 30) == [
        {
            "labels": {
                "alertname": "gave_up",
                "alert": "gave_up",
                "severity": "critical",
                "host": "box",
                "gpu": "gpu1 NVIDIA GeForce RTX 3090",
                "unit_instance": "1",
            },
            "annotations": {
                "summary": f"gave up: 2 start failures; root cause: {CAUSE}; the engine stays stopped until r3090ctl restart",
                "root_cause": CAUSE,
            },
            "startsAt": "2027-01-15T08:00:00.000Z",
            "endsAt": "2027-01-15T08:04:30.000Z",  # sent at +30 s, 4 x 60 s ahead of the send
        }
    ]


def test_ends_at_by_kind_and_state():
    assert amp.firing_ttl(amp.Kind.CONDITION, 1.0) == 4.0
    assert amp.firing_ttl(amp.Kind.EVENT, 1.0) == 300.0
    assert amp.firing_ttl(amp.Kind.EXIT, 1.0) == 6 * 3600.0
    assert amp.kind_of("engine_restarted", exit_on_give_up=False) is amp.Kind.EVENT
    assert amp.kind_of("preflight_failed", exit_on_give_up=False) is amp.Kind.EXIT
    assert amp.kind_of("gave_up", exit_on_give_up=False) is amp.Kind.CONDITION
    assert amp.kind_of("gave_up", exit_on_give_up=True) is amp.Kind.EXIT
    event = amp.one_off_post(raised("engine_restarted", summary="engine restarting (exited)"))
    assert amp.body(event, WALL + 100)[0]["endsAt"] == "2027-01-15T08:05:00.000Z"  # the event's time + 5 min
    resolve = amp.one_off_post(raised(state="resolved"))
    assert amp.body(resolve, WALL + 100)[0]["endsAt"] == "2027-01-15T08:00:00.000Z"


def test_every_event_condition_in_the_package_is_an_event_key():
    """A SendAlert does not say it is one-shot: the channel knows events by name, and must know them all."""
    found = {}
    for path in (REPO / "r3090d").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "Condition"):
                continue
            event = next((k.value for k in node.keywords if k.arg == "event"), None)
            if isinstance(event, ast.Constant) and event.value is True:
                assert node.args and isinstance(node.args[0], ast.Constant), f"{path}:{node.lineno}: an event with a computed key"
                found[node.args[0].value] = f"{path.relative_to(REPO)}:{node.lineno}"
    assert "engine_restarted" in found
    missing = {key: where for key, where in found.items() if key not in amp.EVENT_KEYS}
    assert not missing, f"add these to alertmanager.EVENT_KEYS: {missing}"


def test_start_after_end_is_clamped_so_alertmanager_accepts_it():
    alert = amp.AmAlert("k", amp.Kind.CONDITION, (("alertname", "k"),), (), WALL + 10)
    [doc] = amp.body(amp.AmPost(alert, amp.PostState.RESOLVED, WALL, 0.0), WALL)
    assert doc["startsAt"] == doc["endsAt"] == "2027-01-15T08:00:00.000Z"


def test_labels_keep_only_what_is_known_and_are_one_line():
    assert amp.alert_labels("k", "info", AlertContext(hostname="h")) == (
        ("alertname", "k"),
        ("alert", "k"),
        ("severity", "info"),
        ("host", "h"),
    )
    index_only = amp.alert_labels("k", "info", AlertContext(hostname="h\nx", gpu_index=0, instance=0))
    assert dict(index_only) == {"alertname": "k", "alert": "k", "severity": "info", "host": "h x", "gpu": "gpu0", "unit_instance": "0"}


def test_description_is_the_detail_and_a_detail_line_names_the_root_cause():
    annotations = dict(amp.alert_annotations("s; root cause: from the summary", "evidence\nroot cause: from the detail\n", CTX))
    assert annotations == {
        "summary": "s; root cause: from the summary",
        "root_cause": "from the detail",
        "description": "evidence\nroot cause: from the detail",
    }
    assert dict(amp.alert_annotations("no cause here", "", CTX)) == {"summary": "no cause here"}


UUID = "GPU-5f2e1c7a-0b3d-4e8f-9a61-2c7d3e4f5a6b"


def test_the_gpu_uuid_is_an_annotation_never_a_label():
    with_uuid = dataclasses.replace(CTX, gpu_uuid=UUID)
    annotations = dict(amp.alert_annotations("KV cache full", "evidence", with_uuid))
    assert annotations == {"summary": "KV cache full", "gpu_uuid": UUID, "description": "evidence"}
    assert amp.alert_labels("kv_pressure", "warning", with_uuid) == amp.alert_labels("kv_pressure", "warning", CTX)
    assert UUID not in repr(amp.alert_labels("kv_pressure", "warning", with_uuid))
    assert "gpu_uuid" not in dict(amp.alert_annotations("KV cache full", "", CTX))  # not known yet
    # gpu.required = false: no GPU is watched, so none is named.
    unwatched = dataclasses.replace(with_uuid, gpu_index=None)
    assert "gpu_uuid" not in dict(amp.alert_annotations("KV cache full", "", unwatched))


def test_a_uuid_learnt_mid_episode_joins_the_annotations_and_keeps_the_alert():
    f, [q] = feed()
    f.on_alert(raised(at=WALL))  # before NVML answered
    learnt = dataclasses.replace(CTX, gpu_uuid=UUID)
    f.on_alert(raised(state="reminder", summary="KV cache still full", ctx=learnt, at=WALL + 3600))
    # What the lifecycle's table fires (sync), and an event, name it too.
    held = type("Entry", (), {"severity": "warning", "summary": "GPU memory used 23600 MiB", "since": 0.0})()
    f.sync({"kv_pressure": held, "gpu_memory": held}, learnt)
    f.on_alert(raised(key="test", severity="info", summary="a test", ctx=learnt, at=WALL + 3700))
    first, remind, synced, test = q.items
    assert first.alert.labels == remind.alert.labels and first.alert.starts_at == remind.alert.starts_at
    assert "gpu_uuid" not in dict(first.alert.annotations)
    assert dict(remind.alert.annotations)["gpu_uuid"] == UUID
    assert synced.alert.key == "gpu_memory" and dict(synced.alert.annotations)["gpu_uuid"] == UUID
    assert dict(test.alert.annotations)["gpu_uuid"] == UUID
    f.close()


def _crashed(gen):
    """The engine of generation `gen`, exited 1 with CAUSE as the certain root cause."""
    return child(gen, alive=False, tree=(), exit_code=1, root_cause=CAUSE, root_cause_certain=True)


def test_root_cause_is_cut_from_every_summary_the_policy_writes():
    """engine_restarted, restart_storm and gave_up, as the real policy words them, around a cause with brackets and a ';'."""
    cfg = bare_config(alerts={"min_interval": 0.0},
                      watchdog={"start_failures": 10, "same_cause_failures": 3, "backoff_initial": 1.0, "restart_storm_restarts": 1})  # fmt: skip
    st = policy.initial_state(0.0)
    sent: list[SendAlert] = []
    now, gen = 0.0, 0
    for _ in range(200):
        if st.phase is policy.Phase.GIVEN_UP:
            break
        if st.phase is policy.Phase.STARTING and st.generation != gen:
            gen = st.generation
            ch = _crashed(gen)
        elif st.phase is policy.Phase.STARTING:
            ch = _crashed(gen)
        else:
            ch = ChildSample(generation=gen)
        acts, st = policy.decide(snap(now, ch, REFUSED), st, cfg, now)
        sent += [a for a in acts if isinstance(a, SendAlert)]
        now += 0.5
    by_key = {a.key: a for a in sent if a.state == "firing"}
    assert {"engine_restarted", "restart_storm", "gave_up"} <= set(by_key), sent
    assert ", next start in" in by_key["engine_restarted"].summary
    assert "the engine stays stopped" in by_key["gave_up"].summary
    assert by_key["restart_storm"].summary.endswith(")")
    for key in ("engine_restarted", "restart_storm", "gave_up"):
        assert amp.root_cause(by_key[key].summary) == CAUSE, by_key[key].summary


# -------------------------------------------------------------------- config


def load(tmp_path, section: str, *, check_files=True):
    path = tmp_path / "r3090d.toml"
    path.write_text(f'[engine]\nmodel = "m"\n[gpu]\nrequired = false\n[alerts.alertmanager]\n{section}\n')
    return config.load(path, check_files=check_files)


def refused(tmp_path, section, key, problem):
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, section)
    line = exc.value.one_line()
    assert exc.value.key == key and problem in line and "\n" not in line, line
    return line


def test_url_is_a_string_or_a_list(tmp_path):
    one = load(tmp_path, 'enabled = true\nurl = "http://am:9093/"').alerts.alertmanager
    assert one.urls == ("http://am:9093",)
    two = load(tmp_path, 'enabled = true\nurl = ["http://a:9093", "https://b.example.org/am"]').alerts.alertmanager
    assert two.urls == ("http://a:9093", "https://b.example.org/am")
    assert load(tmp_path, "").alerts.alertmanager == AlertmanagerConfig()


@pytest.mark.parametrize(
    "section,key,problem",
    [
        ("enabled = true", "alerts.alertmanager.url", "enabled but no URL is set"),
        ('url = "ftp://am:21"', "alerts.alertmanager.url", "is not an http:// or https:// URL"),
        ('url = "http://user:secret@am:9093"', "alerts.alertmanager.url", "holds credentials"),
        ('url = "http://am:99999"', "alerts.alertmanager.url", "is not a URL"),
        ('url = "http://am:9093/?x=1"', "alerts.alertmanager.url", "query or fragment"),
        ('url = ["http://a:9093", ""]', "alerts.alertmanager.url[1]", "is empty"),
        ('url = ["http://a:9093", "http://a:9093/"]', "alerts.alertmanager.url[1]", "listed twice"),
        ("url = 9093", "alerts.alertmanager.url", "expected a string or a list, got int"),
        ('url = ["http://a:9093", 1]', "alerts.alertmanager.url[1]", "expected a string"),
        ("resend_interval = 0.5", "alerts.alertmanager.resend_interval", "out of range"),
    ],
)
def test_bad_settings_are_one_line_errors(tmp_path, section, key, problem):
    line = refused(tmp_path, section, key, problem)
    assert "secret" not in line


def test_bearer_token_file_must_be_readable_and_its_text_is_never_shown(tmp_path):
    refused(tmp_path, f'enabled = true\nurl = "http://am:9093"\nbearer_token_file = "{tmp_path}/none"', "alerts.alertmanager.bearer_token_file", "cannot read")
    token = tmp_path / "token"
    token.write_text("s3cret-token\nsecond line\n")
    cfg = load(tmp_path, f'enabled = true\nurl = "http://am:9093"\nbearer_token_file = "{token}"')
    with pytest.raises(ConfigError) as exc:
        am.build_channels(cfg.alerts.alertmanager, cfg.source)
    assert exc.value.key == "alerts.alertmanager.bearer_token_file" and "s3cret" not in exc.value.one_line()
    token.write_text("s3cret-token\n")
    [channel] = am.build_channels(cfg.alerts.alertmanager, cfg.source)
    assert channel.redact("server said: Bearer s3cret-token") == "server said: Bearer <redacted>"
    assert "s3cret" not in repr(channel) + channel.target


def test_shipped_example_section_loads_once_uncommented(tmp_path):
    text = (REPO / "etc" / "r3090d.toml").read_text()
    section = re.search(r"^# \[alerts\.alertmanager\]\n((?:#.*\n)+)", text, re.M)
    assert section, "etc/r3090d.toml has a commented [alerts.alertmanager] section"
    keys = [line[2:] for line in section.group(1).splitlines() if re.match(r"# [a-z_]+ = ", line)]
    cfg = load(tmp_path, "\n".join(keys), check_files=False).alerts.alertmanager
    assert cfg == dataclasses.replace(AlertmanagerConfig(), enabled=True, url=cfg.url) and cfg.urls


# ---------------------------------------------------------------- the table


class FakeQueue:
    """A channel queue that records what the feed puts into it."""

    def __init__(self, name="alertmanager"):
        self.channel = type("Ch", (), {"name": name})()
        self.items: list[amp.AmPost] = []

    def put(self, item):
        self.items.append(item)

    def wait(self, n, timeout=10.0):
        wait_until(
            lambda: len(self.items) >= n,
            timeout,
            what=f"{n} items queued",
            details=lambda: f"queued: {self.items}",
        )
        return list(self.items)


def feed(queues=None, *, resend=60.0, state_dir=None, exit_on_give_up=False, clock=None):
    queues = queues or [FakeQueue()]
    cfg = AlertmanagerConfig(enabled=True, url="http://am:9093", resend_interval=resend)
    return am.AlertmanagerFeed(cfg, queues, state_dir=state_dir, exit_on_give_up=exit_on_give_up, clock=clock or (lambda: WALL + 50)), queues


def test_a_firing_keeps_its_labels_and_start_and_its_resolve_names_the_same_alert():
    f, [q] = feed()
    f.on_alert(raised(at=WALL))
    renamed = dataclasses.replace(CTX, gpu_name="another name")
    f.on_alert(raised(state="reminder", summary="KV cache still full", ctx=renamed, at=WALL + 3600))
    f.on_alert(raised(state="resolved", summary="KV cache has room again", ctx=renamed, at=WALL + 4000))
    fire, remind, resolve = q.items
    assert fire.alert.labels == remind.alert.labels == resolve.alert.labels == amp.alert_labels("kv_pressure", "warning", CTX)
    assert fire.alert.starts_at == remind.alert.starts_at == resolve.alert.starts_at == WALL
    assert dict(remind.alert.annotations)["summary"] == "KV cache still full"
    assert (resolve.state, resolve.ends_at, dict(resolve.alert.annotations)["summary"]) == ("resolved", WALL + 4000, "KV cache has room again")
    f.close()


def test_sync_sends_a_firing_the_lifecycle_held_back_and_resolves_what_left():
    """A local silence and min_interval hold FIRING back on the other channels, not on Alertmanager."""
    cfg = bare_config(alerts={"hysteresis_polls": 1, "min_interval": 600.0})
    book = alerting.silence(alerting.AlertBook(), "gpu_memory", 1000.0)
    f, [q] = feed()
    hot = [Condition("gpu_memory", True, "warning", "GPU memory used 23600 MiB")]
    actions, book = alerting.evaluate(hot, book, cfg, 10.0)
    assert actions == []  # silenced: syslog and email hear nothing
    f.sync(book.firing(), CTX, wall_offset=WALL)
    [post] = q.items
    assert (post.alert.key, post.state, post.alert.starts_at) == ("gpu_memory", "firing", WALL + 10.0)
    f.sync(book.firing(), CTX, wall_offset=WALL)
    assert len(q.items) == 1  # no POST per tick: the timer re-sends
    actions, book = alerting.evaluate([dataclasses.replace(hot[0], active=False, summary="back under")], book, cfg, 20.0)
    assert actions == []  # its FIRING was never sent, so the lifecycle owes no RESOLVED
    f.sync(book.firing(), CTX, wall_offset=WALL)
    assert [(p.alert.key, p.state) for p in q.items] == [("gpu_memory", "firing"), ("gpu_memory", "resolved")]
    assert q.items[1].alert.labels == post.alert.labels
    f.close()


def test_events_are_sent_once_and_not_resolved_by_sync():
    f, [q] = feed()
    f.on_alert(raised("engine_restarted", summary="engine restarting (hang)"))
    f.sync({}, CTX)
    [post] = q.items
    assert (post.state, post.ends_at) == ("firing", WALL + amp.EVENT_TTL_S)
    assert f.table() == {}
    f.close()


def test_the_timer_re_sends_every_firing_alert_and_resolves_until_each_url_took_them():
    queues = [FakeQueue("alertmanager[0]"), FakeQueue("alertmanager[1]")]
    f, _ = feed(queues, resend=0.05, clock=lambda: WALL)  # the resolve is not yet stale (forgotten after 4 resends)
    f.on_alert(raised())
    f.on_alert(raised("gpu_temperature", state="firing"))
    f.on_alert(raised("gpu_temperature", state="resolved"))
    resolve = queues[0].items[-1]
    resolve.delivered("alertmanager[0]")
    # Re-sends: both URLs get kv_pressure again; only the URL that missed the resolve gets it again.
    queues[1].wait(3 + 2 * 2)
    q0 = [(p.alert.key, p.state) for p in queues[0].wait(3 + 2)]
    assert q0[:3] == [("kv_pressure", "firing"), ("gpu_temperature", "firing"), ("gpu_temperature", "resolved")]
    assert ("gpu_temperature", "resolved") not in q0[3:]
    assert ("gpu_temperature", "resolved") in [(p.alert.key, p.state) for p in queues[1].items[3:]]
    resolve.delivered("alertmanager[1]")
    assert f.table() == {"kv_pressure": am.Phase.FIRING}
    f.close()


def test_a_late_delivery_of_an_old_resolve_does_not_end_a_new_episode():
    f, [q] = feed()
    f.on_alert(raised())
    f.on_alert(raised(state="resolved"))
    old_resolve = q.items[-1]
    f.on_alert(raised(at=WALL + 100))
    old_resolve.delivered("alertmanager")
    assert f.table() == {"kv_pressure": am.Phase.FIRING}
    f.close()


def test_exit_alerts_persist_and_the_next_start_resolves_them_with_the_same_labels(tmp_path):
    f, [q] = feed(state_dir=tmp_path, exit_on_give_up=True)
    f.on_alert(raised("gave_up", "critical", summary="gave up: 5 start failures"))
    f.on_alert(raised("preflight_failed", "critical", summary="preflight failed: driver"))
    f.on_alert(raised("kv_pressure"))
    assert [p.ttl for p in q.items] == [amp.EXIT_TTL_S, amp.EXIT_TTL_S, 240.0]
    assert f.flush(time.monotonic() + 10)
    f.close()
    saved = json.loads((tmp_path / am.STATE_FILE).read_text())
    assert {a["key"]: a["phase"] for a in saved["alerts"]} == {"gave_up": "firing", "preflight_failed": "firing", "kv_pressure": "firing"}

    later = AlertContext(hostname="box")  # the next start knows no GPU name yet
    f2, [q2] = feed(state_dir=tmp_path, clock=lambda: WALL + 900)
    resolves = {p.alert.key: p for p in q2.items}
    assert set(resolves) == {"gave_up", "preflight_failed"}  # kv_pressure: adopted, left to the lifecycle
    assert resolves["gave_up"].state == "resolved" and resolves["gave_up"].ends_at == WALL + 900
    assert resolves["gave_up"].alert.labels == amp.alert_labels("gave_up", "critical", CTX)
    assert f2.table() == {"gave_up": "resolving", "preflight_failed": "resolving", "kv_pressure": "adopted"}
    # The lifecycle says kv_pressure still fires: the same alert goes on, with its first start.
    entry = alerting.AlertEntry(firing=True, severity="warning", summary="KV cache full", since=800.0)
    f2.sync({"kv_pressure": entry}, later, wall_offset=WALL)
    kv = q2.items[-1]
    assert (kv.alert.key, kv.state, kv.alert.starts_at) == ("kv_pressure", "firing", WALL)
    assert kv.alert.labels == amp.alert_labels("kv_pressure", "warning", CTX)
    for post in q2.items[:2]:
        post.delivered("alertmanager")
    assert f2.flush(time.monotonic() + 10)
    f2.close()
    saved = json.loads((tmp_path / am.STATE_FILE).read_text())
    assert [a["key"] for a in saved["alerts"]] == ["kv_pressure"]


def test_an_adopted_condition_the_lifecycle_no_longer_lists_is_resolved(tmp_path):
    f, _ = feed(state_dir=tmp_path)
    f.on_alert(raised())
    assert f.flush(time.monotonic() + 10)
    f.close()
    f2, [q2] = feed(state_dir=tmp_path)
    assert q2.items == []
    f2.sync({}, CTX)
    [post] = q2.items
    assert (post.alert.key, post.state, post.alert.starts_at) == ("kv_pressure", "resolved", WALL)
    f2.close()


@pytest.mark.parametrize("text", ["{", "[]", '{"format": 1, "alerts": [{"key": "k"}]}', '{"format": 9, "alerts": []}'])
def test_an_unreadable_table_is_ignored_with_a_warning(tmp_path, caplog, text):
    (tmp_path / am.STATE_FILE).write_text(text)
    f, [q] = feed(state_dir=tmp_path)
    assert q.items == [] and f.table() == {}
    assert f"ignoring {tmp_path / am.STATE_FILE}" in caplog.text
    f.close()


# ------------------------------------------------------- the worker's queue


class ScriptedChannel:
    """A channel that fails while `failing` is set, and records what it delivered."""

    name = "alertmanager"
    target = "http://am:9093"
    max_attempts = 8

    def __init__(self):
        self.failing = True
        self.attempts: list[amp.AmPost] = []
        self.delivered: list[amp.AmPost] = []

    def prepare(self, item):
        return item

    def deliver(self, post):
        self.attempts.append(post)
        if self.failing:
            raise DeliveryError("HTTP 503")
        self.delivered.append(post)
        return ""

    def redact(self, text):
        return text

    def close(self):
        pass


def _post(state, generation):
    alert = amp.AmAlert("gave_up", amp.Kind.CONDITION, (("alertname", "gave_up"),), (), WALL)
    return amp.AmPost(alert, amp.PostState(state), WALL if state == "resolved" else None, 240.0, generation)


def test_a_firing_in_retry_is_abandoned_once_its_resolve_is_queued():
    channel = ScriptedChannel()
    stop = threading.Event()
    worker = _ChannelWorker(channel, stop, retry_initial=30.0, retry_max=30.0, queue_limit=16)
    worker.put(_post("firing", 1))
    wait_until(lambda: len(channel.attempts) == 1, 10.0, what="the first attempt")  # failed; now in a 30 s backoff
    channel.failing = False
    started = time.monotonic()
    worker.put(_post("resolved", 2))
    assert worker.wait_idle(time.monotonic() + 10)
    assert time.monotonic() - started < 10  # the backoff ended when the newer state came
    assert [p.state for p in channel.delivered] == ["resolved"]
    assert [p.state for p in channel.attempts] == ["firing", "resolved"]
    assert worker.status()["dropped"] == 0
    stop.set()
    worker.close(time.monotonic() + 5)


def test_only_the_newest_state_of_a_key_waits_in_the_queue():
    channel = ScriptedChannel()
    stop = threading.Event()
    worker = _ChannelWorker(channel, stop, retry_initial=30.0, retry_max=30.0, queue_limit=16)
    other = dataclasses.replace(_post("firing", 9), alert=dataclasses.replace(_post("firing", 9).alert, key="kv_pressure"))
    worker.put(other)
    wait_until(lambda: len(channel.attempts) == 1, 10.0, what="the first attempt")  # busy retrying kv_pressure
    for generation in range(1, 50):
        worker.put(_post("firing" if generation % 2 else "resolved", generation))
    assert worker.status()["pending"] == 2  # kv_pressure in flight, one gave_up waiting
    channel.failing = False
    stop.set()
    worker.close(time.monotonic() + 5)


def test_dispatcher_without_alertmanager_has_no_table_and_sync_is_a_no_op():
    d = AlertDispatcher(AlertsConfig(syslog=SyslogConfig(enabled=False)), CTX)
    d.sync({"kv_pressure": alerting.AlertEntry(firing=True)}, wall_offset=0.0)
    assert d.channels == [] and d.flush(1.0)
    d.close()


def test_an_engines_alert_in_swap_mode_is_its_condition_labelled_with_its_model():
    """Swap mode keys an engine's alerts KEY:MODEL, so two models' `dead` are two alerts: one alertname, two served_model."""
    labels = dict(amp.alert_labels("dead:chat", "critical", AlertContext(hostname="h")))
    assert labels == {"alertname": "dead", "alert": "dead:chat", "served_model": "chat", "severity": "critical", "host": "h"}
    assert amp.kind_of("engine_restarted:chat", exit_on_give_up=False) is amp.Kind.EVENT
    assert amp.kind_of("gave_up:chat", exit_on_give_up=False) is amp.Kind.CONDITION
