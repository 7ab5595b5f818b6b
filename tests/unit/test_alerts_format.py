"""Pure parts of the alert notifiers: priorities, subjects, bodies, addresses, secrets."""

from __future__ import annotations

import base64
import dataclasses
import logging.handlers
from email import message_from_bytes
from email.policy import default as default_policy

import pytest

from r3090d.config import AlertsConfig, ConfigError, EmailConfig, SyslogConfig
from r3090d.core.actions import SendAlert
from r3090d.core.vocabulary import AlertState, Severity
from r3090d.effectors import alertformat, alerts, channels
from r3090d.effectors.alertformat import AlertContext, RaisedAlert

CTX = AlertContext(hostname="box", gpu_index=1, gpu_name="NVIDIA GeForce RTX 3090", instance=1)
WALL = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
UUID = "GPU-5f2e1c7a-0b3d-4e8f-9a61-2c7d3e4f5a6b"


def raised(key="gpu_memory", severity="warning", state="firing", summary="used 23.6 GiB", detail="", ctx=CTX):
    return RaisedAlert(SendAlert(key, severity, state, summary, detail), ctx, WALL)


@pytest.mark.parametrize(
    "severity,state,expected",
    [
        ("critical", "firing", 2),
        ("critical", "reminder", 2),
        ("warning", "firing", 4),
        ("warning", "reminder", 4),
        ("info", "firing", 6),
        ("info", "reminder", 6),
        ("critical", "resolved", 5),
        ("warning", "resolved", 5),
        ("info", "resolved", 5),
        ("bogus", "firing", 4),  # an unknown severity is not silently demoted to info
    ],
)
def test_syslog_severity_follows_rfc5424(severity, state, expected):
    assert logging.handlers.SysLogHandler.priority_names[alertformat.syslog_priority_name(SendAlert("k", severity, state, "s"))] == expected


@pytest.mark.parametrize(
    "severity,state,level",
    [
        (Severity.CRITICAL, AlertState.FIRING, logging.ERROR),
        (Severity.CRITICAL, AlertState.REMINDER, logging.ERROR),
        (Severity.WARNING, AlertState.FIRING, logging.WARNING),
        (Severity.INFO, AlertState.FIRING, logging.WARNING),
        (Severity.CRITICAL, AlertState.RESOLVED, logging.INFO),  # good news: out of `journalctl -p warning`
        (Severity.WARNING, AlertState.RESOLVED, logging.INFO),
    ],
)
def test_the_daemons_own_log_line_for_an_alert(severity, state, level):
    assert alertformat.log_level(SendAlert("k", severity, state, "s")) == level


def test_subject_names_host_gpu_key_state_severity_summary_and_gpu_name():
    assert (
        alertformat.email_subject(raised())
        == "[r3090d] box gpu1 gpu_memory FIRING (warning): used 23.6 GiB [NVIDIA GeForce RTX 3090]"
    )
    assert (
        alertformat.email_subject(raised(state="resolved", summary=""))
        == "[r3090d] box gpu1 gpu_memory RESOLVED (warning) [NVIDIA GeForce RTX 3090]"
    )
    with_uuid = dataclasses.replace(CTX, gpu_uuid=UUID)
    assert alertformat.email_subject(raised(ctx=with_uuid)).endswith(f"used 23.6 GiB [NVIDIA GeForce RTX 3090, {UUID}]")
    index_only = AlertContext(hostname="box", gpu_index=1)
    assert alertformat.email_subject(raised(ctx=index_only)) == "[r3090d] box gpu1 gpu_memory FIRING (warning): used 23.6 GiB"


def test_subject_is_one_line_and_bounded_whatever_the_summary():
    subject = alertformat.email_subject(raised(summary="line one\r\nline two\t" + "x" * 500, key="a\nb"))
    assert "\n" not in subject and "\r" not in subject and "\t" not in subject
    assert "a b FIRING" in subject
    assert subject.endswith("… [NVIDIA GeForce RTX 3090]")
    assert len(subject) < 200


def test_subject_without_gpu():
    ctx = AlertContext(hostname="box")
    assert alertformat.email_subject(raised(ctx=ctx)) == "[r3090d] box nogpu gpu_memory FIRING (warning): used 23.6 GiB"
    # A name without a watched GPU (gpu.required = false) is not shown: "nogpu [name]" would contradict itself.
    named = AlertContext(hostname="box", gpu_name="NVIDIA GeForce RTX 3090", gpu_uuid=UUID)
    assert alertformat.email_subject(raised(ctx=named)) == alertformat.email_subject(raised(ctx=ctx))
    assert alertformat.syslog_message(raised(ctx=named)) == "nogpu gpu_memory FIRING (warning): used 23.6 GiB"
    body = alertformat.email_body(raised(ctx=named))
    assert "GPU:      none configured\n" in body and "UUID" not in body


