"""Swap mode as the operator sees it: the state document's models and swap sections read back, `status`'s
verdict and panel, the exporter's per-model series, /healthz and /healthz/<served_model>.

The documents are built from the document's own types (tests/swapdocs.py): three
models behind the router, `chat` ready, `coder` parked with a frozen request,
`embed` cold. A parked or cold model is the arbiter's choice, never a warning.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from r3090d import exitcodes
from r3090d.core.arbiter import Residency
from r3090d.core.snapshot import MetricsSample
from r3090d.core.suspension import Result, Stage
from r3090d.core.vocabulary import Phase
from r3090d.service import exporter, statusview
from r3090d.service.statedoc import (
    FORMAT_VERSION,
    SWAP_BUCKETS,
    AlertsInfo,
    FiringAlert,
    HealingInfo,
    Histogram,
    LastRequest,
    RestartsInfo,
    RouterInfo,
    StateDocument,
    SuspendInfo,
    SwapProgress,
    SwapRecord,
    UnreadableFormat,
    parse,
)
from r3090d.units import GIB
from tests.swapdocs import NOW, as_json, swap_doc, swap_info, with_model
from tests.unit.test_state_document import FULL, VALUES, readers

# ------------------------------------------------------------------ the document


def test_a_swap_document_reads_back_as_it_was_written():
    written = swap_doc()
    raw = as_json(written)
    read = parse(raw)
    assert read.format == FORMAT_VERSION == 3 and read.swap_mode
    assert [(m.name, m.kind.value, m.residency) for m in read.models] == [
        ("chat", "generate", Residency.READY), ("coder", "generate", Residency.PARKED), ("embed", "embed", Residency.COLD),
    ]  # fmt: skip
    # Only what parse() derives for itself differs: the phase and residency as written.
    derived = dataclasses.replace(
        written,
        engine=dataclasses.replace(written.engine, phase_text="swap"),
        models=[dataclasses.replace(m, residency_text=m.residency.value, engine=dataclasses.replace(m.engine, phase_text=m.engine.phase.value))
                for m in written.models],
    )  # fmt: skip
    assert read == derived
    assert json.loads(json.dumps(read.to_json())) == {**raw, "engine": {**raw["engine"], "phase": None}}


def test_the_swap_sections_keep_their_shape():
    raw = as_json(swap_doc())
    model = raw["models"][1]
    assert set(model) == {
        "name", "kind", "residency", "port", "last_used", "host_bytes", "gpu_bytes", "swaps_in", "swaps_out", "inflight", "waiting", "frozen",
        "engine", "restarts", "health", "inference", "canary", "suspend", "metrics", "watch", "give_up_reason", "next_action", "healing",
        "fleet",
    }  # fmt: skip
    assert (model["residency"], model["kind"], model["suspend"]["parked"], model["host_bytes"]) == ("parked", "generate", True, 16 * GIB)
    assert set(raw["swap"]) == {"in_progress", "total", "failed", "abandoned", "last", "latency", "host_budget_bytes", "host_parked_bytes", "router", "max_resident",
                                "queue_timeout"}  # fmt: skip
    assert raw["swap"]["last"]["to_model"] == "chat" and raw["swap"]["last"]["checkpoint_s"] == 6.3
    assert raw["swap"]["router"] == {"pid": 400, "up": True, "linked": True, "restarts": 0, "last_restart_at": None, "address": "0.0.0.0:8000"}
    assert [upper for upper, _ in raw["swap"]["latency"]["buckets"]] == list(SWAP_BUCKETS)


def test_an_older_daemons_document_has_no_models_and_reads_as_single_mode():
    older = {**copy.deepcopy(FULL), "format": 2}
    del older["models"], older["swap"]
    d = parse(older)
    assert (d.format, d.models, d.swap, d.swap_mode) == (2, [], None, False)
    assert statusview.verdict_of(d, running=True, now=NOW).line() == "CRITICAL: gpu_memory firing"  # judged as before
    names = {s.name for fam in exporter.families(d, NOW) for s in fam.samples}
    assert "r3090d_engine_up" in names and not {n for n in names if n.startswith(("r3090d_model_", "r3090d_swap", "r3090d_router_"))}


def test_single_mode_exports_no_served_model_label():
    d = parse(FULL)
    labels = {k for fam in exporter.families(d, NOW) for s in fam.samples for k in s.labels}
    assert "served_model" not in labels
    assert exporter.model_healthz(d, "m", NOW) == (404, "not found: r3090d serves one model here; its health is /healthz")


def test_the_top_level_engine_of_swap_mode_names_no_phase():
    d = parse(as_json(swap_doc()))
    assert (d.engine.phase, d.engine.phase_text, d.engine.phase_name) == (None, "swap", "swap")
    written_without_phase = as_json(swap_doc())
    del written_without_phase["engine"]["phase"]
    assert parse(written_without_phase).engine.phase_name == "swap"  # from its state
    one_hot = [s for fam in exporter.families(d, NOW) if fam.name == "r3090d_engine_state" for s in fam.samples]
    assert one_hot and all("served_model" in s.labels for s in one_hot)  # the top-level engine is no engine


def test_an_unknown_residency_is_named_not_crashed_on():
    raw = as_json(swap_doc())
    raw["models"][2]["residency"] = "hibernating"
    d = parse(raw)
    m = d.models[2]
    assert (m.residency, m.residency_text, m.residency_name) == (None, "hibernating", "hibernating")
    verdict = statusview.verdict_of(d, running=True, now=NOW)
    assert verdict.code == exitcodes.CRITICAL and "model embed in an unknown state 'hibernating'" in verdict.reasons
    state = {s.labels["state"]: s.value for fam in exporter.families(d, NOW) if fam.name == "r3090d_model_state" for s in fam.samples
             if s.labels["served_model"] == "embed"}  # fmt: skip
    assert set(state) == {r.value for r in Residency} and set(state.values()) == {0.0}
    assert exporter.model_healthz(d, "embed", NOW)[0] == 503


def test_the_swap_latency_histogram_counts_cumulatively():
    h = Histogram.empty(SWAP_BUCKETS)
    assert h.count == 0 and all(n == 0 for _, n in h.buckets)
    h = h.observed(0.5).observed(9.8).observed(400.0)
    got = dict(h.buckets)
    assert (got[0.5], got[1.0], got[5.0], got[10.0], got[300.0]) == (1, 1, 1, 2, 2)  # 400 s is past the last bound: +Inf only
    assert (h.count, h.sum) == (3, pytest.approx(410.3))


def test_one_models_view_is_the_single_mode_document_of_its_engine():
    d = parse(as_json(swap_doc()))
    coder = d.model("coder")
    single = d.for_model(coder)
    assert not single.swap_mode and single.engine is coder.engine and single.suspend is coder.suspend and single.canary is coder.canary
    assert (single.gpu, single.alerts, single.daemon) == (d.gpu, d.alerts, d.daemon)  # the card's and the daemon's stay
    held = dataclasses.replace(d, healing=HealingInfo(reset_hold="XID 79", reset_hold_since=NOW - 5, xid_by_class={"reset": 1}))
    assert (held.for_model(coder).healing.reset_hold, held.for_model(coder).healing.xid_by_class) == ("XID 79", {"reset": 1})
    assert d.model("nope") is None


# ------------------------------------------------------------------ status: the verdict


def verdict(doc: StateDocument) -> statusview.HealthVerdict:
    return statusview.verdict_of(parse(as_json(doc)), running=True, now=NOW)


def test_parked_and_cold_models_are_ok():
    v = verdict(swap_doc())
    assert v.code == exitcodes.OK and v.line() == "OK: models: chat ready, coder parked, embed cold"


GIVEN_UP = dict(residency=Residency.FAILED, give_up_reason="6 failures in 1800 s", healing=HealingInfo(given_up=True))


@pytest.mark.parametrize(
    "doc, code, reason",
    [
        # The swap's own moves: no warning.
        (with_model(swap_doc(), "coder", residency=Residency.RESUMING, engine=dataclasses.replace(swap_doc().models[1].engine, phase=Phase.RESUMING)),
         exitcodes.OK, "models: chat ready, coder resuming"),
        (with_model(swap_doc(), "chat", residency=Residency.STOPPING, engine=dataclasses.replace(swap_doc().models[0].engine, phase=Phase.DRAINING)),
         exitcodes.OK, "models: chat stopping"),
        (with_model(swap_doc(), "embed", residency=Residency.STARTING, engine=dataclasses.replace(swap_doc().models[2].engine, phase=Phase.STARTING)),
         exitcodes.OK, "embed starting"),
        # What single mode warns of, for one model.
        (with_model(swap_doc(), "chat", engine=dataclasses.replace(swap_doc().models[0].engine, phase=Phase.BACKOFF)),
         exitcodes.WARNING, "model chat backoff (kv)"),
        (with_model(swap_doc(), "chat", engine=dataclasses.replace(swap_doc().models[0].engine, phase=Phase.RESTARTING)),
         exitcodes.WARNING, "model chat restarting (kv)"),
        (with_model(swap_doc(), "embed", residency=Residency.STARTING, engine=dataclasses.replace(swap_doc().models[2].engine, phase=Phase.WAITING_FOR_GPU)),
         exitcodes.WARNING, "model embed waiting for GPU memory held by others"),
        # The operator's suspension of a model is one, as in single mode; a parked one is not.
        (with_model(swap_doc(), "coder", suspend=dataclasses.replace(swap_doc().models[1].suspend, parked=False)),
         exitcodes.WARNING, "model coder suspended by the operator"),
        (swap_doc(swap=dataclasses.replace(swap_info(), last=SwapRecord(from_model="chat", to_model="coder", ok=False, error="restore failed: CUDA error"),
                                           failed=1)),
         exitcodes.WARNING, "the last swap failed (chat -> coder): restore failed: CUDA error"),
        (swap_doc(swap=dataclasses.replace(swap_info(), router=RouterInfo(pid=400, up=True, linked=False))),
         exitcodes.WARNING, "the router has lost its link to the daemon"),
        # Down.
        (with_model(swap_doc(), "embed", engine=dataclasses.replace(swap_doc().models[2].engine, phase=Phase.GIVEN_UP), **GIVEN_UP),
         exitcodes.CRITICAL, "model embed gave up: 6 failures in 1800 s"),
        (with_model(swap_doc(), "embed", residency=Residency.FAILED, give_up_reason="cannot start: no room"),
         exitcodes.CRITICAL, "model embed failed: cannot start: no room"),
        (swap_doc(swap=dataclasses.replace(swap_info(), router=RouterInfo(up=False, restarts=12))),
         exitcodes.CRITICAL, "the router is down: nothing is served on the public port (12 restarts)"),
    ],
    ids=["resuming", "stopping-for-a-swap", "starting-for-a-swap", "backoff", "restarting", "waiting-for-gpu", "suspended-by-operator",
         "last-swap-failed", "router-unlinked", "given-up", "failed", "router-down"],
)  # fmt: skip
def test_swap_verdicts(doc, code, reason):
    v = verdict(doc)
    assert v.code == code, v.line()
    assert any(reason in r for r in v.reasons), v.reasons


def test_swap_verdict_keeps_the_alerts_and_maintenance():
    firing = AlertsInfo(firing={"gpu_lost": FiringAlert(severity="critical", summary="the GPU fell off the bus", since=NOW - 5)})
    assert verdict(swap_doc(alerts=firing)).line() == "CRITICAL: gpu_lost firing"
    silenced = dataclasses.replace(firing, silenced={"gpu_lost": NOW + 60})
    assert verdict(swap_doc(alerts=silenced)).code == exitcodes.OK
    maintenance = swap_doc(engine=dataclasses.replace(swap_doc().engine, maintenance=True))
    assert verdict(maintenance).line() == "WARNING: maintenance mode"


def test_one_models_verdict_judges_it_alone():
    doc = parse(as_json(with_model(swap_doc(), "embed", engine=dataclasses.replace(swap_doc().models[2].engine, phase=Phase.GIVEN_UP), **GIVEN_UP)))
    assert statusview.model_verdict(doc, doc.model("coder"), NOW).line() == "OK: model coder parked"
    assert statusview.model_verdict(doc, doc.model("embed"), NOW).line() == "CRITICAL: model embed gave up: 6 failures in 1800 s"
    down = dataclasses.replace(doc, swap=dataclasses.replace(doc.swap, router=RouterInfo(up=False)))
    assert statusview.model_verdict(down, down.model("coder"), NOW).code == exitcodes.CRITICAL  # served through the router


# ------------------------------------------------------------------ status: the panel


def panel(doc: StateDocument, now: float = NOW) -> list[str]:
    d = parse(as_json(doc))
    return statusview.panel(d, statusview.verdict_of(d, running=True, now=now), now)


def test_the_panel_has_a_row_per_model():
    lines = panel(swap_doc())
    header = next(i for i, line in enumerate(lines) if line.split() and line.split()[0] == "MODEL")
    assert lines[header].split() == ["MODEL", "KIND", "STATE", "PHASE", "LAST", "USED", "HOST", "RAM", "SWAPS", "IN", "RESTARTS", "CANARY"]
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert rows[0] == ["chat", "generate", "ready", "ready", "12", "s", "ago", "-", "4", "1", "match"]
    assert rows[1] == ["coder", "generate", "parked", "suspended", "3", "min", "ago", "16.0", "GiB", "3", "0", "match"]
    assert rows[2] == ["embed", "embed", "cold", "cold", "never", "-", "0", "0", "off"]
    # The columns line up: every row's state starts where the header's STATE does.
    at = lines[header].index("STATE")
    assert [line[at:].split()[0] for line in lines[header + 1 : header + 4]] == ["ready", "parked", "cold"]
    text = "\n".join(lines)
    assert "Models     3, 1 on the GPU (at most 1)" in text
    assert "Last swap  coder -> chat (resumed) in 9.8 s, 2 min ago" in text
    assert "drain 0.1 s, checkpoint 6.3 s, restore 2.5 s, canary 0.4 s, routing 0.0 s; 1 request(s) frozen with the outgoing engine" in text
    assert "Swaps      7 swap(s), 0 failed" in text
    assert "Router     up (pid 400) on 0.0.0.0:8000, linked; 0 restart(s); a request waits up to 120 s for its model" in text
    assert "Host RAM   16.0 GiB of 48.0 GiB held by parked engines" in text
    assert "GPU        0: RTX 3090, memory 16.0/24.0 GiB" in text
    assert lines[-1] == "Status     OK: models: chat ready, coder parked, embed cold"
    assert not [line for line in lines if line.startswith(("Engine ", "KV cache", "Suspended", "Resume"))]  # no one engine's lines


def test_the_panel_shows_a_swap_under_way_a_failed_one_and_a_router_down():
    swap = dataclasses.replace(
        swap_info(),
        in_progress=SwapProgress(from_model="chat", to_model="embed", stage="starting embed", since=NOW - 3),
        last=SwapRecord(from_model=None, to_model="embed", cold=True, ok=False, seconds=40.0, start_s=39.9, error="embed gave up: exited 1", at=NOW - 600),
        router=RouterInfo(up=False, restarts=3, last_restart_at=NOW - 1),
    )  # fmt: skip
    lines = panel(swap_doc(swap=swap))
    assert "Swapping   chat -> embed: starting embed for 3 s" in lines
    assert "Last swap  (none) -> embed (cold start) in 40.0 s, 10 min ago FAILED: embed gave up: exited 1" in lines
    assert "           start 39.9 s" in lines
    assert any(line.startswith("Router     DOWN; 3 restart(s), last ") for line in lines)
    assert lines[-1].startswith("Status     CRITICAL: the router is down")


def test_the_panel_names_a_given_up_model_and_why():
    doc = with_model(swap_doc(), "embed", engine=dataclasses.replace(swap_doc().models[2].engine, phase=Phase.GIVEN_UP), **GIVEN_UP)
    lines = panel(doc)
    assert "Gave up    embed: 6 failures in 1800 s" in lines
    assert [line.split()[:4] for line in lines if line.startswith("  embed")] == [["embed", "embed", "failed", "given-up"]]


def test_one_models_panel_is_its_engines_with_where_it_is():
    d = parse(as_json(swap_doc()))
    coder = d.model("coder")
    lines = statusview.model_panel(d, coder, statusview.model_verdict(d, coder, NOW), NOW)
    text = "\n".join(lines)
    assert "Engine     suspended for 60 s, pid 601" in lines
    assert "Model      /srv/models/qwen-coder at http://127.0.0.1:18101" in lines
    assert "Served as  coder (generate) on port 18101: parked; last used 3 min ago; swapped in 3, out 4; holds 16.0 GiB of host memory parked" in lines
    assert "Requests   0 waiting at the router, 1 in flight, 1 frozen with the engine" in lines
    assert f"Parked     since {statusview.clock(NOW - 170)} (2 min ago); the engine holds 16.0 GiB of host memory, 15.0 GiB of GPU memory checkpointed" in lines
    assert "Frozen     1 request(s) frozen with the engine, to finish when its model's turn comes" in lines
    assert "KV cache   - (parked: not on the GPU)" in lines  # not the readings from before it left
    assert "Resume" not in text and "Suspended" not in text  # parked is no suspension to undo
    assert lines[-1] == "Status     OK: model coder parked"
    chat = d.model("chat")
    lines = statusview.model_panel(d, chat, statusview.model_verdict(d, chat, NOW), NOW)
    assert "KV cache   25% used, 749 free blocks of 1000; running 2, waiting 0" in lines
    assert "Canary     last check match; last match" in "\n".join(lines)


def test_an_operators_suspension_of_a_model_reads_as_one():
    doc = with_model(swap_doc(), "coder", suspend=dataclasses.replace(swap_doc().models[1].suspend, parked=False))
    d = parse(as_json(doc))
    coder = d.model("coder")
    lines = statusview.model_panel(d, coder, statusview.model_verdict(d, coder, NOW), NOW)
    assert any(line.startswith("Suspended  since") for line in lines) and "Resume     r3090ctl resume" in lines
    assert [line.split()[:3] for line in panel(doc) if line.startswith("  coder")] == [["coder", "generate", "parked"]]
    assert "parked (suspended)" in "\n".join(panel(doc))


def test_not_running_lines_name_the_models():
    lines = statusview.not_running_lines(as_json(swap_doc()), "pid 100 is gone", "/var/lib/r3090d/state.json", "systemctl start r3090d", NOW)
    assert "  models: chat ready, coder parked, embed cold" in lines


# ------------------------------------------------------------------ the exporter


def scrape(doc) -> dict[tuple[str, tuple], float]:
    """The exporter's /metrics for `doc` as {(sample name, sorted labels): value}, through prometheus_client's own exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter.StateCollector(lambda: doc, clock=lambda: NOW))
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"{key} exported twice"
            out[key] = s.value
    return out


