"""r3090ctl suspend / resume against a running daemon, the vLLM double, and a GPU faked at its two boundaries.

NVML is tests/fakenvml (the card is a JSON file this test writes: it lists the
double's fake-EngineCore as the GPU's one process, as a real card lists
vLLM's EngineCore); the CUDA driver's checkpoint calls are tests/fakecuda (lock
SIGSTOPs that process, checkpoint takes it off the card, restore puts it back,
unlock SIGCONTs it; its control file injects failures and delays). Everything
else is real: the daemon, its suspender worker process, r3090ctl, the exporter.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from r3090d import exitcodes, procstat
from r3090d.effectors.checkpoint import FAKE_ENV
from tests.ctl_harness import ctl, ctl_json
from tests.waiting import wait_until

pytestmark = pytest.mark.component

ROOT = Path(__file__).resolve().parents[2]
FAKE_PATHS = f"{ROOT / 'tests' / 'fakenvml'}{os.pathsep}{ROOT / 'tests' / 'fakecuda'}"
ENGINE_MIB = 15349
TOTAL_MIB = 24576
POLL = 0.2
BOUND = 60.0  # generous: a worker process per driver operation, on a busy 2-core machine
WATCHDOG = {"poll_interval": POLL, "lb_grace": 0.5, "stall_seconds": 1.0, "probe_idle_seconds": 600, "min_uptime": 0.0}
SUSPEND = {"drain_timeout": 2.0, "verify_timeout": 30.0, "lock_timeout": 2.0}


def write_atomically(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Rig:
    """One daemon with the double, the fake card and the fake checkpoint driver."""

    def __init__(self, make_daemon, tmp_path: Path, *, watchdog=None, suspend=None, extra_args=(), gpu=True):
        self.card = tmp_path / "card.json"
        self.control = tmp_path / "cuda.json"
        self.calls = tmp_path / "calls.jsonl"
        self.hold()
        self.control_set()
        self.d = make_daemon(watchdog={**WATCHDOG, **(watchdog or {})}, extra_args=("--fake-token-delay", "0.02", *extra_args),
                             args=("--skip-preflight",))  # fmt: skip
        self.d.rewrite(gpu={"required": gpu, "card": "any"}, suspend={**SUSPEND, **(suspend or {})})
        self.start()

    def start(self) -> None:
        self.d.start(prefix=["env", f"PYTHONPATH={FAKE_PATHS}", f"R3090D_FAKE_NVML={self.card}", f"{FAKE_ENV}={self.control}"])

    # -- the fakes
    def hold(self, *holders: tuple[int, int], util: int = 50) -> None:
        """The card as NVML shows it: these (pid, MiB) hold memory."""
        used = sum(mib for _, mib in holders)
        write_atomically(self.card, {"memory_total_mib": TOTAL_MIB, "memory_used_mib": used, "util": util, "processes": [list(h) for h in holders]})

    def card_json(self) -> dict:
        return json.loads(self.card.read_text())

    def control_set(self, **conf) -> None:
        write_atomically(self.control, {"log": str(self.calls), **conf})

    def driver_calls(self) -> list[str]:
        if not self.calls.exists():
            return []
        return [json.loads(line)["step"] for line in self.calls.read_text().splitlines()]

    # -- the engine
    def core_pid(self, st: dict) -> int | None:
        for pid in st["engine"]["tree_pids"]:
            try:
                if psutil.Process(pid).name() == "fake-EngineCore":
                    return pid
            except psutil.Error:
                pass
        return None

    def ready(self, old_pid: int | None = None) -> int:
        """Wait for a ready engine, list its EngineCore as the GPU's holder, wait until the daemon sees that; its pid."""
        st = self.d.wait_ready(timeout=BOUND, old_pid=old_pid)
        core = wait_until(lambda: self.core_pid(self.d.state()), BOUND, what="the fake-EngineCore")
        self.hold((core, ENGINE_MIB))
        self.d.proc.wait_for(lambda s: [p["pid"] for p in (s["gpu"] or {}).get("processes") or []] == [core], BOUND, "NVML to list the core")
        assert st["engine"]["pid"]
        return core

    def phase(self) -> str:
        return self.d.state()["engine"]["phase"]

    def wait_phase(self, phase: str, timeout: float = BOUND) -> dict:
        return self.d.wait_phase(phase, timeout)

    def ctl(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return ctl(self.d.config, *args, timeout=timeout)


SUSPENDED_GAUGES = ("r3090d_suspended_since_timestamp_seconds", "r3090d_suspended_host_bytes", "r3090d_suspended_gpu_bytes")


def suspended_gauges(d) -> dict[str, float]:
    """The exporter's suspended gauges, as a scrape of /metrics shows them."""
    text = httpx.get(d.exporter_url + "/metrics", timeout=5.0, trust_env=False).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in SUSPENDED_GAUGES}


