"""The state document read back: parse() takes what the daemon, preflight or an older daemon wrote.

Every reader (the exporter, /healthz, /livez, `r3090ctl status`) goes through
it, so a damaged or unexpected document costs defaults, never a traceback; only
a format this r3090d cannot read is refused, with one line saying what to do.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3090d import config, exitcodes
from r3090d.core import policy
from r3090d.core.alerting import AlertBook, AlertEntry
from r3090d.core.policy import PolicyState
from r3090d.core.snapshot import (
    ChildSample,
    GpuProcess,
    GpuSample,
    GpuStatus,
    HealthSample,
    HealthStatus,
    InferenceProbeSample,
    MetricsSample,
)
from r3090d.core.suspension import Result, Stage, Suspension
from r3090d.core.vocabulary import Phase
from r3090d.preflight.checks import CheckResult, Status
from r3090d.service import exporter, statusview
from r3090d.service.report import book_info, hand_on, preflight_report, report, swap_document
from r3090d.service.state import carried_over
from r3090d.service.statedoc import (
    FORMAT_VERSION,
    DaemonIdentity,
    HealingInfo,
    LastRequest,
    PreflightSummary,
    StateDocument,
    SuspendInfo,
    SwapInfo,
    UnreadableFormat,
    WorkerInfo,
    WorkerStep,
    parse,
)
from r3090d.units import GIB
from tests.snapshots import snap

NOW = 1_800_000_000.0
OFFSET = NOW - 1000.0  # monotonic 1000 is NOW on the wall clock


# The suspend section of a daemon whose engine was suspended and resumed once: no suspension stands.
RESUMED = SuspendInfo(
    last=LastRequest(2, "resume", Result.RESUMED, "pid 6 resumed, 15.0 GiB back on the GPU", NOW - 100),
    worker=WorkerInfo(op="resume", pid=6, steps=(WorkerStep("restore", True, 2.1), WorkerStep("unlock", True, 0.01)), outcome="resumed", duration_s=2.2),
    remind_after_s=14400.0,
)  # fmt: skip
CFG = config.from_dict({"engine": {"python": "/usr/bin/python3", "model": "/srv/model", "served_model_name": "m"}}, check_files=False)


def full_report(suspend: SuspendInfo | None = RESUMED, **policy) -> StateDocument:
    """What a daemon with a ready engine, a firing alert, a silence and a preflight summary publishes."""
    cfg = CFG
    st_ = PolicyState(
        phase=Phase.READY, phase_since=900.0, generation=3, ready_since=950.0, start_failures=1, last_root_cause="CUDA out of memory",
        backoff_level=2, restart_times=(800.0,), restarts_total=2, restarts_by_reason=(("kv", 1), ("requested", 1)),
        last_restart_reason="kv", last_restart_at=940.0, xid_seen=(79,),
        alerts=AlertBook(
            entries=(("gpu_memory", AlertEntry(firing=True, severity="critical", summary="GPU memory 23.9 GiB", since=990.0, last_sent_at=991.0)),
                     ("kv_pressure", AlertEntry(clear_since=995.0))),
            silenced=(("kv_pressure", 1600.0),),
        ),
    )  # fmt: skip
    st_ = dataclasses.replace(st_, **policy)
    gpu = GpuSample(
        GpuStatus.OK, index=0, taken_at=999.0, name="RTX 3090", memory_total=24 << 30, memory_used=20 << 30, utilization_gpu=80,
        temperature_c=70, power_w=300.5, power_limit_w=350.0, compute_capability=(8, 6), clock_event_reasons=("gpu_idle",),
        processes=(GpuProcess(5, 1 << 30),), pcie_width=16, pcie_gen=4,
    )  # fmt: skip
    snapshot = snap(
        1000.0, wall=NOW, ch=ChildSample(pid=5, alive=True, tree_pids=(5, 6), generation=3),
        health=HealthSample(HealthStatus.OK, 200, 0.01),
        metrics=MetricsSample(kv_usage=0.5, num_gpu_blocks=100, free_blocks=49.5, running=2.0, waiting=0.0, cache_config=(("block_size", "16"),)),
        gpu=gpu, inference=InferenceProbeSample(sent_at=998.0, finished_at=998.5, ok=True),
    )  # fmt: skip
    stats = exporter.TickStats()
    stats.observe(0.02)
    stats.observe(0.3)
    summary = PreflightSummary(exitcodes.WARNING, (CheckResult("swap", Status.WARN, "on", "off", "swapoff -a"),), NOW - 900)
    return report(st_, snapshot, cfg, identity=DaemonIdentity(1, NOW - 2000, "0.1.0", "gpu1"), offset=OFFSET, written_at=NOW - 1,
                  tick_s=0.0123, preflight=summary, telemetry=stats.to_json(), suspend=suspend)  # fmt: skip


FULL = json.loads(json.dumps(full_report().to_json()))  # as a reader gets it: through JSON


# ------------------------------------------------------------------ what the daemon and preflight write


def test_a_document_reads_back_as_it_was_written():
    written = full_report()
    read = parse(FULL)
    assert read.engine.phase is Phase.READY and read.engine.phase_text == "ready"
    assert read == dataclasses.replace(written, engine=dataclasses.replace(written.engine, phase_text="ready"))
    assert json.loads(json.dumps(read.to_json())) == FULL  # nothing parse() keeps for itself is written


def test_the_document_keeps_its_shape():
    assert set(FULL) == {
        "written_at", "daemon", "engine", "restarts", "next_action", "watch", "give_up_reason", "xid_seen", "health", "inference",
        "thresholds", "metrics", "gpu", "alerts", "alert_book", "preflight", "telemetry", "format", "waiting", "suspend", "healing",
        "canary", "models", "swap",
    }  # fmt: skip
    assert FULL["models"] == [] and FULL["swap"] is None  # single mode: what format 2 was
    assert FULL["format"] == FORMAT_VERSION and FULL["engine"]["phase"] == "ready" and "phase_text" not in FULL["engine"]
    assert FULL["alerts"]["firing"]["gpu_memory"] == {"severity": "critical", "summary": "GPU memory 23.9 GiB", "since": NOW - 10}
    assert FULL["alert_book"]["entries"]["kv_pressure"]["clear_since"] == NOW - 5  # wall clock: a restarted daemon rebuilds its book
    assert FULL["alert_book"]["silenced"] == FULL["alerts"]["silenced"] == {"kv_pressure": NOW + 600}
    assert FULL["telemetry"]["poll_duration_seconds"]["buckets"][2] == [0.025, 1]
    assert FULL["preflight"]["checks"][0] == {"name": "swap", "status": "warn", "measured": "on", "expected": "off", "hint": "swapoff -a", "permanent": True}
    assert FULL["gpu"]["processes"] == [{"pid": 5, "used_bytes": 1 << 30}] and FULL["gpu"]["compute_capability"] == [8, 6]
    assert FULL["waiting"] is None and set(FULL["watch"]) == {"gpu_signal_off"}
    assert FULL["suspend"]["stage"] is None and FULL["suspend"]["last"] == {
        "request": 2, "op": "resume", "result": "resumed", "detail": "pid 6 resumed, 15.0 GiB back on the GPU", "at": NOW - 100,
    }  # fmt: skip
    assert FULL["suspend"]["worker"]["steps"][0] == {"step": "restore", "ok": True, "took_s": 2.1, "error": ""}


PORT_BUSY = CheckResult("port", Status.FAIL, "8000 busy", "free", permanent=False)
IDENTITY = DaemonIdentity(pid=7, started_at=NOW - 30, version="0.1.0", host="h")


def preflight_document(waiting: str | None, previous: StateDocument | None = None, at: float = NOW - 1) -> dict:
    """What PreflightRunner writes before the loop has run, as JSON (by default on a host with no earlier state file)."""
    summary = PreflightSummary(exit_code=exitcodes.CRITICAL, checks=(PORT_BUSY,), at=at)
    return preflight_report(previous, CFG, identity=IDENTITY, summary=summary, waiting=waiting, written_at=at).to_json()


def test_preflights_partial_document_is_read_and_judged():
    d = parse(preflight_document("port: 8000 busy"))
    assert d.engine.phase is Phase.STOPPED and d.waiting is not None and d.waiting.what == "port: 8000 busy"
    assert d.preflight is not None and d.preflight.checks[0].name == "port" and d.gpu is None and d.health is None
    verdict = statusview.verdict_of(d, running=True, now=NOW)
    assert verdict.code == exitcodes.WARNING and "waiting for preflight before starting the engine: port: 8000 busy" in verdict.line()
    assert "GPU        -" in statusview.panel(d, verdict, NOW)
    assert exporter.healthz(d, NOW) == (503, "engine stopped")
    assert exporter.livez(d, NOW) == (200, "alive")
    names = {fam.name for fam in exporter.families(d, NOW)}
    assert "r3090d_engine_state" in names and "r3090d_poll_duration_seconds" not in names
    failed = parse(preflight_document(None))
    assert statusview.verdict_of(failed, running=True, now=NOW).line() == "CRITICAL: engine stopped"


def test_preflight_keeps_an_earlier_daemons_alert_book_and_nothing_it_measured():
    earlier = parse(FULL)  # a daemon that ran an engine, then was restarted into a preflight wait
    assert earlier.alert_book.entries and earlier.gpu is not None and earlier.engine.pid is not None
    first = parse(preflight_document("port: 8000 busy", earlier, at=NOW + 10))
    assert first.format == FORMAT_VERSION and first.alert_book == earlier.alert_book
    assert (first.engine.pid, first.engine.tree_pids, first.gpu, first.health, first.metrics) == (None, [], None, None, MetricsSample())
    assert (first.restarts.total, first.daemon.pid, first.engine.model) == (2, IDENTITY.pid, "m")  # the engine's restarts count on
    # A re-check keeps when the wait began; a failure ends the wait and says why.
    again = parse(preflight_document("port: 8000 busy", first, at=NOW + 40))
    assert (again.waiting.since, again.written_at) == (NOW + 10, NOW + 40)
    failed = parse(preflight_document(None, again, at=NOW + 70))
    assert failed.waiting is None and failed.give_up_reason == "preflight failed: port"


def test_an_older_daemons_preflight_document_is_read():
    """Written by hand before preflight_report existed: no format, the engine's phase only."""
    older = {
        "written_at": NOW - 1,
        "preflight": {"exit_code": 1, "checks": [{"name": "port", "status": "fail", "measured": "8000 busy", "expected": "free", "hint": "", "permanent": False}], "at": NOW - 1},
        "engine": {"phase": "stopped", "state": "stopped"},
        "daemon": {"pid": 7, "started_at": NOW - 30, "version": "0.1.0", "instance": None, "config": "/etc/r3090d.toml", "poll_interval": 10.0},
        "waiting": {"for": "port: 8000 busy", "since": NOW - 20},
        "give_up_reason": None,
    }  # fmt: skip
    d = parse(older)
    assert d.format == 1 and d.preflight.checks == (PORT_BUSY,) and d.waiting.what == "port: 8000 busy"
    assert statusview.verdict_of(d, running=True, now=NOW).code == exitcodes.WARNING


