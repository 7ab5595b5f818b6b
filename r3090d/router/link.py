"""The link between the daemon and the router: newline-delimited JSON on a unix stream socket, pure.

The daemon listens (runtime_dir/router.sock, mode 0600) and sends a `table` on
connect and whenever anything in it changes; the router sends `demand`
whenever its queues change. Both sides encode and decode through this module,
so the protocol is written in one place:

    daemon -> router  {"type": "table", "seq": N, "models": [{"name", "kind", "state",
                       "routable", "upstream", "upstream_key", "reason"}, ...]}
    router -> daemon  {"type": "demand", "models": {NAME: {"waiting", "oldest_waiting_at",
                       "inflight", "last_used_at"}, ...}}

Times are CLOCK_MONOTONIC seconds (`time.monotonic()`), which every process on
one Linux host shares. A line that does not decode raises LinkError naming
what is wrong; the reader logs it and goes on with the next line. A model's
`reason` (why it gave up) may be missing: a daemon from before it sends none.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

# One vocabulary with the daemon: a model's kind is the config's, its state the arbiter's residency.
from r3090d.config.schema import UNIX_PATH_MAX
from r3090d.config.schema import EngineKind as ModelKind
from r3090d.core.arbiter import Residency as EngineState

MAX_LINE_BYTES = 1024 * 1024  # a table of dozens of models is a few kB; a longer line is not ours
MAX_REASON_CHARS = 4096  # a give-up reason is a sentence; it goes into a client's error message
UNIX_PREFIX = "unix:"  # an upstream on a unix socket: unix:/PATH


class LinkError(ValueError):
    """A line that is not a valid link message."""


@dataclass(frozen=True)
class ModelEntry:
    """One served model as the daemon sees it. `routable`: send requests to `upstream` now."""

    name: str
    kind: ModelKind
    state: EngineState
    routable: bool
    upstream: str  # unix:/PATH (the engine's socket), or http://127.0.0.1:PORT, no path
    upstream_key: str = ""  # the engine's API key, empty when it has none
    reason: str = ""  # why the daemon gave up on it (state failed), for the clients' 503; empty otherwise

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return (
            f"ModelEntry(name={self.name!r}, kind={self.kind.value}, state={self.state.value}, "
            f"routable={self.routable}, upstream={self.upstream!r}, upstream_key={'***' if self.upstream_key else ''!r}, "
            f"reason={self.reason!r})"
        )


@dataclass(frozen=True)
class Table:
    seq: int
    models: tuple[ModelEntry, ...]

    def get(self, name: str) -> ModelEntry | None:
        return next((m for m in self.models if m.name == name), None)


@dataclass(frozen=True)
class ModelDemand:
    """What the router holds for one model: requests waiting for it to be routable, and requests sent to it."""

    waiting: int = 0
    oldest_waiting_at: float | None = None  # monotonic arrival of the oldest waiting request
    inflight: int = 0  # sent upstream and not finished; for a parked model, the requests frozen with it
    last_used_at: float | None = None  # monotonic time a request last started or finished


@dataclass(frozen=True)
class Demand:
    models: dict[str, ModelDemand]


Message = Table | Demand


# ----------------------------------------------------------------- encoding


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def encode_table(table: Table) -> bytes:
    models = [
        {
            "name": m.name,
            "kind": m.kind.value,
            "state": m.state.value,
            "routable": m.routable,
            "upstream": m.upstream,
            "upstream_key": m.upstream_key,
            "reason": m.reason,
        }
        for m in table.models
    ]
    return _line({"type": "table", "seq": table.seq, "models": models})


def encode_demand(demand: Demand) -> bytes:
    models = {
        name: {
            "waiting": d.waiting,
            "oldest_waiting_at": d.oldest_waiting_at,
            "inflight": d.inflight,
            "last_used_at": d.last_used_at,
        }
        for name, d in demand.models.items()
    }
    return _line({"type": "demand", "models": models})


# ----------------------------------------------------------------- decoding


def decode(line: bytes | str) -> Message:
    """One line (its newline optional) to a Table or a Demand; LinkError says what is wrong."""
    if len(line) > MAX_LINE_BYTES:
        raise LinkError(f"a line of {len(line)} bytes, over the {MAX_LINE_BYTES}-byte limit")
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise LinkError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LinkError("a message must be a JSON object")
    kind = obj.get("type")
    if kind == "table":
        return _decode_table(obj)
    if kind == "demand":
        return _decode_demand(obj)
    raise LinkError(f"unknown message type {kind!r}; expected 'table' or 'demand'")


def _exact_keys(obj: dict, keys: set[str], where: str, optional: frozenset[str] = frozenset()) -> None:
    missing, extra = keys - set(obj), set(obj) - keys - optional
    if missing:
        raise LinkError(f"{where}: missing {sorted(missing)}")
    if extra:
        raise LinkError(f"{where}: unknown {sorted(extra)}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _decode_table(obj: dict) -> Table:
    _exact_keys(obj, {"type", "seq", "models"}, "table")
    if not _is_int(obj["seq"]) or obj["seq"] < 0:
        raise LinkError(f"table: seq must be a non-negative integer, got {obj['seq']!r}")
    if not isinstance(obj["models"], list):
        raise LinkError("table: models must be a list")
    models = tuple(_decode_entry(i, m) for i, m in enumerate(obj["models"]))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise LinkError(f"table: a model name appears twice in {names}")
    return Table(seq=obj["seq"], models=models)


def _enum(cls, value: object, where: str):
    try:
        return cls(value)
    except ValueError:
        raise LinkError(f"{where} must be one of {[e.value for e in cls]}, got {value!r}") from None


def _decode_entry(index: int, m: object) -> ModelEntry:
    where = f"table: models[{index}]"
    if not isinstance(m, dict):
        raise LinkError(f"{where} must be an object")
    _exact_keys(
        m, {"name", "kind", "state", "routable", "upstream", "upstream_key"}, where, frozenset({"reason"})
    )
    name = m["name"]
    if not isinstance(name, str) or not name or len(name) > 256:
        raise LinkError(f"{where}.name must be a non-empty string of at most 256 characters")
    if not isinstance(m["routable"], bool):
        raise LinkError(f"{where}.routable must be true or false")
    upstream = _upstream(m["upstream"], where)
    key = m["upstream_key"]
    if not isinstance(key, str) or any(c in key for c in "\r\n\0"):
        raise LinkError(f"{where}.upstream_key must be a string of one line")
    reason = m.get("reason", "")
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
        raise LinkError(f"{where}.reason must be a string of at most {MAX_REASON_CHARS} characters")
    return ModelEntry(
        name=name,
        kind=_enum(ModelKind, m["kind"], f"{where}.kind"),
        state=_enum(EngineState, m["state"], f"{where}.state"),
        routable=m["routable"],
        upstream=upstream,
        upstream_key=key,
        reason=reason,
    )


def _upstream(upstream: object, where: str) -> str:
    """unix:/PATH, or http://HOST:PORT without its trailing slash."""
    if isinstance(upstream, str) and upstream.startswith(UNIX_PREFIX):
        path = upstream[len(UNIX_PREFIX) :]
        if not path.startswith("/") or "\0" in path or len(path.encode("utf-8", "surrogateescape")) > UNIX_PATH_MAX:
            raise LinkError(f"{where}.upstream must name an absolute socket path of at most {UNIX_PATH_MAX} bytes, got {upstream!r}")
        return upstream
    parts = urlsplit(upstream) if isinstance(upstream, str) else None
    if (
        parts is None
        or parts.scheme != "http"
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
    ):
        raise LinkError(f"{where}.upstream must be unix:/PATH or http://HOST:PORT, got {upstream!r}")
    try:
        parts.port  # noqa: B018 -- raises on a port out of range
    except ValueError:
        raise LinkError(f"{where}.upstream has a bad port: {upstream!r}") from None
    return upstream.rstrip("/")