def model(name: str, **labels: str) -> tuple:
    return tuple(sorted({"served_model": name, **labels}.items()))


def test_each_engines_series_carry_its_served_model():
    m = scrape(as_json(swap_doc()))
    assert m[("r3090d_engine_up", model("chat"))] == 1 and m[("r3090d_engine_up", model("coder"))] == 0
    assert ("r3090d_engine_up", ()) not in m  # no series for the top-level engine, which is none
    assert m[("r3090d_engine_state", model("coder", state="suspended"))] == 1
    assert m[("r3090d_engine_state", model("embed", state="cold"))] == 1
    assert m[("r3090d_restarts_total", model("chat", reason="kv"))] == 1
    assert m[("r3090d_restarts_total", model("embed", reason="requested"))] == 0  # every reason at 0 from the start
    assert m[("r3090d_canary_checks_total", model("chat"))] == 5
    assert ("r3090d_canary_checks_total", model("embed")) not in m  # an embedding model has no canary
    assert m[("r3090d_inference_probe_latency_seconds", model("chat"))] == 0.05
    # One r3090d_info, and the card's series once, without the label.
    assert [k for k in m if k[0] == "r3090d_info"] == [("r3090d_info", (("host", "gpu1"), ("model", ""), ("unit_instance", ""), ("version", "0.1.0")))]
    assert m[("r3090d_gpu_memory_used_bytes", ())] == 16 * GIB and m[("r3090d_kv_free_blocks_threshold", ())] == 100
    assert m[("r3090d_maintenance", ())] == 0 and m[("r3090d_engine_restart_storm_threshold", ())] == 3


