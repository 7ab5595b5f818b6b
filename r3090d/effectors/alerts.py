"""Alert delivery: syslog, email and Alertmanager, off the caller's thread.

The policy decides *what* to send (dedup, hysteresis, reminders, rate limits);
this module only delivers `SendAlert` actions. `AlertDispatcher.submit()` never
blocks: it time-stamps the alert and appends it to one queue per channel. Each
channel has its own worker thread, so a hung SMTP server delays neither the
daemon's loop nor the syslog line. A worker retries a failed delivery with
capped exponential backoff and drops the alert only after the channel's
attempt limit, logging the drop on the "r3090d.alerts" logger.

Alertmanager (r3090d.effectors.alertmanager) keeps a table of its own and
re-sends firing alerts on a timer; its queue holds one POST per alert key, the
newest (see `Deliverable.coalesce_key`).

Syslog priorities (RFC 5424 severities), chosen so a filter on "warning and
worse" sees every open problem and a filter on "notice and worse" also sees
each all-clear:

    critical, firing or reminder  -> crit (2)
    warning,  firing or reminder  -> warning (4)
    any severity, resolved        -> notice (5)
    info,     firing or reminder  -> info (6)

Secrets: the SMTP password is read from `alerts.email.password_file` or from
systemd's `$CREDENTIALS_DIRECTORY/smtp-password` (LoadCredential=), never from
the TOML. It is scrubbed, with its base64 forms, from every error text this
module logs or returns, because a server may echo what it was sent.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
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
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from r3090d.config import AlertsConfig, Config, ConfigError, EmailConfig, SyslogConfig
from r3090d.core.actions import SendAlert

if TYPE_CHECKING:  # the Alertmanager module imports this one; at run time it is imported where used
    from r3090d.effectors.alertmanager import AlertmanagerFeed, Firing

log = logging.getLogger("r3090d.alerts")

CREDENTIAL_NAME = "smtp-password"  # LoadCredential=smtp-password:/etc/r3090d/smtp-password
SYSLOG_UDP_PORT = 514
SYSLOG_MAX_ATTEMPTS = 3  # a local socket either works at once or is absent; don't hold alerts long
MAX_SYSLOG_TEXT = 2000  # characters; well under any datagram limit
MAX_SUBJECT_SUMMARY = 100
DEFAULT_RETRY_INITIAL_S = 2.0
DEFAULT_RETRY_MAX_S = 120.0  # with the default 8 attempts: about four minutes of retrying
DEFAULT_QUEUE_LIMIT = 256

SEVERITIES = ("info", "warning", "critical")
STATES = ("firing", "reminder", "resolved")

_SYSLOG_PRIORITY = {"critical": "crit", "warning": "warning", "info": "info"}
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]+")
_IDENT_RE = re.compile(r"[A-Za-z0-9._-]{1,48}")
# RFC 5322's hard line limit, not the 78 it recommends: Python's folder moves a
# header value that would fit on a line of its own to the next line, and the
# unfolded subject then starts with a space, which breaks "^Subject: [r3090d]"
# filters. Subjects here are one bounded line, far below 998.
_MAIL_POLICY = email.policy.default.clone(max_line_length=998)


# ------------------------------------------------------------------ the alert


@dataclass(frozen=True)
class AlertContext:
    """Where the alert comes from: printed in every subject, body and syslog line.

    The configured GPU index is known at start; the name and UUID only once NVML
    has answered (AlertDispatcher.set_gpu), so alerts raised before then carry
    the index alone.
    """

    hostname: str
    gpu_index: int | None = None  # None: gpu.required = false, no GPU is watched
    gpu_name: str | None = None  # from NVML once known; None before the first sample
    instance: int | None = None  # N of r3090d@N; None for the plain unit
    gpu_uuid: str | None = None  # from NVML once known, e.g. "GPU-5f2e1c7a-..."

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        gpu_name: str | None = None,
        gpu_uuid: str | None = None,
        hostname: str | None = None,
    ) -> AlertContext:
        return cls(
            hostname=hostname or socket.gethostname(),
            gpu_index=cfg.gpu.index if cfg.gpu.required else None,
            gpu_name=gpu_name,
            instance=cfg.instance,
            gpu_uuid=gpu_uuid,
        )

    def with_gpu(self, name: str | None, index: int | None, uuid: str | None) -> AlertContext:
        """This context for the GPU NVML reported; what a sample lacks (a failed read) stays as known."""
        return dataclasses.replace(
            self,
            gpu_index=self.gpu_index if index is None else index,
            gpu_name=one_line(name) if name else self.gpu_name,
            gpu_uuid=one_line(uuid) if uuid else self.gpu_uuid,
        )

    @property
    def gpu_label(self) -> str:
        return f"gpu{self.gpu_index}" if self.gpu_index is not None else "nogpu"

    @property
    def gpu_identity(self) -> str:
        """'[name, uuid]' (either part when only one is known), or '' when neither is or no GPU is watched."""
        if self.gpu_index is None:
            return ""
        known = [one_line(part) for part in (self.gpu_name, self.gpu_uuid) if part]
        return f"[{', '.join(known)}]" if known else ""

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        """The origin as name/value pairs, only those known: for channels that carry labels."""
        pairs = [
            ("host", self.hostname),
            ("instance", None if self.instance is None else str(self.instance)),
            ("gpu_index", None if self.gpu_index is None else str(self.gpu_index)),
            ("gpu_name", self.gpu_name),
            ("gpu_uuid", self.gpu_uuid),
        ]
        return tuple((name, value) for name, value in pairs if value)


@dataclass(frozen=True)
class RaisedAlert:
    """An alert as submitted: the action, its origin, and when it was raised (wall clock)."""

    alert: SendAlert
    context: AlertContext
    raised_at: float

    @property
    def label(self) -> str:
        return _label(self)

    @property
    def coalesce_key(self) -> str | None:
        return None  # every message counts: a mail is never replaced by a later one

    def delivered(self, channel: str) -> None:
        pass


class Deliverable(Protocol):
    """What a channel's queue holds: a RaisedAlert, or an Alertmanager POST."""

    @property
    def label(self) -> str: ...  # for log lines: "gpu_memory FIRING (warning)"

    @property
    def coalesce_key(self) -> str | None: ...  # not None: a newer item with this key replaces this one

    def delivered(self, channel: str) -> None: ...  # called once the channel took it (no lock held)