def test_context_takes_the_gpu_nvml_reported():
    ctx = AlertContext(hostname="box", gpu_index=0, instance=2)
    named = ctx.with_gpu("NVIDIA GeForce\nRTX 3090", None, UUID)
    assert (named.gpu_index, named.gpu_name, named.gpu_uuid) == (0, "NVIDIA GeForce RTX 3090", UUID)
    assert ctx.with_gpu("NVIDIA GeForce RTX 3090", 3, None).gpu_index == 3
    assert ctx.with_gpu("", 0, "").gpu_identity == ""
    assert named.with_gpu(None, None, None) == named  # a sample whose name read failed forgets nothing
    assert named.labels == (
        ("host", "box"),
        ("instance", "2"),
        ("gpu_index", "0"),
        ("gpu_name", "NVIDIA GeForce RTX 3090"),
        ("gpu_uuid", UUID),
    )
    assert AlertContext(hostname="box").labels == (("host", "box"),)


@pytest.mark.parametrize("length", range(0, 131, 3))
def test_the_subject_reads_back_unchanged_whatever_its_length(length):
    # A subject that fits on a line of its own but not after "Subject: " must not come back with a leading space.
    channel = channels.EmailChannel(email(), password=None, helo_name="box")
    alert = raised(summary=("word " * 30)[:length].strip())
    message = message_from_bytes(channel.prepare(alert).as_bytes(), policy=default_policy)
    assert message["Subject"] == alertformat.email_subject(alert)


def test_body_has_summary_detail_host_gpu_unit_and_time():
    body = alertformat.email_body(raised(detail="threshold 23500 MiB\nused 24170 MiB"))
    assert "gpu_memory is FIRING (warning)" in body
    assert "used 23.6 GiB" in body
    assert "threshold 23500 MiB\nused 24170 MiB" in body
    assert "Host:     box" in body
    assert "GPU:      1 (NVIDIA GeForce RTX 3090)" in body
    assert "UUID" not in body  # not known in CTX
    with_uuid = alertformat.email_body(raised(ctx=dataclasses.replace(CTX, gpu_uuid=UUID)))
    assert f"GPU:      1 (NVIDIA GeForce RTX 3090)\nGPU UUID: {UUID}\n" in with_uuid
    assert "Unit:     r3090d@1" in body
    assert "(2027-01-15 08:00:00 UTC)" in body


def test_syslog_message_is_one_line_and_bounded():
    text = alertformat.syslog_message(raised(summary="a\nb\x00c" + "y" * 5000))
    assert text.startswith("gpu1 gpu_memory FIRING (warning): a b c")
    assert not any(ch in text for ch in "\n\r\x00")
    assert len(text) == alertformat.MAX_SYSLOG_TEXT
    assert text.endswith("y… [NVIDIA GeForce RTX 3090]")  # the GPU survives the cut
    assert alertformat.syslog_message(raised()) == "gpu1 gpu_memory FIRING (warning): used 23.6 GiB [NVIDIA GeForce RTX 3090]"


def test_retry_delay_doubles_then_caps():
    assert [alerts.retry_delay(n, 2.0, 120.0) for n in range(1, 9)] == [2, 4, 8, 16, 32, 64, 120, 120]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("/dev/log", "/dev/log"),
        ("/run/systemd/journal/dev-log", "/run/systemd/journal/dev-log"),
        ("loghost:1514", ("loghost", 1514)),
        ("loghost", ("loghost", 514)),
        ("10.0.0.5:514", ("10.0.0.5", 514)),
        ("[::1]:5514", ("::1", 5514)),
        ("[fe80::1]", ("fe80::1", 514)),
    ],
)
def test_parse_syslog_address(text, expected):
    assert channels.parse_syslog_address(text) == expected


@pytest.mark.parametrize(
    "text", ["", "host:0", "host:99999", "host:abc", "::1:514", "[::1", "[::1]x", ":514"]
)
def test_parse_syslog_address_rejects_with_key(text):
    with pytest.raises(ConfigError) as err:
        channels.parse_syslog_address(text, "/etc/r3090d/r3090d.toml")
    assert err.value.key == "alerts.syslog.address"
    assert err.value.fix


def test_unknown_facility_and_bad_ident_are_config_errors():
    with pytest.raises(ConfigError) as err:
        channels.SyslogChannel(SyslogConfig(facility="lokal0"))
    assert err.value.key == "alerts.syslog.facility" and "local0" in err.value.fix
    with pytest.raises(ConfigError) as err:
        channels.SyslogChannel(SyslogConfig(ident="r3090d: evil"))
    assert err.value.key == "alerts.syslog.ident"
    assert channels.SyslogChannel(SyslogConfig(facility="LOCAL3")).facility == "local3"


# ------------------------------------------------------------------ secrets


def email(**kw) -> EmailConfig:
    base = dict(enabled=True, smtp_host="127.0.0.1", security="none", recipients=["a@example.org"])
    base.update(kw)
    return EmailConfig(**base)


def test_password_from_file_strips_only_the_line_end(tmp_path):
    f = tmp_path / "pw"
    f.write_text(" s3cret pass \n")
    assert channels.read_smtp_password(email(username="u", password_file=str(f)), environ={}) == " s3cret pass "


