"""What a test needs to run a real vLLM on CPU: the engine's python, a daemon
config for the tiny model, free ports, and the tiny model's KV arithmetic.

The facts behind the defaults are in docs/cpu-vllm-notes.md. Start at most one
real vLLM at a time (hold the `vllm_lock` fixture): the machine has 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from r3090d import argv as argvmod
from tests.waiting import wait_until

ENGINE_PYTHON_ENV = "R3090D_ENGINE_PYTHON"
DEFAULT_ENGINE_PYTHON = "/opt/r3090d-engine/bin/python"
CPU_BLOCK_SIZE = 128  # vLLM's default block size on CPU when --block-size is not given
TINY_MODEL_NAME = "tiny-qwen2"
# Nothing may be fetched at run time: there is no internet on the test hosts.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# The dtype the tiny model is written in and served in. vLLM's bfloat16 path on CPU
# picks its kernels by the CPU's features (AVX-512 BF16, AMX, or emulation), so a
# bfloat16 engine runs different code on different hosts; float32 runs the same
# kernels on every x86-64 CPU. The KV cache takes this dtype too.
CPU_DTYPE = "float32"
# Random weights, no torch.compile: ready in about a minute on 2 cores.
CPU_EXTRA_ARGS = ["--load-format", "dummy", "--enforce-eager", "--dtype", CPU_DTYPE]
# With the tiny model on 2 cores, vLLM's API server is the bottleneck: the engine
# finishes a request long before its stream has been sent, then idles. This wider,
# deeper variant (random weights, 4x the width, 4 layers) decodes about 40 tokens/s
# in float32 on 2 AVX-512 cores, a fraction of what the API server can stream, so
# requests stay in the engine for as long as they would on a busy GPU server. Its
# load time is about the same.
ENGINE_BOUND_ARGS = [
    "--hf-overrides",
    json.dumps({"hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096, "num_hidden_layers": 4}),
]
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def engine_python_path() -> str:
    return os.environ.get(ENGINE_PYTHON_ENV) or DEFAULT_ENGINE_PYTHON


@pytest.fixture(scope="session")
def engine_python() -> str:
    """The python of the CPU vLLM venv ($R3090D_ENGINE_PYTHON, else /opt/r3090d-engine); skips the test without one."""
    path = engine_python_path()
    if not os.access(path, os.X_OK):
        pytest.skip(f"no CPU vLLM engine: {path} is not an executable (run `make engine`, or set {ENGINE_PYTHON_ENV})")
    try:
        argvmod.engine_version(path)
    except argvmod.EngineNotInstalled as exc:
        pytest.skip(f"no CPU vLLM engine: {exc} (run `make engine`, or set {ENGINE_PYTHON_ENV})")
    return path


class VllmProcess:
    """A real vLLM started straight from an argv, in its own session, logging to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], url: str, log_path: Path, startup_timeout: float):
        self.argv, self.url, self.log_path, self.startup_timeout = argv, url, log_path, startup_timeout
        self.log = open(log_path, "wb")  # noqa: SIM115  (closed by kill_group)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> float:
        """Seconds from spawn until /health answers 200."""

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM exited with {self.proc.returncode} while loading:\n{self.log_tail()}")
            return httpx.get(self.url + "/health", timeout=2).status_code == 200

        remaining = self.startup_timeout - (time.monotonic() - self.started)
        wait_until(healthy, remaining, what="vLLM's /health 200", interval=0.5, ignoring=(httpx.TransportError,), details=self.log_tail)
        return time.monotonic() - self.started

    def stop(self) -> None:
        """SIGTERM to the main pid only, as docs/cpu-vllm-notes.md says, then whatever is left of the group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def start_server(engine_python: str, model, log_path: Path, *args: str, env: dict[str, str] | None = None,
                 startup_timeout: float = 420.0, served_name: str = "tiny") -> VllmProcess:
    """vLLM's OpenAI server on `model` with CPU_EXTRA_ARGS and these args; the KV size comes from args or env only."""
    port = free_port()
    argv = [engine_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", served_name,
            *CPU_EXTRA_ARGS, "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    return VllmProcess(argv, {**base, **OFFLINE_ENV, **(env or {})}, f"http://127.0.0.1:{port}", log_path, startup_timeout)


def engine_tree(main_pid: int) -> dict[str, int]:
    """name -> pid for the real vLLM tree under the API server."""
    import psutil

    out = {}
    for p in psutil.Process(main_pid).children(recursive=True):
        try:
            out[p.name()] = p.pid
        except psutil.NoSuchProcess:
            pass
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_bytes_per_token(model_dir: Path | str) -> int:
    """2 (K and V) x layers x KV heads x head_dim x dtype bytes, from the model's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES[cfg["torch_dtype"]]


def predicted_kv(kv_cache_bytes: int, model_dir: Path | str, block_size: int = CPU_BLOCK_SIZE) -> tuple[int, int]:
    """(num_gpu_blocks, kv_cache_size_tokens) that vLLM on CPU reports for an explicit KV size."""
    blocks = kv_cache_bytes // (block_size * kv_bytes_per_token(model_dir))
    return blocks, blocks * block_size


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as a TOML value")


def toml_text(data: dict) -> str:
    """TOML for plain config data (scalars, lists of scalars, nested tables)."""
    lines: list[str] = []

    def table(d: dict, header: str | None) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in d.items() if isinstance(v, dict)}
        if header is not None and (scalars or not tables):
            lines.append(f"\n[{header}]")
        lines.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars.items())
        for k, v in tables.items():
            table(v, f"{header}.{_key(k)}" if header else _key(k))

    table(data, None)
    text = "\n".join(lines).lstrip("\n") + "\n"
    if tomllib.loads(text) != data:
        raise ValueError("the TOML written does not read back as the data given")
    return text


def vllm_config_data(
    *,
    engine_python: str,
    model: Path | str,
    directory: Path | str,
    port: int | None = None,
    exporter_port: int | None = None,
    kv_space_gib: int | None = 1,
    kv_cache_memory_bytes: int | None = None,
    overrides: dict | None = None,
) -> dict:
    """A daemon config for the tiny model on a real CPU vLLM; ports are free ones unless given.

    The KV size must be explicit, or vLLM on CPU reserves gpu_memory_utilization of
    the host's RAM: kv_space_gib sets VLLM_CPU_KVCACHE_SPACE (whole GiB: 8192 blocks
    of 128 tokens each for the tiny model); for other sizes pass kv_space_gib=None
    and kv_cache_memory_bytes. When both are set the environment variable wins.
    `overrides` is merged in last, table by table.
    """
    directory = Path(directory)
    extra_args = list(CPU_EXTRA_ARGS)
    if kv_cache_memory_bytes is not None:
        extra_args += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    kv_env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)} if kv_space_gib is not None else {}
    data = {
        "profile": "realtime",
        "engine": {
            "python": engine_python,
            "model": str(model),
            "served_model_name": TINY_MODEL_NAME,
            "host": "127.0.0.1",
            "port": port or free_port(),
            "shutdown_timeout": 10,
            "startup_timeout": 420,
            "extra_args": extra_args,
            "env": {**kv_env, **OFFLINE_ENV},
        },
        "gpu": {"required": False},
        "alerts": {"syslog": {"enabled": False}},
        "daemon": {
            "state_dir": str(directory / "state"),
            "runtime_dir": str(directory / "run"),
            "exporter_port": exporter_port or free_port(),
        },
    }
    return _merge(data, overrides or {})


def write_vllm_config(path: Path | str, **kwargs) -> Path:
    """Write vllm_config_data(**kwargs) to `path`; state and runtime dirs go beside it unless `directory` is given."""
    path = Path(path)
    kwargs.setdefault("directory", path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml_text(vllm_config_data(**kwargs)))
    return path


@pytest.fixture
def vllm_config_writer(engine_python, tiny_model, tmp_path):
    """write(name="r3090d", **vllm_config_data kwargs) -> path of a config in tmp_path for a real vLLM."""

    def write(name: str = "r3090d", **kwargs) -> Path:
        kwargs.setdefault("engine_python", engine_python)
        kwargs.setdefault("model", tiny_model)
        kwargs.setdefault("directory", tmp_path / name)
        return write_vllm_config(tmp_path / f"{name}.toml", **kwargs)

    return write