def proc_state(pid: int) -> str:
    st = procstat.read(pid)
    assert st is not None, f"pid {pid} is gone"
    return st.state


@pytest.fixture
def rig(make_daemon, tmp_path):
    return lambda **kw: Rig(make_daemon, tmp_path, **kw)


def test_one_holder_suspended_and_resumed_with_healthz_and_state_file_while_suspended(rig):
    r = rig()
    core = r.ready()
    api = r.d.state()["engine"]["pid"]
    wait_until(lambda: r.d.healthz()[0] == 200, 10, what="/healthz 200")

    done = r.ctl("suspend", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "accepted" in done.stdout and "suspended after" in done.stdout and "15.0 GiB of GPU memory freed" in done.stdout
    st = r.d.state()
    assert st["engine"]["phase"] == "suspended"
    sus = st["suspend"]
    assert (sus["stage"], sus["pid"], sus["gpu_bytes"], sus["cold"]) == ("suspended", core, ENGINE_MIB * 2**20, False)
    assert sus["how_to_resume"] == "r3090ctl resume" and sus["since"] <= time.time()
    assert sus["host_rss_bytes"] == psutil.Process(core).memory_info().rss
    assert [s["step"] for s in sus["worker"]["steps"]] == ["init", "lock", "checkpoint"]
    assert st["next_action"] == "none until r3090ctl resume"
    # What an operator sees from outside: the core stopped, the card free, /healthz 503, the record on disk.
    assert proc_state(core) == "T" and r.card_json()["processes"] == []
    code, text = r.d.healthz()
    assert code == 503 and "suspended" in text
    record = json.loads((Path(r.d.sections["daemon"]["state_dir"]) / "suspended.json").read_text())
    assert (record["pid"], record["engine_pid"], record["bytes"]) == (core, api, ENGINE_MIB * 2**20)
    # r3090ctl status: WARNING, and a panel saying since when, what the engine holds, and how to resume.
    shown = r.ctl("status")
    assert shown.returncode == exitcodes.WARNING, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    assert "Status     WARNING: engine suspended" in lines and "Resume     r3090ctl resume" in lines
    rss_gib = psutil.Process(core).memory_info().rss / 2**30  # stopped: its RSS does not move
    since = re.escape(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sus["since"])))
    [panel] = [line for line in lines if line.startswith("Suspended  ")]
    held = f"the engine holds {rss_gib:.1f} GiB of host memory, 15.0 GiB of GPU memory checkpointed"
    assert re.fullmatch(rf"Suspended  since {since} \(\d+ (s|min) ago\); {re.escape(held)}", panel), panel
    rc, out = ctl_json(r.d.config, "status")
    assert rc == exitcodes.WARNING and out["state"]["suspend"]["stage"] == "suspended" and out["state"]["suspend"]["pid"] == core
    # The exporter: when the suspension began, the host memory the engine holds, the GPU memory it checkpointed.
    assert suspended_gauges(r.d) == {
        "r3090d_suspended_since_timestamp_seconds": sus["since"],
        "r3090d_suspended_host_bytes": psutil.Process(core).memory_info().rss,
        "r3090d_suspended_gpu_bytes": ENGINE_MIB * 2**20,
    }

    done = r.ctl("resume", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed after" in done.stdout
    st = r.d.state()
    assert st["engine"]["phase"] == "ready" and st["engine"]["pid"] == api and st["restarts"]["total"] == 0
    assert st["suspend"]["stage"] is None and st["suspend"]["last"]["result"] == "resumed"
    assert proc_state(core) != "T" and r.card_json()["processes"] == [[core, ENGINE_MIB]]
    wait_until(lambda: r.d.healthz()[0] == 200, 10, what="/healthz back to 200")
    wait_until(lambda: suspended_gauges(r.d) == {}, 10, what="the suspended gauges to go")
    assert not (Path(r.d.sections["daemon"]["state_dir"]) / "suspended.json").exists()
    assert r.driver_calls() == ["lock", "checkpoint", "restore", "unlock"]
    assert "suspend request 1: suspended" in r.d.log() and "resume request 2: resumed" in r.d.log()


def test_suspended_long_reminds_and_the_borrowers_memory_raises_no_gpu_alert(rig):
    r = rig(suspend={"remind_after": 1.0}, watchdog={"gpu_memory_alert_mib": 18000})
    r.ready()
    assert r.ctl("suspend", "--wait").returncode == 0
    borrower = subprocess.Popen(["sleep", "300"])
    try:
        r.hold((borrower.pid, 20000))  # over the 18000 MiB alert
        st = r.d.proc.wait_for(lambda s: s if "suspended_long" in s["alerts"]["firing"] else None, BOUND, "the suspended_long alert")
        firing = st["alerts"]["firing"]
        assert "r3090ctl resume brings it back" in firing["suspended_long"]["summary"]
        assert "gpu_memory" not in firing and "alert gpu_memory firing" not in r.d.log()
    finally:
        borrower.kill()
        borrower.wait()
    r.hold()
    assert r.ctl("resume", "--wait").returncode == 0
    wait_until(lambda: "alert suspended_long resolved" in r.d.log(), BOUND, what="suspended_long to resolve")


def test_a_two_holder_tree_is_refused_and_left_alone(rig):
    r = rig()
    core = r.ready()
    worker = next(p for p in r.d.state()["engine"]["tree_pids"] if psutil.Process(p).name() == "fake-Worker")
    r.hold((core, ENGINE_MIB), (worker, 500))
    r.d.proc.wait_for(lambda s: len((s["gpu"] or {}).get("processes") or []) == 2, BOUND, "NVML to list both")
    done = r.ctl("suspend")
    assert done.returncode == exitcodes.WARNING
    assert done.stderr.strip() == f"r3090ctl: refused: 2 engine processes hold GPU memory (pids {', '.join(map(str, sorted([core, worker])))}): " \
                                  "a multi-GPU engine cannot be suspended"
    rc, out = ctl_json(r.d.config, "suspend")
    assert (rc, out["ok"], out["exit_code"], out["unavailable"]) == (1, False, 1, False)
    assert r.phase() == "ready" and r.driver_calls() == [] and proc_state(core) != "T"


def test_without_a_gpu_suspend_says_why_in_one_line_and_exits_69(rig):
    r = rig(gpu=False)
    st = r.d.wait_ready(timeout=BOUND)
    done = r.ctl("suspend", "--wait")
    assert done.returncode == 69 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "there is no GPU to lend: gpu.required is false" in done.stderr
    rc, out = ctl_json(r.d.config, "suspend")
    assert rc == 69 and out["exit_code"] == 69 and out["unavailable"] is True
    done = r.ctl("resume")
    assert done.returncode == 1 and "not suspended: nothing to resume" in done.stderr
    after = r.d.state()["engine"]
    assert (after["phase"], after["pid"], after["generation"]) == ("ready", st["engine"]["pid"], st["engine"]["generation"])
    assert r.driver_calls() == []


def after_failure(r: Rig, api: int) -> int:
    """A cold restart: the old engine goes, so does its line on the card; wait for the new one, list it."""
    r.hold()
    return r.ready(old_pid=api)


def run_under_fault(r: Rig, verb: str, conf: dict, code: int, result: str, calls: list[str]) -> dict:
    """Runs `r3090ctl VERB --wait --json` with the fake driver failing as `conf` says, then clears the fault.

    Checks that run's exit code, result and driver calls (`init` aside); returns the JSON it printed.
    """
    r.calls.unlink(missing_ok=True)
    r.control_set(**conf)
    done = r.ctl(verb, "--wait", "--json")
    out = json.loads(done.stdout)
    assert (done.returncode, out["result"]) == (code, result), (conf, out)
    assert [c for c in r.driver_calls() if c != "init"] == calls, conf
    r.control_set()
    return out


def test_every_suspend_failure(rig):
    r = rig()
    core = r.ready()
    cases = [
        # (control, exit code, result, driver calls, cold restart)
        ({"fail": {"lock": 909}}, 1, "kept_running", ["lock", "state"], False),
        ({"fail": {"checkpoint": 999}}, 1, "kept_running", ["lock", "checkpoint", "state", "unlock"], False),
        ({"fail": {"checkpoint": 999}, "leave": {"checkpoint": "FAILED"}}, 1, "failed", ["lock", "checkpoint", "state"], True),
        ({"fail": {"checkpoint": 999, "state": 999}}, 1, "failed", ["lock", "checkpoint", "state"], True),
        ({"unavailable": "no usable driver in this test"}, 69, "unavailable", [], False),
    ]
    restarts = 0
    for conf, code, result, calls, cold in cases:
        st = r.d.state()
        api, generation = st["engine"]["pid"], st["engine"]["generation"]
        out = run_under_fault(r, "suspend", conf, code, result, calls)
        if cold:
            restarts += 1
            assert "the engine restarts cold" in out["detail"]
            core = after_failure(r, api)
            st = r.d.state()
            assert st["engine"]["generation"] == generation + 1 and st["restarts"]["by_reason"]["suspend_failed"] == restarts
            assert "alert engine_restarted firing: engine restarting (suspend_failed)" in r.d.log()
        else:
            st = r.wait_phase("ready")
            assert (st["engine"]["pid"], st["engine"]["generation"], st["restarts"]["total"]) == (api, generation, restarts), conf
            wait_until(lambda pid=core: proc_state(pid) != "T", 10, what="the engine must run on")
        wait_until(lambda: r.d.healthz()[0] == 200, 10, what="/healthz back to 200")  # the exporter reads the next state write


def test_every_resume_failure(rig):
    r = rig()
    core = r.ready()
    cases = [
        # (control, exit code, result, driver calls of the resume, cold restart)
        ({"fail": {"restore": 2}}, 1, "failed", ["restore", "state"], True),
        ({"fail": {"restore": 999}, "leave": {"restore": "LOCKED"}}, 0, "resumed", ["restore", "state", "unlock"], False),
        ({"fail": {"unlock": 999}}, 1, "failed", ["restore", "unlock", "state", "unlock"], True),
    ]
    restarts = 0
    for conf, code, result, calls, cold in cases:
        st = r.d.state()
        api, generation = st["engine"]["pid"], st["engine"]["generation"]
        assert r.ctl("suspend", "--wait").returncode == 0
        run_under_fault(r, "resume", conf, code, result, calls)
        if cold:
            restarts += 1
            core = after_failure(r, api)
            assert r.d.state()["restarts"]["by_reason"]["resume_failed"] == restarts
        else:
            st = r.wait_phase("ready")
            assert (st["engine"]["pid"], st["engine"]["generation"], st["restarts"]["total"]) == (api, generation, restarts)
            r.hold((core, ENGINE_MIB))  # the fake left it off the card when its restore "failed"
        wait_until(lambda: r.d.healthz()[0] == 200, 10, what="/healthz back to 200")  # the exporter reads the next state write


def test_resume_is_refused_while_another_process_holds_the_memory(rig):
    r = rig()
    core = r.ready()
    assert r.ctl("suspend", "--wait").returncode == 0
    borrower = subprocess.Popen(["sleep", "300"])
    try:
        r.hold((borrower.pid, 20000))
        r.d.proc.wait_for(lambda s: [p["pid"] for p in (s["gpu"] or {}).get("processes") or []] == [borrower.pid], BOUND, "NVML to list it")
        done = r.ctl("resume", "--wait")
        assert done.returncode == 1
        assert f"held by pid {borrower.pid} (sleep, 19.5 GiB)" in done.stderr and "15.0 GiB + 0.5 GiB margin needed" in done.stderr
        st = r.d.state()
        assert st["engine"]["phase"] == "suspended" and st["suspend"]["error"].startswith("resume refused: ")
        assert proc_state(core) == "T" and "restore" not in r.driver_calls()
    finally:
        borrower.kill()
        borrower.wait()
    r.hold()
    done = r.ctl("resume", "--wait")
    assert done.returncode == 0, done.stderr
    assert r.phase() == "ready" and r.d.state()["restarts"]["total"] == 0


def test_a_slow_checkpoint_never_holds_the_loop(rig, sockdir):
    """The acceptance test: a checkpoint that takes 5 s; state writes and watchdog pings keep their pace."""
    poll = 0.5
    notify = sockdir / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(0.05)
    pings: list[float] = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            if b"WATCHDOG=1" in data:
                pings.append(time.monotonic())

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    r = rig(watchdog={"poll_interval": poll})
    r.d.proc.stop()
    r.d.start(prefix=["env", f"NOTIFY_SOCKET={notify}", f"PYTHONPATH={FAKE_PATHS}", f"R3090D_FAKE_NVML={r.card}", f"{FAKE_ENV}={r.control}"])
    try:
        r.ready()
        r.control_set(delay_s={"checkpoint": 5})
        assert r.ctl("suspend").returncode == 0
        r.wait_phase("suspending")
        writes, last = [], None
        began = time.monotonic()
        while (st := r.d.state()) is None or st["engine"]["phase"] != "suspended":
            if st is not None and st["written_at"] != last:
                last = st["written_at"]
                writes.append(last)
            assert time.monotonic() - began < BOUND
            time.sleep(0.02)
        ended = time.monotonic()
        worker = r.d.state()["suspend"]["worker"]
        took = {s["step"]: s["took_s"] for s in worker["steps"]}
        assert took["checkpoint"] >= 5.0
        gaps = [b - a for a, b in zip(writes, writes[1:], strict=False)]
        in_window = [t for t in pings if began <= t <= ended]
        ping_gaps = [b - a for a, b in zip(in_window, in_window[1:], strict=False)]
        print(f"{len(writes)} state writes, max gap {max(gaps):.3f} s; {len(in_window)} watchdog pings, max gap {max(ping_gaps):.3f} s (poll {poll} s)")
        # A loop held by the checkpoint would show one gap of 5 s; 4 polls leave room for a loaded 2-core machine.
        assert len(writes) >= 5 / poll * 0.6 and max(gaps) <= 4 * poll
        assert len(in_window) >= 5 / poll * 0.6 and max(ping_gaps) <= 4 * poll
    finally:
        stop.set()
        listener.join(1)
        sock.close()


def test_a_daemon_restart_while_suspended_keeps_the_engine_down_until_resume(rig):
    r = rig()
    core = r.ready()
    api = r.d.state()["engine"]["pid"]
    record = Path(r.d.sections["daemon"]["state_dir"]) / "suspended.json"
    assert r.ctl("suspend", "--wait").returncode == 0

    # 1. A clean stop: the locked engine is stopped fast (it cannot drain), the record stays.
    assert r.d.proc.stop() == 0
    assert not psutil.pid_exists(core) or psutil.Process(core).status() == psutil.STATUS_ZOMBIE
    assert record.exists()
    r.start()
    st = r.d.proc.wait_for(lambda s: s if s["daemon"]["pid"] == r.d.pid and s["engine"]["phase"] == "suspended" else None, BOUND, "suspended")
    assert st["suspend"]["cold"] is True and st["engine"]["pid"] is None
    first = st["written_at"]
    r.d.proc.wait_for(lambda s: s["written_at"] > first + 10 * POLL, BOUND, "ten more ticks")
    assert psutil.Process(r.d.pid).children() == [] and r.phase() == "suspended"  # no engine was started
    assert "it stays down, and preflight waits, until r3090ctl resume" in r.d.log()
    done = r.ctl("resume", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ready after" in done.stdout
    core = r.ready(old_pid=api)
    st = r.d.state()
    assert st["suspend"]["last"]["result"] == "started_cold" and not record.exists()

    # 2. The daemon killed outright: its engine's launcher takes the whole tree with it.
    api = st["engine"]["pid"]
    assert r.ctl("suspend", "--wait").returncode == 0
    tree = r.d.state()["engine"]["tree_pids"]
    assert api in tree and core in tree and len(tree) >= 4  # launcher, API server, EngineCore, worker
    r.d.proc.proc.kill()
    r.d.proc.proc.wait()
    wait_until(lambda: all(gone(pid) for pid in tree), BOUND, what="the engine to go with its daemon")

    # 3. An engine left behind all the same (its launcher could not act) is killed by the next daemon, which keeps it down.
    left = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        write_atomically(record, {**json.loads(record.read_text()), "engine_pid": left.pid, "engine_started": procstat.read(left.pid).start_ticks})
        r.start()
        assert left.wait(BOUND) == -signal.SIGKILL
    finally:
        left.kill()
        left.wait()
    assert "the suspended engine of the previous daemon" in r.d.log()
    st = r.d.proc.wait_for(lambda s: s if s["daemon"]["pid"] == r.d.pid and s["engine"]["phase"] == "suspended" else None, BOUND, "suspended")
    assert st["suspend"]["cold"] is True
    assert r.ctl("resume", "--wait").returncode == 0
    r.ready(old_pid=api)


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for its parent."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ancestors(pid: int) -> list[int]:
    """The ppid chain of `pid` from /proc, its parent first, up to init."""
    chain = []
    while (st := procstat.read(pid)) is not None and st.ppid > 0:
        chain.append(st.ppid)
        pid = st.ppid
    return chain


def test_the_driver_is_called_by_an_ancestor_of_the_engine_core(rig):
    """Under Yama's ptrace_scope = 1 the driver refuses any caller but an ancestor of the process it acts on."""
    r = rig()
    core = r.ready()
    launcher = r.d.state()["engine"]["pid"]
    assert r.ctl("suspend", "--wait").returncode == 0
    tree = subprocess.run(["ps", "-ww", "-o", "pid,ppid,pgid,sid,stat,args", "--forest", "-s", str(launcher)], capture_output=True, text=True)
    print(f"daemon {r.d.pid}; suspended engine's session:\n{tree.stdout}")
    assert r.ctl("resume", "--wait").returncode == 0
    calls = [json.loads(line) for line in r.calls.read_text().splitlines()]
    assert [(c["step"], c["pid"]) for c in calls] == [("lock", core), ("checkpoint", core), ("restore", core), ("unlock", core)]
    chain = ancestors(core)
    api_server = chain[0]
    assert api_server in r.d.state()["engine"]["tree_pids"] and chain[1] == launcher  # the core's parent is the API server, its parent the launcher
    assert r.d.pid in chain  # the daemon above the launcher
    assert {c["caller"] for c in calls} == {launcher}  # the driver was called by the launcher: an ancestor, never the daemon


def test_a_request_frozen_across_three_stall_seconds_finishes_after_resume(rig):
    r = rig()
    r.ready()
    stall = WATCHDOG["stall_seconds"]
    events: list[tuple[float, dict]] = []
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}

    def stream():
        with httpx.Client(timeout=120.0, trust_env=False) as client, client.stream("POST", r.d.engine_url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append((time.monotonic(), json.loads(line[6:])))

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    wait_until(lambda: len(events) >= 5, BOUND, what="the stream to flow")
    assert r.ctl("suspend").returncode == 0
    st = r.wait_phase("suspended")
    assert st["suspend"]["frozen_requests"] == 1  # still running at the drain deadline: frozen, not aborted
    suspended_at = time.monotonic()
    frozen_count = len(events)
    wait_until(lambda: time.monotonic() - suspended_at >= 3 * stall, 10 * stall, what="3 x stall_seconds suspended")  # time passing on purpose
    assert len(events) == frozen_count  # nothing moved while suspended
    done = r.ctl("resume", "--wait")
    assert done.returncode == 0, done.stderr
    reader.join(BOUND)
    assert not reader.is_alive()
    tokens = [e for _, e in events if "choices" in e]
    assert len(tokens) == 400 and tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert not [e for _, e in events if "error" in e]
    gaps = [b[0] - a[0] for a, b in zip(events, events[1:], strict=False)]
    assert max(gaps) >= 3 * stall
    ready = r.d.state()
    r.d.proc.wait_for(lambda s: s["written_at"] > ready["written_at"] + 3 * stall, BOUND, "three stall_seconds of READY")
    st = r.d.state()
    assert st["engine"]["phase"] == "ready" and st["restarts"]["total"] == 0 and st["engine"]["pid"] == ready["engine"]["pid"]


def test_preflight_asks_the_driver_about_the_running_engine(tmp_path, monkeypatch):
    from r3090d.core.snapshot import GpuProcess, GpuSample, GpuStatus
    from r3090d.preflight import gather

    engine = subprocess.Popen(["sleep", "300"])
    try:
        card, control = tmp_path / "card.json", tmp_path / "cuda.json"
        write_atomically(card, {"processes": [[engine.pid, ENGINE_MIB]]})
        write_atomically(control, {})
        monkeypatch.setenv("PYTHONPATH", FAKE_PATHS)
        monkeypatch.setenv("R3090D_FAKE_NVML", str(card))
        monkeypatch.setenv(FAKE_ENV, str(control))
        gpu = GpuSample(GpuStatus.OK, processes=(GpuProcess(engine.pid, ENGINE_MIB * 2**20),))
        assert gather.checkpoint_state(gpu, frozenset({engine.pid})) == f"pid {engine.pid}: RUNNING"
        write_atomically(control, {"unavailable": "no usable driver in this test"})
        assert gather.checkpoint_state(gpu, frozenset({engine.pid})) == "unavailable: no usable driver in this test"
    finally:
        engine.kill()
        engine.wait()


def test_suspend_test_suspends_resumes_completes_and_reports(rig):
    r = rig()
    r.ready()
    r.control_set(delay_s={"checkpoint": 0.3, "restore": 0.2})
    done = r.ctl("suspend", "--test")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("suspend ") and "lock " in lines[0] and "checkpoint 0." in lines[0]
    assert lines[1].startswith("resume ") and "restore 0." in lines[1] and "unlock " in lines[1]
    assert lines[2].startswith("complete ") and lines[2].endswith("(ok)")
    assert lines[3] == f"VRAM freed: {ENGINE_MIB} MiB (the engine's process held {ENGINE_MIB} MiB)"
    rc, out = ctl_json(r.d.config, "suspend", "--test")
    assert rc == 0 and out["ok"] is True and out["vram_freed_bytes"] == ENGINE_MIB * 2**20
    assert out["suspend_steps"]["checkpoint"] >= 0.3 and out["resume_steps"]["restore"] >= 0.2
    assert r.phase() == "ready" and r.d.state()["restarts"]["total"] == 0


def test_an_engine_killed_while_suspended_stays_down_and_resume_starts_it_cold(rig):
    r = rig()
    core = r.ready()
    api = r.d.state()["engine"]["pid"]
    assert r.ctl("suspend", "--wait").returncode == 0
    os.kill(core, signal.SIGKILL)  # as the OOM killer would: the core's RSS grew by what it held on the GPU
    st = r.d.proc.wait_for(lambda s: s if s["suspend"]["cold"] else None, BOUND, "the suspension to go cold")
    assert st["engine"]["phase"] == "suspended" and "the suspended engine exited" in st["suspend"]["error"]
    wait_until(lambda: "alert suspended_engine_lost firing" in r.d.log(), BOUND, what="the alert")
    wait_until(lambda: not r.d.state()["engine"]["tree_pids"], BOUND, what="what was left of the engine to go")
    first = r.d.state()["written_at"]
    r.d.proc.wait_for(lambda s: s["written_at"] > first + 10 * POLL, BOUND, "ten more ticks")
    st = r.d.state()
    assert st["engine"]["phase"] == "suspended" and st["restarts"]["total"] == 0 and psutil.Process(r.d.pid).children() == []
    done = r.ctl("resume", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    r.ready(old_pid=api)
    assert r.d.state()["restarts"]["total"] == 0
