"""Email delivery against a real SMTP server (aiosmtpd on 127.0.0.1), and `r3090ctl alerts test`.

Covers: subject, body and every recipient; AUTH with the password from a file
or a systemd credential; implicit TLS and STARTTLS with a locally made CA; a
server that accepts connections and never answers for 30 s, during which
submit() stays instant and after which retries deliver; attempt exhaustion; and
that the password never reaches a log line or the CLI's output.
"""

from __future__ import annotations

import base64
import datetime as dt
import email
import email.policy
import ipaddress
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword

from r3090d import exitcodes
from r3090d.config import AlertsConfig, Config, ConfigError, EmailConfig, GpuConfig, SyslogConfig
from r3090d.core.actions import SendAlert
from r3090d.effectors import channels
from r3090d.effectors.alertformat import AlertContext
from r3090d.effectors.alerts import AlertDispatcher
from tests.daemon_harness import bind_unix_dgram
from tests.silent_server import SilentServer
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.component,
    # The plain-text AUTH servers below are on 127.0.0.1 and exist to test exactly that.
    pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS:UserWarning"),
]

CTX = AlertContext(hostname="testhost", gpu_index=0, gpu_name="NVIDIA GeForce RTX 3090")
RECIPIENTS = ["ops@example.org", "oncall@example.org", "pager@example.net"]
PASSWORD = "c0rrect horse+battery/staple"
USER = "r3090d-mailer"
ALERT = SendAlert(
    "gpu_memory",
    "warning",
    "firing",
    "GPU memory 23.6 GiB above 23.0 GiB",
    detail="used 24170 MiB of 24576 MiB",
)


# ----------------------------------------------------------------- servers


@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    message: email.message.EmailMessage
    tls: bool
    login: str | None