def test_an_older_daemons_document_is_read_with_defaults():
    old = copy.deepcopy(FULL)
    del old["format"], old["thresholds"], old["inference"], old["watch"], old["suspend"]
    for key in ("start_failures", "recent", "last_root_cause"):
        del old["restarts"][key]
    d = parse(old)
    assert d.format == 1 and d.restarts.start_failures == 0 and d.restarts.last_root_cause is None
    assert d.thresholds.gpu_memory_alert_bytes is None and d.inference.latency_s is None and d.watch.gpu_signal_off is None
    names = {s.name for fam in exporter.families(d, NOW) for s in fam.samples}
    assert "r3090d_gpu_memory_alert_threshold_bytes" not in names and "r3090d_inference_probe_latency_seconds" not in names
    assert statusview.verdict_of(d, running=True, now=NOW).line() == "CRITICAL: gpu_memory firing"
    assert d.suspend is None and not {n for n in names if n.startswith("r3090d_suspended_")}
    assert not [line for line in statusview.panel(d, statusview.verdict_of(d, running=True, now=NOW), NOW) if "uspend" in line]


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 99, "3", True, None])
def test_a_newer_format_is_refused_with_one_line_saying_what_to_do(version):
    with pytest.raises(UnreadableFormat) as caught:
        parse({**FULL, "format": version})
    text = str(caught.value)
    assert "\n" not in text and "written in format" in text and ": restart the daemon" in text
    if isinstance(version, int) and not isinstance(version, bool):
        assert f"written in format {version}," in text


