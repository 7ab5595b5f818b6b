"""The installed units under a real systemd: verification, permanent failures, per-GPU instances.

The engines here are the vLLM test double (tests/fakevllm): these tests are
about systemd and the daemon, and run in seconds. The real vLLM runs are in
test_systemd_vllm.py.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from r3090d import exitcodes
from tests.e2e.conftest import DEBIAN_PYTHON, PREFIX, REPO, TEST_ROOT, UNITDIR, write_public
from tests.fakevllm.harness import SHIM_DIR

pytestmark = pytest.mark.systemd

RESTART_SEC = 5  # the units' RestartSec
INSTANCE_ENGINE_PORT = 18190
INSTANCE_EXPORTER_PORT = 19590


@pytest.fixture(scope="session")
def fake_engine_python(ns_source) -> str:
    """A python that runs the vLLM double as `-m vllm.entrypoints.openai.api_server`.

    tests/fakevllm/harness.make_engine_python does the same from the test's own
    python; here the venv must come from Debian's python and live outside /tmp
    and /root, or the hardened service user could not run it."""
    venv = TEST_ROOT / "fake-engine"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([DEBIAN_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    site = Path(purelib)
    shim = ns_source / SHIM_DIR.relative_to(REPO)  # the checkout itself may be hidden from the service
    (site / "fakevllm_shim.pth").write_text(f"import sys; sys.path.insert(0, {str(shim)!r})\n")
    dist = site / "vllm-0.32.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
    return str(python)


def fake_config(python: str, model: Path, **overrides: str) -> str:
    sections = {
        "engine": {
            "python": f'"{python}"',
            "model": f'"{model}"',
            "served_model_name": '"fake"',
            "port": str(INSTANCE_ENGINE_PORT),
            "shutdown_timeout": "5",
            "startup_timeout": "60",
        },
        "gpu": {"required": "false"},
        "watchdog": {"poll_interval": "1.0"},
        "daemon": {"exporter_port": str(INSTANCE_EXPORTER_PORT)},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        sections[section][key] = value
    return "\n".join(
        f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in body.items()) for name, body in sections.items()
    )


def test_installed_units_verify(systemd_ns, installed):
    for unit in ("r3090d.service", "r3090d@.service"):
        assert Path(UNITDIR, unit).is_file()
    out = systemd_ns.nsenter(
        ["systemd-analyze", "verify", f"{UNITDIR}/r3090d.service", "r3090d@0.service"], check=False
    )
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
    fragment = systemd_ns.show("r3090d.service", "FragmentPath")["FragmentPath"]
    assert fragment == f"{UNITDIR}/r3090d.service"
    assert Path(f"{PREFIX}/bin/r3090d").is_file()
    venv_home = Path(f"{PREFIX}/pyvenv.cfg").read_text()
    assert "home = /usr/bin" in venv_home, "the service user cannot run a venv linked to a python under /root"
    entry = pwd.getpwnam("r3090")
    assert entry.pw_shell.endswith("nologin") and not entry.pw_dir.startswith("/root")


@pytest.mark.parametrize(
    "case, expected_code, expected_text",
    [
        ("unknown-key", exitcodes.CONFIG, "engine.prot: unknown key"),
        ("no-vllm", exitcodes.PREFLIGHT_PERMANENT, f"vllm is not installed for {DEBIAN_PYTHON}"),
    ],
)
def test_permanent_failure_is_not_restarted(
    unit_factory, tiny_model, fake_engine_python, case, expected_code, expected_text
):
    if case == "unknown-key":
        text = fake_config(fake_engine_python, tiny_model, engine__prot="1")
    else:
        text = fake_config(DEBIAN_PYTHON, tiny_model)  # a python without vLLM
    config = write_public(TEST_ROOT / f"config-{case}.toml", text)
    unit = unit_factory("r3090d.service", f"r3090d-{case}.log")
    unit.reset()
    unit.configure(config)

    started = unit.ns.ctl("start", unit.name, check=False)
    assert started.returncode != 0, "a permanent failure must fail the start job"
    props = unit.show("ActiveState", "Result", "ExecMainStatus", "NRestarts")
    assert props == {
        "ActiveState": "failed",
        "Result": "exit-code",
        "ExecMainStatus": str(expected_code),
        "NRestarts": "0",
    }, unit.describe()
    # Were it restartable, systemd would have started it again after RestartSec.
    time.sleep(RESTART_SEC + 3)
    props = unit.show("ActiveState", "NRestarts")
    assert props == {"ActiveState": "failed", "NRestarts": "0"}, unit.describe()
    assert expected_text in unit.output(), unit.describe()


def test_two_instances_side_by_side(unit_factory, tiny_model, fake_engine_python, systemd_ns):
    config = write_public(TEST_ROOT / "config-instances.toml", fake_config(fake_engine_python, tiny_model))
    units = [unit_factory(f"r3090d@{n}.service") for n in (0, 1)]
    for unit in units:
        unit.reset()
        unit.configure(config)
    start = time.monotonic()
    systemd_ns.ctl("start", *(u.name for u in units), timeout=120)
    took = time.monotonic() - start
    print(f"two instances active in {took:.1f} s")

    r3090 = pwd.getpwnam("r3090")
    main_pids = []
    for n, unit in enumerate(units):
        assert unit.state() == "active", unit.describe()
        main = unit.main_pid()
        assert main is not None
        main_pids.append(main)
        assert os.stat(f"/proc/{main}").st_uid == r3090.pw_uid, "r3090d must run as the service user"
        engine_port = INSTANCE_ENGINE_PORT + n
        assert httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=5).status_code == 200
        engine_pids = unit.pids() - {main}
        assert engine_pids, f"no engine process in {unit.name}'s cgroup"
        # Each instance's engine is its own child, on its own port, in its own cgroup.
        cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in engine_pids]
        assert any(str(engine_port).encode() in c and b"--port" in c for c in cmdlines), cmdlines

        state_file = Path(f"/var/lib/r3090d/{n}/state.json")
        doc = unit.wait_for(lambda sf=state_file: _ready_state(sf), 30, f"{state_file} to say ready")
        assert doc["daemon"]["instance"] == n
        assert doc["daemon"]["pid"] == int(unit.show("MainPID")["MainPID"]), (
            "the pid as the namespace sees it"
        )
        assert doc["engine"]["url"] == f"http://127.0.0.1:{engine_port}"
        assert state_file.stat().st_uid == r3090.pw_uid
        runtime = systemd_ns.nsenter(["stat", "-c", "%U %a", f"/run/r3090d/{n}"]).stdout.split()
        assert runtime == ["r3090", "750"]
        _check_ctl_status(systemd_ns, config, n, engine_port)
    assert main_pids[0] != main_pids[1]

    systemd_ns.ctl("stop", *(u.name for u in units), timeout=120)
    for unit in units:
        assert unit.state() == "inactive"
        assert unit.pids() == set(), f"{unit.name} left processes behind"
    assert systemd_ns.namespace_pids_matching("vllm.entrypoints") == {}


def _ready_state(path: Path):
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if doc.get("engine", {}).get("phase") == "ready" else None


def _check_ctl_status(systemd_ns, config: Path, n: int, engine_port: int) -> None:
    """`r3090ctl status --instance N` from inside the namespace, where the instance's
    control socket (/run/r3090d/N) lives, answered by that instance's daemon."""
    ctl = f"{PREFIX}/bin/r3090ctl"
    out = systemd_ns.nsenter(
        ["env", f"R3090D_CONFIG={config}", ctl, "status", "--instance", str(n), "--json"], check=False
    )
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert (doc["running"], doc["source"]) == (True, "socket"), doc
    state = doc["state"]
    assert state["daemon"]["instance"] == n
    assert state["engine"]["url"] == f"http://127.0.0.1:{engine_port}"
    assert state["engine"]["phase"] == "ready"