class Recorder:
    """aiosmtpd handler: keeps every accepted message; tests wait on it."""

    def __init__(self):
        self.messages: list[Received] = []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 (aiosmtpd's hook name)
        parsed = email.message_from_bytes(envelope.content, policy=email.policy.default)
        login = session.auth_data.login.decode() if isinstance(session.auth_data, LoginPassword) else None
        # session.ssl is set by STARTTLS only; an implicit-TLS transport carries its ssl_object.
        tls = session.ssl is not None or server.transport.get_extra_info("ssl_object") is not None
        self.messages.append(Received(envelope.mail_from, list(envelope.rcpt_tos), parsed, tls, login))
        return "250 2.0.0 OK"

    def wait_for(self, n: int, timeout: float) -> list[Received]:
        """Until `n` messages were accepted; returns every message accepted so far."""
        wait_until(
            lambda: len(self.messages) >= n,
            timeout,
            what=f"{n} messages accepted",
            details=lambda: f"accepted {len(self.messages)}",
        )
        return list(self.messages)


def password_checker(expected_user: str, expected_password: str, echo: bool = False):
    """An aiosmtpd authenticator. With echo, a rejection quotes what it was sent, as a careless server might."""

    def authenticator(server, session, envelope, mechanism, auth_data):
        if not isinstance(auth_data, LoginPassword):
            return AuthResult(success=False, handled=False)
        user, password = auth_data.login.decode(), auth_data.password.decode()
        if (user, password) == (expected_user, expected_password):
            return AuthResult(success=True, auth_data=auth_data)
        if echo:
            blob = base64.b64encode(f"\0{user}\0{password}".encode()).decode()
            return AuthResult(
                success=False, handled=False, message=f"535 5.7.8 rejected {user} {password} {blob}"
            )
        return AuthResult(success=False, handled=False)

    return authenticator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def smtp_server(handler=None, port: int | None = None, **kwargs):
    handler = handler or Recorder()
    controller = Controller(handler, hostname="127.0.0.1", port=port or free_port(), **kwargs)
    controller.start()
    try:
        yield controller, handler
    finally:
        controller.stop()


def email_config(port: int, **kw) -> AlertsConfig:
    base = dict(
        enabled=True,
        smtp_host="127.0.0.1",
        smtp_port=port,
        security="none",
        sender="r3090d@testhost.example.org",
        recipients=RECIPIENTS,
        timeout=2.0,
        max_attempts=3,
    )
    base.update(kw)
    return AlertsConfig(syslog=SyslogConfig(enabled=False), email=EmailConfig(**base))


@pytest.fixture
def password_file(tmp_path) -> Path:
    path = tmp_path / "smtp-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    return path


def own_log_text(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("r3090d"))


# ------------------------------------------------------------------ delivery


def test_alert_arrives_with_subject_body_and_every_recipient():
    raised_at = dt.datetime(2027, 1, 15, 8, 0, 0, tzinfo=dt.UTC).timestamp()
    with smtp_server() as (server, recorder):
        with AlertDispatcher(
            email_config(server.port), CTX, environ={}, clock=lambda: raised_at
        ) as dispatcher:
            dispatcher.submit(ALERT)
            assert dispatcher.flush(10)
        (got,) = recorder.wait_for(1, 5)
    msg = got.message
    assert (
        msg["Subject"]
        == "[r3090d] testhost gpu0 gpu_memory FIRING (warning): GPU memory 23.6 GiB above 23.0 GiB"
        " [NVIDIA GeForce RTX 3090]"
    )
    assert got.mail_from == "r3090d@testhost.example.org"
    assert got.rcpt_tos == RECIPIENTS
    assert [a.addr_spec for a in msg["To"].addresses] == RECIPIENTS
    assert msg["Auto-Submitted"] == "auto-generated"
    assert msg["Message-ID"].endswith("@testhost>")
    assert email.utils.parsedate_to_datetime(msg["Date"]).timestamp() == raised_at
    body = msg.get_content()
    assert "GPU memory 23.6 GiB above 23.0 GiB" in body
    assert "used 24170 MiB of 24576 MiB" in body
    assert "Host:     testhost" in body
    assert "GPU:      0 (NVIDIA GeForce RTX 3090)" in body
    assert "(2027-01-15 08:00:00 UTC)" in body
    assert got.login is None and not got.tls


UUID = "GPU-5f2e1c7a-0b3d-4e8f-9a61-2c7d3e4f5a6b"


def test_subject_and_body_name_the_gpu_once_the_daemon_has_read_it():
    host = socket.gethostname()
    with smtp_server() as (server, recorder):
        cfg = Config(gpu=GpuConfig(required=True, index=1), alerts=email_config(server.port))
        with AlertDispatcher.from_config(cfg, environ={}) as dispatcher:
            dispatcher.submit(SendAlert("nvml_hung", "warning", "firing", "an NVML call has been stuck for 31 s"))
            dispatcher.set_gpu("NVIDIA GeForce RTX 3090", 1, UUID)
            dispatcher.submit(ALERT)
            assert dispatcher.flush(10)
        before, after = recorder.wait_for(2, 5)
    # Before the first usable sample only the configured index is known.
    assert before.message["Subject"] == f"[r3090d] {host} gpu1 nvml_hung FIRING (warning): an NVML call has been stuck for 31 s"
    assert "GPU:      1\r\n" in before.message.get_content()  # index alone: no "()", no "None"
    assert after.message["Subject"] == (
        f"[r3090d] {host} gpu1 gpu_memory FIRING (warning): GPU memory 23.6 GiB above 23.0 GiB"
        f" [NVIDIA GeForce RTX 3090, {UUID}]"
    )
    body = after.message.get_content()
    assert "GPU:      1 (NVIDIA GeForce RTX 3090)\r\n" in body
    assert f"GPU UUID: {UUID}\r\n" in body


def test_without_a_gpu_the_mail_says_so_and_nothing_odd():
    host = socket.gethostname()
    with smtp_server() as (server, recorder):
        cfg = Config(gpu=GpuConfig(required=False), alerts=email_config(server.port))
        with AlertDispatcher.from_config(cfg, environ={}) as dispatcher:
            dispatcher.submit(SendAlert("engine_dead", "critical", "firing", "vLLM exited with code 1"))
            assert dispatcher.flush(10)
        (got,) = recorder.wait_for(1, 5)
    assert got.message["Subject"] == f"[r3090d] {host} nogpu engine_dead FIRING (critical): vLLM exited with code 1"
    body = got.message.get_content()
    assert "GPU:      none configured\r\n" in body
    assert "None" not in body and "UUID" not in body and "()" not in body


def test_login_with_password_from_file(password_file):
    checker = password_checker(USER, PASSWORD)
    with smtp_server(authenticator=checker, auth_required=True, auth_require_tls=False) as (server, recorder):
        cfg = email_config(server.port, username=USER, password_file=str(password_file))
        with AlertDispatcher(cfg, CTX, environ={}) as dispatcher:
            dispatcher.submit(ALERT)
            assert dispatcher.flush(10)
            assert dispatcher.status()["email"]["delivered"] == 1
        (got,) = recorder.wait_for(1, 5)
    assert got.login == USER
    assert got.rcpt_tos == RECIPIENTS


def test_login_with_password_from_systemd_credential(tmp_path):
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "smtp-password").write_text(PASSWORD)
    checker = password_checker(USER, PASSWORD)
    with smtp_server(authenticator=checker, auth_required=True, auth_require_tls=False) as (server, recorder):
        cfg = email_config(server.port, username=USER)
        with AlertDispatcher(cfg, CTX, environ={"CREDENTIALS_DIRECTORY": str(credentials)}) as dispatcher:
            dispatcher.submit(ALERT)
            assert dispatcher.flush(10)
        (got,) = recorder.wait_for(1, 5)
    assert got.login == USER