@pytest.mark.parametrize("doc", [[], "state", 3, None])
def test_what_is_no_json_object_is_refused_too(doc):
    with pytest.raises(UnreadableFormat, match="not an object"):
        parse(doc)


def test_an_unknown_phase_is_named_not_crashed_on():
    doc = copy.deepcopy(FULL)
    doc["engine"]["phase"] = "hibernating"
    d = parse(doc)
    assert d.engine.phase is None and d.engine.phase_text == "hibernating" and d.engine.phase_name == "hibernating"
    assert statusview.verdict_of(d, running=True, now=NOW).code == exitcodes.CRITICAL
    assert "engine in an unknown phase 'hibernating'" in statusview.verdict_of(d, running=True, now=NOW).reasons
    assert exporter.healthz(d, NOW) == (503, "engine hibernating")
    one_hot = [s.value for fam in exporter.families(d, NOW) if fam.name == "r3090d_engine_state" for s in fam.samples]
    assert one_hot == [0.0] * len(Phase)
    assert "Engine     hibernating for" in "\n".join(statusview.panel(d, statusview.verdict_of(d, running=True, now=NOW), NOW))


def test_malformed_fields_take_their_defaults_and_unknown_keys_are_ignored():
    doc = copy.deepcopy(FULL)
    doc["engine"].update(pid="42", maintenance="yes", tree_pids=[5, "6", None, 7.0], since=float("inf"))
    doc["restarts"]["by_reason"] = {"kv": 1, "hung": "two", "dead": True}
    doc["gpu"]["status"] = "melted"  # a status this version does not know: no reading
    doc["metrics"] = ["not", "an", "object"]
    doc["alerts"]["silenced"] = {"kv_pressure": "tomorrow", "gpu_memory": NOW + 60}
    doc["sections_of_the_future"] = {"anything": 1}
    d = parse(doc)
    assert (d.engine.pid, d.engine.maintenance, d.engine.tree_pids, d.engine.since) == (None, False, [5, 7], None)
    assert d.restarts.by_reason == {"kv": 1}
    assert d.gpu is None and d.metrics == MetricsSample()
    assert d.alerts.silenced == {"gpu_memory": NOW + 60}


