"""The Grafana dashboard imports cleanly, filters every query by $instance and names metrics the exporter has.

`dashboard_queries()` gives every query with Grafana's variables filled in, for a
test that runs them against a real Prometheus (scraping a daemon of single mode:
the collapsed "Swap mode" row's panels plot series only swap mode has, and are
left out unless asked for).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from r3090d.config import WatchdogConfig
from r3090d.core.arbiter import Residency
from r3090d.core.vocabulary import Phase
from r3090d.service.exporter import Exporter
from tests.swapdocs import as_json, swap_doc

DASHBOARD = Path(__file__).resolve().parents[2] / "etc" / "grafana" / "r3090d.json"
DATASOURCE_UID = "${DS_PROMETHEUS}"
INSTANCE_MATCHER = 'instance=~"$instance"'
GRID_COLUMNS = 24
# What Grafana puts in place of its variables, for running a query outside it.
SUBSTITUTIONS = {"$instance": ".*", "$__rate_interval": "1m"}
# Metrics the dashboard plots that the exporter does not serve (yet): name -> (type, labels).
PENDING_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {}
METRIC_NAME = re.compile(r"\b((?:r3090d|process)_[a-zA-Z0-9_]+)\b")
SWAP_ROW = "Swap mode"
# What only swap mode exports: plotted in the swap row alone.
SWAP_ONLY = re.compile(r"\br3090d_(?:model_|swaps?_|router_|host_memory_)")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict | None = None) -> list[dict]:
    """Every panel, rows' nested panels included."""
    out = []
    for panel in (dashboard or load())["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def query_panels(dashboard: dict | None = None) -> list[dict]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def annotations(dashboard: dict | None = None) -> list[dict]:
    return [a for a in (dashboard or load())["annotations"]["list"] if not a.get("builtIn")]


def swap_panels(dashboard: dict | None = None) -> list[dict]:
    (row,) = [p for p in (dashboard or load())["panels"] if p["type"] == "row" and p["title"] == SWAP_ROW]
    return row["panels"]


def raw_queries(dashboard: dict | None = None, *, swap_mode: bool = True) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every query annotation (without the swap row's: swap_mode=False)."""
    dashboard = dashboard or load()
    skip = set() if swap_mode else {p["id"] for p in swap_panels(dashboard)}
    out = [(f"panel {p['title']!r} target {t['refId']}", t.get("expr", "")) for p in query_panels(dashboard) if p["id"] not in skip for t in p["targets"]]
    out += [(f"annotation {a['name']!r}", a.get("expr", "")) for a in annotations(dashboard)]
    return out


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    return expr


def swap_queries() -> list[str]:
    """The swap row's PromQL, as dashboard_queries() fills it in: what a swap-mode exporter must give data for."""
    return [substitute(t["expr"]) for p in swap_panels() for t in p["targets"]]


def dashboard_queries(*, swap_mode: bool = False) -> list[str]:
    """Every panel's and annotation's PromQL, with $instance as `.*` and $__rate_interval as 1m; the swap row's
    only with swap_mode (a daemon of single mode exports none of what they plot)."""
    return [substitute(expr) for _, expr in raw_queries(swap_mode=swap_mode)]


SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def exported_names() -> set[str]:
    """Every sample name the exporter's registry serves, from state documents that fill every family: single mode's and swap mode's."""
    single = {
        "written_at": 1000.0,
        "engine": {"phase": Phase.READY.value},
        "telemetry": {"poll_duration_seconds": {"buckets": [[0.1, 1]], "count": 1, "sum": 0.05}},
    }
    names = set()
    for doc in (single, as_json(swap_doc(1000.0))):
        registry = Exporter("127.0.0.1", 0, lambda doc=doc: doc, clock=lambda: 1000.0).registry  # never started: no socket
        names |= {fam.name + suffix for fam in registry.collect() for suffix in SAMPLE_SUFFIXES.get(fam.type, ("",))}
    return names


def test_import_format():
    d = load()
    for key in ("title", "uid", "panels", "schemaVersion", "templating", "__inputs"):
        assert key in d, f"the dashboard has no {key}"
    assert isinstance(d["schemaVersion"], int)
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", d["uid"]), "Grafana uids are at most 40 of [A-Za-z0-9_-]"
    assert d["id"] is None, "an exported dashboard carries no database id"
    (ds,) = [i for i in d["__inputs"] if i["name"] == "DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["pluginId"] == "prometheus"


def test_panels_have_unique_ids_and_fit_the_grid_without_overlap():
    panels = all_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    boxes = []
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), f"{p['title']}: gridPos {g}"
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= GRID_COLUMNS, f"{p['title']}: wider than the grid"
        for title, o in boxes:
            overlap = g["x"] < o["x"] + o["w"] and o["x"] < g["x"] + g["w"] and g["y"] < o["y"] + o["h"] and o["y"] < g["y"] + g["h"]
            assert not overlap, f"{p['title']!r} overlaps {title!r}"
        boxes.append((p["title"], g))


def test_every_query_uses_the_prometheus_input():
    d = load()
    for p in query_panels(d):
        assert p["datasource"]["uid"] == DATASOURCE_UID, p["title"]
        assert p["targets"], f"{p['title']} has no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DATASOURCE_UID, p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), f"{p['title']}: duplicate refId"
    for a in annotations(d):
        assert a["datasource"]["uid"] == DATASOURCE_UID, a["name"]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"]["uid"] == DATASOURCE_UID, v["name"]


def test_instance_variable():
    (var,) = [v for v in load()["templating"]["list"] if v["name"] == "instance"]
    assert var["type"] == "query"
    assert re.fullmatch(r"label_values\(\s*r3090d_info\s*,\s*instance\s*\)", var["query"])
    # "All" must list the r3090d targets, not match every target: process_* metrics
    # come from every exporter that Prometheus scrapes.
    assert var.get("allValue") in (None, ""), "a custom allValue such as .* would match every target"


@pytest.mark.parametrize(("where", "expr"), raw_queries(), ids=[w for w, _ in raw_queries()])
def test_every_selector_is_filtered_by_instance(where, expr):
    assert expr.strip(), f"{where} has no expr"
    for m in METRIC_NAME.finditer(expr):
        rest = expr[m.end():]
        assert rest.startswith("{"), f"{where}: {m.group(1)} has no label matchers"
        matchers = rest[1:rest.index("}")]
        assert INSTANCE_MATCHER in matchers, f"{where}: {m.group(1)} is not filtered by {INSTANCE_MATCHER}"
    assert "$" not in substitute(expr), f"{where}: a Grafana variable no Prometheus test can fill in"


def test_every_metric_is_exported_or_listed_as_pending():
    exported = exported_names()
    used = {m.group(1) for _, expr in raw_queries() for m in METRIC_NAME.finditer(expr)}
    unknown = used - exported - set(PENDING_METRICS)
    assert not unknown, f"the exporter has no {sorted(unknown)}: a typo, or add them to PENDING_METRICS"
    assert "r3090d_poll_duration_seconds_bucket" in used and "r3090d_restarts_total" in used


def test_swap_mode_has_its_own_collapsed_row_with_every_swap_only_query():
    d = load()
    (row,) = [p for p in d["panels"] if p["type"] == "row" and p["title"] == SWAP_ROW]
    assert row["collapsed"] is True  # single mode shows nothing empty
    inside = {p["title"] for p in swap_panels(d)}
    assert inside == {"Model residency", "Swaps per model", "Swap latency", "Host memory of parked engines"}
    outside = [(where, expr) for where, expr in raw_queries(d, swap_mode=False) if SWAP_ONLY.search(expr)]
    assert outside == [], "a query of what only swap mode exports, outside the swap row"
    used = {m.group(1) for _, expr in raw_queries(d) for m in METRIC_NAME.finditer(expr)}
    assert {"r3090d_swaps_total", "r3090d_swap_failures_total", "r3090d_swap_seconds_bucket", "r3090d_model_state"} <= used


def test_swap_latency_is_read_from_the_histogram():
    (panel,) = [p for p in swap_panels() if p["title"] == "Swap latency"]
    quantiles = sorted(float(re.match(r"histogram_quantile\(([\d.]+),", t["expr"]).group(1)) for t in panel["targets"])
    assert quantiles == [0.5, 0.9]
    assert all("r3090d_swap_seconds_bucket" in t["expr"] and "le)" in t["expr"] for t in panel["targets"])


def test_model_residency_maps_every_residency():
    (panel,) = [p for p in swap_panels() if p["title"] == "Model residency"]
    (target,) = panel["targets"]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    texts = {option["text"]: int(value) for value, option in mapping["options"].items()}
    assert set(texts) == {r.value for r in Residency}, "a residency the timeline cannot name"
    for text, value in texts.items():
        assert re.search(rf'state="{re.escape(text)}"\}} == 1\) \* {value}\b', target["expr"]), f"{text} is not mapped to {value}"
    assert target["expr"].startswith("max by (instance, served_model) (")


def test_engine_phase_maps_every_phase():
    (panel,) = [p for p in query_panels() if p["title"] == "Engine phase"]
    (target,) = panel["targets"]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    texts = {option["text"]: int(value) for value, option in mapping["options"].items()}
    assert set(texts) == {p.value for p in Phase}, "a phase the timeline cannot name"
    for text, value in texts.items():
        assert re.search(rf'state="{re.escape(text)}"\}} == 1\) \* {value}\b', target["expr"]), f"{text} is not mapped to {value}"


def test_threshold_lines_match_the_daemon_defaults():
    by_title = {p["title"]: p for p in query_panels()}
    w = WatchdogConfig()
    for title, default in (("GPU temperature", w.temperature_warn_c), ("Inference probe latency", w.probe_timeout)):
        steps = by_title[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert [s["value"] for s in steps if s["value"] is not None] == [default], f"{title}: the line is not at {default}"


def test_restarts_are_annotated_with_their_reason():
    (restarts,) = [a for a in annotations() if "r3090d_restarts_total" in a["expr"]]
    assert restarts["enable"] is True
    assert "reason" in restarts["tagKeys"].split(",")
    assert "{{reason}}" in restarts["titleFormat"]