def test_deterministic_start_failure_gives_up_and_the_unit_stays_active(unit_factory, tiny_model, fake_engine_python, systemd_ns):
    """A start that fails the same way twice gives up; the unit still becomes active, says why, and recovers on restart."""
    # The double's KV cache (8 blocks of 16 tokens) cannot hold the profile's 4096-token max_model_len:
    # every start fails in EngineCore with the same ValueError, as vLLM's does.
    broken = fake_config(fake_engine_python, tiny_model, engine__extra_args='["--fake-num-gpu-blocks", "8"]')
    config = write_public(TEST_ROOT / "config-give-up.toml", broken)
    state_file = Path("/var/lib/r3090d/state.json")
    unit = unit_factory("r3090d.service", "r3090d-give-up.log")
    unit.reset()
    unit.configure(config)
    state_file.unlink(missing_ok=True)

    started = systemd_ns.ctl("start", unit.name, check=False, timeout=120)
    assert started.returncode == 0, unit.describe()  # READY=1 comes with the give-up: the start job returns
    assert unit.state() == "active", unit.describe()
    doc = unit.wait_for(lambda: _phase_state(state_file, "given-up"), 30, "given-up in the state file")
    cause = "ValueError: To serve at least one request"
    assert cause in doc["give_up_reason"] and "same cause" in doc["give_up_reason"], doc["give_up_reason"]
    assert cause in unit.show("StatusText")["StatusText"]  # what `systemctl status` shows
    ctl = f"{PREFIX}/bin/r3090ctl"
    out = systemd_ns.nsenter(["env", f"R3090D_CONFIG={config}", ctl, "status", "--json"], check=False)
    assert out.returncode == exitcodes.CRITICAL, out.stdout + out.stderr
    reasons = json.loads(out.stdout)["reasons"]
    assert reasons[0].startswith("gave up:") and cause in reasons[0], reasons
    assert unit.pids() == {unit.main_pid()}, "the given-up engine must be stopped, the daemon alone left"

    # The config is fixed: reload alone does not start it; restart does, and gave_up resolves.
    write_public(config, fake_config(fake_engine_python, tiny_model))
    out = systemd_ns.nsenter(["env", f"R3090D_CONFIG={config}", ctl, "reload"], check=False)
    assert out.returncode == 0 and "stays stopped" in out.stdout, out.stdout + out.stderr
    assert _phase_state(state_file, "given-up")
    out = systemd_ns.nsenter(["env", f"R3090D_CONFIG={config}", ctl, "restart", "--wait"], check=False, timeout=120)
    assert out.returncode == 0 and "ready after" in out.stdout, out.stdout + out.stderr + unit.describe()
    unit.wait_for(lambda: (d := _phase_state(state_file, "ready")) and "gave_up" not in d["alerts"]["firing"], 30, "gave_up resolved")
    assert "alert gave_up resolved" in unit.output()
    systemd_ns.ctl("stop", unit.name, timeout=120)
    assert unit.state() == "inactive"


def _phase_state(path: Path, phase: str):
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if doc.get("engine", {}).get("phase") == phase else None
