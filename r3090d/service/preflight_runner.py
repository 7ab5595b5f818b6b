"""Preflight before the first start: check, wait out what is transient, or fail.

A permanent failure exits 69 (systemd leaves it alone); a transient one (port
busy, VRAM short with no process to name) is re-checked every
preflight.transient_retry_s until preflight.transient_give_up_s, then exits 75
so systemd tries again later. While it waits, the state file says what for, so
`r3090ctl status` can tell the operator. A card held by other processes is only
a warning here: the daemon goes up (READY=1) and the engine's first start waits
for the holders in waiting-for-gpu, naming them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from r3090d import exitcodes
from r3090d.atomicfile import write_json_atomic
from r3090d.config import Config
from r3090d.core.actions import SendAlert
from r3090d.core.snapshot import GpuStatus
from r3090d.core.vocabulary import AlertState, Severity
from r3090d.preflight import checks, gather
from r3090d.service.report import preflight_report
from r3090d.service.state import read_json
from r3090d.service.statedoc import DaemonIdentity, PreflightSummary, UnreadableFormat, parse

log = logging.getLogger("r3090d")


class PreflightRunner:
    def __init__(self, cfg: Config, *, identity: DaemonIdentity, state_path: Path, gpu_monitor, notifier, alerts,
                 wait: Callable[[float], bool]):  # fmt: skip
        self.cfg = cfg
        self.identity = identity
        self.state_path = state_path
        self.gpu_monitor = gpu_monitor
        self.notifier = notifier
        self.alerts = alerts
        self.wait = wait  # sleeps up to N s, handling signals; True when a shutdown was asked for
        self.summary: PreflightSummary | None = None

    def run(self) -> int | None:
        """None to go on and start the engine, else the exit code."""
        pf = self.cfg.preflight
        deadline = time.monotonic() + pf.transient_give_up_s
        while True:
            results = self._check()
            permanent = checks.failures(results, permanent=True)
            transient = checks.failures(results, permanent=False)
            if permanent:
                return self._failed(permanent, exitcodes.PREFLIGHT_PERMANENT)
            if not transient:
                log.info("preflight passed (%d checks)", len(results))
                return None
            if time.monotonic() >= deadline:
                return self._failed(transient, exitcodes.TEMPFAIL)
            what = "; ".join(f"{r.name}: {r.measured}" for r in transient)
            self._write(waiting=what)
            self.notifier.status(f"waiting for preflight: {what}")
            self.notifier.extend_timeout(pf.transient_retry_s + 30)
            log.info("preflight: waiting for %s; re-checking in %.0f s", what, pf.transient_retry_s)
            if self.wait(pf.transient_retry_s):
                return exitcodes.OK

    def _check(self) -> list:
        gpu = self.gpu_monitor.latest(time.monotonic()) if self.gpu_monitor else None
        if gpu is not None and gpu.status is GpuStatus.PENDING:
            gpu = None  # no reading from the worker yet: take one of its own
        results = gather.run(self.cfg, (), gpu=gpu)
        self.summary = PreflightSummary(exit_code=checks.exit_code(results), checks=tuple(results), at=time.time())
        for r in results:
            if r.status in (checks.Status.WARN, checks.Status.FAIL):
                log.warning("preflight %s %s: %s (expected %s)%s", r.name, r.status.value.upper(), r.measured, r.expected, f"; {r.hint}" if r.hint else "")
        return results

    def _failed(self, failed, code: int) -> int:
        text = "; ".join(f"{r.name}: {r.measured} (expected {r.expected}){' - ' + r.hint if r.hint else ''}" for r in failed)
        log.error("preflight failed, not starting vLLM: %s (exit %d)", text, code)
        if self.alerts is not None:
            self.alerts.submit(SendAlert(key="preflight_failed", severity=Severity.CRITICAL, state=AlertState.FIRING, summary=f"preflight failed: {text}"))
        self._write()
        return code

    def _write(self, waiting: str | None = None) -> None:
        """Leave the verdict where `r3090ctl status` looks, though the loop has not run:
        what preflight waits for (re-written at each re-check), or why it failed."""
        try:
            previous = parse(read_json(self.state_path) or {})
        except UnreadableFormat:
            previous = None  # a newer daemon's document: its alert book cannot be read either
        doc = preflight_report(previous, self.cfg, identity=self.identity, summary=self.summary, waiting=waiting, written_at=time.time())
        try:
            write_json_atomic(self.state_path, doc.to_json())
        except OSError as exc:
            log.error("cannot write %s: %s", self.state_path, exc)
