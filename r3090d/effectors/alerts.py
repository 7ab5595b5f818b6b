"""Alert delivery off the caller's thread: the dispatcher.

The policy decides *what* to send (dedup, hysteresis, reminders, rate limits);
this module only delivers `SendAlert` actions. `AlertDispatcher.submit()` never
blocks: it time-stamps the alert and appends it to one queue per channel. Each
channel has its own worker thread, so a hung SMTP server delays neither the
daemon's loop nor the syslog line. A worker retries a failed delivery with
capped exponential backoff and drops the alert only after the channel's
attempt limit, logging the drop on the "r3090d.alerts" logger.

What is sent is written by r3090d.effectors.alertformat; the syslog and SMTP
channels are r3090d.effectors.channels. Alertmanager
(r3090d.effectors.alertmanager) keeps a table of its own and re-sends firing
alerts on a timer; its queue holds one POST per alert key, the newest (see
`Deliverable.coalesce_key`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from r3090d.config import AlertsConfig, Config
from r3090d.core.actions import SendAlert
from r3090d.effectors.alertformat import AlertContext, RaisedAlert, alert_label, one_line
from r3090d.effectors.channels import build_channels, channel_kind
from r3090d.effectors.delivery import Channel, DeliveryError

if TYPE_CHECKING:  # at run time imported where used: it loads httpx, which only Alertmanager needs
    from r3090d.effectors.alertmanager import AlertmanagerFeed, Firing

log = logging.getLogger("r3090d.alerts")

DEFAULT_RETRY_INITIAL_S = 2.0
DEFAULT_RETRY_MAX_S = 120.0  # with the default 8 attempts: about four minutes of retrying
DEFAULT_QUEUE_LIMIT = 256


class Deliverable(Protocol):
    """What a channel's queue holds: a RaisedAlert, or an Alertmanager POST."""

    @property
    def label(self) -> str: ...  # for log lines: "gpu_memory FIRING (warning)"

    @property
    def coalesce_key(self) -> str | None: ...  # not None: a newer item with this key replaces this one

    def delivered(self, channel: str) -> None: ...  # called once the channel took it (no lock held)


def retry_delay(failed_attempts: int, initial: float, cap: float) -> float:
    """Seconds to wait after the Nth failed attempt: initial, 2x, 4x, ... capped."""
    return min(cap, initial * (2 ** max(0, failed_attempts - 1)))


# --------------------------------------------------------------- dispatcher