def test_a_parked_engine_exports_neither_old_readings_nor_a_suspension():
    m = scrape(as_json(swap_doc()))
    assert m[("r3090d_kv_free_blocks", model("chat"))] == 749.25
    assert not [k for k in m if k[0].startswith(("r3090d_kv_", "r3090d_requests_")) and ("served_model", "coder") in k[1]]
    assert not [k for k in m if k[0].startswith("r3090d_suspended_")]  # parked: not the operator's suspension
    suspended = with_model(swap_doc(), "coder", suspend=dataclasses.replace(swap_doc().models[1].suspend, parked=False))
    m = scrape(as_json(suspended))
    assert m[("r3090d_suspended_since_timestamp_seconds", model("coder"))] == NOW - 170
    assert m[("r3090d_suspended_host_bytes", model("coder"))] == 16 * GIB


def test_the_swap_series():
    m = scrape(as_json(swap_doc()))
    assert m[("r3090d_model_resident", model("chat"))] == 1 and m[("r3090d_model_resident", model("coder"))] == 0
    for name, state in (("chat", "ready"), ("coder", "parked"), ("embed", "cold")):
        one_hot = {dict(k[1])["state"]: v for k, v in m.items() if k[0] == "r3090d_model_state" and dict(k[1])["served_model"] == name}
        assert one_hot == {r.value: 1.0 if r.value == state else 0.0 for r in Residency}
    assert m[("r3090d_model_host_memory_bytes", model("coder"))] == 16 * GIB and m[("r3090d_model_host_memory_bytes", model("chat"))] == 0
    assert m[("r3090d_model_last_used_timestamp_seconds", model("chat"))] == NOW - 12
    assert ("r3090d_model_last_used_timestamp_seconds", model("embed")) not in m  # never used
    assert m[("r3090d_model_requests_frozen", model("coder"))] == 1 and m[("r3090d_model_requests_inflight", model("chat"))] == 2
    assert (m[("r3090d_swaps_total", model("chat"))], m[("r3090d_swaps_total", model("embed"))]) == (4, 0)
    failures = (m[("r3090d_swap_failures_total", (("outcome", "failed"),))], m[("r3090d_swap_failures_total", (("outcome", "abandoned"),))])
    assert failures == (0, 0) and m[("r3090d_swap_in_progress", ())] == 0
    buckets = {dict(k[1])["le"]: v for k, v in m.items() if k[0] == "r3090d_swap_seconds_bucket"}
    assert (buckets["2.0"], buckets["5.0"], buckets["10.0"], buckets["30.0"], buckets["60.0"], buckets["+Inf"]) == (0, 1, 2, 2, 3, 3)
    assert (m[("r3090d_swap_seconds_count", ())], m[("r3090d_swap_seconds_sum", ())]) == (3, pytest.approx(44.8))
    assert (m[("r3090d_router_up", ())], m[("r3090d_router_restarts_total", ())]) == (1, 0)
    assert (m[("r3090d_host_memory_budget_bytes", ())], m[("r3090d_host_memory_parked_bytes", ())]) == (48 * GIB, 16 * GIB)
    # /healthz's gauge: the node's series (the router) and one per model (its /healthz/<served_model>).
    assert m[("r3090d_serving", (("served_model", ""),))] == 1 and m[("r3090d_serving", model("embed"))] == 1


