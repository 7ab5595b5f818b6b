"""Configuration: loading, validation messages, exit codes, and the vLLM argv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import tomllib
from pathlib import Path

import pytest

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d import exitcodes
from r3090d.config import ConfigError
from tests import unprivileged as unprivileged_mod
from tests.unprivileged import SYSTEM_PYTHON

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def write(tmp_path, body: str) -> Path:
    path = tmp_path / "r3090d.toml"
    path.write_text(textwrap.dedent(body))
    return path


def base(model_dir, extra_engine: str = "", rest: str = "") -> str:
    return f"""
[engine]
python = "{sys.executable}"
model = "{model_dir}"
{extra_engine}
[gpu]
required = false
{rest}
"""


def test_shipped_example_is_valid_apart_from_its_paths():
    cfg = configmod.load(REPO / "etc" / "r3090d.toml", check_files=False)
    assert cfg.profile == "realtime"
    assert cfg.engine.port == 8000
    assert cfg.watchdog.gpu_memory_alert_mib == 23500
    # Every default in the annotated example matches the dataclass default.
    assert cfg.watchdog == configmod.WatchdogConfig()
    assert cfg.alerts == configmod.AlertsConfig()
    assert cfg.daemon == configmod.DaemonConfig()
    assert cfg.preflight == configmod.PreflightConfig()
    assert cfg.gpu == configmod.GpuConfig()


def test_valid_config_loads(tmp_path, model_dir):
    cfg = configmod.load(write(tmp_path, base(model_dir, 'served_model_name = "m"\nport = 8123')))
    assert cfg.engine.port == 8123
    assert cfg.model_name == "m"
    assert cfg.engine_url == "http://127.0.0.1:8123"
    assert cfg.active_profile.max_num_seqs == 16


def test_instance_derives_ports_and_directories(tmp_path, model_dir):
    cfg = configmod.load(write(tmp_path, base(model_dir)), instance=2)
    assert cfg.gpu.index == 2
    assert cfg.engine.port == 8002
    assert cfg.daemon.exporter_port == 9402
    assert cfg.daemon.state_dir.endswith("/2")
    assert cfg.daemon.runtime_dir.endswith("/2")


def test_api_key_is_read_from_file_and_redacted(tmp_path, model_dir):
    key = tmp_path / "key"
    key.write_text("s3cret-key\n")
    cfg = configmod.load(write(tmp_path, base(model_dir, f'api_key_file = "{key}"')))
    assert cfg.api_key == "s3cret-key"
    assert "s3cret-key" not in repr(cfg)
    assert "s3cret-key" not in str(configmod.redacted(cfg))
    argv = argvmod.build_argv(cfg, argvmod.parse_version("0.32.0"))
    assert "s3cret-key" not in " ".join(argv)
    assert argvmod.engine_env(cfg, {})["VLLM_API_KEY"] == "s3cret-key"


def test_engine_env_scrubs_systemd_variables(tmp_path, model_dir):
    cfg = configmod.load(write(tmp_path, base(model_dir)))
    env = argvmod.engine_env(cfg, {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1", "PATH": "/bin"})
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env and "WATCHDOG_PID" not in env
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["PATH"] == "/bin"


def test_profile_flags_in_argv(tmp_path, model_dir):
    cfg = configmod.load(write(tmp_path, base(model_dir, rest='[profiles.realtime]\nenable_prefix_caching = false\nmax_num_seqs = 8')))
    argv = argvmod.build_argv(cfg, argvmod.parse_version("0.32.0"))
    joined = " ".join(argv)
    assert "--max-num-seqs 8" in joined
    assert "--no-enable-prefix-caching" in argv
    assert "--shutdown-timeout 30" in joined


def test_version_awareness_refuses_missing_flag(tmp_path, model_dir):
    cfg = configmod.load(write(tmp_path, base(model_dir)))
    with pytest.raises(ConfigError) as err:
        argvmod.build_argv(cfg, argvmod.parse_version("0.17.1"))
    assert "engine.shutdown_timeout" in str(err.value) and "0.18" in str(err.value)
    cfg = configmod.load(write(tmp_path, base(model_dir, 'shutdown_timeout = 0\nextra_args = ["--num-scheduler-steps", "8"]')))
    with pytest.raises(ConfigError) as err:
        argvmod.build_argv(cfg, argvmod.parse_version("0.32.0"))
    assert "removed in vLLM 0.10.2" in str(err.value)
    # An old vLLM still had it.
    assert "--num-scheduler-steps" in argvmod.build_argv(cfg, argvmod.parse_version("0.9.2"))


@pytest.mark.parametrize(
    "arg, says",
    [("--max_model_len=4096", "--max-model-len is set by profile"), ("--served_model_name", "--served-model-name is set by r3090d"),
     ("--disable_log_stats", "--disable-log-stats removes")],
)  # fmt: skip
def test_flags_r3090d_owns_are_refused_in_the_underscore_spelling_too(tmp_path, model_dir, arg, says):
    # vLLM reads --max_model_len as --max-model-len: it would fight the profile just the same.
    with pytest.raises(ConfigError) as err:
        configmod.load(write(tmp_path, base(model_dir, f'extra_args = ["{arg}"]')))
    assert err.value.key == "engine.extra_args[0]" and says in err.value.one_line()


def test_email_without_recipients_is_a_config_error(tmp_path, model_dir):
    with pytest.raises(ConfigError) as err:
        configmod.load(write(tmp_path, base(model_dir, rest="[alerts.email]\nenabled = true\n")))
    assert err.value.key == "alerts.email.recipients" and "no recipient is set" in err.value.one_line()


@pytest.mark.parametrize(
    "version, accepted",
    [("0.9.2", True), ("0.10.2rc1", True), ("0.10.2.dev45+g1234abc", True), ("0.10.2", False), ("0.10.2+cpu", False),
     ("0.10.2.post1", False), ("0.11.0+cpu", False)],
)  # fmt: skip
def test_a_removed_flag_is_judged_in_pep_440_order(tmp_path, model_dir, version, accepted):
    # FLAG_VERSIONS names 0.10.2 as the first release without --num-scheduler-steps; its
    # pre-releases and dev builds come before it, so they still have the flag.
    body = base(model_dir, 'shutdown_timeout = 0\nextra_args = ["--num-scheduler-steps", "8"]')
    cfg = configmod.load(write(tmp_path, body))
    if accepted:
        assert "--num-scheduler-steps" in argvmod.build_argv(cfg, argvmod.parse_version(version))
    else:
        with pytest.raises(ConfigError, match="removed in vLLM 0.10.2"):
            argvmod.build_argv(cfg, argvmod.parse_version(version))


@pytest.mark.parametrize(
    "text, shown, release",
    [("0.10.2rc1", "0.10.2rc1", (0, 10, 2)), (" 0.11.0+cpu\n", "0.11.0+cpu", (0, 11, 0)), ("0.6.3.post1", "0.6.3.post1", (0, 6, 3))],
)  # fmt: skip
def test_the_vllm_version_keeps_its_text_for_display(text, shown, release):
    version = argvmod.parse_version(text)
    assert str(version) == shown and version.parts == release


@pytest.mark.parametrize("garbage", ["", "vllm", "latest", "0.10.x"])
def test_an_unreadable_vllm_version_is_an_error(garbage):
    with pytest.raises(ValueError, match="unparseable version"):
        argvmod.parse_version(garbage)


@pytest.mark.parametrize(
    "version, quieted",
    [("0.15.1", False), ("0.16.0", True), ("0.16.0rc1", True), ("0.31.2", True), ("0.32.0", True)],
)
def test_the_daemons_polls_leave_the_access_log_where_vllm_can(tmp_path, model_dir, version, quieted):
    cfg = configmod.load(write(tmp_path, base(model_dir, "shutdown_timeout = 0")))
    argv = argvmod.build_argv(cfg, argvmod.parse_version(version))
    assert "--disable-uvicorn-access-log" not in argv, "the users' requests keep their access lines"
    if quieted:
        # One comma-separated value, as vLLM parses it.
        i = argv.index("--disable-access-log-for-endpoints")
        assert argv[i + 1] == "/health,/metrics"
    else:
        assert "--disable-access-log-for-endpoints" not in argv  # vLLM 0.15 would refuse to start


@pytest.mark.parametrize(
    "extra", [["--disable-access-log-for-endpoints", "/ping"], ["--disable-access-log-for-endpoints=/ping"]]
)
def test_the_users_own_access_log_endpoints_win(tmp_path, model_dir, extra):
    cfg = configmod.load(write(tmp_path, base(model_dir, f"extra_args = {extra!r}".replace("'", '"'))))
    argv = argvmod.build_argv(cfg, argvmod.parse_version("0.32.0"))
    assert [a for a in argv if a.startswith("--disable-access-log-for-endpoints")] == [extra[0]]
    assert argv[-len(extra) :] == extra


def test_the_access_log_flag_is_refused_before_vllm_had_it(tmp_path, model_dir):
    cfg = configmod.load(write(tmp_path, base(model_dir, 'shutdown_timeout = 0\nextra_args = ["--disable-access-log-for-endpoints", "/ping"]')))
    with pytest.raises(ConfigError) as err:
        argvmod.build_argv(cfg, argvmod.parse_version("0.15.1"))
    assert "engine.extra_args[0]" in str(err.value) and "0.16" in str(err.value)


def venv_with_vllm(tmp_path, version_py: str, init: str = "") -> str:
    """A venv whose site-packages holds a stand-in `vllm` package; returns its python."""
    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(init)
    (site / "_version.py").write_text(version_py)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = next(venv.glob("lib/python3*/site-packages"))
    (purelib / "shim.pth").write_text(str(tmp_path / "site") + "\n")
    return str(venv / "bin" / "python")


def test_engine_version_read_from_the_engine_python(tmp_path):
    python = venv_with_vllm(tmp_path, "version = '0.21.3'\n", init="raise SystemExit('importing vllm is slow and must not happen')\n")
    assert str(argvmod.engine_version(python)) == "0.21.3"
    with pytest.raises(argvmod.EngineNotInstalled):
        argvmod.engine_version(str(tmp_path / "nope" / "python"))


# ------------------------------------------------- bad configs through the CLI

NOT_UTF8 = b"\xff\xfe"


def secret_file(model_dir: Path, content: bytes | None) -> Path:
    """A secret file beside the model directory; None makes it a FIFO with no writer."""
    path = model_dir.parent / "secret"
    if content is None:
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    return path


BAD_CONFIGS = [
    # (name, file body builder, expected key in the message)
    ("syntax", lambda m: f'[engine]\nmodel = "{m}"\nport = \n', "TOML syntax error"),
    ("unknown key", lambda m: base(m, "prot = 8000"), "engine.prot"),
    ("unknown section", lambda m: base(m) + "[watchdgo]\npoll_interval = 1\n", "watchdgo"),
    ("wrong type", lambda m: base(m, 'port = "8000"'), "engine.port"),
    ("bool as int", lambda m: base(m, "port = true"), "engine.port"),
    ("out of range", lambda m: base(m, "port = 70000"), "engine.port"),
    ("negative timeout", lambda m: base(m, "shutdown_timeout = -1"), "engine.shutdown_timeout"),
    ("missing model path", lambda m: base("/nonexistent/model"), "engine.model"),
    ("missing model key", lambda m: '[gpu]\nrequired = false\n', "engine.model"),
    ("disable-log-stats", lambda m: base(m, 'extra_args = ["--disable-log-stats"]'), "engine.extra_args[0]"),
    ("api key in argv", lambda m: base(m, 'extra_args = ["--api-key", "x"]'), "engine.extra_args[0]"),
    ("public host without key", lambda m: base(m, 'host = "0.0.0.0"'), "engine.host"),
    ("unknown profile", lambda m: 'profile = "fast"\n' + base(m), "profile"),
    (
        "profile over the alert threshold",
        lambda m: f'profile = "batch"\n[engine]\npython = "{sys.executable}"\nmodel = "{m}"\n[profiles.batch]\ngpu_memory_utilization = 0.95\n',
        "profiles.batch.gpu_memory_utilization",
    ),
    ("bad choice", lambda m: base(m, rest='[alerts.email]\nsecurity = "tls"\n'), "alerts.email.security"),
    ("missing api key file", lambda m: base(m, 'api_key_file = "/nonexistent/key"'), "engine.api_key_file"),
    ("engine python missing", lambda m: base(m).replace(sys.executable, "/nonexistent/python"), "engine.python"),
    ("path component too long", lambda m: base(m).replace(str(m), f"/srv/{'m' * 300}"), "engine.model"),
    ("NUL in a path", lambda m: base(m).replace(sys.executable, "/usr/bin/py\\u0000thon"), "engine.python"),
    ("nested 2000 deep", lambda m: base(m, "extra_args = " + "[" * 2000 + "]" * 2000), "nested"),
    ("nan", lambda m: base(m, rest="[watchdog]\npoll_interval = nan\n"), "watchdog.poll_interval"),
    ("non-UTF-8 api key file", lambda m: base(m, f'api_key_file = "{secret_file(m, NOT_UTF8)}"'), "engine.api_key_file"),
    ("api key file is a FIFO", lambda m: base(m, f'api_key_file = "{secret_file(m, None)}"'), "engine.api_key_file"),
    ("misspelt throttle reason", lambda m: base(m, rest='[watchdog]\nthrottle_warn_reasons = ["hw_slowdwn"]\n'), "watchdog.throttle_warn_reasons[0]"),
]


@pytest.mark.parametrize("name,body,key", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
@pytest.mark.parametrize("command", ["r3090ctl config check", "r3090d"])
def test_bad_config_is_one_line_exit_78(tmp_path, model_dir, name, body, key, command):
    path = write(tmp_path, body(model_dir))
    mod = "r3090d.cli:ctl_main" if command.startswith("r3090ctl") else "r3090d.cli:daemon_main"
    args = ["config", "check"] if command.startswith("r3090ctl") else []
    code = f"import sys; sys.argv[0] = {command.split()[0]!r}; from {mod.split(':')[0]} import {mod.split(':')[1]} as m; m()"
    out = subprocess.run([sys.executable, "-c", code, *args, "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 78, (out.stdout, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert str(path) in lines[0]
    assert key in lines[0]
    assert "fix:" in lines[0]


def test_usage_error_exits_64():
    out = subprocess.run([sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()", "config", "check", "--bogus"], capture_output=True, text=True)
    assert out.returncode == 64
    assert "Traceback" not in out.stderr


def test_config_check_prints_argv_and_redacts(tmp_path, model_dir):
    key = tmp_path / "key"
    key.write_text("hunter2-secret")
    path = write(tmp_path, base(model_dir, f'api_key_file = "{key}"'))
    python = venv_with_vllm(tmp_path, "__version__ = '0.32.0'\n")
    path.write_text(path.read_text().replace(sys.executable, python))
    out = subprocess.run([sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()", "config", "check", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout
    assert "<redacted>" in out.stdout
    assert "argv: " in out.stdout and "--shutdown-timeout 30" in out.stdout


def test_config_check_reports_alert_channel_mistakes(tmp_path, model_dir):
    path = write(tmp_path, base(model_dir, rest='[alerts.syslog]\nfacility = "daemonn"\n'))
    out = subprocess.run([sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()", "config", "check", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 78, out.stderr
    assert "alerts.syslog.facility" in out.stderr and "Traceback" not in out.stderr


# ------------------------------------------- malformed values: ConfigError, never a traceback


def from_base(model_dir, **sections) -> dict:
    """A minimal valid config as a dict, with sections merged in."""
    data = {"engine": {"python": sys.executable, "model": str(model_dir)}, "gpu": {"required": False}}
    for name, table in sections.items():
        if isinstance(table, dict):
            data.setdefault(name, {}).update(table)
        else:
            data[name] = table
    return data


def refused(data, *, key: str, problem: str = "", instance=None, check_files=True) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        configmod.from_dict(data, "r3090d.toml", instance, check_files=check_files)
    line = err.value.one_line()
    assert err.value.key == key, line
    assert line.startswith(f"r3090d.toml: {key}: "), line
    assert problem in line, line
    assert "(fix: " in line and "\n" not in line, line
    return err.value


LONG = "x" * 256


@pytest.mark.parametrize(
    "section,key",
    [("daemon", "state_dir"), ("daemon", "runtime_dir"), ("engine", "python"), ("engine", "model"), ("engine", "api_key_file")],
)
def test_path_component_over_255_bytes_is_refused(model_dir, section, key):
    data = from_base(model_dir, **{section: {key: f"/srv/{LONG}/x"}})
    refused(data, key=f"{section}.{key}", problem="longer than 255 bytes")
    # Multi-byte characters count in bytes, as the kernel counts them.
    data = from_base(model_dir, **{section: {key: "/srv/" + "é" * 128}})
    refused(data, key=f"{section}.{key}", problem="longer than 255 bytes")


def test_password_file_path_is_checked(model_dir):
    email = {"enabled": True, "recipients": ["ops@example.org"], "username": "u", "password_file": f"/etc/{LONG}"}
    refused(from_base(model_dir, alerts={"email": email}), key="alerts.email.password_file", problem="longer than 255 bytes")


@pytest.mark.parametrize("section,key", [("engine", "python"), ("engine", "model"), ("engine", "api_key_file"), ("daemon", "state_dir"), ("engine", "served_model_name")])
def test_nul_byte_in_a_string_is_refused(model_dir, section, key):
    refused(from_base(model_dir, **{section: {key: "/srv/a\0b"}}), key=f"{section}.{key}", problem="NUL")


def test_non_utf8_api_key_file_is_refused(tmp_path, model_dir):
    key = tmp_path / "key"
    key.write_bytes(b"\xff\xfe-latin1-\xe9\n")
    refused(from_base(model_dir, engine={"api_key_file": str(key)}), key="engine.api_key_file", problem="not UTF-8")


def test_non_utf8_smtp_password_file_is_refused(tmp_path, model_dir):
    pw = tmp_path / "pw"
    pw.write_bytes(b"\xff\xfe\n")
    email = {"enabled": True, "recipients": ["ops@example.org"], "username": "u", "password_file": str(pw)}
    refused(from_base(model_dir, alerts={"email": email}), key="alerts.email.password_file", problem="not UTF-8")


def test_deeply_nested_toml_is_a_config_error(tmp_path, model_dir):
    path = write(tmp_path, base(model_dir, "extra_args = " + "[" * 2000 + "]" * 2000))
    with pytest.raises(ConfigError) as err:
        configmod.load(path)
    assert str(path) in str(err.value) and "nested" in str(err.value) and "fix:" in str(err.value)


def test_integer_too_long_to_read_is_a_config_error(tmp_path, model_dir):
    path = write(tmp_path, base(model_dir, "port = " + "1" * 5000))
    with pytest.raises(ConfigError) as err:
        configmod.load(path)
    assert str(path) in str(err.value) and "fix:" in str(err.value)


# ------------------------------------------------------------------ secret files


def test_secret_from_a_character_device_is_refused_at_once(model_dir):
    refused(from_base(model_dir, engine={"api_key_file": "/dev/zero"}), key="engine.api_key_file", problem="not a regular file")


def test_secret_from_a_fifo_is_refused_without_blocking(tmp_path, model_dir):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    result: dict = {}

    def attempt():
        try:
            configmod.from_dict(from_base(model_dir, engine={"api_key_file": str(fifo)}), "r3090d.toml")
        except ConfigError as exc:
            result["error"] = exc

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=30)  # a reader blocked on a FIFO with no writer never returns
    if worker.is_alive():
        # Unblock the stuck reader so the test process can exit.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO as the API key file blocked")
    assert result["error"].key == "engine.api_key_file" and "not a regular file" in str(result["error"])


def test_secret_over_the_size_cap_is_refused(tmp_path, model_dir):
    key = tmp_path / "key"
    key.write_bytes(b"k" * (configmod.SECRET_MAX_BYTES + 1))
    refused(from_base(model_dir, engine={"api_key_file": str(key)}), key="engine.api_key_file", problem="over the")
    key.write_bytes(b"k" * configmod.SECRET_MAX_BYTES)
    assert configmod.from_dict(from_base(model_dir, engine={"api_key_file": str(key)})).api_key == "k" * configmod.SECRET_MAX_BYTES


# The config loaded in a child without root's privileges: its uid, then the API key's length or the error.
LOAD_CONFIG = """
import json, os, sys
from r3090d import config as configmod, exitcodes
print(os.geteuid())
try:
    cfg = configmod.from_dict(json.loads(sys.argv[1]), "r3090d.toml")