class _ChannelWorker:
    """One channel's queue and thread: in order, with retries, never raising.

    An item with a coalesce_key replaces the queued item with the same key (in
    its place in the queue), and a retry of such an item is abandoned once a
    newer one is queued: only the newest state of a key goes out, so an old
    FIRING cannot land after its RESOLVED.
    """

    def __init__(
        self,
        channel: Channel,
        stop: threading.Event,
        retry_initial: float,
        retry_max: float,
        queue_limit: int,
    ):
        self.channel = channel
        self._stop = stop
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._queue_limit = queue_limit
        self._cond = threading.Condition()
        self._pending: deque[Deliverable] = deque()
        self._busy = False
        self._closed = False
        self._failing: str | None = None  # the failure last logged at WARNING; None while healthy
        self.delivered = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"r3090d-alerts-{channel.name}", daemon=True)
        self._thread.start()

    def put(self, item: Deliverable) -> None:
        dropped: tuple[Deliverable, str] | None = None
        with self._cond:
            if self._closed:
                dropped = item, "the dispatcher is closed"
            elif (i := self._queued_at(item.coalesce_key)) is not None:
                self._pending[i] = item  # the newer state, where the older one waited
            else:
                if len(self._pending) >= self._queue_limit:
                    dropped = self._pending.popleft(), f"{self._queue_limit} alerts were already waiting"
                self._pending.append(item)
            self._cond.notify_all()
        if dropped is not None:
            self._log_drop(*dropped)  # logged outside the lock, as everything here

    def _queued_at(self, key: str | None) -> int | None:
        if key is not None:
            for i, queued in enumerate(self._pending):
                if queued.coalesce_key == key:
                    return i
        return None

    def _superseded(self, item: Deliverable) -> bool:
        """A newer item with the same key is queued (call with _cond held)."""
        return self._queued_at(item.coalesce_key) is not None

    def wait_idle(self, deadline: float) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._pending and not self._busy, timeout=max(0.0, deadline - time.monotonic())
            )

    def close(self, deadline: float) -> None:
        self.begin_close()
        self.finish_close(deadline)

    def begin_close(self) -> None:
        """Stop taking alerts, drop (and log) what waits, wake the thread."""
        with self._cond:
            self._closed = True
            left = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for item in left:
            self._log_drop(item, "the dispatcher closed before delivery")

    def finish_close(self, deadline: float) -> None:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("%s: still inside a delivery attempt at close; abandoning it", self.channel.name)
        try:
            self.channel.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: close failed: %s", self.channel.name, self.channel.redact(str(exc)))

    def status(self) -> dict:
        with self._cond:
            return {
                "target": self.channel.target,
                "pending": len(self._pending) + (1 if self._busy else 0),
                "delivered": self.delivered,
                "dropped": self.dropped,
                "failing": self._failing,
            }

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                item = self._pending.popleft()
                self._busy = True
            try:
                self._deliver(item)
            except Exception as exc:  # noqa: BLE001 -- a bug here must not kill the channel
                self._log_drop(item, f"internal error {type(exc).__name__}: {self.channel.redact(str(exc))}")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _deliver(self, raised: Deliverable) -> None:
        name, attempts = self.channel.name, self.channel.max_attempts
        payload = self.channel.prepare(raised)
        for attempt in range(1, attempts + 1):
            try:
                note = self.channel.deliver(payload)
            except DeliveryError as exc:
                reason = str(exc)
            except Exception as exc:  # noqa: BLE001
                reason = self.channel.redact(f"{type(exc).__name__}: {exc}")
            else:
                with self._cond:
                    self.delivered += 1
                if self._failing is not None:
                    log.info("%s delivery works again (%s)", name, self.channel.target)
                    self._failing = None
                if note:
                    log.warning("%s: alert %s: %s", name, raised.label, note)
                log.debug("%s: delivered alert %s (attempt %d)", name, raised.label, attempt)
                raised.delivered(name)  # outside _cond: the callee may queue more
                return
            last = attempt == attempts
            delay = 0.0 if last else retry_delay(attempt, self._retry_initial, self._retry_max)
            # One warning per distinct failure; repeats of the same outage go to debug.
            level = logging.WARNING if reason != self._failing else logging.DEBUG
            self._failing = reason
            then = "giving up" if last else f"retrying in {delay:g} s"
            log.log(
                level,
                "%s: alert %s: attempt %d of %d failed: %s; %s",
                name,
                raised.label,
                attempt,
                attempts,
                reason,
                then,
            )
            # Nothing is logged with _cond held: a slow log sink must not stall put(), and so submit().
            with self._cond:
                if not last:
                    # The backoff ends early when a newer state of the same key arrives: that one goes instead.
                    self._cond.wait_for(
                        lambda: self._closed or self._stop.is_set() or self._superseded(raised), timeout=delay
                    )
                closing = not last and (self._closed or self._stop.is_set())
                superseded = self._superseded(raised)
            if closing:
                self._log_drop(raised, f"the dispatcher closed while waiting to retry (last error: {reason})")
                return
            if superseded:
                log.debug("%s: alert %s: a newer state is queued instead", name, raised.label)
                return
            if last:
                self._log_drop(raised, f"{attempts} attempts failed, last: {reason}")
                return

    def _log_drop(self, item: Deliverable, why: str) -> None:
        with self._cond:
            self.dropped += 1
        log.error("%s: dropped alert %s: %s", self.channel.name, item.label, why)