def test_a_server_that_requires_auth_rejects_an_anonymous_sender():
    checker = password_checker(USER, PASSWORD)
    with smtp_server(authenticator=checker, auth_required=True, auth_require_tls=False) as (server, recorder):
        channel = channels.EmailChannel(email_config(server.port).email, password=None, helo_name="testhost")
        result = channels.send_once(channel, channels.make_test_alert(CTX))
        assert recorder.messages == []
    assert not result.ok
    assert result.detail.startswith("send: ") and "530" in result.detail


def test_wrong_password_is_dropped_after_max_attempts_and_never_logged(tmp_path, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    wrong = tmp_path / "pw"
    wrong.write_text("wr0ng-Pa55word\n")
    blob = base64.b64encode(f"\0{USER}\0wr0ng-Pa55word".encode()).decode()
    checker = password_checker(USER, PASSWORD, echo=True)
    with smtp_server(authenticator=checker, auth_require_tls=False) as (server, recorder):
        cfg = email_config(server.port, username=USER, password_file=str(wrong), max_attempts=2)
        with AlertDispatcher(cfg, CTX, environ={}, retry_initial=0.05) as dispatcher:
            dispatcher.submit(ALERT)
            assert dispatcher.flush(10)
            assert dispatcher.status()["email"]["dropped"] == 1
        assert recorder.messages == []
        channel = channels.build_channels(cfg, hostname="testhost", environ={})[0]
        result = channels.send_once(channel, channels.make_test_alert(CTX))
    logged = own_log_text(caplog)
    assert "dropped alert gpu_memory FIRING (warning): 2 attempts failed" in logged
    # The server echoed the password and its AUTH PLAIN form; both were scrubbed.
    assert "login: server said 535 5.7.8 rejected r3090d-mailer <redacted> <redacted>" in logged
    assert not result.ok and "<redacted>" in result.detail
    out, err = capfd.readouterr()
    for text in (logged, result.detail, out, err):
        assert "wr0ng-Pa55word" not in text
        assert blob not in text


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A local CA and a server certificate for 127.0.0.1 and localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "r3090d test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    d = tmp_path_factory.mktemp("tls")
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return d


def server_tls_context(d: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(d / "server.pem", d / "server.key")
    return ctx


def test_implicit_tls_verifies_the_server_and_logs_in(tls_files, password_file, monkeypatch):
    # The client uses the system trust store; point OpenSSL's default at the test CA.
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files / "ca.pem"))
    checker = password_checker(USER, PASSWORD)
    # aiosmtpd counts only STARTTLS as TLS for AUTH, hence auth_require_tls=False on this TLS-only port.
    with smtp_server(
        ssl_context=server_tls_context(tls_files),
        authenticator=checker,
        auth_required=True,
        auth_require_tls=False,
    ) as (server, recorder):
        cfg = email_config(server.port, security="ssl", username=USER, password_file=str(password_file))
        with AlertDispatcher(cfg, CTX, environ={}) as dispatcher:
            dispatcher.submit(ALERT)
            assert dispatcher.flush(10)
        (got,) = recorder.wait_for(1, 5)
    assert got.tls and got.login == USER and got.rcpt_tos == RECIPIENTS


