"""Configuration: loading, validation messages, exit codes, and the vLLM argv."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d.config import ConfigError

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
        lambda m: f'profile = "batch"\n[engine]\npython = "{sys.executable}"\nmodel = "{m}"\n',
        "profiles.batch.gpu_memory_utilization",
    ),
    ("bad choice", lambda m: base(m, rest='[alerts.email]\nsecurity = "tls"\n'), "alerts.email.security"),
    ("missing api key file", lambda m: base(m, 'api_key_file = "/nonexistent/key"'), "engine.api_key_file"),
    ("engine python missing", lambda m: base(m).replace(sys.executable, "/nonexistent/python"), "engine.python"),
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
