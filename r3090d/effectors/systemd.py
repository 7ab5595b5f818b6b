"""sd_notify: READY, STATUS, WATCHDOG, EXTEND_TIMEOUT_USEC, STOPPING.

A no-op without $NOTIFY_SOCKET, so the same daemon runs in a terminal. The
watchdog ping is sent from the main loop only: if the loop stalls, systemd must
notice, which a free-running thread would hide.
"""

from __future__ import annotations

import os

# Each EXTEND_TIMEOUT_USEC grants this much from the moment it is sent; the loop
# re-sends it every tick, so it only has to outlast a couple of ticks.
EXTEND_BY_S = 30.0


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = _notifier() if self.enabled else None
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        applies = not pid or pid == str(os.getpid())
        self.watchdog_interval_s = int(usec) / 1e6 if usec.isdigit() and applies else None
        self.ready_sent = False
        self._last_status = None

    def _send(self, text: str) -> None:
        if self._sd is not None:
            self._sd.notify(text)

    def ready(self, status: str) -> None:
        if not self.ready_sent:
            self._send(f"READY=1\nSTATUS={status}")
            self.ready_sent = True
            self._last_status = status

    def status(self, status: str) -> None:
        if status != self._last_status:
            self._send(f"STATUS={status}")
            self._last_status = status

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def extend_timeout(self, seconds: float = EXTEND_BY_S) -> None:
        self._send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def stopping(self, status: str = "stopping") -> None:
        self._send(f"STOPPING=1\nSTATUS={status}")

    def tick(self, status: str, *, active: bool, busy: bool) -> None:
        """Once per tick: READY=1 (once) when the unit should be active; before that, and
        while busy stopping or draining, extend systemd's timeout; then STATUS and the ping."""
        if active:
            self.ready(status)
        elif not self.ready_sent or busy:
            self.extend_timeout()
        self.status(status)
        self.watchdog()


def watchdog_warning(limit_s: float | None, worst_tick_s: float) -> str | None:
    """A warning when WatchdogSec= is too short for the longest tick this config allows."""
    if limit_s and worst_tick_s > limit_s / 2:
        return (f"WatchdogSec={limit_s:.0f} is short for this config: a tick can take {worst_tick_s:.1f} s (poll + health and "
                "metrics timeouts); raise WatchdogSec or lower watchdog.health_timeout/metrics_timeout")  # fmt: skip
    return None


def _notifier():
    # Imported only under a service manager: a container or a terminal needs no sd_notify.
    import sdnotify

    return sdnotify.SystemdNotifier()
