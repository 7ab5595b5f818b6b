"""Pure parts of the alert notifiers: priorities, subjects, bodies, addresses, secrets."""

from __future__ import annotations

import base64
import dataclasses

import pytest

from r3090d.config import AlertsConfig, ConfigError, EmailConfig, SyslogConfig
from r3090d.effectors import alerts
from r3090d.effectors.alerts import AlertContext, RaisedAlert
from r3090d.model import SendAlert

CTX = AlertContext(hostname="box", gpu_index=1, gpu_name="NVIDIA GeForce RTX 3090", instance=1)
WALL = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC


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
    assert alerts.syslog_severity(SendAlert("k", severity, state, "s")) == expected


def test_subject_names_host_gpu_key_state_severity_and_summary():
    assert alerts.email_subject(raised()) == "[r3090d] box gpu1 gpu_memory FIRING (warning): used 23.6 GiB"
    assert (
        alerts.email_subject(raised(state="resolved", summary=""))
        == "[r3090d] box gpu1 gpu_memory RESOLVED (warning)"
    )


def test_subject_is_one_line_and_bounded_whatever_the_summary():
    subject = alerts.email_subject(raised(summary="line one\r\nline two\t" + "x" * 500, key="a\nb"))
    assert "\n" not in subject and "\r" not in subject and "\t" not in subject
    assert "a b FIRING" in subject
    assert subject.endswith("…")
    assert len(subject) < 200


def test_subject_without_gpu():
    ctx = AlertContext(hostname="box")
    assert alerts.email_subject(raised(ctx=ctx)).startswith("[r3090d] box nogpu gpu_memory FIRING")


def test_body_has_summary_detail_host_gpu_unit_and_time():
    body = alerts.email_body(raised(detail="threshold 23500 MiB\nused 24170 MiB"))
    assert "gpu_memory is FIRING (warning)" in body
    assert "used 23.6 GiB" in body
    assert "threshold 23500 MiB\nused 24170 MiB" in body
    assert "Host:     box" in body
    assert "GPU:      1 (NVIDIA GeForce RTX 3090)" in body
    assert "Unit:     r3090d@1" in body
    assert "(2027-01-15 08:00:00 UTC)" in body


def test_syslog_message_is_one_line_and_bounded():
    text = alerts.syslog_message(raised(summary="a\nb\x00c" + "y" * 5000))
    assert text.startswith("gpu1 gpu_memory FIRING (warning): a b c")
    assert not any(ch in text for ch in "\n\r\x00")
    assert len(text) == alerts.MAX_SYSLOG_TEXT


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
    assert alerts.parse_syslog_address(text) == expected


@pytest.mark.parametrize(
    "text", ["", "host:0", "host:99999", "host:abc", "::1:514", "[::1", "[::1]x", ":514"]
)
def test_parse_syslog_address_rejects_with_key(text):
    with pytest.raises(ConfigError) as err:
        alerts.parse_syslog_address(text, "/etc/r3090d/r3090d.toml")
    assert err.value.key == "alerts.syslog.address"
    assert err.value.fix


def test_unknown_facility_and_bad_ident_are_config_errors():
    with pytest.raises(ConfigError) as err:
        alerts.SyslogChannel(SyslogConfig(facility="lokal0"))
    assert err.value.key == "alerts.syslog.facility" and "local0" in err.value.fix
    with pytest.raises(ConfigError) as err:
        alerts.SyslogChannel(SyslogConfig(ident="r3090d: evil"))
    assert err.value.key == "alerts.syslog.ident"
    assert alerts.SyslogChannel(SyslogConfig(facility="LOCAL3")).facility == "local3"


# ------------------------------------------------------------------ secrets


def email(**kw) -> EmailConfig:
    base = dict(enabled=True, smtp_host="127.0.0.1", security="none", recipients=["a@example.org"])
    base.update(kw)
    return EmailConfig(**base)


def test_password_from_file_strips_only_the_line_end(tmp_path):
    f = tmp_path / "pw"
    f.write_text(" s3cret pass \n")
    assert alerts.read_smtp_password(email(username="u", password_file=str(f)), environ={}) == " s3cret pass "


def test_password_from_systemd_credentials(tmp_path):
    (tmp_path / "smtp-password").write_text("from-credential\n")
    cfg = email(username="u")
    assert (
        alerts.read_smtp_password(cfg, environ={"CREDENTIALS_DIRECTORY": str(tmp_path)}) == "from-credential"
    )


def test_password_file_wins_over_credentials(tmp_path):
    (tmp_path / "smtp-password").write_text("from-credential")
    (tmp_path / "pw").write_text("from-file")
    cfg = email(username="u", password_file=str(tmp_path / "pw"))
    assert alerts.read_smtp_password(cfg, environ={"CREDENTIALS_DIRECTORY": str(tmp_path)}) == "from-file"


def test_no_username_means_no_password_read(tmp_path):
    assert alerts.read_smtp_password(email(), environ={"CREDENTIALS_DIRECTORY": str(tmp_path)}) is None


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
        alerts.read_smtp_password(email(username=username, password_file=str(f)), "cfg.toml", environ={})
    assert err.value.key == expect_key
    assert expect_text in err.value.one_line()
    assert "pw-line" not in err.value.one_line()


def test_username_without_any_password_source():
    with pytest.raises(ConfigError) as err:
        alerts.read_smtp_password(email(username="u"), environ={})
    assert "LoadCredential=smtp-password" in err.value.fix


def test_clear_text_login_to_a_remote_host_is_refused():
    with pytest.raises(ConfigError) as err:
        alerts.EmailChannel(email(smtp_host="mail.example.org", username="u"), password="pw", helo_name="box")
    assert err.value.key == "alerts.email.security"
    # Loopback relays are fine, and so is TLS.
    alerts.EmailChannel(email(smtp_host="localhost", username="u"), password="pw", helo_name="box")
    alerts.EmailChannel(
        email(smtp_host="mail.example.org", username="u", security="ssl"), password="pw", helo_name="box"
    )


@pytest.mark.parametrize("bad", ["nobody", "a b@example.org", "x@example.org\nBcc: evil@example.org"])
def test_bad_addresses_are_config_errors(bad):
    with pytest.raises(ConfigError) as err:
        alerts.EmailChannel(email(recipients=["ok@example.org", bad]), password=None, helo_name="box")
    assert err.value.key == "alerts.email.recipients[1]"


def test_redact_removes_password_and_its_wire_forms():
    channel = alerts.EmailChannel(email(username="user"), password="hunter2!", helo_name="box")
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


def test_send_alert_stays_frozen_with_detail():
    alert = SendAlert("k", "info", "firing", "s", detail="d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        alert.detail = "x"


def test_check_config_reports_alerts_mistakes_for_config_check(tmp_path):
    from r3090d.config import from_dict

    base = {"engine": {"model": "m"}, "alerts": {"syslog": {"facility": "daemon"}}}
    alerts.check_config(from_dict(base, "f.toml", check_files=False), environ={})
    base["alerts"]["syslog"]["facility"] = "deamon"
    with pytest.raises(ConfigError) as err:
        alerts.check_config(from_dict(base, "f.toml", check_files=False), environ={})
    assert err.value.one_line().startswith("f.toml: alerts.syslog.facility: unknown facility 'deamon'")