# ----------------------------------------------------------- pure formatting


def one_line(text: str) -> str:
    return _CONTROL_CHARS.sub(" ", text).strip()


def syslog_priority_name(alert: SendAlert) -> str:
    if alert.state == "resolved":
        return "notice"
    return _SYSLOG_PRIORITY.get(alert.severity, "warning")


def syslog_severity(alert: SendAlert) -> int:
    """The RFC 5424 severity number (0 emerg .. 7 debug)."""
    return logging.handlers.SysLogHandler.priority_names[syslog_priority_name(alert)]


def syslog_message(raised: RaisedAlert) -> str:
    """The text after `ident[pid]: `: one line, GPU, key, state, severity, summary, GPU name and UUID.

    The name and UUID come last, so a filter on the leading words keeps working,
    and survive a summary cut at the length limit.
    """
    a, c = raised.alert, raised.context
    head = one_line(f"{c.gpu_label} {a.key} {a.state.upper()} ({a.severity}):")
    tail = f" {c.gpu_identity}" if c.gpu_identity else ""
    room = MAX_SYSLOG_TEXT - len(head) - len(tail) - 1
    summary = one_line(a.summary)
    if len(summary) > room:
        summary = summary[: max(0, room - 1)] + "…"
    return (f"{head} {summary}".rstrip() + tail)[:MAX_SYSLOG_TEXT]


