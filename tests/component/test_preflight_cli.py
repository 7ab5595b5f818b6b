"""`r3090ctl preflight` as a user runs it: a real process, real NVML library lookup, real sockets."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig

import pytest

from r3090d.core.snapshot import GpuStatus
from r3090d.probes.nvml import read_gpu

pytestmark = pytest.mark.component

# The r3090ctl installed beside this python (the venv's), not another one that PATH finds first.
_SCRIPT = shutil.which("r3090ctl", path=sysconfig.get_path("scripts"))
CTL = [_SCRIPT] if _SCRIPT else [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp_path, engine_python: str, *, gpu_required: bool = True, port: int | None = None) -> str:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    path = tmp_path / "r3090d.toml"
    path.write_text(
        f'[engine]\npython = "{engine_python}"\nmodel = "{model}"\nport = {port or free_port()}\n'
        f"[gpu]\nrequired = {'true' if gpu_required else 'false'}\n"
    )
    return str(path)


def preflight(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("R3090D_CONFIG", "R3090D_INSTANCE")}
    return subprocess.run([*CTL, "preflight", *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def no_gpu():
    if read_gpu(0, 10.0).status is GpuStatus.OK:
        pytest.skip("this machine has an NVIDIA GPU")


def test_no_driver_exits_2_with_one_clear_line(tmp_path, fake_engine_python, no_gpu):
    out = preflight("--config", write_config(tmp_path, fake_engine_python))
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if "no NVIDIA driver" in line]
    assert len(lines) == 1 and lines[0].split()[:2] == ["driver", "FAIL"]


def test_no_driver_json(tmp_path, fake_engine_python, no_gpu):
    out = preflight("--config", write_config(tmp_path, fake_engine_python), "--json")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    data = json.loads(out.stdout)
    by = {c["name"]: c for c in data["checks"]}
    assert data["exit_code"] == 2
    assert by["driver"]["status"] == "fail" and by["driver"]["measured"].startswith("no NVIDIA driver")
    assert (by["vllm"]["status"], by["vllm"]["measured"]) == ("ok", "vLLM 0.32.0")
    assert set(by[n]["status"] for n in ("card", "pcie_width", "vram", "model_fit")) == {"skip"}


def test_gpu_not_required_passes_or_warns(tmp_path, fake_engine_python):
    out = preflight("--config", write_config(tmp_path, fake_engine_python, gpu_required=False))
    assert out.returncode in (0, 1), out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "no NVIDIA driver" not in out.stdout
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert rows["driver"] == "SKIP" and rows["port"] == "OK" and rows["vllm"] == "OK"


def test_unknown_newer_vllm_warns_naming_both_versions(tmp_path, make_fake_engine_python):
    out = preflight("--config", write_config(tmp_path, make_fake_engine_python("0.40.0"), gpu_required=False), "--json")
    assert "Traceback" not in out.stderr
    by = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert (by["vllm"]["status"], by["vllm"]["measured"]) == ("warn", "vLLM 0.40.0")
    assert "vLLM 0.40.0 is newer than 0.32.0, the last version known to work" in by["vllm"]["hint"]
    assert out.returncode == 1 or any(c["status"] == "fail" for c in by.values()), out.stdout


def test_engine_without_vllm_fails(tmp_path):
    out = preflight("--config", write_config(tmp_path, sys.executable, gpu_required=False), "--json")
    by = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert out.returncode == 2 and by["vllm"]["status"] == "fail" and by["vllm"]["permanent"] is True


def test_port_held_by_another_process_then_by_our_engine(tmp_path, fake_engine_python):
    port = free_port()
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "up"
        cfg = write_config(tmp_path, fake_engine_python, gpu_required=False, port=port)
        out = preflight("--config", cfg, "--json")
        port_check = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["port"]
        assert out.returncode == 2
        assert port_check["status"] == "fail" and port_check["permanent"] is False
        assert f"pid {holder.pid}" in port_check["measured"]
        out = preflight("--config", cfg, "--json", "--own-pid", str(holder.pid))
        port_check = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["port"]
        assert port_check["status"] == "ok" and port_check["measured"] == f"held by r3090d's engine (pid {holder.pid})"
        assert out.returncode in (0, 1)
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone: the same port is free again.
    out = preflight("--config", cfg, "--json")
    assert {c["name"]: c for c in json.loads(out.stdout)["checks"]}["port"]["status"] == "ok"