except configmod.ConfigError as exc:
    print(exc.one_line())
    sys.exit(exitcodes.CONFIG)
print(f"an API key of {len(cfg.api_key)} characters")
"""


def test_unreadable_secret_is_refused(unprivileged):
    model = unprivileged.mkdir("model")
    (model / "config.json").write_text("{}")
    (model / "config.json").chmod(0o644)
    key = unprivileged.mkdir("secrets") / "key"
    key.write_text("sk-test")
    data = json.dumps({"engine": {"python": SYSTEM_PYTHON, "model": str(model), "api_key_file": str(key)}, "gpu": {"required": False}})
    uid = unprivileged_mod.expected_uid()
    # The same child reads the key once the file's mode lets it: the import, the paths and the
    # user all work, so the refusal below is the file's permission alone.
    key.chmod(0o644)
    readable = unprivileged.python(LOAD_CONFIG, data)
    assert (readable.returncode, readable.stdout) == (0, f"{uid}\nan API key of 7 characters\n"), readable.stderr
    key.chmod(0)
    out = unprivileged.python(LOAD_CONFIG, data)
    assert (out.returncode, out.stderr) == (exitcodes.CONFIG, ""), out.stderr
    assert out.stdout == (f"{uid}\nr3090d.toml: engine.api_key_file: cannot read {key}: Permission denied "
                          "(fix: check the file exists and the service user can read it)\n")  # fmt: skip


def test_secret_directory_is_refused(tmp_path, model_dir):
    refused(from_base(model_dir, engine={"api_key_file": str(tmp_path)}), key="engine.api_key_file", problem="not a regular file")


# ------------------------------------------------------------ non-finite numbers


@pytest.mark.parametrize("text", ["nan", "+nan", "-nan", "inf", "+inf", "-inf", "1e400"])
def test_non_finite_float_is_refused(tmp_path, model_dir, text):
    path = write(tmp_path, base(model_dir, rest=f"[watchdog]\npoll_interval = {text}\n"))
    with pytest.raises(ConfigError) as err:
        configmod.load(path)
    assert err.value.key == "watchdog.poll_interval" and "finite" in err.value.problem


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_profile_value_is_refused(model_dir, value):
    data = from_base(model_dir, profiles={"realtime": {"gpu_memory_utilization": value}})
    refused(data, key="profiles.realtime.gpu_memory_utilization", problem="finite")
    # Also a profile no one selects: it still must not carry a NaN.
    data = from_base(model_dir, profiles={"spare": {"gpu_memory_utilization": value}})
    refused(data, key="profiles.spare.gpu_memory_utilization", problem="finite")


def test_integer_too_large_for_a_float_is_refused(model_dir):
    refused(from_base(model_dir, watchdog={"backoff_max": 1 << 1100}), key="watchdog.backoff_max", problem="out of range")


def test_profile_table_values_are_normalised(model_dir):
    cfg = configmod.from_dict(from_base(model_dir, profiles={"mine": {"max_num_seqs": 4}}))
    assert cfg.profiles == {"mine": {"max_num_seqs": 4}}
    assert configmod.resolve_profiles(cfg)["mine"].max_num_seqs == 4


# ------------------------------------------------ values that used to fail later


@pytest.mark.parametrize("section,key", [("daemon", "exporter_port"), ("engine", "port")])
def test_port_plus_instance_offset_must_fit(model_dir, section, key):
    data = from_base(model_dir, **{section: {key: 65535}})
    assert configmod.from_dict(data, instance=None)  # no offset: fine
    err = refused(data, key=f"{section}.{key}", problem="65536", instance=1)
    assert "65534" in err.fix
    assert configmod.from_dict(from_base(model_dir, **{section: {key: 65534}}), instance=1)


def test_instance_beyond_the_gpu_index_range_is_refused(model_dir):
    refused(from_base(model_dir), key="instance", instance=64)


@pytest.mark.parametrize("raw", ["²", "1" * 5000, "-1", "64"])
def test_bad_instance_in_the_environment_is_a_config_error(monkeypatch, raw):
    monkeypatch.setenv(configmod.ENV_INSTANCE, raw)
    with pytest.raises(ConfigError) as err:
        configmod.instance_from_env()
    assert err.value.key == configmod.ENV_INSTANCE


def test_long_served_model_name_is_refused(model_dir):
    refused(from_base(model_dir, engine={"served_model_name": "m" * 200_000}), key="engine.served_model_name", problem="bytes")
    assert configmod.from_dict(from_base(model_dir, engine={"served_model_name": "m" * 1024}))


def test_extra_args_and_env_share_a_size_budget(model_dir):
    args = ["--x"] + ["y" * 4000] * 20
    refused(from_base(model_dir, engine={"extra_args": args}), key="engine.extra_args", problem="budget")
    env = {f"V{i}": "y" * 4000 for i in range(20)}
    refused(from_base(model_dir, engine={"env": env}), key="engine.env", problem="budget")
    assert configmod.from_dict(from_base(model_dir, engine={"extra_args": args[:5], "env": dict(list(env.items())[:5])}))


def test_throttle_reason_names_are_checked(model_dir):
    err = refused(from_base(model_dir, watchdog={"throttle_warn_reasons": ["hw_slowdown", "hw_slowdwn"]}), key="watchdog.throttle_warn_reasons[1]", problem="hw_slowdwn")
    assert "hw_slowdown" in err.fix
    refused(from_base(model_dir, watchdog={"throttle_warn_reasons": [1, 2]}), key="watchdog.throttle_warn_reasons[0]", problem="expected a string")
    cfg = configmod.from_dict(from_base(model_dir, watchdog={"throttle_warn_reasons": ["sw_power_cap", "gpu_idle"]}))
    assert cfg.watchdog.throttle_warn_reasons == ["sw_power_cap", "gpu_idle"]


def test_every_clock_event_reason_nvml_reports_is_accepted():
    pynvml = pytest.importorskip("pynvml")
    from r3090d.probes.nvml import clock_reason_table

    names = set(clock_reason_table(pynvml).values())
    assert names and names <= configmod.CLOCK_EVENT_REASONS


@pytest.mark.parametrize(
    "section,table,key",
    [
        ("engine", {"extra_args": ["--ok", 1]}, "engine.extra_args[1]"),
        ("engine", {"extra_args": [["--nested"]]}, "engine.extra_args[0]"),
        ("engine", {"env": {"A": 1}}, "engine.env.A"),
        ("engine", {"env": {"A=B": "1"}}, 'engine.env."A=B"'),
        ("engine", {"env": {"": "1"}}, 'engine.env.""'),
        ("alerts", {"email": {"recipients": ["ops@example.org", 7]}}, "alerts.email.recipients[1]"),
    ],
)
def test_list_and_table_elements_are_checked(model_dir, section, table, key):
    refused(from_base(model_dir, **{section: table}), key=key)


def test_utf8_byte_order_mark_is_accepted(tmp_path, model_dir):
    path = tmp_path / "r3090d.toml"
    path.write_bytes(b"\xef\xbb\xbf" + textwrap.dedent(base(model_dir, "port = 8123")).encode())
    assert configmod.load(path).engine.port == 8123


def test_error_line_stays_one_line_for_odd_keys_and_values(model_dir):
    # Keys that are not bare TOML keys are quoted as TOML quotes them.
    err = refused(from_base(model_dir, engine={"pr\not": 1}), key='engine."pr\\not"')
    assert "pr\\not" in err.one_line()
    err = refused(from_base(model_dir, engine={"p" * 10_000: 1}), key=f'engine.{"p" * 60}...')
    err = refused(from_base(model_dir, engine={"port": "8\n0" * 10_000}), key="engine.port")
    assert len(err.one_line()) < 500


# ------------------------------------------------------------------- migration


def test_removed_restart_keys_are_migrated_with_warnings(model_dir):
    data = from_base(model_dir, watchdog={"give_up_restarts": 4, "give_up_window": 900.0, "stable_after": 600.0})
    cfg = configmod.from_dict(data, "old.toml")
    assert cfg.watchdog.start_failures == 5  # gave up after MORE than 4 failures
    assert cfg.watchdog.restart_storm_window == 900.0
    assert len(cfg.warnings) == 3
    by_key = {w.split(": ")[1]: w for w in cfg.warnings}
    assert set(by_key) == {"watchdog.give_up_restarts", "watchdog.give_up_window", "watchdog.stable_after"}
    assert "watchdog.start_failures = 5" in by_key["watchdog.give_up_restarts"]
    assert "watchdog.restart_storm_window" in by_key["watchdog.give_up_window"]
    assert "ignored" in by_key["watchdog.stable_after"] and "watchdog.min_uptime" in by_key["watchdog.stable_after"]
    for w in cfg.warnings:
        assert w.startswith("old.toml: watchdog.") and "(fix: " in w and "\n" not in w
    # The caller's dict is left as it was.
    assert "give_up_restarts" in data["watchdog"]


def test_new_key_wins_over_its_removed_predecessor(model_dir):
    data = from_base(model_dir, watchdog={"give_up_restarts": 4, "start_failures": 2, "give_up_window": 900.0, "restart_storm_window": 60.0})
    cfg = configmod.from_dict(data)
    assert cfg.watchdog.start_failures == 2 and cfg.watchdog.restart_storm_window == 60.0
    assert len(cfg.warnings) == 2 and all("wins" in w for w in cfg.warnings)


def test_removed_keys_are_still_type_checked(model_dir):
    refused(from_base(model_dir, watchdog={"give_up_restarts": "5"}), key="watchdog.give_up_restarts", problem="integer")
    refused(from_base(model_dir, watchdog={"stable_after": float("nan")}), key="watchdog.stable_after", problem="finite")


def test_current_config_has_no_warnings(tmp_path, model_dir):
    assert configmod.load(write(tmp_path, base(model_dir))).warnings == ()
    assert configmod.load(REPO / "etc" / "r3090d.toml", check_files=False).warnings == ()


def test_config_check_prints_migration_warnings(tmp_path, model_dir):
    path = write(tmp_path, base(model_dir, rest="[watchdog]\ngive_up_restarts = 3\n"))
    python = venv_with_vllm(tmp_path, "__version__ = '0.32.0'\n")
    path.write_text(path.read_text().replace(sys.executable, python))
    out = subprocess.run([sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()", "config", "check", "--config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    warn = [line for line in out.stderr.splitlines() if line.startswith("WARN ")]
    assert len(warn) == 1 and "watchdog.give_up_restarts" in warn[0] and "start_failures = 4" in warn[0]


def test_every_shipped_profile_loads_against_the_shipped_defaults(tmp_path):
    """The shipped profiles and the shipped memory alert must agree: each one passes `config check`."""
    shipped = tomllib.loads((Path(__file__).resolve().parents[2] / "etc" / "r3090d.toml").read_text())
    for name in configmod.BUILTIN_PROFILES:
        data = {**shipped, "profile": name}
        data["engine"] = {**shipped["engine"], "model": str(tmp_path), "python": sys.executable}
        cfg = configmod.from_dict(data, check_files=False)
        assert cfg.active_profile == configmod.BUILTIN_PROFILES[name]
