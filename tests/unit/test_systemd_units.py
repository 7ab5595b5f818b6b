"""The shipped units agree with the daemon and with each other, verify cleanly, and stay hardened."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from r3090d import exitcodes
from r3090d.config import Config
from r3090d.effectors.child import DRAIN_MARGIN_S

UNIT_DIR = Path(__file__).resolve().parents[2] / "systemd"
SERVICE = UNIT_DIR / "r3090d.service"
TEMPLATE = UNIT_DIR / "r3090d@.service"
# Lines that may differ between the plain unit and the template.
INSTANCE_KEYS = {"Description", "StateDirectory", "RuntimeDirectory", "CacheDirectory"}
MAX_EXPOSURE = 4.0

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value, in order (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path.name}: {line!r} outside a section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service(path: Path) -> dict[str, list[str]]:
    return parse_unit(path)["Service"]


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, f"unexpected time value {value!r}"
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


@pytest.mark.parametrize("path", [SERVICE, TEMPLATE], ids=lambda p: p.name)
def test_units_match_the_daemon_contract(path):
    svc = service(path)
    assert svc["Type"] == ["notify"]
    assert svc["NotifyAccess"] == ["main"], "only r3090d may send READY, never vLLM"
    assert svc["KillMode"] == ["mixed"], "SIGTERM must reach r3090d alone so it can drain vLLM itself"
    assert svc["Restart"] == ["on-failure"]
    prevented = {int(code) for code in svc["RestartPreventExitStatus"][0].split()}
    assert prevented == set(exitcodes.PERMANENT)
    assert svc["ExecStart"] == ["/opt/r3090d/bin/r3090d"], "no --config: the daemon finds its config itself"
    assert svc["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    drain = Config().engine.shutdown_timeout + DRAIN_MARGIN_S
    assert seconds(svc["TimeoutStopSec"][0]) > drain + 10, (
        "systemd must not SIGKILL vLLM while r3090d drains it"
    )
    poll = Config().watchdog.poll_interval
    assert seconds(svc["WatchdogSec"][0]) >= 4 * poll, (
        "the loop pings once per tick; half the watchdog must fit two ticks"
    )


def test_directories_are_the_config_defaults():
    daemon = Config().daemon
    svc, tmpl = service(SERVICE), service(TEMPLATE)
    assert f"/var/lib/{svc['StateDirectory'][0]}" == daemon.state_dir
    assert f"/run/{svc['RuntimeDirectory'][0]}" == daemon.runtime_dir
    # An instance's daemon uses <dir>/N (config._apply_instance).
    assert tmpl["StateDirectory"] == [f"{svc['StateDirectory'][0]}/%i"]
    assert tmpl["RuntimeDirectory"] == [f"{svc['RuntimeDirectory'][0]}/%i"]
    assert "R3090D_INSTANCE=%i" in tmpl["Environment"]
    env = " ".join(svc["Environment"])
    for var in ("HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT"):
        assert re.search(rf"\b{var}=%C/r3090d\b", env), f"{var} must point into the CacheDirectory"


def test_template_has_the_same_hardening_as_the_unit():
    plain, tmpl = service(SERVICE), service(TEMPLATE)
    differing = {k for k in plain.keys() | tmpl.keys() if plain.get(k) != tmpl.get(k)}
    assert differing <= INSTANCE_KEYS | {"Environment"}, sorted(differing - INSTANCE_KEYS)
    extra_env = [e for e in tmpl["Environment"] if e not in plain["Environment"]]
    assert [e for e in extra_env if not e.startswith("HOME=")] == ["R3090D_INSTANCE=%i"]


@pytest.mark.parametrize("path", [SERVICE, TEMPLATE], ids=lambda p: p.name)
def test_units_avoid_settings_that_break_vllm_or_the_probes(path):
    svc = service(path)
    assert "MemoryDenyWriteExecute" not in svc, "torch's JIT needs writable executable memory"
    assert "ProcSubset" not in svc, "the probes read /proc/meminfo, /proc/swaps, /proc/driver/nvidia"
    assert "PrivateDevices" not in svc, "it would hide /dev/nvidia*"
    allowed = svc["DeviceAllow"]
    for group in ("char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw"):
        assert group in allowed
    assert svc["DevicePolicy"] == ["closed"]
    assert svc["User"] == ["r3090"] and svc["Group"] == ["r3090"]


def _copy_for_analysis(tmp_path: Path) -> Path:
    # verify checks that ExecStart exists; the installed venv may not be there.
    for path in (SERVICE, TEMPLATE):
        text = path.read_text().replace("ExecStart=/opt/r3090d/bin/r3090d", "ExecStart=/bin/true")
        (tmp_path / path.name).write_text(text)
    return tmp_path


@needs_analyze
@pytest.mark.parametrize("name", ["r3090d.service", "r3090d@0.service"])
def test_systemd_analyze_verify_is_clean(tmp_path, name):
    d = _copy_for_analysis(tmp_path)
    out = subprocess.run(["systemd-analyze", "verify", str(d / name)], capture_output=True, text=True, cwd=d)
    # verify exits 0 even for unknown keys and unparsable values; it only prints them.
    assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", (
        out.stdout + out.stderr
    )


@needs_analyze
@pytest.mark.parametrize("name", ["r3090d.service", "r3090d@0.service"])
def test_security_exposure_is_low(tmp_path, name):
    d = _copy_for_analysis(tmp_path)
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(d / name)],
        capture_output=True,
        text=True,
        cwd=d,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, out.stdout