def _time(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise LinkError(f"{where} must be a monotonic time in seconds or null, got {value!r}")
    return float(value)


def _count(value: object, where: str) -> int:
    if not _is_int(value) or value < 0:
        raise LinkError(f"{where} must be a non-negative integer, got {value!r}")
    return value


def _decode_demand(obj: dict) -> Demand:
    _exact_keys(obj, {"type", "models"}, "demand")
    if not isinstance(obj["models"], dict):
        raise LinkError("demand: models must be an object of model names")
    out: dict[str, ModelDemand] = {}
    for name, d in obj["models"].items():
        where = f"demand: models[{name!r}]"
        if not isinstance(d, dict):
            raise LinkError(f"{where} must be an object")
        _exact_keys(d, {"waiting", "oldest_waiting_at", "inflight", "last_used_at"}, where)
        waiting = _count(d["waiting"], f"{where}.waiting")
        oldest = _time(d["oldest_waiting_at"], f"{where}.oldest_waiting_at")
        if (waiting > 0) != (oldest is not None):
            raise LinkError(f"{where}: oldest_waiting_at must be a time exactly when waiting > 0")
        out[name] = ModelDemand(
            waiting=waiting,
            oldest_waiting_at=oldest,
            inflight=_count(d["inflight"], f"{where}.inflight"),
            last_used_at=_time(d["last_used_at"], f"{where}.last_used_at"),
        )
    return Demand(models=out)