def test_gpu_line_reads_a_restart_records_dict_too():
    assert statusview.gpu_line(FULL["gpu"]) == statusview.gpu_line(parse(FULL).gpu)
    assert statusview.gpu_line({}) == "-" and statusview.gpu_line({"status": "disabled"}).startswith("not monitored")
    assert statusview.gpu_line({"status": "no_driver", "detail": "NVML: driver not loaded"}) == "no_driver: NVML: driver not loaded"


# ------------------------------------------------------------------ anything in place of a section

JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=4),
    max_leaves=10,
)
SECTIONS = sorted(FULL)


@st.composite
def damaged_documents(draw) -> dict:
    doc = copy.deepcopy(FULL)
    if draw(st.booleans()):
        doc.pop("format")  # mostly a readable format, so the sections themselves are read
    for key in draw(st.lists(st.sampled_from([*SECTIONS, "new_section"]), max_size=4)):
        if key != "format" or draw(st.integers(0, 9)) == 0:
            doc[key] = draw(VALUES)
    for key in draw(st.lists(st.sampled_from(SECTIONS), max_size=6)):
        section = doc.get(key)
        if isinstance(section, dict):
            inner = draw(st.sampled_from([*sorted(map(str, section)), "new_field"]))
            section[inner] = draw(VALUES)
    return doc


def readers(doc: dict) -> None:
    """Every reader of the document, as the exporter and `r3090ctl status` call them."""
    for running in (True, False):
        verdict = statusview.verdict_of(doc, running=running, now=NOW)
        statusview.panel(doc, verdict, NOW, note="n")
    statusview.not_running_lines(doc, "pid 1 is gone", "/var/lib/r3090d/state.json", "systemctl start r3090d", NOW)
    statusview.gpu_line(doc.get("gpu") if isinstance(doc.get("gpu"), dict) else None)
    exporter.healthz(doc, NOW)
    exporter.livez(doc, NOW)
    exporter.stale_after(doc)
    exporter.families(doc, NOW)


@settings(deadline=None, derandomize=True, max_examples=150)
@given(damaged_documents())
def test_parse_gives_a_document_or_unreadable_format_and_nothing_else(doc):
    try:
        d = parse(doc)
    except UnreadableFormat as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(d, StateDocument)
    json.dumps(d.to_json())  # and it can be written again


@settings(deadline=None, derandomize=True, max_examples=150)
@given(damaged_documents())
def test_every_reader_survives_a_damaged_document(doc):
    try:
        readers(doc)
    except UnreadableFormat:
        pass


def test_status_judges_a_newer_format_from_the_socket_unknown():
    from r3090d.cli import status_cmd

    found = status_cmd.located(True, {**FULL, "format": 99}, "socket", None, "/var/lib/r3090d/state.json")
    assert found.state is None and found.doc is not None and found.doc["format"] == 99
    verdict = status_cmd.judge(found, NOW)
    assert verdict.code == exitcodes.UNKNOWN
    assert verdict.line().startswith("UNKNOWN: the daemon's control socket: the state was written in format 99,")
    readable = status_cmd.located(True, FULL, "socket", None, "/var/lib/r3090d/state.json")
    assert readable.unreadable is None and status_cmd.judge(readable, NOW).line() == "CRITICAL: gpu_memory firing"