def email_subject(raised: RaisedAlert) -> str:
    a, c = raised.alert, raised.context
    summary = one_line(a.summary)
    if len(summary) > MAX_SUBJECT_SUMMARY:
        summary = summary[: MAX_SUBJECT_SUMMARY - 1] + "…"
    subject = (
        f"[r3090d] {one_line(c.hostname)} {c.gpu_label} {one_line(a.key)} {a.state.upper()} ({a.severity})"
    )
    if summary:
        subject = f"{subject}: {summary}"
    # The GPU's name and UUID last: what and how bad stay at the front of a mail list.
    return f"{subject} {c.gpu_identity}" if c.gpu_identity else subject


def _format_time(wall: float) -> str:
    local = dt.datetime.fromtimestamp(wall).astimezone()
    utc = dt.datetime.fromtimestamp(wall, dt.UTC)
    return f"{local.isoformat(timespec='seconds')} ({utc.strftime('%Y-%m-%d %H:%M:%S')} UTC)"


def email_body(raised: RaisedAlert) -> str:
    a, c = raised.alert, raised.context
    gpu = "none configured" if c.gpu_index is None else str(c.gpu_index)
    if c.gpu_index is not None and c.gpu_name:
        gpu += f" ({c.gpu_name})"
    lines = [f"{a.key} is {a.state.upper()} ({a.severity})", "", a.summary, ""]
    if a.detail:
        lines += [a.detail.rstrip(), ""]
    lines += [
        f"Host:     {c.hostname}",
        f"GPU:      {gpu}",
    ]
    if c.gpu_index is not None and c.gpu_uuid:
        lines.append(f"GPU UUID: {c.gpu_uuid}")
    if c.instance is not None:
        lines.append(f"Unit:     r3090d@{c.instance}")
    lines += [
        f"Alert:    {a.key}",
        f"Severity: {a.severity}",
        f"State:    {a.state}",
        f"Raised:   {_format_time(raised.raised_at)}",
        "",
        "-- ",
        f"Sent by r3090d on {c.hostname}. `r3090ctl status` shows the current state.",
    ]
    return "\n".join(lines) + "\n"


def retry_delay(failed_attempts: int, initial: float, cap: float) -> float:
    """Seconds to wait after the Nth failed attempt: initial, 2x, 4x, ... capped."""
    return min(cap, initial * (2 ** max(0, failed_attempts - 1)))


# ----------------------------------------------------------------- channels


class DeliveryError(Exception):
    """One delivery attempt failed; the text is safe to log (no secrets)."""


class Channel(Protocol):
    name: str
    target: str  # where it delivers, for humans: "/dev/log", "smtp.example.org:587 (starttls) ..."
    max_attempts: int

    def prepare(self, item: Any) -> Any: ...  # a RaisedAlert, or what the channel's own feed queues

    def deliver(self, payload: Any) -> str: ...  # a note for the operator, "" if none; raises DeliveryError

    def redact(self, text: str) -> str: ...

    def close(self) -> None: ...


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
        or _CONTROL_CHARS.search(address)
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
        self.recipients = [
            _check_address(source, f"alerts.email.recipients[{i}]", r) for i, r in enumerate(cfg.recipients)
        ]
        if not self.recipients:
            raise ConfigError(
                source,
                "alerts.email.recipients",
                "no recipient is set",
                'add recipients = ["ops@example.org"]',
            )
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
        from r3090d.effectors import alertmanager  # it imports this module

        channels.extend(alertmanager.build_channels(cfg.alertmanager, source))
    return channels


def check_config(cfg: Config, environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError for what only this module checks (facility, address, password file)."""
    for channel in build_channels(cfg.alerts, hostname="localhost", source=cfg.source, environ=environ):
        channel.close()


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


def _label(raised: RaisedAlert) -> str:
    a = raised.alert
    return f"{one_line(a.key)} {a.state.upper()} ({a.severity})"


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
        log.info("alert %s: %s", _label(raised), one_line(alert.summary))
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
        severity="info",
        state="firing",
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
