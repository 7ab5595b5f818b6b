"""Alerts from the running daemon: a real SMTP server, a real syslog socket, a card faked at NVML.

The GPU is the only fake (this machine has none): tests/fakenvml stands in for
pynvml, reading what the card reports from a JSON file the test rewrites.
"""

from __future__ import annotations

import json
import os
import socket
import time
from email import message_from_bytes
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller

from tests.daemon_harness import DaemonProcess, engine_config, free_port, write_config
from tests.silent_server import SilentServer
from tests.waiting import wait_until

pytestmark = pytest.mark.component

FAKE_NVML = Path(__file__).resolve().parents[1] / "fakenvml"
POLL = 1.0


class Inbox:
    def __init__(self):
        self.messages = []

    async def handle_DATA(self, server, session, envelope):
        self.messages.append((list(envelope.rcpt_tos), message_from_bytes(envelope.content)))
        return "250 OK"


def syslog_socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(0.2)
    return s


def drain_syslog(s: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(s.recv(65536).decode())
        except (TimeoutError, BlockingIOError):
            return out


def test_memory_alert_by_email_and_syslog_and_smtp_hang_never_stalls_the_loop(tmp_path, fake_engine_python):
    card = tmp_path / "card.json"
    card.write_text(json.dumps({"memory_used_mib": 1000}))
    smtp_port = free_port()
    inbox = Inbox()
    smtp = Controller(inbox, hostname="127.0.0.1", port=smtp_port)
    smtp.start()
    log_sock = syslog_socket(tmp_path / "log.sock")
    sections = engine_config(
        tmp_path,
        fake_engine_python,
        watchdog={"poll_interval": POLL, "gpu_memory_alert_mib": 2000, "probe_idle_seconds": 600},
        alerts={"hysteresis_polls": 1, "min_interval": 0.0},
    )
    sections["gpu"] = {"required": True, "card": "any"}
    sections["alerts.syslog"] = {"enabled": True, "address": str(tmp_path / "log.sock"), "facility": "daemon", "ident": "r3090d-test"}
    sections["alerts.email"] = {
        "enabled": True,
        "smtp_host": "127.0.0.1",
        "smtp_port": smtp_port,
        "security": "none",
        "recipients": ["ops@example.org", "oncall@example.org"],
        "sender": "r3090d@example.org",
        "timeout": 3.0,
    }
    config = write_config(tmp_path / "r3090d.toml", sections)
    env_extra = {"PYTHONPATH": str(FAKE_NVML), "R3090D_FAKE_NVML": str(card)}
    d = DaemonProcess(config, tmp_path / "daemon.log", "--skip-preflight")
    old = {k: os.environ.get(k) for k in env_extra}
    os.environ.update(env_extra)
    try:
        d.start()
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    hanging = None
    try:
        d.wait_ready()
        assert d.state()["gpu"]["name"] == "NVIDIA GeForce RTX 3090"
        drain_syslog(log_sock)

        # 1. Memory above the threshold: the alert reaches both channels.
        card.write_text(json.dumps({"memory_used_mib": 2500}))
        wait_until(lambda: inbox.messages, 20, what="the FIRING email", details=lambda: d.log()[-3000:])
        rcpts, msg = inbox.messages[0]
        assert sorted(rcpts) == ["oncall@example.org", "ops@example.org"]
        subject = msg["Subject"]
        host = socket.gethostname()
        assert host in subject and "gpu0" in subject and "gpu_memory" in subject and "FIRING" in subject
        body = msg.get_payload(decode=True).decode()
        assert "GPU memory used 2500 MiB (alert above 2000 MiB)" in body
        lines = [line for line in drain_syslog(log_sock) if "gpu_memory" in line]
        assert lines, "no syslog line for gpu_memory"
        assert lines[0].startswith("<28>")  # facility daemon (3) * 8 + warning (4)
        assert "r3090d-test[" in lines[0]

        # 2. The SMTP server hangs for 30 s while the alert resolves: the loop keeps its pace.
        smtp.stop()
        hanging = SilentServer(smtp_port)
        card.write_text(json.dumps({"memory_used_mib": 500}))
        ticks = []
        t_end = time.monotonic() + 30.0
        last = None
        while time.monotonic() < t_end:
            st = d.state()
            if st and st["written_at"] != last:
                last = st["written_at"]
                ticks.append(last)
            time.sleep(0.02)
        gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
        print(f"ticks during the SMTP hang: {len(ticks)}, max gap {max(gaps):.3f} s (poll {POLL} s)")
        assert len(ticks) >= 30 / POLL * 0.8
        assert max(gaps) <= 2 * POLL, max(gaps)
        assert any("RESOLVED" in line.upper() and "gpu_memory" in line for line in drain_syslog(log_sock))  # syslog was not held back
        assert len(inbox.messages) == 1

        # 3. The server comes back: the queued resolve notice arrives.
        hanging.close()
        hanging = None
        smtp = Controller(inbox, hostname="127.0.0.1", port=smtp_port)
        smtp.start()
        wait_until(
            lambda: len(inbox.messages) >= 2, 60, what="the RESOLVED email", details=lambda: d.log()[-3000:]
        )
        assert "RESOLVED" in inbox.messages[1][1]["Subject"]
        assert "GPU memory used 500 MiB" in inbox.messages[1][1].get_payload(decode=True).decode()
    finally:
        if hanging is not None:
            hanging.close()
        d.cleanup()
        smtp.stop()
        log_sock.close()