@pytest.mark.parametrize("phase", [Phase.SUSPENDING, Phase.SUSPENDED, Phase.RESUMING])
def test_a_suspended_engine_is_a_warning_not_an_unknown_phase(phase):
    doc = copy.deepcopy(FULL)
    doc["engine"]["phase"] = phase.value
    doc["alerts"]["firing"] = {}
    verdict = statusview.verdict_of(doc, running=True, now=NOW)
    assert verdict.line() == f"WARNING: engine {phase.value}"  # no restart reason: none is under way


def test_the_exporter_parses_each_published_document_once():
    published = {"doc": FULL}
    reads = []
    latest = exporter.LatestDocument(lambda: reads.append(1) or published["doc"])
    first = latest()
    assert latest() is first and len(reads) == 2  # read twice, parsed once
    published["doc"] = {**FULL, "written_at": NOW}  # the next tick: a new dict
    assert latest().written_at == NOW
    published["doc"] = None
    assert latest() is None


def test_preflight_trusts_the_engine_pids_of_a_live_daemons_readable_state(tmp_path):
    import os

    from r3090d.cli.preflight_cmd import own_engine_pids

    cfg = config.from_dict({"engine": {"python": "/usr/bin/python3", "model": "/srv/model"}, "daemon": {"state_dir": str(tmp_path)}}, check_files=False)
    state = tmp_path / "state.json"
    doc = copy.deepcopy(FULL)
    doc["daemon"]["pid"] = os.getpid()  # alive
    doc["engine"].update(pid=5, tree_pids=[6, "7", 5])
    state.write_text(json.dumps(doc))
    assert own_engine_pids(cfg) == (5, 6)
    state.write_text(json.dumps({**doc, "format": 99}))
    assert own_engine_pids(cfg) == ()  # what a newer daemon wrote vouches for nothing
    state.write_text("[1, 2]")
    assert own_engine_pids(cfg) == ()


# ------------------------------------------------------------------ the suspend section

# The engine checkpointed 15 GiB at monotonic 900 (NOW - 100 on the wall clock), with one request frozen.
STANDING = Suspension(Stage.SUSPENDED, 900.0, 1, target=6, bytes=15 * GIB, since=900.0, since_wall=NOW - 100, frozen_requests=1)


def suspended_report(s: Suspension, phase: Phase, info: SuspendInfo) -> StateDocument:
    return full_report(info, phase=phase, phase_since=s.stage_since, suspension=s, alerts=AlertBook())


def standing_info(s: Suspension = STANDING, **changes) -> SuspendInfo:
    """The section the daemon publishes for a suspension: SuspendService.document's, with a measured RSS."""
    info = SuspendInfo(stage=s.stage, since=s.since_wall, cold=s.cold, pid=s.target, gpu_bytes=s.bytes, host_rss_bytes=16 * GIB,
                       frozen_requests=s.frozen_requests, how_to_resume="r3090ctl resume",
                       last=LastRequest(1, "suspend", Result.SUSPENDED, "pid 6 suspended, 15.0 GiB of GPU memory freed", NOW - 100),
                       remind_after_s=14400.0)  # fmt: skip
    return dataclasses.replace(info, **changes)


def test_a_standing_suspension_reads_back_typed_with_what_to_do_next():
    written = suspended_report(STANDING, Phase.SUSPENDED, standing_info())
    raw = json.loads(json.dumps(written.to_json()))
    read = parse(raw)
    assert read == dataclasses.replace(written, engine=dataclasses.replace(written.engine, phase_text="suspended"))
    assert read.suspend is not None and read.suspend.stage is Stage.SUSPENDED and read.suspend.last.result is Result.SUSPENDED
    assert (read.suspend.since, read.suspend.gpu_bytes, read.suspend.host_rss_bytes) == (NOW - 100, 15 * GIB, 16 * GIB)
    assert raw["suspend"]["stage"] == "suspended" and raw["suspend"]["last"]["result"] == "suspended"  # the shape --wait reads
    assert read.next_action == "none until r3090ctl resume"
    cold = dataclasses.replace(STANDING, cold=True)
    assert suspended_report(cold, Phase.SUSPENDED, standing_info(cold)).next_action == "none until r3090ctl resume (which starts a new engine)"