def test_a_document_without_latency_counts_still_exports_the_buckets():
    raw = as_json(swap_doc())
    del raw["swap"]["latency"]
    m = scrape(raw)
    assert {dict(k[1])["le"] for k in m if k[0] == "r3090d_swap_seconds_bucket"} == {repr(b) for b in SWAP_BUCKETS} | {"+Inf"}
    assert m[("r3090d_swap_seconds_count", ())] == 0


# ------------------------------------------------------------------ /healthz and /healthz/<served_model>


def test_healthz_answers_while_the_router_can_serve_or_queue():
    assert exporter.healthz(as_json(swap_doc()), NOW) == (200, "serving: chat ready; 2 more after a swap")
    # Nothing resident: requests queue while a model is swapped in.
    nothing = as_json(with_model(swap_doc(), "chat", residency=Residency.PARKED))
    assert exporter.healthz(nothing, NOW) == (200, "serving: none ready; 3 more after a swap")
    down = swap_doc(swap=dataclasses.replace(swap_info(), router=RouterInfo(up=False)))
    assert exporter.healthz(as_json(down), NOW) == (503, "the router is down")
    unlinked = swap_doc(swap=dataclasses.replace(swap_info(), router=RouterInfo(up=True, linked=False)))
    assert exporter.healthz(as_json(unlinked), NOW) == (503, "the router has no link to the daemon")
    failed = swap_doc()
    for name in ("chat", "coder", "embed"):
        failed = with_model(failed, name, residency=Residency.FAILED)
    assert exporter.healthz(as_json(failed), NOW) == (503, "no model can be served: chat failed, coder failed, embed failed")
    maintenance = swap_doc(engine=dataclasses.replace(swap_doc().engine, maintenance=True))
    assert exporter.healthz(as_json(maintenance), NOW) == (503, "maintenance mode")
    assert exporter.healthz(as_json(swap_doc()), NOW + 60)[0] == 503  # stale: the loop is stuck