def test_starttls_upgrades_before_login(tls_files, password_file, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files / "ca.pem"))
    checker = password_checker(USER, PASSWORD)
    # auth_require_tls (aiosmtpd's default) refuses AUTH on a plain connection.
    with smtp_server(
        tls_context=server_tls_context(tls_files),
        require_starttls=True,
        authenticator=checker,
        auth_required=True,
    ) as (server, recorder):
        cfg = email_config(server.port, security="starttls", username=USER, password_file=str(password_file))
        channel = channels.build_channels(cfg, hostname="testhost", environ={})[0]
        result = channels.send_once(channel, channels.make_test_alert(CTX))
        (got,) = recorder.wait_for(1, 5)
    assert result.ok, result.detail
    assert got.tls and got.login == USER
    assert (
        got.message["Subject"]
        == "[r3090d] testhost gpu0 test FIRING (info): test alert from r3090ctl alerts test [NVIDIA GeForce RTX 3090]"
    )


def test_an_untrusted_certificate_is_refused(tls_files, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", os.devnull)
    monkeypatch.setenv("SSL_CERT_DIR", os.devnull)
    with smtp_server(ssl_context=server_tls_context(tls_files)) as (server, recorder):
        channel = channels.build_channels(
            email_config(server.port, security="ssl"), hostname="testhost", environ={}
        )[0]
        result = channels.send_once(channel, channels.make_test_alert(CTX))
        assert recorder.messages == []
    assert not result.ok
    assert result.detail.startswith("connect: TLS certificate not trusted")


def test_starttls_against_a_server_without_it_is_an_error_not_a_plain_send():
    with smtp_server() as (server, recorder):
        channel = channels.build_channels(
            email_config(server.port, security="starttls"), hostname="testhost", environ={}
        )[0]
        result = channels.send_once(channel, channels.make_test_alert(CTX))
        assert recorder.messages == []
    assert not result.ok
    assert result.detail.startswith("STARTTLS: server does not support it")


# ------------------------------------------------------- failure and retries


def test_hung_server_never_blocks_submit_and_retries_deliver_after_it_recovers(sockdir, caplog, capsys):
    """30 s of an SMTP server that accepts and never answers, then a working one on the same port."""
    caplog.set_level(logging.INFO, logger="r3090d.alerts")
    hang_seconds = 30.0
    port = free_port()
    hung = SilentServer(port)
    syslog_path = sockdir / "syslog.sock"
    syslog = bind_unix_dgram(syslog_path)
    cfg = AlertsConfig(
        syslog=SyslogConfig(enabled=True, address=str(syslog_path)),
        email=email_config(port, timeout=1.0, max_attempts=20).email,
    )
    sent = [
        SendAlert(f"key{i}", "critical" if i == 0 else "warning", "firing", f"problem {i}") for i in range(4)
    ]
    started = time.monotonic()
    dispatcher = AlertDispatcher(cfg, CTX, environ={}, retry_initial=0.5, retry_max=4.0)
    latencies = []
    try:
        for alert in sent[:3]:
            t = time.perf_counter()
            dispatcher.submit(alert)
            latencies.append(time.perf_counter() - t)
        # Syslog has its own worker: the hung SMTP server does not hold its lines back.
        lines = [syslog.recv(65536) for _ in range(3)]
        syslog_latency = time.monotonic() - started
        assert [line.split(b": ", 1)[1].split(b" ")[1] for line in lines] == [b"key0", b"key1", b"key2"]
        assert syslog_latency < 2.0
        t = time.monotonic()
        assert dispatcher.flush(0.5) is False  # email is still stuck
        flush_wait = time.monotonic() - t
        assert 0.45 <= flush_wait < 1.0
        # Time passing on purpose: half the outage.
        time.sleep(hang_seconds / 2 - (time.monotonic() - started))
        t = time.perf_counter()
        dispatcher.submit(sent[3])  # mid-outage, the worker is inside a connect or a backoff
        latencies.append(time.perf_counter() - t)
        syslog.recv(65536)
        assert dispatcher.status()["email"]["delivered"] == 0
        assert len(hung.accepted) >= 4  # the client really did keep trying the hung server
        # Time passing on purpose: the rest of the outage.
        time.sleep(max(0.0, hang_seconds - (time.monotonic() - started)))
        hung.close()
        with smtp_server(port=port) as (_, recorder):
            assert dispatcher.flush(15)
            got = recorder.wait_for(4, 5)
        total = time.monotonic() - started
        status = dispatcher.status()["email"]
    finally:
        dispatcher.close()
        syslog.close()
    assert max(latencies) < 0.2  # a send that blocked would take at least the 1 s SMTP timeout; this allows for a preempted thread
    assert [g.message["X-R3090D-Alert"].split(";")[0] for g in got] == ["key0", "key1", "key2", "key3"]
    assert all(g.rcpt_tos == RECIPIENTS for g in got)
    assert status == {
        "target": f"127.0.0.1:{port} (none), 3 recipients",
        "pending": 0,
        "delivered": 4,
        "dropped": 0,
        "failing": None,
    }
    assert "email delivery works again" in own_log_text(caplog)
    assert total < hang_seconds + 8
    with capsys.disabled():
        print(
            f"\n[hang test] submit max {max(latencies) * 1e3:.3f} ms, mean {sum(latencies) / len(latencies) * 1e3:.3f} ms; "
            f"syslog lines in {syslog_latency * 1e3:.0f} ms; flush(0.5) waited {flush_wait:.2f} s; "
            f"{len(hung.accepted)} connections to the hung server; all delivered {total:.1f} s after the first submit"
        )


def test_max_attempts_exhaustion_logs_one_drop_per_alert(caplog):
    caplog.set_level(logging.DEBUG, logger="r3090d.alerts")
    port = free_port()  # nothing listens: connection refused
    with AlertDispatcher(
        email_config(port, max_attempts=4), CTX, environ={}, retry_initial=0.02, retry_max=0.05
    ) as dispatcher:
        dispatcher.submit(ALERT)
        dispatcher.submit(SendAlert("engine_gave_up", "critical", "firing", "5 restarts in 30 min"))
        assert dispatcher.flush(10)
        status = dispatcher.status()["email"]
    assert status["dropped"] == 2 and status["delivered"] == 0
    assert status["failing"] == "connect: Connection refused"
    records = [r for r in caplog.records if r.name == "r3090d.alerts"]
    attempts = [r for r in records if " of 4 failed: " in r.getMessage()]
    assert len(attempts) == 8
    assert [r.levelno for r in attempts] == [logging.WARNING] + [logging.DEBUG] * 7
    drops = [r.getMessage() for r in records if r.levelno == logging.ERROR]
    assert drops == [
        "email: dropped alert gpu_memory FIRING (warning): 4 attempts failed, last: connect: Connection refused",
        "email: dropped alert engine_gave_up FIRING (critical): 4 attempts failed, last: connect: Connection refused",
    ]


def test_flush_is_bounded_and_close_logs_what_it_abandons(caplog):
    caplog.set_level(logging.INFO, logger="r3090d.alerts")
    port = free_port()
    hung = SilentServer(port)
    try:
        dispatcher = AlertDispatcher(email_config(port, timeout=5.0), CTX, environ={})
        dispatcher.submit(ALERT)
        dispatcher.submit(SendAlert("second", "info", "firing", "queued behind the first"))
        t = time.monotonic()
        assert dispatcher.flush(0.3) is False
        assert 0.25 <= time.monotonic() - t < 0.8
        t = time.monotonic()
        dispatcher.close(timeout=0.2)
        assert time.monotonic() - t < 1.0
        dispatcher.submit(SendAlert("late", "info", "firing", "after close"))  # logged, not raised
    finally:
        hung.close()
    logged = own_log_text(caplog)
    assert "email: dropped alert second FIRING (info): the dispatcher closed before delivery" in logged
    assert "email: still inside a delivery attempt at close" in logged
    assert "email: dropped alert late FIRING (info): the dispatcher is closed" in logged


def test_missing_password_file_is_a_config_error_at_construction(tmp_path):
    cfg = email_config(25, username=USER, password_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError) as err:
        AlertDispatcher(cfg, CTX, environ={})
    assert err.value.key == "alerts.email.password_file"
    assert "cannot read SMTP password file" in err.value.problem


# ------------------------------------------------------------------ the CLI


CTL = [
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'r3090ctl'; from r3090d.cli import ctl_main; ctl_main()",
]


def write_config(
    path: Path, *, syslog_address: str | None, smtp_port: int | None, password_file: Path | None = None
) -> Path:
    lines = [
        "[engine]",
        'model = "/nonexistent/models/qwen"',  # `alerts test` needs neither the engine nor the model
        'python = "/nonexistent/venv/bin/python"',
        "[alerts.syslog]",
        f"enabled = {'true' if syslog_address else 'false'}",
        f'address = "{syslog_address or "/dev/log"}"',
        'ident = "r3090d"',
        "[alerts.email]",
        f"enabled = {'true' if smtp_port else 'false'}",
        'smtp_host = "127.0.0.1"',
        f"smtp_port = {smtp_port or 25}",
        'security = "none"',
        f"recipients = {json.dumps(RECIPIENTS)}",
        "timeout = 2",
    ]
    if password_file:
        lines += [f'username = "{USER}"', f'password_file = "{password_file}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def ctl(*args: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("R3090D_CONFIG", "R3090D_INSTANCE", "CREDENTIALS_DIRECTORY")
    }
    return subprocess.run([*CTL, *args], capture_output=True, text=True, timeout=60, env=env)


def test_cli_sends_on_every_channel_and_exits_0(tmp_path, sockdir, password_file):
    syslog_path = sockdir / "syslog.sock"
    syslog = bind_unix_dgram(syslog_path)
    checker = password_checker(USER, PASSWORD)
    with smtp_server(authenticator=checker, auth_required=True, auth_require_tls=False) as (server, recorder):
        config = write_config(
            tmp_path / "r3090d.toml",
            syslog_address=str(syslog_path),
            smtp_port=server.port,
            password_file=password_file,
        )
        proc = ctl("alerts", "test", "--config", str(config))
        got = recorder.wait_for(1, 5)
    datagram = syslog.recv(65536)
    syslog.close()
    assert proc.returncode == exitcodes.OK, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"syslog -> {syslog_path}: sending test alert ... ok (")
    assert lines[1].startswith(
        f"email -> 127.0.0.1:{server.port} (none), 3 recipients: sending test alert ... ok ("
    )
    assert lines[2] == "all 2 channels delivered"
    assert datagram.startswith(b"<30>r3090d[")  # daemon.info
    assert datagram.endswith(b": gpu0 test FIRING (info): test alert from r3090ctl alerts test")
    assert len(got) == 1 and got[0].login == USER and got[0].rcpt_tos == RECIPIENTS
    assert "r3090d can reach you" in got[0].message.get_content()
    assert PASSWORD not in proc.stdout + proc.stderr