def test_password_from_systemd_credentials(tmp_path):
    (tmp_path / "smtp-password").write_text("from-credential\n")
    cfg = email(username="u")
    assert (
        channels.read_smtp_password(cfg, environ={"CREDENTIALS_DIRECTORY": str(tmp_path)}) == "from-credential"
    )


def test_password_file_wins_over_credentials(tmp_path):
    (tmp_path / "smtp-password").write_text("from-credential")
    (tmp_path / "pw").write_text("from-file")
    cfg = email(username="u", password_file=str(tmp_path / "pw"))
    assert channels.read_smtp_password(cfg, environ={"CREDENTIALS_DIRECTORY": str(tmp_path)}) == "from-file"


def test_no_username_means_no_password_read(tmp_path):
    assert channels.read_smtp_password(email(), environ={"CREDENTIALS_DIRECTORY": str(tmp_path)}) is None


@pytest.mark.parametrize(
    "content,username,expect_key,expect_text",
    [
        (None, "u", "alerts.email.password_file", "cannot read"),
        ("", "u", "alerts.email.password_file", "is empty"),
        ("\n", "u", "alerts.email.password_file", "is empty"),
        ("pw-line-1\npw-line-2\n", "u", "alerts.email.password_file", "more than one line"),
        ("pw-line", "", "alerts.email.password_file", "username is empty"),
    ],
)
def test_password_problems_are_config_errors_without_the_text(
    tmp_path, content, username, expect_key, expect_text
):
    f = tmp_path / "pw"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ConfigError) as err:
        channels.read_smtp_password(email(username=username, password_file=str(f)), "cfg.toml", environ={})
    assert err.value.key == expect_key
    assert expect_text in err.value.one_line()
    assert "pw-line" not in err.value.one_line()


def test_username_without_any_password_source():
    with pytest.raises(ConfigError) as err:
        channels.read_smtp_password(email(username="u"), environ={})
    assert "LoadCredential=smtp-password" in err.value.fix


def test_clear_text_login_to_a_remote_host_is_refused():
    with pytest.raises(ConfigError) as err:
        channels.EmailChannel(email(smtp_host="mail.example.org", username="u"), password="pw", helo_name="box")
    assert err.value.key == "alerts.email.security"
    # Loopback relays are fine, and so is TLS.
    channels.EmailChannel(email(smtp_host="localhost", username="u"), password="pw", helo_name="box")
    channels.EmailChannel(
        email(smtp_host="mail.example.org", username="u", security="ssl"), password="pw", helo_name="box"
    )


@pytest.mark.parametrize("bad", ["nobody", "a b@example.org", "x@example.org\nBcc: evil@example.org"])
def test_bad_addresses_are_config_errors(bad):
    with pytest.raises(ConfigError) as err:
        channels.EmailChannel(email(recipients=["ok@example.org", bad]), password=None, helo_name="box")
    assert err.value.key == "alerts.email.recipients[1]"


def test_redact_removes_password_and_its_wire_forms():
    channel = channels.EmailChannel(email(username="user"), password="hunter2!", helo_name="box")
    plain = base64.b64encode(b"\0user\0hunter2!").decode()
    login = base64.b64encode(b"hunter2!").decode()
    text = channel.redact(f"535 nope hunter2! {plain} {login}")
    assert "hunter2" not in text and plain not in text and login not in text
    assert text.count("<redacted>") == 3
    assert "hunter2" not in repr(channel)


def test_submit_rejects_a_non_alert():
    cfg = AlertsConfig(syslog=SyslogConfig(enabled=False))
    with alerts.AlertDispatcher(cfg, CTX) as dispatcher:
        with pytest.raises(TypeError):
            dispatcher.submit("gpu_memory firing")
        assert dispatcher.channels == []
        assert dispatcher.flush(0.1) is True


def test_set_gpu_names_the_gpu_once_and_repeats_are_no_ops():
    cfg = AlertsConfig(syslog=SyslogConfig(enabled=False))
    with alerts.AlertDispatcher(cfg, AlertContext(hostname="box", gpu_index=0)) as dispatcher:
        assert dispatcher.set_gpu("NVIDIA GeForce RTX 3090", 0, UUID) is True
        assert dispatcher.set_gpu("NVIDIA GeForce RTX 3090", 0, UUID) is False
        assert dispatcher.context.gpu_identity == f"[NVIDIA GeForce RTX 3090, {UUID}]"


def test_send_alert_stays_frozen_with_detail():
    alert = SendAlert("k", "info", "firing", "s", detail="d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        alert.detail = "x"


def test_check_config_reports_alerts_mistakes_for_config_check(tmp_path):
    from r3090d.config import from_dict

    base = {"engine": {"model": "m"}, "alerts": {"syslog": {"facility": "daemon"}}}
    channels.check_config(from_dict(base, "f.toml", check_files=False), environ={})
    base["alerts"]["syslog"]["facility"] = "deamon"
    with pytest.raises(ConfigError) as err:
        channels.check_config(from_dict(base, "f.toml", check_files=False), environ={})
    assert err.value.one_line().startswith("f.toml: alerts.syslog.facility: unknown facility 'deamon'")