def test_next_action_follows_the_stage_of_a_suspend_or_resume_under_way():
    drain = CFG.suspend.drain_timeout
    draining = Suspension(Stage.DRAINING, 990.0, 1, target=6)  # 10 s ago (snapshot.now is 1000)
    assert suspended_report(draining, Phase.SUSPENDING, standing_info(draining)).next_action == (
        f"checkpoint the engine once nothing runs (at the latest in {drain - 10:.0f} s after the load balancer's grace)"
    )
    checkpointing = Suspension(Stage.CHECKPOINTING, 995.0, 1, target=6, bytes=15 * GIB)
    assert suspended_report(checkpointing, Phase.SUSPENDING, standing_info(checkpointing)).next_action == "wait for the GPU driver (checkpointing)"
    verifying = dataclasses.replace(STANDING, stage=Stage.VERIFYING, resuming=True)
    assert suspended_report(verifying, Phase.RESUMING, standing_info(verifying)).next_action == "ready once /health answers 200 and one inference probe passes"
    # A shutdown keeps the suspension (the engine stays suspended on record) but its next action is the shutdown's.
    assert suspended_report(STANDING, Phase.SHUTTING_DOWN, standing_info()).next_action is None


def test_a_damaged_suspend_section_costs_defaults_not_the_document():
    doc = json.loads(json.dumps(suspended_report(STANDING, Phase.SUSPENDED, standing_info()).to_json()))
    doc["suspend"].update(stage="hibernating", gpu_bytes="lots", frozen_requests=None)
    doc["suspend"]["last"]["result"] = "teleported"  # a result a newer daemon may know
    d = parse(doc)
    assert d.suspend is not None and d.suspend.stage is None and d.suspend.gpu_bytes == 0 and d.suspend.frozen_requests == 0
    assert d.suspend.last is not None and d.suspend.last.result is None and d.suspend.last.request == 1
    assert parse({**doc, "suspend": "yes"}).suspend is None


def panel_text(doc: StateDocument, now: float = NOW) -> tuple[statusview.HealthVerdict, list[str]]:
    verdict = statusview.verdict_of(doc, running=True, now=now)
    return verdict, statusview.panel(doc, verdict, now)


def test_status_shows_a_standing_suspension_since_when_what_it_holds_and_how_to_resume():
    now = NOW + 3 * 3600  # 3 h 01 min 40 s after the checkpoint
    verdict, lines = panel_text(suspended_report(STANDING, Phase.SUSPENDED, standing_info()), now)
    assert verdict.code == exitcodes.WARNING and verdict.line() == "WARNING: engine suspended"
    assert f"Suspended  since {statusview.clock(NOW - 100)} (3 h 01 min ago); the engine holds 16.0 GiB of host memory, " \
           "15.0 GiB of GPU memory checkpointed" in lines  # fmt: skip
    assert "Frozen     1 request(s) frozen with the engine, to finish after resume" in lines
    assert "Resume     r3090ctl resume" in lines
    assert "Next       none until r3090ctl resume" in lines
    assert not [line for line in lines if line.startswith(("Stage", "Last op", "Error"))]  # the last request succeeded


def test_status_shows_a_cold_suspension_and_why_it_went_cold():
    cold = dataclasses.replace(STANDING, cold=True, frozen_requests=0, error="the suspended engine exited with code -9 (OOM-killed? ...)")
    info = standing_info(cold, host_rss_bytes=None, error=cold.error)
    _, lines = panel_text(suspended_report(cold, Phase.SUSPENDED, info))
    assert f"Suspended  since {statusview.clock(NOW - 100)} (1 min ago); no engine process is left: resuming starts a new one, " \
           "which needs 15.0 GiB of GPU memory free" in lines  # fmt: skip
    assert "Error      the suspended engine exited with code -9 (OOM-killed? ...)" in lines
    assert "Resume     r3090ctl resume" in lines and not [line for line in lines if line.startswith("Frozen")]


def test_status_shows_the_stage_of_a_suspend_under_way():
    checkpointing = Suspension(Stage.CHECKPOINTING, 995.0, 3, target=6, bytes=15 * GIB)
    worker = WorkerInfo(op="suspend", pid=6, in_flight=True, step="checkpoint")
    verdict, lines = panel_text(suspended_report(checkpointing, Phase.SUSPENDING, standing_info(checkpointing, how_to_resume=None, worker=worker)))
    assert verdict.line() == "WARNING: engine suspending"
    assert "Stage      checkpointing (the GPU driver's suspend of pid 6: checkpoint)" in lines
    assert not [line for line in lines if line.startswith(("Suspended", "Resume"))]  # not suspended yet


