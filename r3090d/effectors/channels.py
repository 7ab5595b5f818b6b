"""Alert channels: syslog and SMTP, and one synchronous attempt for `r3090ctl alerts test`.

A channel turns a RaisedAlert into what it sends (`prepare`) and makes one
delivery attempt (`deliver`), raising DeliveryError with a line that is safe
to log; the dispatcher (r3090d.effectors.alerts) queues, retries and drops.
The Alertmanager channel is r3090d.effectors.alertmanager.

Secrets: the SMTP password is read from `alerts.email.password_file` or from
systemd's `$CREDENTIALS_DIRECTORY/smtp-password` (LoadCredential=), never from
the TOML. It is scrubbed, with its base64 forms, from every error text a
channel returns, because a server may echo what it was sent.
"""

from __future__ import annotations

import base64
import dataclasses
import email.policy
import ipaddress
import logging
import logging.handlers
import os
import re
import smtplib
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from pathlib import Path
from typing import Any

from r3090d.config import AlertsConfig, Config, ConfigError, EmailConfig, SyslogConfig
from r3090d.core.actions import SendAlert
from r3090d.core.vocabulary import AlertState, Severity
from r3090d.effectors.alertformat import (
    CONTROL_CHARS,
    AlertContext,
    RaisedAlert,
    email_body,
    email_subject,
    one_line,
    syslog_message,
    syslog_priority_name,
)
from r3090d.effectors.delivery import Channel, DeliveryError

log = logging.getLogger("r3090d.alerts")

CREDENTIAL_NAME = "smtp-password"  # LoadCredential=smtp-password:/etc/r3090d/smtp-password
SYSLOG_UDP_PORT = 514
SYSLOG_MAX_ATTEMPTS = 3  # a local socket either works at once or is absent; don't hold alerts long

_IDENT_RE = re.compile(r"[A-Za-z0-9._-]{1,48}")
# RFC 5322's hard line limit, not the 78 it recommends: Python's folder moves a
# header value that would fit on a line of its own to the next line, and the
# unfolded subject then starts with a space, which breaks "^Subject: [r3090d]"
# filters. Subjects here are one bounded line, far below 998.
_MAIL_POLICY = email.policy.default.clone(max_line_length=998)