def test_model_healthz():
    d = as_json(swap_doc())
    assert exporter.model_healthz(d, "chat", NOW) == (200, "ready")
    assert exporter.model_healthz(d, "coder", NOW) == (200, "parked: served after a swap")
    assert exporter.model_healthz(d, "embed", NOW) == (200, "cold: served after a cold start")
    assert exporter.model_healthz(d, "nope", NOW) == (404, "not found: no model 'nope'; served: chat, coder, embed")
    gave_up = with_model(swap_doc(), "embed", engine=dataclasses.replace(swap_doc().models[2].engine, phase=Phase.GIVEN_UP), **GIVEN_UP)
    assert exporter.model_healthz(as_json(gave_up), "embed", NOW) == (503, "failed: 6 failures in 1800 s")
    assert exporter.model_healthz(as_json(gave_up), "coder", NOW) == (200, "parked: served after a swap")  # one failed model masks no other
    down = swap_doc(swap=dataclasses.replace(swap_info(), router=RouterInfo(up=False)))
    assert exporter.model_healthz(as_json(down), "chat", NOW) == (503, "the router is down")
    assert exporter.model_healthz(None, "chat", NOW) == (503, exporter.NO_STATE)
    assert exporter.model_healthz(d, "chat", NOW + 60)[0] == 503
    m = scrape(as_json(gave_up))
    assert m[("r3090d_serving", model("embed"))] == 0 and m[("r3090d_serving", model("coder"))] == 1 and m[("r3090d_serving", (("served_model", ""),))] == 1