def test_cli_json_reports_a_failing_channel_and_exits_2(tmp_path, sockdir):
    syslog_path = sockdir / "syslog.sock"
    syslog = bind_unix_dgram(syslog_path)
    dead_port = free_port()
    config = write_config(tmp_path / "r3090d.toml", syslog_address=str(syslog_path), smtp_port=dead_port)
    proc = ctl("alerts", "test", "--config", str(config), "--json")
    syslog.close()
    assert proc.returncode == exitcodes.CRITICAL, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    by_name = {c["channel"]: c for c in report["channels"]}
    assert by_name["syslog"]["ok"] is True
    assert by_name["email"] == {
        "channel": "email",
        "target": f"127.0.0.1:{dead_port} (none), 3 recipients",
        "ok": False,
        "detail": "connect: Connection refused",
        "seconds": by_name["email"]["seconds"],
    }


def test_cli_channel_option_tests_a_disabled_channel(tmp_path):
    with smtp_server() as (server, recorder):
        config = write_config(tmp_path / "r3090d.toml", syslog_address=None, smtp_port=None)
        text = config.read_text().replace("smtp_port = 25", f"smtp_port = {server.port}")
        config.write_text(text)
        proc = ctl("alerts", "test", "--config", str(config), "--channel", "email")
        got = recorder.wait_for(1, 5)
    assert proc.returncode == exitcodes.OK, proc.stdout + proc.stderr
    assert len(got) == 1
    assert "syslog" not in proc.stdout


def test_cli_with_no_channel_enabled_exits_3(tmp_path):
    config = write_config(tmp_path / "r3090d.toml", syslog_address=None, smtp_port=None)
    proc = ctl("alerts", "test", "--config", str(config))
    assert proc.returncode == exitcodes.UNKNOWN
    assert "no alert channel is enabled" in proc.stdout


def test_cli_unreadable_password_file_is_a_config_error(tmp_path):
    config = write_config(
        tmp_path / "r3090d.toml",
        syslog_address=None,
        smtp_port=2525,
        password_file=tmp_path / "missing-password",
    )
    proc = ctl("alerts", "test", "--config", str(config))
    assert proc.returncode == exitcodes.CONFIG
    assert proc.stderr.strip() == (
        f"r3090d: config error: {config}: alerts.email.password_file: cannot read SMTP password file "
        f"{tmp_path / 'missing-password'}: No such file or directory (fix: check the file exists and the service user can read it)"
    )
    assert "Traceback" not in proc.stderr
