"""Alertmanager payloads: r3090d's alerts as Alertmanager alerts (HTTP API v2), pure.

Each alert is one element of the JSON list POSTed to `{url}/api/v2/alerts`
by the channel (r3090d.effectors.alertmanager):

    labels       alertname      the key: gave_up, kv_pressure, engine_restarted, ...
                 alert          the key again: the label of the r3090d_alerts_firing series, and so
                                of Prometheus' R3090dCriticalCondition, which the inhibit rule in
                                etc/alertmanager/alertmanager.yml matches on
                 severity       info | warning | critical
                 host           socket.gethostname()
                 gpu            "gpu0", or "gpu0 NVIDIA GeForce RTX 3090" once NVML has named the card
                                (absent with gpu.required = false)
                 unit_instance  N of r3090d@N (absent for the plain unit)
    annotations  summary        the alert's one-line summary, the latest
                 root_cause     what follows "root cause: " in a line of the alert's detail, else in
                                its summary, less the summary's own tail (see root_cause())
                 gpu_uuid       the GPU's UUID, once NVML has given it (absent with gpu.required = false):
                                an annotation, not a label, so that an alert raised before NVML
                                answered stays the same alert once the UUID is known
                 description    the alert's detail, when it has one
    startsAt     when the alert began firing: kept per key for the whole episode
    endsAt       by kind, below

Labels name an alert in Alertmanager, so they are fixed when an episode starts
(a GPU name learnt later would otherwise make a second alert) and the resolve
carries the same ones.

Kinds and their endsAt:

    condition  (kv_pressure, gpu_memory, gave_up, ...) firing: now + 4 x resend_interval,
               re-sent every resend_interval while it fires, whatever reminder_interval,
               min_interval or a local silence hold back on the other channels; if r3090d
               dies, Alertmanager resolves it by itself four intervals later. Resolved:
               endsAt = now.
    event      (engine_restarted, the test alert) sent once with endsAt = now + 5 min:
               "it happened in the last five minutes". Another one within that time has the
               same labels, so Alertmanager extends the one alert.
    exit       (preflight_failed; gave_up with daemon.exit_on_give_up) the daemon exits right
               after it, so nobody would re-send it: endsAt = now + 6 h, and the next start
               resolves it.
"""

from __future__ import annotations

import datetime as dt
import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from r3090d.effectors.alertformat import AlertContext, RaisedAlert, one_line

ENDS_AFTER_RESENDS = 4  # a firing alert's endsAt: this many resend intervals ahead
EVENT_TTL_S = 300.0
EXIT_TTL_S = 6 * 3600.0
MAX_LABEL = 1024
MAX_ANNOTATION = 4000

GAVE_UP = "gave_up"
PREFLIGHT_FAILED = "preflight_failed"
# One-shot keys: every Condition(..., event=True) in the package (a unit test keeps
# the two in step) and the CLI's test alert. A SendAlert does not say whether it is
# an event, and an event never resolves, so one missing here would be re-sent as a
# firing condition until sync() resolved it.
EVENT_KEYS = frozenset({
    "engine_restarted", "suspended_engine_lost", "sleep_failed", "test",
    "gpu_xid_application", "gpu_xid_row_remap", "gpu_xid_unknown",
    "wrong_output", "canary_start_mismatch", "canary_prompt_unusable",
})  # fmt: skip


class Kind(enum.StrEnum):
    CONDITION = "condition"
    EVENT = "event"
    EXIT = "exit"