class AlertDispatcher:
    """Delivers SendAlert actions to every enabled channel without blocking the caller.

    Daemon use:
        dispatcher = AlertDispatcher.from_config(cfg)      # ConfigError -> exit 78
        dispatcher.submit(action)                          # for each SendAlert; returns at once
        dispatcher.sync(book.firing(), wall_offset=off)    # each tick: what fires, sent or held back
        dispatcher.set_gpu(sample.name, sample.index, sample.uuid)  # on a usable GPU sample
        dispatcher.flush(timeout=30)                       # before exiting, so the last alert goes out
        dispatcher.close()

    state_dir (from_config: daemon.state_dir) is where the Alertmanager channel
    keeps the alerts it must resolve at the next start; exit_on_give_up
    (daemon.exit_on_give_up) makes gave_up one of them.
    """

    def __init__(
        self,
        cfg: AlertsConfig,
        context: AlertContext,
        *,
        source: str = "<config>",
        environ: Mapping[str, str] | None = None,
        retry_initial: float = DEFAULT_RETRY_INITIAL_S,
        retry_max: float = DEFAULT_RETRY_MAX_S,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        clock=time.time,
        state_dir: Path | str | None = None,
        exit_on_give_up: bool = False,
    ):
        channels = build_channels(cfg, hostname=context.hostname, source=source, environ=environ)
        self._context = context
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._workers = [
            _ChannelWorker(ch, self._stop, retry_initial, retry_max, queue_limit) for ch in channels
        ]
        # Alertmanager's queues are fed by its table, not by submit() directly.
        am_workers = [w for w in self._workers if channel_kind(w.channel) == "alertmanager"]
        self._direct = [w for w in self._workers if w not in am_workers]
        self._feed: AlertmanagerFeed | None = None
        if am_workers:
            from r3090d.effectors.alertmanager import AlertmanagerFeed

            self._feed = AlertmanagerFeed(
                cfg.alertmanager,
                am_workers,
                state_dir=Path(state_dir) if state_dir is not None else None,
                exit_on_give_up=exit_on_give_up,
                clock=clock,
            )
        if not channels:
            log.info("no alert channel is enabled: alerts are logged only")

    @classmethod
    def from_config(cls, cfg: Config, *, gpu_name: str | None = None, **kwargs) -> AlertDispatcher:
        kwargs.setdefault("state_dir", cfg.daemon.state_dir)
        kwargs.setdefault("exit_on_give_up", cfg.daemon.exit_on_give_up)
        return cls(cfg.alerts, AlertContext.from_config(cfg, gpu_name=gpu_name), source=cfg.source, **kwargs)

    @property
    def channels(self) -> list[str]:
        return [w.channel.name for w in self._workers]

    @property
    def context(self) -> AlertContext:
        return self._context

    def set_gpu(self, name: str | None, index: int | None, uuid: str | None) -> bool:
        """Name the GPU in every alert raised from now on; True if that changed anything.

        Cheap and idempotent: the daemon may call it with every usable sample, so a
        card that comes back under another name or UUID is named right.
        """
        with self._lock:
            context = self._context.with_gpu(name, index, uuid)
            if context == self._context:
                return False
            self._context = context  # submit() reads the reference once per alert
        log.info(
            "alerts name the GPU: %s %s", context.gpu_label, context.gpu_identity or "(no name or UUID known)"
        )
        return True

    def submit(self, alert: SendAlert) -> None:
        """Queue the alert on every channel and return at once. Never raises for delivery problems."""
        if not isinstance(alert, SendAlert):
            raise TypeError(f"submit() takes a SendAlert, not {type(alert).__name__}")
        raised = RaisedAlert(alert, self._context, self._clock())
        log.info("alert %s: %s", alert_label(raised), one_line(alert.summary))
        for worker in self._direct:
            worker.put(raised)
        if self._feed is not None:
            self._feed.on_alert(raised)

    def sync(self, firing: Mapping[str, Firing], *, wall_offset: float = 0.0) -> None:
        """Tell Alertmanager what fires now, including what the lifecycle holds back.

        `firing` is the lifecycle's AlertBook.firing(): key -> entry with
        severity, summary and since (the loop's monotonic clock; wall_offset
        turns it into wall time). A FIRING held back by min_interval or a
        silence still reaches Alertmanager this way, and a key that left the
        table is resolved there. Cheap; a no-op without Alertmanager.
        """
        if self._feed is not None:
            self._feed.sync(firing, self._context, wall_offset=wall_offset)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued alert is delivered or dropped; False if the timeout came first."""
        deadline = time.monotonic() + max(0.0, timeout)
        saved = self._feed.flush(deadline) if self._feed is not None else True
        return all([w.wait_idle(deadline) for w in self._workers]) and saved

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers: pending alerts are dropped (and logged). Call flush() first to deliver them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        deadline = time.monotonic() + max(0.0, timeout)
        if self._feed is not None:
            self._feed.close()  # no more re-sends; what it must persist, flush() saved
        for worker in self._workers:
            worker.begin_close()  # every thread woken at once, then joined
        for worker in self._workers:
            worker.finish_close(deadline)

    def status(self) -> dict[str, dict]:
        """Per channel: target, pending, delivered, dropped, and the current failure (None when healthy)."""
        return {w.channel.name: w.status() for w in self._workers}

    def __enter__(self) -> AlertDispatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