def test_status_shows_how_the_last_request_failed_once():
    # A resume refused for lack of room: still suspended, the refusal said once.
    why = "the GPU has 2.0 GiB free, the engine needs 15.0 GiB plus a 512 MiB margin (held by pid 77 (python))"
    refused = dataclasses.replace(STANDING, request=2, error=f"resume refused: {why}")
    info = standing_info(refused, error=refused.error, last=LastRequest(2, "resume", Result.REFUSED, why, NOW - 60))
    _, lines = panel_text(suspended_report(refused, Phase.SUSPENDED, info))
    assert f"Last op    resume (request 2) refused 60 s ago: {why}" in lines
    assert not [line for line in lines if line.startswith("Error")] and "Resume     r3090ctl resume" in lines
    # A failed resume: the engine restarted cold and serves again; the failure stays in view, with its age.
    failed = SuspendInfo(last=LastRequest(4, "resume", Result.FAILED, "restore failed: CUDA error; the engine restarts cold", NOW - 3600))
    _, lines = panel_text(full_report(failed))
    assert "Last op    resume (request 4) failed 60 min ago: restore failed: CUDA error; the engine restarts cold" in lines
    assert not [line for line in panel_text(full_report())[1] if line.startswith(("Suspended", "Stage", "Last op", "Resume"))]


# ------------------------------------------------------------------ what the next daemon goes on from


def test_the_next_daemon_goes_on_from_the_restart_history_in_the_file(tmp_path, caplog):
    window = CFG.watchdog.restart_storm_window  # 3600 s
    written = full_report(restart_times=(800.0 - window, 700.0, 800.0), start_failures=2, same_cause_run=2)  # the first is out of the window
    path = tmp_path / "state.json"
    path.write_text(json.dumps(written.to_json()))
    assert written.restarts.recent_at == [OFFSET + 800.0 - window, OFFSET + 700.0, OFFSET + 800.0]
    # The next process's monotonic clock reads 50 at NOW + 20 (its offset is NOW - 30).
    book, history = carried_over(path, NOW - 30.0)
    assert history.restart_times == pytest.approx((800.0 - window - 970.0, 700.0 - 970.0, 800.0 - 970.0))
    assert (history.start_failures, history.same_cause_run, history.last_root_cause) == (2, 2, "CUDA out of memory")
    assert [key for key, entry in book.entries if entry.firing] == ["gpu_memory"]
    st_ = policy.carry_on(policy.initial_state(50.0), history, CFG, 50.0)
    assert st_.restart_times == pytest.approx((700.0 - 970.0, 800.0 - 970.0))  # 1000 and 900 s ago: the oldest dropped
    assert (st_.start_failures, st_.same_cause_run, st_.last_root_cause) == (2, 2, "CUDA out of memory")
    assert not caplog.records


def test_the_restart_counters_go_on_across_a_daemon_restart(tmp_path):
    """systemd restarts the daemon: `status` still says how many restarts the engine had, and the next one adds to them."""
    written = full_report(restarts_total=7, restarts_by_reason=(("exited", 5), ("kv", 2)))
    path = tmp_path / "state.json"
    path.write_text(json.dumps(written.to_json()))
    _, history = carried_over(path, NOW - 30.0)
    st_ = policy.carry_on(policy.initial_state(50.0), history, CFG, 50.0)
    assert (st_.restarts_total, st_.restarts_by_reason) == (7, (("exited", 5), ("kv", 2)))
    assert (st_.last_restart_reason, st_.last_restart_at) == ("kv", pytest.approx(940.0 - 970.0))  # 60 s before NOW + 20
    _, st_ = policy.decide(snap(51.0, ch=ChildSample()), st_, CFG, 51.0)  # the first start
    _, st_ = policy.decide(snap(52.0, ch=ChildSample(pid=5, alive=True, tree_pids=(5,), generation=1)), st_, CFG, 52.0)
    assert st_.phase is Phase.READY
    _, st_ = policy.decide(snap(53.0, ch=ChildSample(pid=5, alive=False, exit_code=1, generation=1)), st_, CFG, 53.0)
    assert (st_.restarts_total, st_.restarts_by_reason) == (8, (("exited", 6), ("kv", 2)))


def test_preflight_hands_the_restart_history_on():
    earlier = parse(json.loads(json.dumps(full_report(restart_times=(700.0, 800.0), start_failures=2, same_cause_run=1).to_json())))
    doc = parse(json.loads(json.dumps(preflight_document("port: 8000 busy", earlier, at=NOW + 10))))
    r = doc.restarts
    assert (r.recent_at, r.recent, r.start_failures, r.same_cause_run, r.last_root_cause) == ([OFFSET + 700.0, OFFSET + 800.0], 2, 2, 1, "CUDA out of memory")
    # The engine's restarts, whatever happened to the daemon.
    assert (r.total, r.by_reason, r.last_reason, r.last_at) == (2, {"kv": 1, "requested": 1}, "kv", OFFSET + 940.0)


