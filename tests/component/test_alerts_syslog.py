"""Syslog delivery into real sockets: a unix datagram socket (as /dev/log is) and UDP."""

from __future__ import annotations

import logging
import os
import re
import socket
import time

import pytest

from r3090d.config import AlertsConfig, Config, EmailConfig, GpuConfig, SyslogConfig
from r3090d.core.actions import SendAlert
from r3090d.effectors.alertformat import MAX_SYSLOG_TEXT, AlertContext
from r3090d.effectors.alerts import AlertDispatcher
from tests.daemon_harness import bind_unix_dgram

pytestmark = pytest.mark.component

CTX = AlertContext(hostname="box", gpu_index=0)  # the name and UUID come later, by set_gpu (tested below)
LINE = re.compile(rb"^<(\d{1,3})>([A-Za-z0-9._-]+)\[(\d+)\]: (.*)$", re.S)
LOCAL3 = 19


def receive(sock: socket.socket, n: int) -> list[bytes]:
    return [sock.recv(65536) for _ in range(n)]


def parse(datagram: bytes) -> tuple[int, int, str, int, str]:
    m = LINE.match(datagram)
    assert m, f"not <PRI>ident[pid]: message: {datagram!r}"
    pri = int(m.group(1))
    return pri // 8, pri % 8, m.group(2).decode(), int(m.group(3)), m.group(4).decode()


def syslog_only(address: str, facility="local3", ident="r3090d-test") -> AlertsConfig:
    return AlertsConfig(
        syslog=SyslogConfig(enabled=True, address=address, facility=facility, ident=ident),
        email=EmailConfig(enabled=False),
    )


def test_lines_carry_facility_severity_ident_and_pid(sockdir):
    path = sockdir / "syslog.sock"
    receiver = bind_unix_dgram(path)
    sent = [
        SendAlert("gpu_lost", "critical", "firing", "GPU fell off the bus"),
        SendAlert("gpu_memory", "warning", "reminder", "used 23.6 GiB"),
        SendAlert("engine_started", "info", "firing", "vLLM is serving"),
        SendAlert("gpu_memory", "warning", "resolved", "used 20.1 GiB"),
        SendAlert("gpu_lost", "critical", "resolved", "GPU back"),
    ]
    with AlertDispatcher(syslog_only(str(path)), CTX, retry_initial=0.05) as dispatcher:
        for alert in sent:
            dispatcher.submit(alert)
        assert dispatcher.flush(5)
        assert dispatcher.status()["syslog"]["delivered"] == 5
    lines = [parse(d) for d in receive(receiver, 5)]
    assert [(fac, sev) for fac, sev, *_ in lines] == [
        (LOCAL3, 2),
        (LOCAL3, 4),
        (LOCAL3, 6),
        (LOCAL3, 5),
        (LOCAL3, 5),
    ]
    assert {ident for _, _, ident, _, _ in lines} == {"r3090d-test"}
    assert {pid for _, _, _, pid, _ in lines} == {os.getpid()}
    assert lines[0][4] == "gpu0 gpu_lost FIRING (critical): GPU fell off the bus"
    assert lines[1][4] == "gpu0 gpu_memory REMINDER (warning): used 23.6 GiB"
    assert lines[3][4] == "gpu0 gpu_memory RESOLVED (warning): used 20.1 GiB"
    receiver.close()


def test_a_multiline_summary_is_one_line_without_nul(sockdir):
    path = sockdir / "syslog.sock"
    receiver = bind_unix_dgram(path)
    with AlertDispatcher(syslog_only(str(path), facility="daemon"), CTX) as dispatcher:
        dispatcher.submit(SendAlert("kv_low", "warning", "firing", "free blocks 40\nthreshold 100\r\n"))
        assert dispatcher.flush(5)
    (datagram,) = receive(receiver, 1)
    fac, sev, ident, _, text = parse(datagram)
    assert (fac, sev, ident) == (3, 4, "r3090d-test")
    assert text == "gpu0 kv_low FIRING (warning): free blocks 40 threshold 100"
    assert b"\n" not in datagram and b"\0" not in datagram
    receiver.close()


def test_udp_host_port(sockdir):
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(5)
    port = receiver.getsockname()[1]
    with AlertDispatcher(syslog_only(f"127.0.0.1:{port}", facility="user"), CTX) as dispatcher:
        dispatcher.submit(SendAlert("engine_dead", "critical", "firing", "vLLM exited with code 0"))
        assert dispatcher.flush(5)
    fac, sev, ident, pid, text = parse(receiver.recv(65536))
    assert (fac, sev, ident, pid) == (1, 2, "r3090d-test", os.getpid())
    assert text == "gpu0 engine_dead FIRING (critical): vLLM exited with code 0"
    receiver.close()


