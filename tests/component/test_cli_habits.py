"""r3090ctl's command-line habits, each checked on a real process as a shell or a monitoring plugin runs it.

Global options before the subcommand, health commands that exit only 0-3,
errors as JSON under --json, quiet exits into a closed pipe, commands that
need no config file, shell completion and --version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import r3090d
from tests.daemon_harness import engine_config, write_config

pytestmark = pytest.mark.component

# Not a console script: argv[0] is "-c", so nothing may depend on the program's file name.
CTL = [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]
DAEMON = [sys.executable, "-c", "from r3090d.cli import daemon_main; daemon_main()"]
QWEN_CONFIG = Path(__file__).resolve().parent.parent / "data" / "qwen2.5-7b-config.json"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("R3090D_CONFIG", "R3090D_INSTANCE") and not k.startswith("_R3090")}
    return {**env, **extra}


def run(*args, env: dict[str, str] | None = None, argv0=CTL, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*argv0, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env or clean_env())


@pytest.fixture
def config(tmp_path, fake_engine_python) -> Path:
    return write_config(tmp_path / "r3090d.toml", engine_config(tmp_path, fake_engine_python))


# ----------------------------------------------------------------- global options


def test_config_and_json_before_the_subcommand(config):
    after = run("config", "check", "--json", "--config", config)
    assert after.returncode == 0, after.stderr
    before = run("--config", config, "--json", "config", "check")
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout) == json.loads(after.stdout)


def test_instance_before_the_subcommand(config, tmp_path):
    base = json.loads(run("--config", config, "config", "check", "--json").stdout)["config"]["engine"]["port"]
    out = run("--instance", 3, "--config", config, "config", "check", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["config"]["engine"]["port"] == base + 3


def test_status_with_global_options_reaches_the_status_command(config):
    out = run("--config", config, "--json", "status")
    # No daemon runs: UNKNOWN, reported by status itself as JSON (not a usage error, 64).
    assert out.returncode == 3, out.stdout + out.stderr
    assert json.loads(out.stdout)["running"] is False


def test_the_subcommand_option_wins_over_the_global_one(config, tmp_path):
    out = run("--config", tmp_path / "absent.toml", "config", "check", "--config", config)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------ health exit codes


@pytest.mark.parametrize("command", ["preflight", "status"])
def test_a_config_error_under_a_health_command_is_unknown(command, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nmodel = '/m'\nno_such_key = 1\n")
    out = run(command, "--config", bad)
    assert out.returncode == 3, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "engine.no_such_key" in lines[0] and str(bad) in lines[0], out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["preflight", "status"])
def test_a_usage_error_under_a_health_command_is_unknown(command):
    out = run(command, "--no-such-option")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "--no-such-option" in out.stderr


def test_the_daemon_keeps_the_config_exit_code(tmp_path):
    out = run("--config", tmp_path / "absent.toml", argv0=DAEMON)
    assert out.returncode == 78, out.stdout + out.stderr


# ------------------------------------------------------------------ JSON errors


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("preflight", "--json"), 3),
        (("--json", "status"), 3),
        (("config", "check", "--json"), 78),
        (("--json", "config", "check"), 78),
    ],
)
def test_errors_under_json_are_json_on_stdout(args, code, tmp_path):
    out = run(*args, "--config", tmp_path / "absent.toml")
    assert out.returncode == code, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == code
    assert str(tmp_path / "absent.toml") in doc["error"] and "file not found" in doc["error"]
    assert out.stderr == ""


def test_a_usage_error_under_json_is_json(config):
    out = run("config", "check", "--json", "--no-such-option", "--config", config)
    assert out.returncode == 64, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == 64 and "--no-such-option" in doc["error"]


# ------------------------------------------------------------------ closed pipes


def run_into_closed_pipe(*args) -> subprocess.CompletedProcess:
    """Run with stdout a pipe nobody reads any more, as `| head -c 10` leaves it once head has exited."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([*CTL, *map(str, args)], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, env=clean_env())
    finally:
        os.close(write_end)
    return proc


@pytest.mark.parametrize("as_json", [True, False])
def test_output_into_a_closed_pipe_exits_quietly(config, as_json):
    out = run_into_closed_pipe("config", "check", *(["--json"] if as_json else []), "--config", config)
    assert out.returncode in (0, 141), out.stderr
    assert out.stderr == ""


