"""The link's protocol: what the daemon and the router send each other, encoded and decoded in one place."""

from __future__ import annotations

import json

import pytest

from r3090d.router.link import (
    MAX_LINE_BYTES,
    Demand,
    EngineState,
    LinkError,
    ModelDemand,
    ModelEntry,
    ModelKind,
    Table,
    decode,
    encode_demand,
    encode_table,
)

CHAT = ModelEntry("chat", ModelKind.GENERATE, EngineState.READY, True, "http://127.0.0.1:18101", "s3cret")
EMBED = ModelEntry("search", ModelKind.EMBED, EngineState.PARKED, False, "http://127.0.0.1:18102", "")
GAVE_UP = ModelEntry(
    "code", ModelKind.GENERATE, EngineState.FAILED, False, "http://127.0.0.1:18103", "", "5 restarts"
)


def entry(**changes) -> dict:
    base = {
        "name": "chat",
        "kind": "generate",
        "state": "ready",
        "routable": True,
        "upstream": "http://127.0.0.1:18101",
        "upstream_key": "",
    }
    return {**base, **changes}


def table_line(*models: dict, seq: int = 1, **extra) -> str:
    return json.dumps({"type": "table", "seq": seq, "models": list(models), **extra})


def demand_line(**models) -> str:
    return json.dumps({"type": "demand", "models": models})


def test_a_table_round_trips():
    table = Table(seq=7, models=(CHAT, EMBED, GAVE_UP))
    line = encode_table(table)
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # one message, one line
    assert decode(line) == table
    assert json.loads(line)["models"][0] == {
        "name": "chat",
        "kind": "generate",
        "state": "ready",
        "routable": True,
        "upstream": "http://127.0.0.1:18101",
        "upstream_key": "s3cret",
        "reason": "",
    }
    assert json.loads(line)["models"][2]["reason"] == "5 restarts"


def test_a_table_from_a_daemon_that_sends_no_reason_decodes_with_none():
    assert decode(table_line(entry())).models[0].reason == ""
    assert decode(table_line(entry(state="failed", reason="gave up: OOM"))).models[0].reason == "gave up: OOM"


def test_a_demand_round_trips():
    demand = Demand(
        {
            "chat": ModelDemand(waiting=3, oldest_waiting_at=1234.5, inflight=2, last_used_at=1200.0),
            "search": ModelDemand(),
        }
    )
    line = encode_demand(demand)
    assert decode(line) == demand
    assert json.loads(line) == {
        "type": "demand",
        "models": {
            "chat": {"waiting": 3, "oldest_waiting_at": 1234.5, "inflight": 2, "last_used_at": 1200.0},
            "search": {"waiting": 0, "oldest_waiting_at": None, "inflight": 0, "last_used_at": None},
        },
    }


def test_an_upstream_key_never_shows_in_a_repr():
    assert "s3cret" not in repr(CHAT) and "s3cret" not in repr(Table(1, (CHAT,)))


def test_the_upstream_loses_a_trailing_slash_and_lookup_is_by_name():
    table = decode(table_line(entry(upstream="http://127.0.0.1:18101/")))
    assert table.get("chat").upstream == "http://127.0.0.1:18101"
    assert table.get("other") is None


def test_every_state_and_kind_decodes():
    for state in EngineState:
        for kind in ModelKind:
            m = decode(table_line(entry(state=state.value, kind=kind.value))).models[0]
            assert (m.state, m.kind) == (state, kind)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("", "not JSON"),
        ("{", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        ("[]", "JSON object"),
        ('{"type": "hello"}', "unknown message type"),
        ('{"seq": 1, "models": []}', "unknown message type"),
        (table_line(seq=-1), "seq"),
        (table_line(seq=True), "seq"),
        (table_line(seq=1.5), "seq"),
        (json.dumps({"type": "table", "seq": 1, "models": {}}), "models must be a list"),
        (json.dumps({"type": "table", "seq": 1}), "missing ['models']"),
        (table_line(extra=1), "unknown ['extra']"),
        (table_line("chat"), "must be an object"),
        (table_line(entry(), entry()), "appears twice"),
        (table_line(entry(name="")), "name"),
        (table_line(entry(name=5)), "name"),
        (table_line(entry(name="x" * 300)), "name"),
        (table_line(entry(kind="chat")), "kind must be one of"),
        (table_line(entry(state="sleeping")), "state must be one of"),
        (table_line(entry(routable="yes")), "routable"),
        (table_line(entry(upstream="https://127.0.0.1:1")), "upstream"),
        (table_line(entry(upstream="http://127.0.0.1:1/v1")), "upstream"),
        (table_line(entry(upstream="127.0.0.1:1")), "upstream"),
        (table_line(entry(upstream="http://127.0.0.1:99999")), "bad port"),
        (table_line(entry(upstream=None)), "upstream"),
        (table_line(entry(upstream_key=None)), "upstream_key"),
        (table_line(entry(upstream_key="a\nb")), "upstream_key"),
        (table_line({k: v for k, v in entry().items() if k != "upstream_key"}), "missing ['upstream_key']"),
        (table_line({**entry(), "port": 1}), "unknown ['port']"),
        (table_line(entry(reason=None)), "reason"),
        (table_line(entry(reason="x" * 5000)), "reason"),
        (json.dumps({"type": "demand", "models": []}), "object of model names"),
        (demand_line(chat=3), "must be an object"),
        (
            demand_line(chat={"waiting": 1, "oldest_waiting_at": 5.0, "inflight": 0}),
            "missing ['last_used_at']",
        ),
        (
            demand_line(chat={"waiting": -1, "oldest_waiting_at": None, "inflight": 0, "last_used_at": None}),
            "waiting",
        ),
        (
            demand_line(
                chat={"waiting": 0, "oldest_waiting_at": None, "inflight": 1.5, "last_used_at": None}
            ),
            "inflight",
        ),
        (
            demand_line(chat={"waiting": 0, "oldest_waiting_at": None, "inflight": 0, "last_used_at": "now"}),
            "last_used_at",
        ),
        (
            demand_line(chat={"waiting": 0, "oldest_waiting_at": None, "inflight": 0, "last_used_at": -1}),
            "last_used_at",
        ),
        (
            demand_line(chat={"waiting": 1, "oldest_waiting_at": None, "inflight": 0, "last_used_at": None}),
            "exactly when waiting",
        ),
        (
            demand_line(chat={"waiting": 0, "oldest_waiting_at": 3.0, "inflight": 0, "last_used_at": None}),
            "exactly when waiting",
        ),
        (
            '{"type": "demand", "models": {"chat": {"waiting": 1, "oldest_waiting_at": NaN, "inflight": 0, "last_used_at": null}}}',
            "oldest_waiting_at",
        ),
    ],
)
def test_a_malformed_line_raises_link_error_saying_what(line, says):
    with pytest.raises(LinkError) as caught:
        decode(line)
    assert says in str(caught.value)


def test_an_overlong_line_is_refused_before_parsing():
    with pytest.raises(LinkError, match="over the"):
        decode(b" " * (MAX_LINE_BYTES + 1))


def test_encoding_refuses_a_non_finite_time():
    with pytest.raises(ValueError):
        encode_demand(Demand({"chat": ModelDemand(waiting=1, oldest_waiting_at=float("nan"))}))
