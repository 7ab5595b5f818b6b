"""Alertmanager delivery: the channel, its table of what Alertmanager should know, and its file.

What each alert looks like (labels, annotations, startsAt and endsAt by kind)
is r3090d.effectors.alertmanager_payload.

The channel's own table (AlertmanagerFeed) holds what Alertmanager should
know: every alert firing, and every resolve not yet delivered to each URL. It
is fed by submit() (the lifecycle's SendAlert actions) and by sync() (the
lifecycle's table of what fires, sent or held back), and a timer thread
re-sends it. It is kept in `state_dir/alertmanager.json` (written atomically,
off the caller's thread), so the next start resolves an exit alert left
firing, and keeps the labels and start of a condition that still fires.

Delivery goes through the dispatcher's queues, one per URL: retries with
backoff, secrets scrubbed from every logged error, and at most one POST per
alert key in a queue (a newer state replaces a queued older one, and a retry
in backoff is abandoned once a newer one is queued), so an old FIRING never
lands after its RESOLVED.
"""

from __future__ import annotations

import enum
import json
import logging
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import httpx

from r3090d import __version__
from r3090d.atomicfile import write_text_atomic
from r3090d.config import AlertmanagerConfig, ConfigError, alertmanager_url_problem, read_secret
from r3090d.effectors.alertformat import AlertContext, RaisedAlert, one_line
from r3090d.effectors.alertmanager_payload import (
    AmAlert,
    AmPost,
    Kind,
    PostState,
    alert_annotations,
    alert_labels,
    body,
    clip,
    firing_ttl,
    kind_of,
    merge_text,
    one_off_post,
)
from r3090d.effectors.delivery import DeliveryError

log = logging.getLogger("r3090d.alerts")

API_PATH = "/api/v2/alerts"
# Retries span about four minutes (with the dispatcher's default backoff), longer
# than a resend interval: a re-send replaces a failing POST before it is dropped.
MAX_ATTEMPTS = 8
STATE_FILE = "alertmanager.json"
STATE_FORMAT = 1


class Phase(enum.StrEnum):
    """An entry of the feed's table."""

    FIRING = "firing"  # re-sent every resend_interval
    ADOPTED = "adopted"  # firing when the last run ended: kept, re-sent once the lifecycle says it still fires
    RESOLVING = "resolving"  # its resolve is re-sent until every URL took it


# ------------------------------------------------------------------ channel


def read_bearer_token(cfg: AlertmanagerConfig, source: str = "<config>") -> str | None:
    """The token, or None when no file is set. Raises ConfigError naming the file, never the text."""
    if not cfg.bearer_token_file:
        return None
    key, path = "alerts.alertmanager.bearer_token_file", cfg.bearer_token_file
    token = read_secret(source, key, path).strip()
    if not token:
        raise ConfigError(source, key, f"{path} is empty", "write the token into it")
    if not token.isprintable():
        raise ConfigError(
            source, key, f"{path} holds more than the token (several lines or control characters)", "keep only the token in it"
        )
    return token