def test_head_of_the_json_output(config):
    shell = subprocess.run(
        ["bash", "-o", "pipefail", "-c", '"$@" | head -c 10 >/dev/null', "sh", *CTL, "config", "check", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert shell.returncode in (0, 141), shell.stderr
    assert shell.stderr == ""


def test_a_health_command_keeps_its_exit_code_into_a_closed_pipe(config):
    out = run_into_closed_pipe("status", "--config", config)
    assert out.returncode == 3, out.stderr
    assert out.stderr == ""


def test_status_watch_stops_when_the_reader_goes(config):
    # `status --watch | head -3`: once head has gone the loop must end, not print to nobody for ever.
    for as_json in ([], ["--json"]):
        out = run_into_closed_pipe("status", "--watch", "0.2", *as_json, "--config", config)
        assert out.returncode == 3, out.stderr
        assert out.stderr == ""


# -------------------------------------------------------------- without a config


def test_plan_with_a_model_needs_no_engine_model_in_the_config(tmp_path):
    # A fresh install's config names no model yet; --model is enough.
    cfg = tmp_path / "r3090d.toml"
    cfg.write_text("[gpu]\nrequired = false\n")
    for env in (clean_env(R3090D_CONFIG=str(cfg)), clean_env()):
        args = ("plan", "--model", QWEN_CONFIG, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
        out = run(*args, *(() if "R3090D_CONFIG" in env else ("--config", cfg)), env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["model"]["num_layers"] == 28


def test_plan_with_a_model_and_no_config_named(tmp_path):
    # Whatever the default file is here (absent, a fresh install's, broken), --model is enough.
    out = run("plan", "--model", QWEN_CONFIG, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["model"]["num_layers"] == 28


def test_a_named_broken_config_still_stops_plan(tmp_path):
    cfg = tmp_path / "r3090d.toml"
    cfg.write_text("[engine]\nno_such_key = 1\n")
    out = run("plan", "--model", QWEN_CONFIG, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936, "--config", cfg)
    assert out.returncode == 78, out.stdout + out.stderr
    assert "engine.no_such_key" in out.stderr


def test_plan_without_a_model_still_says_what_is_missing(tmp_path):
    cfg = tmp_path / "r3090d.toml"
    cfg.write_text("[gpu]\nrequired = false\n")
    out = run("plan", "--config", cfg, "--gpu-memory-gib", 24, "--bandwidth-gbs", 936)
    assert out.returncode == 78, out.stdout + out.stderr
    assert "engine.model" in out.stderr


# ----------------------------------------------------------------------- bench


BENCH = ("--concurrency", "1", "--requests", 2, "--rounds", 1, "--warmup", 0, "--max-tokens", 4, "--prompt-tokens", 4)


def test_bench_json_goes_to_stdout(fake_vllm):
    d = fake_vllm("--fake-token-delay", "0.001")
    d.wait_healthy(30)
    out = run("bench", "--url", d.url, *BENCH, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["levels"][0]["completed"] == 2


def test_bench_output_writes_a_file(fake_vllm, tmp_path):
    d = fake_vllm("--fake-token-delay", "0.001")
    d.wait_healthy(30)
    path = tmp_path / "bench.json"
    out = run("bench", "--url", d.url, *BENCH, "--output", path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(path.read_text())["levels"][0]["completed"] == 2
    assert "client CPU" in out.stdout  # the table still goes to the terminal


def test_bench_with_a_url_needs_no_config(fake_vllm, tmp_path):
    d = fake_vllm("--fake-token-delay", "0.001")
    d.wait_healthy(30)
    cfg = tmp_path / "r3090d.toml"
    cfg.write_text("[gpu]\nrequired = false\n")  # no engine.model yet
    out = run("bench", "--url", d.url, *BENCH, "--json", env=clean_env(R3090D_CONFIG=str(cfg)))
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------ completion and version


def test_bash_completion_script_and_answers():
    script = run(env=clean_env(_R3090CTL_COMPLETE="bash_source"))
    assert script.returncode == 0, script.stderr
    assert "complete -o nosort -F _r3090ctl_completion r3090ctl" in script.stdout
    answer = run(env=clean_env(_R3090CTL_COMPLETE="bash_complete", COMP_WORDS="r3090ctl sta", COMP_CWORD="1"))
    assert answer.stdout.split() == ["plain,status"], answer.stdout


@pytest.mark.parametrize("argv0", [CTL, DAEMON], ids=["r3090ctl", "r3090d"])
def test_version(argv0):
    out = run("--version", argv0=argv0)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == r3090d.__version__