class PostState(enum.StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


def model_key(key: str, model: str) -> str:
    """Swap mode's key of an engine's alert: its condition and its served model (split_key reads it back)."""
    return f"{key}:{model}"


def split_key(key: str) -> tuple[str, str | None]:
    """An alert's key as (the condition, the served model): swap mode keys an engine's alerts KEY:MODEL."""
    base, _, model = key.partition(":")
    return base, model or None


def kind_of(key: str, *, exit_on_give_up: bool) -> Kind:
    key, _ = split_key(key)
    if key in EVENT_KEYS:
        return Kind.EVENT
    if key == PREFLIGHT_FAILED or (key == GAVE_UP and exit_on_give_up):
        return Kind.EXIT
    return Kind.CONDITION


def firing_ttl(kind: Kind, resend_interval: float) -> float:
    """Seconds from a POST of a firing alert to its endsAt."""
    if kind is Kind.EVENT:
        return EVENT_TTL_S
    if kind is Kind.EXIT:
        return EXIT_TTL_S
    return ENDS_AFTER_RESENDS * resend_interval


# ------------------------------------------------------------ pure payloads


Pairs = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class AmAlert:
    """One alert as Alertmanager knows it: its identity (labels), text and start."""

    key: str
    kind: Kind
    labels: Pairs
    annotations: Pairs
    starts_at: float  # wall clock


@dataclass(frozen=True)
class AmPost:
    """One queued POST of one alert.

    endsAt is `ends_at` when set (a resolve, an event), else the time of the
    POST plus `ttl`, so that a POST retried a minute late still runs ahead.
    """

    alert: AmAlert
    state: PostState
    ends_at: float | None
    ttl: float
    generation: int = 0  # the table entry's, when posted: a late delivery of an older state changes nothing
    on_delivered: Callable[[str, AmPost], None] | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"{self.alert.key} {self.state.upper()} ({dict(self.alert.labels).get('severity', '?')})"

    @property
    def coalesce_key(self) -> str:
        return self.alert.key

    def delivered(self, channel: str) -> None:
        if self.on_delivered is not None:
            self.on_delivered(channel, self)


def rfc3339(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def body(post: AmPost, now: float) -> list[dict]:
    """The JSON list POSTed to /api/v2/alerts for `post`, sent at `now` (wall clock)."""
    a = post.alert
    ends = post.ends_at if post.ends_at is not None else now + post.ttl
    return [
        {
            "labels": dict(a.labels),
            "annotations": dict(a.annotations),
            "startsAt": rfc3339(min(a.starts_at, ends)),  # a start after the end is refused
            "endsAt": rfc3339(ends),
        }
    ]


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def gpu_label(context: AlertContext) -> str | None:
    if context.gpu_index is None:
        return None
    return f"gpu{context.gpu_index} {context.gpu_name}" if context.gpu_name else f"gpu{context.gpu_index}"


def alert_labels(key: str, severity: str, context: AlertContext) -> Pairs:
    """The labels, only those with a value (Alertmanager reads an empty label as absent anyway)."""
    base, model = split_key(key)
    pairs = (
        ("alertname", base),
        ("alert", key),
        ("served_model", model),
        ("severity", severity),
        ("host", context.hostname),
        ("gpu", gpu_label(context)),
        ("unit_instance", None if context.instance is None else str(context.instance)),
    )
    return tuple((name, clip(one_line(value), MAX_LABEL)) for name, value in pairs if value and one_line(value))


_CAUSE = "root cause: "
# What rules.py and policy.py write after the cause in a summary.
_SUMMARY_TAILS = (
    re.compile(r"; the engine stays stopped until r3090ctl restart$"),
    re.compile(r", next start in \d+ s$"),
)


def root_cause(summary: str, detail: str = "") -> str | None:
    """The root cause an alert names, or None.

    A detail line "root cause: X" wins. Else the summary's text after its first
    "root cause: ", less what the summaries append after it (gave_up's "; the
    engine stays stopped until r3090ctl restart", engine_restarted's ", next
    start in N s") and less the ")" that closes restart_storm's "(last: ...":
    a cause cut from inside brackets closes one more than it opens.
    """
    for line in detail.splitlines():
        text = line.strip()
        if text.lower().startswith(_CAUSE):
            return clip(one_line(text[len(_CAUSE) :]), MAX_ANNOTATION) or None
    at = summary.find(_CAUSE)
    if at < 0:
        return None
    cause = one_line(summary[at + len(_CAUSE) :])
    for tail in _SUMMARY_TAILS:
        cause = tail.sub("", cause)
    while cause.endswith(")") and cause.count(")") > cause.count("("):
        cause = cause[:-1].rstrip()
    return clip(cause, MAX_ANNOTATION) or None


def alert_annotations(summary: str, detail: str, context: AlertContext) -> Pairs:
    pairs = [("summary", clip(one_line(summary), MAX_ANNOTATION))]
    cause = root_cause(summary, detail)
    if cause:
        pairs.append(("root_cause", cause))
    if context.watched_gpu_uuid:
        pairs.append(("gpu_uuid", clip(one_line(context.watched_gpu_uuid), MAX_ANNOTATION)))
    if detail.strip():
        pairs.append(("description", clip(detail.strip(), MAX_ANNOTATION)))
    return tuple(pairs)


def one_off_post(raised: RaisedAlert) -> AmPost:
    """The POST of a single alert, outside any table: for `r3090ctl alerts test`."""
    a = raised.alert
    alert = AmAlert(
        a.key,
        Kind.EVENT,
        alert_labels(a.key, a.severity, raised.context),
        alert_annotations(a.summary, a.detail, raised.context),
        raised.raised_at,
    )
    if a.state == PostState.RESOLVED:
        return AmPost(alert, PostState.RESOLVED, raised.raised_at, 0.0)
    return AmPost(alert, PostState.FIRING, raised.raised_at + EVENT_TTL_S, EVENT_TTL_S)


def merge_text(annotations: Pairs, summary: str, context: AlertContext) -> Pairs:
    """New summary (and root cause) text and GPU UUID; a description from an earlier SendAlert stays."""
    kept = tuple((k, v) for k, v in annotations if k == "description")
    return alert_annotations(summary, "", context) + kept