def parse_syslog_address(address: str, source: str = "<config>") -> str | tuple[str, int]:
    """'/dev/log' -> a unix socket path; 'host:port', '[v6]:port' or 'host' -> (host, port) for UDP."""
    key = "alerts.syslog.address"
    fix = 'use a socket path such as "/dev/log", or "host:514" for UDP'
    address = address.strip()
    if not address:
        raise ConfigError(source, key, "is empty", fix)
    if address.startswith("/"):
        return address
    host, port_text = address, ""
    if address.startswith("["):
        end = address.find("]")
        if end < 0:
            raise ConfigError(source, key, f"{address!r} has an unclosed [", fix)
        host, rest = address[1:end], address[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ConfigError(source, key, f"{address!r} is not [host]:port", fix)
        port_text = rest[1:]
    elif address.count(":") == 1:
        host, port_text = address.split(":")
    elif address.count(":") > 1:
        raise ConfigError(source, key, f"{address!r}: write an IPv6 address as [addr]:port", fix)
    if not host:
        raise ConfigError(source, key, f"{address!r} has no host", fix)
    if not port_text:
        return host, SYSLOG_UDP_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ConfigError(source, key, f"port {port_text!r} is not 1..65535", fix)
    return host, int(port_text)


class _RaisingSysLogHandler(logging.handlers.SysLogHandler):
    """SysLogHandler whose send errors reach the caller, and whose priority is the record's levelname."""

    def handleError(self, record):  # noqa: N802 (logging's name)
        raise  # noqa: PLE0704 -- re-raise the exception emit() is handling

    def mapPriority(self, levelName):  # noqa: N802, N803
        return levelName if levelName in self.priority_names else "warning"


class SyslogChannel:
    name = "syslog"
    max_attempts = SYSLOG_MAX_ATTEMPTS

    def __init__(self, cfg: SyslogConfig, source: str = "<config>"):
        self.address = parse_syslog_address(cfg.address, source)
        facility = cfg.facility.strip().lower()
        names = logging.handlers.SysLogHandler.facility_names
        if facility not in names:
            raise ConfigError(
                source,
                "alerts.syslog.facility",
                f"unknown facility {cfg.facility!r}",
                f"use one of {', '.join(sorted(names))}",
            )
        if not _IDENT_RE.fullmatch(cfg.ident):
            raise ConfigError(
                source,
                "alerts.syslog.ident",
                f"{cfg.ident!r} is not a plain program name",
                "use letters, digits, '.', '_' or '-' (at most 48)",
            )
        self.facility = facility
        self.ident = cfg.ident
        self.udp = not isinstance(self.address, str)
        self.target = f"udp:{self.address[0]}:{self.address[1]}" if self.udp else str(self.address)
        self._handler: _RaisingSysLogHandler | None = None
        self._lock = threading.Lock()

    def prepare(self, raised: RaisedAlert) -> tuple[str, str]:
        return syslog_priority_name(raised.alert), syslog_message(raised)

    def deliver(self, payload: tuple[str, str]) -> str:
        priority, text = payload
        with self._lock:
            if not self.udp and not os.path.exists(self.address):
                self._drop_handler()
                raise DeliveryError(
                    f"syslog socket {self.address} does not exist (no syslog daemon or journald?)"
                )
            try:
                handler = self._handler or self._open()
                # The pid goes in at send time: a forked test or re-exec must not report a stale one.
                handler.ident = f"{self.ident}[{os.getpid()}]: "
                handler.append_nul = handler.socktype == socket.SOCK_STREAM  # NUL frames stream messages only
                handler.emit(logging.makeLogRecord({"msg": text, "levelname": priority, "name": log.name}))
            except OSError as exc:
                self._drop_handler()
                raise DeliveryError(f"syslog send to {self.target} failed: {exc.strerror or exc}") from None
        return "sent over UDP: delivery is not confirmed" if self.udp else ""

    def _open(self) -> _RaisingSysLogHandler:
        facility = logging.handlers.SysLogHandler.facility_names[self.facility]
        socktype = socket.SOCK_DGRAM if self.udp else None  # unix: datagram, else stream
        self._handler = _RaisingSysLogHandler(address=self.address, facility=facility, socktype=socktype)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        return self._handler

    def _drop_handler(self) -> None:
        if self._handler is not None:
            try:
                self._handler.close()
            except OSError:
                pass
            self._handler = None

    def redact(self, text: str) -> str:
        return text

    def close(self) -> None:
        with self._lock:
            self._drop_handler()


def read_smtp_password(
    cfg: EmailConfig, source: str = "<config>", environ: Mapping[str, str] | None = None
) -> str | None:
    """The SMTP password, or None when no login is configured. Raises ConfigError naming the file, never the text."""
    environ = os.environ if environ is None else environ
    if not cfg.username:
        if cfg.password_file:
            raise ConfigError(
                source,
                "alerts.email.password_file",
                "is set but alerts.email.username is empty",
                "set username, or remove password_file",
            )
        return None
    if cfg.password_file:
        path, key = Path(cfg.password_file), "alerts.email.password_file"
    elif environ.get("CREDENTIALS_DIRECTORY"):
        path, key = Path(environ["CREDENTIALS_DIRECTORY"]) / CREDENTIAL_NAME, "alerts.email.username"
    else:
        raise ConfigError(
            source,
            "alerts.email.password_file",
            "alerts.email.username is set but no password source is",
            f"set password_file, or add LoadCredential={CREDENTIAL_NAME}:/path/to/file to the unit",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            source,
            key,
            f"cannot read SMTP password file {path}: {exc.strerror}",
            "check the file exists and the service user can read it",
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(
            source, key, f"SMTP password file {path} is not UTF-8 text", "write the password as UTF-8 text"
        ) from None
    password = text.rstrip("\r\n")  # editors add a newline; spaces may be part of the password
    if not password:
        raise ConfigError(source, key, f"SMTP password file {path} is empty", "write the password into it")
    if "\n" in password or "\r" in password:
        raise ConfigError(
            source, key, f"SMTP password file {path} has more than one line", "keep only the password in it"
        )
    return password


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_address(source: str, key: str, address: Any) -> str:
    if (
        not isinstance(address, str)
        or "@" not in address
        or CONTROL_CHARS.search(address)
        or " " in address.strip()
    ):
        raise ConfigError(
            source, key, f"{address!r} is not an email address", 'write it as "name@example.org"'
        )
    return address.strip()


class EmailChannel:
    name = "email"

    def __init__(self, cfg: EmailConfig, *, password: str | None, helo_name: str, source: str = "<config>"):
        self.cfg = cfg
        self.max_attempts = cfg.max_attempts
        self.sender = _check_address(source, "alerts.email.sender", cfg.sender)
        # That an enabled email channel has recipients is checked once, by config loading.
        self.recipients = [
            _check_address(source, f"alerts.email.recipients[{i}]", r) for i, r in enumerate(cfg.recipients)
        ]
        if cfg.username and cfg.security == "none" and not _is_loopback(cfg.smtp_host):
            raise ConfigError(
                source,
                "alerts.email.security",
                f'"none" would send the SMTP password in clear text to {cfg.smtp_host}',
                'use "starttls" or "ssl", or a relay on localhost',
            )
        self._password = password
        self._helo_name = helo_name
        self._secrets = _secret_forms(cfg.username, password)
        n = len(self.recipients)
        self.target = (
            f"{cfg.smtp_host}:{cfg.smtp_port} ({cfg.security}), {n} recipient{'s' if n != 1 else ''}"
        )

    def __repr__(self) -> str:
        return f"EmailChannel({self.target})"

    def prepare(self, raised: RaisedAlert) -> EmailMessage:
        msg = EmailMessage(policy=_MAIL_POLICY)
        msg["Subject"] = email_subject(raised)
        msg["From"] = self.sender
        msg["To"] = ", ".join(self.recipients)
        msg["Date"] = formatdate(raised.raised_at, localtime=True)
        # One Message-ID for every attempt, so a retry after a lost reply can be de-duplicated.
        msg["Message-ID"] = make_msgid("r3090d", domain=one_line(raised.context.hostname) or "localhost")
        msg["Auto-Submitted"] = "auto-generated"  # RFC 3834: no auto-replies to this
        msg["X-R3090D-Alert"] = (
            f"{one_line(raised.alert.key)}; state={raised.alert.state}; severity={raised.alert.severity}"
        )
        msg.set_content(email_body(raised))
        return msg

    def deliver(self, message: EmailMessage) -> str:
        cfg = self.cfg
        step = "connect"
        client: smtplib.SMTP | None = None
        try:
            tls = ssl.create_default_context() if cfg.security != "none" else None
            if cfg.security == "ssl":
                client = smtplib.SMTP_SSL(
                    cfg.smtp_host,
                    cfg.smtp_port,
                    local_hostname=self._helo_name,
                    timeout=cfg.timeout,
                    context=tls,
                )
            else:
                client = smtplib.SMTP(
                    cfg.smtp_host, cfg.smtp_port, local_hostname=self._helo_name, timeout=cfg.timeout
                )
            step = "EHLO"
            client.ehlo()
            if cfg.security == "starttls":
                step = "STARTTLS"
                client.starttls(context=tls)
                client.ehlo()
            if cfg.username:
                step = "login"
                client.login(cfg.username, self._password or "")
            step = "send"
            refused = client.send_message(message, from_addr=self.sender, to_addrs=self.recipients)
        except Exception as exc:  # noqa: BLE001 -- every failure becomes one safe line
            if client is not None:
                client.close()
            raise DeliveryError(self.redact(f"{step}: {_describe_smtp_error(exc, cfg.timeout)}")) from None
        try:
            client.quit()
        except (smtplib.SMTPException, OSError):
            client.close()  # the message was accepted; a lost QUIT reply changes nothing
        if refused:
            bad = ", ".join(f"{addr} ({code})" for addr, (code, _text) in sorted(refused.items()))
            return self.redact(
                f"accepted for {len(self.recipients) - len(refused)} of {len(self.recipients)} recipients; refused: {bad}"
            )
        return ""

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "<redacted>")
        return text

    def close(self) -> None:
        pass


def _secret_forms(username: str, password: str | None) -> tuple[str, ...]:
    """The password and the encodings AUTH PLAIN and AUTH LOGIN put on the wire."""
    if not password:
        return ()
    forms = {password}
    for raw in (password, f"\0{username}\0{password}", f"{username}\0{username}\0{password}"):
        forms.add(base64.b64encode(raw.encode("utf-8")).decode("ascii"))
    return tuple(sorted(forms, key=len, reverse=True))


def _describe_smtp_error(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        return "every recipient was refused: " + ", ".join(
            f"{a} ({c} {_text(t)})" for a, (c, t) in sorted(exc.recipients.items())
        )
    if isinstance(exc, smtplib.SMTPResponseException):
        return f"server said {exc.smtp_code} {_text(exc.smtp_error)}"
    if isinstance(exc, smtplib.SMTPNotSupportedError):
        return f"server does not support it ({exc})"
    if isinstance(exc, smtplib.SMTPServerDisconnected):
        return f"server closed the connection ({exc})" if str(exc) else "server closed the connection"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error: {exc.reason or exc}"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host: {exc.strerror or exc}"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


def _text(value: bytes | str) -> str:
    return one_line(value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))


CHANNEL_KINDS = ("syslog", "email", "alertmanager")


def channel_kind(channel: Channel) -> str:
    """'alertmanager' for 'alertmanager[2]': the name `--channel` and include_disabled use."""
    return channel.name.split("[", 1)[0]


def build_channels(
    cfg: AlertsConfig,
    *,
    hostname: str,
    source: str = "<config>",
    environ: Mapping[str, str] | None = None,
    include_disabled: tuple[str, ...] = (),
) -> list[Channel]:
    """The enabled channels (plus any named in include_disabled). Raises ConfigError."""
    channels: list[Channel] = []
    if cfg.syslog.enabled or "syslog" in include_disabled:
        channels.append(SyslogChannel(cfg.syslog, source))
    if cfg.email.enabled or "email" in include_disabled:
        password = read_smtp_password(cfg.email, source, environ)
        channels.append(EmailChannel(cfg.email, password=password, helo_name=hostname, source=source))
    if cfg.alertmanager.enabled or "alertmanager" in include_disabled:
        from r3090d.effectors import alertmanager  # here: it loads httpx, which only Alertmanager needs

        channels.extend(alertmanager.build_channels(cfg.alertmanager, source))
    return channels


def check_config(cfg: Config, environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError for what only this module checks (facility, address, password file)."""
    for channel in build_channels(cfg.alerts, hostname="localhost", source=cfg.source, environ=environ):
        channel.close()


# ------------------------------------------------------------ one-shot test


@dataclass(frozen=True)
class ChannelResult:
    channel: str
    target: str
    ok: bool
    detail: str  # the note on success, the reason on failure
    seconds: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def make_test_alert(context: AlertContext, clock=time.time) -> RaisedAlert:
    alert = SendAlert(
        key="test",
        severity=Severity.INFO,
        state=AlertState.FIRING,
        summary="test alert from r3090ctl alerts test",
        detail="This is a test. If you read it, r3090d can reach you through this channel. No action is needed.",
    )
    return RaisedAlert(alert, context, clock())


def send_once(channel: Channel, raised: RaisedAlert) -> ChannelResult:
    """One synchronous attempt, no retries: for `r3090ctl alerts test`."""
    started = time.monotonic()
    try:
        note = channel.deliver(channel.prepare(raised))
        ok, detail = True, note
    except DeliveryError as exc:
        ok, detail = False, str(exc)
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, channel.redact(f"{type(exc).__name__}: {exc}")
    finally:
        channel.close()
    return ChannelResult(channel.name, channel.target, ok, detail, round(time.monotonic() - started, 3))