def test_an_operators_suspension_and_a_restart_of_a_model_in_the_document():
    # What suspend --wait and restart --wait read for one model: its suspension's last request, its generation.
    suspended = with_model(
        swap_doc(), "chat",
        suspend=SuspendInfo(stage=Stage.SUSPENDED, since=NOW - 5, last=LastRequest(9, "suspend", Result.SUSPENDED, "pid 501 suspended", NOW - 5)),
        restarts=RestartsInfo(total=2),
    )  # fmt: skip
    d = parse(as_json(suspended))
    view = d.for_model(d.model("chat"))
    assert view.suspend.last.request == 9 and view.suspend.by_operator and view.engine.generation == 1 and view.restarts.total == 2


# ------------------------------------------------------------------ anything in place of a section


SWAP_RAW = as_json(swap_doc())


@st.composite
def damaged_swap_documents(draw) -> dict:
    doc = copy.deepcopy(SWAP_RAW)
    for key in draw(st.lists(st.sampled_from(["models", "swap", "engine", "new_section"]), max_size=2)):
        doc[key] = draw(VALUES)
    models = doc.get("models")
    if isinstance(models, list) and models and draw(st.booleans()):
        m = draw(st.sampled_from(models))
        if isinstance(m, dict):
            m[draw(st.sampled_from([*sorted(m, key=str), "new_field"]))] = draw(VALUES)
    swap = doc.get("swap")
    if isinstance(swap, dict) and draw(st.booleans()):
        target = swap.get(draw(st.sampled_from(["router", "last", "in_progress", "latency"])))
        if isinstance(target, dict) and target:
            target[draw(st.sampled_from(sorted(target, key=str)))] = draw(VALUES)
        else:
            swap[draw(st.sampled_from([*sorted(swap, key=str), "new_field"]))] = draw(VALUES)  # keys of any type, sorted as text
    return doc