def test_absent_socket_is_reported_once_and_delivery_resumes_when_it_appears(sockdir, caplog):
    caplog.set_level(logging.DEBUG, logger="r3090d.alerts")
    path = sockdir / "syslog.sock"
    with AlertDispatcher(syslog_only(str(path)), CTX, retry_initial=0.01, retry_max=0.02) as dispatcher:
        for i in range(3):
            dispatcher.submit(SendAlert(f"k{i}", "warning", "firing", "while the socket is absent"))
        assert dispatcher.flush(5)
        attempts = [r for r in caplog.records if "failed: syslog socket" in r.getMessage()]
        assert len(attempts) == 9 and all("does not exist" in r.getMessage() for r in attempts)
        # 3 alerts x 3 attempts failed for the same reason: one warning, the rest at debug.
        assert [r.levelno for r in attempts] == [logging.WARNING] + [logging.DEBUG] * 8
        drops = [r for r in caplog.records if "dropped alert" in r.getMessage()]
        assert len(drops) == 3 and all(r.levelno == logging.ERROR for r in drops)
        assert dispatcher.status()["syslog"]["dropped"] == 3

        receiver = bind_unix_dgram(path)
        dispatcher.submit(SendAlert("k9", "critical", "firing", "the socket is back"))
        assert dispatcher.flush(5)
        (datagram,) = receive(receiver, 1)
        assert parse(datagram)[4] == "gpu0 k9 FIRING (critical): the socket is back"
        assert any("syslog delivery works again" in r.getMessage() for r in caplog.records)
        assert dispatcher.status()["syslog"]["failing"] is None
        receiver.close()


def test_reconnects_after_the_syslog_daemon_restarts(sockdir):
    path = sockdir / "syslog.sock"
    first = bind_unix_dgram(path)
    with AlertDispatcher(syslog_only(str(path)), CTX, retry_initial=0.01) as dispatcher:
        dispatcher.submit(SendAlert("a", "info", "firing", "before restart"))
        assert dispatcher.flush(5)
        assert parse(first.recv(65536))[4].endswith("before restart")
        # A restarted daemon removes and re-creates its socket: the old connection is dead.
        first.close()
        path.unlink()
        second = bind_unix_dgram(path)
        dispatcher.submit(SendAlert("b", "info", "firing", "after restart"))
        assert dispatcher.flush(5)
        assert parse(second.recv(65536))[4].endswith("after restart")
        assert dispatcher.status()["syslog"]["dropped"] == 0
        second.close()


def test_submit_returns_at_once_even_with_the_socket_absent(sockdir):
    path = sockdir / "nothing-here.sock"
    with AlertDispatcher(syslog_only(str(path)), CTX, retry_initial=0.2) as dispatcher:
        started = time.perf_counter()
        for i in range(50):
            dispatcher.submit(SendAlert(f"k{i}", "warning", "firing", "x"))
        per_call = (time.perf_counter() - started) / 50
    assert per_call < 0.01


# ------------------------------------------------------------ the GPU's name

UUID = "GPU-5f2e1c7a-0b3d-4e8f-9a61-2c7d3e4f5a6b"


def test_lines_name_the_gpu_once_the_daemon_has_read_it(sockdir):
    path = sockdir / "syslog.sock"
    receiver = bind_unix_dgram(path)
    cfg = Config(gpu=GpuConfig(required=True, index=1), alerts=syslog_only(str(path)))
    with AlertDispatcher.from_config(cfg) as dispatcher:
        # Before the first usable sample only the configured index is known.
        dispatcher.submit(SendAlert("nvml_hung", "warning", "firing", "an NVML call has been stuck for 31 s"))
        assert dispatcher.flush(5)
        dispatcher.set_gpu("NVIDIA GeForce RTX 3090", 1, UUID)
        dispatcher.submit(SendAlert("gpu_memory", "warning", "firing", "GPU memory used 23600 MiB"))
        dispatcher.submit(SendAlert("gpu_memory", "warning", "resolved", "GPU memory used 20100 MiB"))
        assert dispatcher.flush(5)
    before, firing, resolved = (parse(d)[4] for d in receive(receiver, 3))
    assert before == "gpu1 nvml_hung FIRING (warning): an NVML call has been stuck for 31 s"
    assert firing == f"gpu1 gpu_memory FIRING (warning): GPU memory used 23600 MiB [NVIDIA GeForce RTX 3090, {UUID}]"
    assert resolved.startswith("gpu1 gpu_memory RESOLVED (warning): GPU memory used 20100 MiB")
    assert "NVIDIA GeForce RTX 3090" in resolved and UUID in resolved
    receiver.close()


def test_the_gpu_survives_a_summary_at_the_length_limit(sockdir):
    path = sockdir / "syslog.sock"
    receiver = bind_unix_dgram(path)
    with AlertDispatcher(syslog_only(str(path)), AlertContext(hostname="box", gpu_index=0)) as dispatcher:
        dispatcher.set_gpu("NVIDIA GeForce RTX 3090", 0, UUID)
        dispatcher.submit(SendAlert("k", "warning", "firing", "y" * 5000))
        assert dispatcher.flush(5)
    (datagram,) = receive(receiver, 1)
    text = parse(datagram)[4]
    assert len(text) <= MAX_SYSLOG_TEXT
    assert text.startswith("gpu0 k FIRING (warning): yyy") and text.endswith(f"… [NVIDIA GeForce RTX 3090, {UUID}]")
    receiver.close()


def test_without_a_gpu_the_line_says_nogpu_and_nothing_more(sockdir):
    path = sockdir / "syslog.sock"
    receiver = bind_unix_dgram(path)
    cfg = Config(gpu=GpuConfig(required=False), alerts=syslog_only(str(path)))
    with AlertDispatcher.from_config(cfg) as dispatcher:
        dispatcher.submit(SendAlert("engine_dead", "critical", "firing", "vLLM exited with code 1"))
        assert dispatcher.flush(5)
    (datagram,) = receive(receiver, 1)
    assert parse(datagram)[4] == "nogpu engine_dead FIRING (critical): vLLM exited with code 1"
    receiver.close()