def test_what_a_swap_mode_engine_hands_on_reads_back_as_its_book_and_history(tmp_path):
    """Swap mode: each model's engine leaves its alert book and restart history in its own state directory."""
    st_ = PolicyState(
        phase=Phase.COLD, phase_since=900.0, restart_times=(700.0, 800.0), start_failures=2, same_cause_run=1,
        last_root_cause="CUDA out of memory", restarts_total=3, restarts_by_reason=(("exited", 3),), last_restart_reason="exited",
        last_restart_at=800.0,
        alerts=AlertBook(entries=(("restart_storm", AlertEntry(firing=True, severity="warning", summary="3 restarts", since=800.0,
                                                                last_sent_at=801.0, fired_sent=True)),),
                         silenced=(("kv_pressure", 1600.0),)),
    )  # fmt: skip
    path = tmp_path / "handed-on.json"
    path.write_text(json.dumps(hand_on(st_, OFFSET)))
    book, history = carried_over(path, OFFSET)  # the same clock: the same times
    assert book == st_.alerts
    on = policy.carry_on(policy.initial_state(1000.0, cold=True), history, CFG, 1000.0)
    fields = ("restart_times", "start_failures", "same_cause_run", "last_root_cause", "restarts_total", "restarts_by_reason",
              "last_restart_reason", "last_restart_at")  # fmt: skip
    assert [getattr(on, f) for f in fields] == [getattr(st_, f) for f in fields]


def test_the_swap_document_holds_the_cards_alert_book_for_the_next_daemon(tmp_path):
    book = AlertBook(entries=(("watchdog_blind", AlertEntry(firing=True, severity="warning", summary="NVML failing", since=990.0,
                                                             last_sent_at=991.0, fired_sent=True)),))  # fmt: skip
    doc = swap_document([], SwapInfo(), None, CFG, identity=IDENTITY, firing={}, xid_seen=[], healing=HealingInfo(), written_at=NOW,
                        tick_s=0.01, preflight=None, telemetry={}, alert_book=book_info(book, OFFSET))  # fmt: skip
    path = tmp_path / "state.json"
    path.write_text(json.dumps(doc.to_json()))
    assert carried_over(path, OFFSET)[0] == book
    # Preflight keeps it, as it keeps the one engine's.
    kept = parse(preflight_document("port: 8000 busy", parse(json.loads(path.read_text())), at=NOW + 10))
    assert kept.alert_book == parse(doc.to_json()).alert_book


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"restarts": {"recent_at": [1.0, 2.0', "Expecting"),  # cut off
        ("[1, 2]", "a JSON list, not an object"),
        ('{"format": 99, "restarts": {"recent_at": [1.0]}}', "format 99"),
        ("\x00\xff", "Expecting value"),
    ],
)
def test_a_damaged_state_file_is_logged_and_goes_for_nothing(tmp_path, caplog, text, why):
    path = tmp_path / "state.json"
    path.write_text(text, errors="surrogateescape")
    book, history = carried_over(path, 0.0)
    assert (book, history) == (AlertBook(), policy.RestartHistory())
    [record] = caplog.records
    assert record.levelname == "WARNING" and str(path) in record.getMessage() and why in record.getMessage()


def test_fields_of_the_wrong_kind_are_left_out_and_no_file_is_no_history(tmp_path, caplog):
    path = tmp_path / "state.json"
    assert carried_over(path, 0.0) == (AlertBook(), policy.RestartHistory())  # a first start: nothing to say
    path.write_text(json.dumps({"restarts": {"recent_at": [100.0, "x", None, True, 200.0], "start_failures": "3", "same_cause_run": 2, "last_root_cause": 7}}))
    _, history = carried_over(path, 10.0)
    assert history == policy.RestartHistory(restart_times=(90.0, 190.0), start_failures=0, same_cause_run=2)
    assert policy.carry_on(policy.initial_state(200.0), history, CFG, 200.0).same_cause_run == 0  # no run longer than the failures
    path.write_text(json.dumps({"restarts": {"total": -3, "by_reason": {"exited": 2, "hung": "x", "kv": -1, "dead": True}}}))
    _, history = carried_over(path, 10.0)
    assert (history.restarts_total, history.restarts_by_reason) == (0, (("exited", 2),))
    assert not caplog.records