@settings(deadline=None, derandomize=True, max_examples=150)
@given(damaged_swap_documents())
def test_every_reader_survives_a_damaged_swap_document(doc):
    try:
        d = parse(doc)
    except UnreadableFormat:
        return
    json.dumps(d.to_json())
    readers(doc)
    for m in d.models:
        statusview.model_panel(d, m, statusview.model_verdict(d, m, NOW), NOW)
        exporter.model_healthz(doc, m.name, NOW)
    scrape(doc)  # one exposition, no family twice


def test_a_model_without_metrics_shows_none():
    doc = with_model(swap_doc(), "chat", metrics=MetricsSample(error="connection refused"))
    m = scrape(as_json(doc))
    assert not [k for k in m if k[0] == "r3090d_kv_free_blocks"]


def test_a_swap_document_round_trips_its_latency():
    h = Histogram.empty(SWAP_BUCKETS).observed(2.5)
    d = parse(as_json(swap_doc(swap=dataclasses.replace(swap_info(), latency=h))))
    assert d.swap.latency == h and d.swap.latency.count == 1
    assert parse({**as_json(swap_doc()), "swap": None}).swap is None and parse({**as_json(swap_doc()), "swap": None}).swap_mode  # models alone say so
    assert StateDocument().swap_mode is False