class AlertmanagerChannel:
    """One Alertmanager URL: a dispatcher channel whose queue holds AmPosts."""

    max_attempts = MAX_ATTEMPTS

    def __init__(self, url: str, *, name: str, token: str | None, timeout: float, clock=time.time):
        self.name = name
        self.url = url
        self.target = url
        self._endpoint = url + API_PATH
        self._token = token
        self._timeout = timeout
        self._clock = clock
        # Made here, on the caller's thread at start: loading a CA store holds the
        # GIL for tens of milliseconds, which in the worker would stall submit().
        self._client: httpx.Client | None = self._new_client()

    def __repr__(self) -> str:
        return f"AlertmanagerChannel({self.target})"

    def prepare(self, item: AmPost | RaisedAlert) -> AmPost:
        return one_off_post(item) if isinstance(item, RaisedAlert) else item

    def deliver(self, post: AmPost) -> str:
        headers = {"Content-Type": "application/json", "User-Agent": f"r3090d/{__version__}"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        content = json.dumps(body(post, self._clock())).encode("utf-8")
        try:
            response = self._http().post(self._endpoint, content=content, headers=headers)
        except httpx.TimeoutException:
            raise DeliveryError(f"{self.target}: no answer within {self._timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise DeliveryError(self.redact(f"{self.target}: {one_line(str(exc)) or type(exc).__name__}")) from None
        if not 200 <= response.status_code < 300:
            text = clip(one_line(response.text), 300)
            raise DeliveryError(self.redact(f"{self.target}: HTTP {response.status_code}" + (f": {text}" if text else "")))
        return ""

    def _http(self) -> httpx.Client:
        if self._client is None:  # closed, then used again
            self._client = self._new_client()
        return self._client

    def _new_client(self) -> httpx.Client:
        # https: the system's CA store (not certifi's), so a site CA works. No proxy
        # from the environment: alerts go where the config says.
        verify: ssl.SSLContext | bool = ssl.create_default_context() if self.url.startswith("https:") else False
        return httpx.Client(timeout=httpx.Timeout(self._timeout), verify=verify, trust_env=False, follow_redirects=False)

    def redact(self, text: str) -> str:
        return text.replace(self._token, "<redacted>") if self._token else text

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def build_channels(cfg: AlertmanagerConfig, source: str = "<config>") -> list[AlertmanagerChannel]:
    """One channel per URL ("alertmanager", or "alertmanager[0]", "alertmanager[1]" ...). Raises ConfigError."""
    key = "alerts.alertmanager.url"
    urls = cfg.urls
    if not urls:
        raise ConfigError(source, key, "no Alertmanager URL is set", 'set url = "http://alertmanager.example.org:9093"')
    for url in urls:
        problem = alertmanager_url_problem(url)
        if problem:
            raise ConfigError(source, key, problem, 'write a base URL such as "http://alertmanager.example.org:9093"')
    token = read_bearer_token(cfg, source)
    names = ["alertmanager"] if len(urls) == 1 else [f"alertmanager[{i}]" for i in range(len(urls))]
    return [AlertmanagerChannel(u, name=n, token=token, timeout=cfg.timeout) for u, n in zip(urls, names, strict=True)]


# --------------------------------------------------------------------- feed


class Firing(Protocol):
    """A firing entry of the lifecycle's AlertBook (alerting.AlertEntry), as sync() reads it."""

    @property
    def severity(self) -> str: ...

    @property
    def summary(self) -> str: ...

    @property
    def since(self) -> float | None: ...  # the loop's monotonic clock


class _Queue(Protocol):
    """A channel's queue (the dispatcher's worker)."""

    @property
    def channel(self) -> AlertmanagerChannel: ...

    def put(self, item: AmPost) -> None: ...


@dataclass(frozen=True)
class Entry:
    alert: AmAlert
    phase: Phase
    generation: int
    resolved_at: float | None = None
    unresolved: frozenset[str] = frozenset()  # RESOLVING: the channels not yet told
    forget_at: float | None = None  # RESOLVING, ADOPTED: Alertmanager has let it expire by then


class AlertmanagerFeed:
    """The table of what Alertmanager should know, its re-sends, and its file."""

    def __init__(
        self,
        cfg: AlertmanagerConfig,
        queues: Iterable[_Queue],
        *,
        state_dir: Path | None,
        exit_on_give_up: bool,
        clock=time.time,
    ):
        self._resend = cfg.resend_interval
        self._queues = list(queues)
        self._names = frozenset(q.channel.name for q in self._queues)
        self._path = state_dir / STATE_FILE if state_dir is not None else None
        self._exit_on_give_up = exit_on_give_up
        self._clock = clock
        self._cond = threading.Condition()
        self._entries: dict[str, Entry] = {}
        self._generation = 0
        self._dirty = False
        self._writing = False
        self._write_failure: str | None = None
        self._closed = False
        with self._cond:
            self._load()
        self._thread = threading.Thread(target=self._run, name="r3090d-alerts-alertmanager", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ input

    def on_alert(self, raised: RaisedAlert) -> None:
        """A SendAlert from the lifecycle (or the daemon): update the table and POST at once."""
        a, now = raised.alert, raised.raised_at
        kind = kind_of(a.key, exit_on_give_up=self._exit_on_give_up)
        with self._cond:
            if self._closed:
                return
            if kind is Kind.EVENT:
                self._put(one_off_post(raised))
            elif a.state == PostState.RESOLVED:
                self._resolve(a.key, kind, now, raised.context, a.severity, alert_annotations(a.summary, a.detail, raised.context))
            else:
                self._fire(a.key, kind, now, raised.context, a.severity, alert_annotations(a.summary, a.detail, raised.context), post=True)

    def sync(self, firing: Mapping[str, Firing], context: AlertContext, *, wall_offset: float = 0.0) -> None:
        """The lifecycle's table of what fires: start what is new, resolve conditions no longer in it."""
        now = self._clock()
        with self._cond:
            if self._closed:
                return
            for key, e in firing.items():
                kind = kind_of(key, exit_on_give_up=self._exit_on_give_up)
                if kind is Kind.EVENT:
                    continue
                since = e.since + wall_offset if e.since is not None else now
                entry = self._entries.get(key)
                fresh = entry is None or entry.phase is not Phase.FIRING
                annotations = merge_text(entry.alert.annotations if entry else (), e.summary, context)
                self._fire(key, kind, since, context, e.severity, annotations, post=fresh)
            for key, entry in list(self._entries.items()):
                gone = key not in firing and entry.phase in (Phase.FIRING, Phase.ADOPTED)
                # An exit alert is never in the lifecycle's table (preflight_failed) or
                # leaves it only with the process; the next start resolves it.
                if gone and entry.alert.kind is Kind.CONDITION:
                    self._resolve(key, entry.alert.kind, now, context, "", entry.alert.annotations)

    # ------------------------------------------------------ transitions

    def _fire(self, key, kind, since, context, severity, annotations, *, post: bool) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.phase in (Phase.FIRING, Phase.ADOPTED):
            # Same episode: labels and start stay, the text is the newest.
            new = replace(entry, alert=replace(entry.alert, kind=kind, annotations=annotations), phase=Phase.FIRING, forget_at=None)
        else:
            alert = AmAlert(key, kind, alert_labels(key, severity, context), annotations, since)
            new = Entry(alert, Phase.FIRING, self._next_generation())
        if entry is None or entry.phase is not Phase.FIRING or entry.alert.kind is not kind:
            self._dirty = True
            self._cond.notify_all()
        self._entries[key] = new
        if post:
            self._put(self._firing_post(new))

    def _resolve(self, key, kind, now, context, severity, annotations) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            alert = replace(entry.alert, annotations=annotations)
        else:
            # Not in the table (Alertmanager enabled by a reload, a lost file): resolve
            # what the labels would be now; resolving what is not there is harmless.
            alert = AmAlert(key, kind, alert_labels(key, severity, context), annotations, now)
        new = Entry(
            alert,
            Phase.RESOLVING,
            self._next_generation(),
            resolved_at=now,
            unresolved=self._names,
            forget_at=now + firing_ttl(alert.kind, self._resend),
        )
        self._entries[key] = new
        self._dirty = True
        self._cond.notify_all()
        self._put(self._resolve_post(new), self._names)

    def _firing_post(self, entry: Entry) -> AmPost:
        return AmPost(entry.alert, PostState.FIRING, None, firing_ttl(entry.alert.kind, self._resend), entry.generation)

    def _resolve_post(self, entry: Entry) -> AmPost:
        return AmPost(entry.alert, PostState.RESOLVED, entry.resolved_at, 0.0, entry.generation, self._delivered)

    def _put(self, post: AmPost, names: frozenset[str] | None = None) -> None:
        # Called with _cond held, so the queues see each key's states in the table's order.
        for queue in self._queues:
            if names is None or queue.channel.name in names:
                queue.put(post)

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def _delivered(self, channel: str, post: AmPost) -> None:
        """A worker delivered a resolve: once every URL has it, the entry goes."""
        with self._cond:
            entry = self._entries.get(post.alert.key)
            if entry is None or entry.generation != post.generation or entry.phase is not Phase.RESOLVING:
                return  # a newer state took over
            left = entry.unresolved - {channel}
            if left:
                self._entries[post.alert.key] = replace(entry, unresolved=left)
                return
            del self._entries[post.alert.key]
            if not self._closed:
                self._dirty = True
                self._cond.notify_all()

    # ------------------------------------------------------------ timer

    def _run(self) -> None:
        due = time.monotonic() + self._resend
        while True:
            snapshot = None
            with self._cond:
                self._cond.wait_for(
                    lambda due=due: self._closed or self._dirty or time.monotonic() >= due,
                    timeout=max(0.0, due - time.monotonic()),
                )
                if self._closed:
                    return
                if time.monotonic() >= due:
                    due = max(due + self._resend, time.monotonic())
                    self._resend_all()
                if self._dirty:
                    snapshot, self._dirty, self._writing = self._to_json(), False, True
            if snapshot is not None:
                try:
                    self._save(snapshot)
                finally:
                    with self._cond:
                        self._writing = False
                        self._cond.notify_all()

    def _resend_all(self) -> None:
        now = self._clock()
        for key, entry in list(self._entries.items()):
            if entry.phase is Phase.FIRING:
                self._put(self._firing_post(entry))
            elif entry.forget_at is not None and now >= entry.forget_at:
                del self._entries[key]  # expired in Alertmanager by now, resolved or not
                self._dirty = True
            elif entry.phase is Phase.RESOLVING and entry.unresolved:
                self._put(self._resolve_post(entry), entry.unresolved)

    def flush(self, deadline: float) -> bool:
        """Wait until the table is on disk (a no-op without a state dir); False if the deadline came first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or not (self._dirty or self._writing),
                timeout=max(0.0, deadline - time.monotonic()),
            )

    def close(self) -> None:
        """Stop re-sending. Nothing is written after this: a successor (a reload) owns the file."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5.0)

    def table(self) -> dict[str, Phase]:
        """Each key's phase, for status and tests."""
        with self._cond:
            return {key: entry.phase for key, entry in self._entries.items()}

    # ------------------------------------------------------- persistence

    def _to_json(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "written_at": self._clock(),
            "alerts": [
                {
                    "key": key,
                    "kind": entry.alert.kind.value,
                    "phase": entry.phase.value,
                    "labels": dict(entry.alert.labels),
                    "annotations": dict(entry.alert.annotations),
                    "starts_at": entry.alert.starts_at,
                    "resolved_at": entry.resolved_at,
                }
                for key, entry in sorted(self._entries.items())
            ],
        }

    def _save(self, doc: dict) -> None:
        if self._path is None:
            return
        try:
            if not self._path.parent.is_dir():
                raise FileNotFoundError(f"{self._path.parent} does not exist")
            write_text_atomic(self._path, json.dumps(doc, indent=1) + "\n", durable=True)  # labels keep their order; the next start reads it
        except OSError as exc:
            reason = f"cannot write {self._path}: {exc.strerror or exc}"
            if reason != self._write_failure:  # one warning per distinct failure
                log.warning("alertmanager: %s; an alert left firing at exit will expire on its own", reason)
            self._write_failure = reason
        else:
            self._write_failure = None

    def _load(self) -> None:
        """The last run's table: resolve its exit alerts, adopt its conditions until the lifecycle speaks."""
        if self._path is None:
            return
        try:
            text = self._path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("alertmanager: cannot read %s (%s); starting with an empty table", self._path, exc)
            return
        try:
            saved = parse_state(text)
        except ValueError as exc:
            log.warning("alertmanager: ignoring %s: %s", self._path, exc)
            return
        now = self._clock()
        for s in saved:
            if s.phase is Phase.RESOLVING or s.alert.kind is not Kind.CONDITION:
                if s.phase is not Phase.RESOLVING:
                    log.info("alertmanager: resolving %s, left firing by the last run", s.alert.key)
                resolved_at = s.resolved_at if s.resolved_at is not None else now
                entry = Entry(
                    s.alert,
                    Phase.RESOLVING,
                    self._next_generation(),
                    resolved_at=resolved_at,
                    unresolved=self._names,
                    forget_at=now + firing_ttl(s.alert.kind, self._resend),
                )
                self._entries[s.alert.key] = entry
                self._put(self._resolve_post(entry), self._names)
            else:
                forget_at = now + firing_ttl(s.alert.kind, self._resend)
                self._entries[s.alert.key] = Entry(s.alert, Phase.ADOPTED, self._next_generation(), forget_at=forget_at)
        self._dirty = bool(saved)


@dataclass(frozen=True)
class SavedEntry:
    alert: AmAlert
    phase: Phase
    resolved_at: float | None


def parse_state(text: str) -> list[SavedEntry]:
    """alertmanager.json's entries. Raises ValueError (one line) for anything this version did not write."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or not isinstance(doc.get("alerts"), list):
        raise ValueError(f"not an r3090d Alertmanager table of format {STATE_FORMAT}")
    out = []
    for i, item in enumerate(doc["alerts"]):
        try:
            labels, annotations = item["labels"], item["annotations"]
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in {**labels, **annotations}.items()):
                raise TypeError("labels and annotations must map strings to strings")
            starts = float(item["starts_at"])
            resolved = item["resolved_at"]
            alert = AmAlert(
                str(item["key"]),
                Kind(item["kind"]),
                tuple(labels.items()),
                tuple(annotations.items()),
                starts,
            )
            out.append(SavedEntry(alert, Phase(item["phase"]), None if resolved is None else float(resolved)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"alerts[{i}] is malformed ({type(exc).__name__}: {exc})") from None
    return out