def test_maintenance_carried_by_the_engines_is_the_nodes():
    doc = swap_doc()
    for name in ("chat", "coder", "embed"):
        m = doc.model(name)
        doc = with_model(doc, name, engine=dataclasses.replace(m.engine, maintenance=True))
    raw = as_json(doc)
    assert verdict(doc).line() == "WARNING: maintenance mode"
    assert exporter.healthz(raw, NOW) == (503, "maintenance mode") and exporter.model_healthz(raw, "chat", NOW) == (503, "maintenance mode")
    assert scrape(raw)[("r3090d_maintenance", ())] == 1
    assert "Maintenance on: automatic restarts are paused, and /healthz answers 503" in panel(doc)


def test_a_top_level_engine_written_without_a_phase_reads_as_swap():
    # The daemon writes the top-level engine as its state alone: {"state": "swap", "phase": null, "model": "chat, coder, embed"}.
    raw = as_json(swap_doc(engine=dataclasses.replace(swap_doc().engine, model="chat, coder, embed")))
    raw["engine"]["phase"] = None
    d = parse(raw)
    assert (d.engine.phase, d.engine.phase_name) == (None, "swap")
    assert statusview.verdict_of(d, running=True, now=NOW).code == exitcodes.OK and exporter.healthz(d, NOW)[0] == 200
    info = [k for k in scrape(raw) if k[0] == "r3090d_info"]
    assert info == [("r3090d_info", (("host", "gpu1"), ("model", "chat, coder, embed"), ("unit_instance", ""), ("version", "0.1.0")))]


def test_status_model_option_names_what_it_cannot_show():
    from r3090d.cli import status_cmd

    single = status_cmd.located(True, FULL, "socket", None, "/var/lib/r3090d/state.json")
    v = status_cmd.judge(single, NOW, "chat")
    assert v.code == exitcodes.UNKNOWN and v.reasons == ("--model 'chat': r3090d serves one engine (no [[models]]); r3090ctl status without --model",)
    swap = status_cmd.located(True, as_json(swap_doc()), "socket", None, "/var/lib/r3090d/state.json")
    assert status_cmd.judge(swap, NOW, "nope").reasons == ("r3090d serves no model 'nope'; its models: chat, coder, embed",)
    assert status_cmd.judge(swap, NOW, "coder").line() == "OK: model coder parked"
    stopped = status_cmd.located(False, as_json(swap_doc()), "state-file", None, "/var/lib/r3090d/state.json")
    assert status_cmd.judge(stopped, NOW, "coder").code == exitcodes.UNKNOWN  # not running: as without --model


def test_without_a_gpu_the_panel_says_running_and_that_nothing_is_parked():
    from r3090d.core.snapshot import GpuSample, GpuStatus

    text = "\n".join(panel(swap_doc(gpu=GpuSample(GpuStatus.DISABLED))))
    assert "Models     3, 1 running (at most 1)" in text
    assert "Host RAM   nothing is parked without a GPU: a swap is a drained stop and a cold start" in text
