"""r3090d as PID 1, as a container's main process is: orphans reaped, signals honoured, /livez honest.

The daemon runs as PID 1 of a PID namespace of its own (`unshare --pid --fork
--mount-proc`), with the vLLM double as its engine. Seen from here, the
namespace's init is unshare's child; its descendants are everything the
namespace holds, orphans re-parented to it included.

The reaper's own tests run their scenarios in a fresh interpreter each, so
that no stray child of the test process, and no subreaper flag, leaks in or out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from r3090d import procstat
from r3090d.service import exporter, forensics
from tests.daemon_harness import DaemonProcess, engine_config, free_port, write_config
from tests.fakevllm.harness import sse_events
from tests.waiting import wait_until

pytestmark = pytest.mark.component

ROOT = Path(__file__).resolve().parents[2]
FAKE_NVML = ROOT / "tests" / "fakenvml"
UNSHARE = shutil.which("unshare")
CRASHES = 3


# ------------------------------------------------------------------ the reaper, with real children


def _fork_exit(code: int, *, own_group: bool = True, by_signal: int | None = None) -> int:
    """A child that exits at once. own_group: in a process group of its own, as the engine's tree is."""
    pid = os.fork()
    if pid == 0:
        if own_group:
            os.setpgid(0, 0)
        if by_signal is not None:
            os.kill(os.getpid(), by_signal)
        os._exit(code)
    return pid


def _wait_exited(pid: int) -> None:
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # blocks until it exits; leaves it a zombie


def _peek() -> int:
    return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT).si_pid


def _owner_wait(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def scenario_kept_pid_first() -> dict:
    """The engine's main pid exited first and is kept; two orphans exited behind it."""
    from r3090d.effectors.reaper import ChildReaper

    kept = _fork_exit(7)
    plain, killed = _fork_exit(3), _fork_exit(0, by_signal=signal.SIGKILL)
    for pid in (kept, plain, killed):
        _wait_exited(pid)
    first = _peek()
    reaper = ChildReaper(lambda: {kept, None}, active=True)
    reaped = {r.pid: r.exit_code for r in reaper.reap()}
    again = reaper.reap()
    return {"first": first, "kept": kept, "reaped": reaped, "expected": {plain: 3, killed: -signal.SIGKILL},
            "again": len(again), "kept_code": _owner_wait(kept), "total": reaper.reaped_total}  # fmt: skip


def scenario_own_group_spared() -> dict:
    """A command the daemon runs itself (same process group) keeps its status for its Popen."""
    from r3090d.effectors.reaper import ChildReaper

    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    forked = _fork_exit(4, own_group=False)
    for pid in (proc.pid, forked):
        _wait_exited(pid)
    reaped = ChildReaper(lambda: (), active=True).reap()
    return {"reaped": len(reaped), "popen_code": proc.wait(), "forked_code": _owner_wait(forked)}


def scenario_without_own_proc(empty_dir: str) -> dict:
    """No /proc of this namespace: peeks alone, so a zombie behind a kept one waits for the owner."""
    from r3090d.effectors.reaper import ChildReaper

    kept = _fork_exit(7)
    behind = _fork_exit(5)
    for pid in (kept, behind):
        _wait_exited(pid)
    reaper = ChildReaper(lambda: {kept}, active=True, proc=empty_dir)
    blocked = reaper.reap()
    kept_code = _owner_wait(kept)  # the waiter thread takes the engine's status
    after = {r.pid: r.exit_code for r in reaper.reap()}
    return {"blocked": len(blocked), "kept_code": kept_code, "after": after, "expected": {behind: 5}}


def scenario_inactive_when_not_pid1() -> dict:
    from r3090d.effectors.reaper import ChildReaper

    pid = _fork_exit(6)
    _wait_exited(pid)
    reaper = ChildReaper(lambda: ())
    return {"active": reaper.active, "reaped": len(reaper.reap()), "owner_code": _owner_wait(pid)}


def scenario_adopted_orphan() -> dict:
    """The engine's crash in miniature: a subreaper adopts the grandchild of a SIGKILLed child."""
    import ctypes

    from r3090d.effectors.reaper import ChildReaper

    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return {"skip": "prctl(PR_SET_CHILD_SUBREAPER) refused"}
    me = os.getpid()
    read_end, write_end = os.pipe()
    server = os.fork()
    if server == 0:
        os.setsid()  # the engine's own session
        core = os.fork()
        if core == 0:
            while os.getppid() != me:  # lingers until adopted, then exits, as an orphaned EngineCore does
                time.sleep(0.005)
            os._exit(5)
        os.write(write_end, str(core).encode())
        while True:
            time.sleep(60)
    os.close(write_end)
    core = int(os.read(read_end, 32))
    os.kill(server, signal.SIGKILL)
    _wait_exited(server)
    _wait_exited(core)  # adopted: waitable by us now
    reaper = ChildReaper(lambda: {server}, active=True)
    reaped = {r.pid: r.exit_code for r in reaper.reap()}
    return {"reaped": reaped, "expected": {core: 5}, "server_code": _owner_wait(server)}


def run_scenario(name: str, *args: str) -> dict:
    code = f"import json, sys; from tests.component.test_pid1 import {name}; print(json.dumps({name}(*sys.argv[1:])))"
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1], object_hook=lambda d: {int(k) if k.lstrip("-").isdigit() else k: v for k, v in d.items()})


def test_reaper_reaps_orphans_queued_behind_the_kept_engine_pid_and_leaves_its_status():
    out = run_scenario("scenario_kept_pid_first")
    assert out["first"] == out["kept"], "the scenario needs the kept pid first in the kernel's list"
    assert out["reaped"] == out["expected"]
    assert out["again"] == 0 and out["total"] == 2
    assert out["kept_code"] == 7  # the waiter thread's status, not a 0 made up after ECHILD


def test_reaper_spares_children_of_its_own_process_group():
    out = run_scenario("scenario_own_group_spared")
    assert out == {"reaped": 0, "popen_code": 3, "forked_code": 4}


def test_reaper_without_its_own_proc_reaps_behind_the_kept_pid_once_the_owner_has_waited():
    out = run_scenario("scenario_without_own_proc", "/nonexistent-proc")
    assert out["blocked"] == 0
    assert out["kept_code"] == 7
    assert out["after"] == out["expected"]


def test_reaper_does_nothing_unless_pid1():
    assert run_scenario("scenario_inactive_when_not_pid1") == {"active": False, "reaped": 0, "owner_code": 6}


def test_reaper_reaps_an_adopted_orphan_and_leaves_the_killed_server_to_its_waiter():
    out = run_scenario("scenario_adopted_orphan")
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["reaped"] == out["expected"]
    assert out["server_code"] == -signal.SIGKILL


# ------------------------------------------------------------------ the daemon as PID 1 of a namespace


def _pidns_usable() -> str | None:
    """Why a PID namespace cannot be made here, or None."""
    if UNSHARE is None:
        return "unshare (util-linux) is not installed"
    try:
        done = subprocess.run([UNSHARE, "--pid", "--fork", "--mount-proc", "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if done.returncode != 0 or done.stdout.strip() != "1":
        return f"cannot make a PID namespace (root needed): {done.stderr.strip()}"
    return None


_PIDNS_UNUSABLE = _pidns_usable()
needs_pidns = pytest.mark.skipif(_PIDNS_UNUSABLE is not None, reason=_PIDNS_UNUSABLE or "")


def _proc_table() -> dict[int, tuple[str, int, str]]:
    """pid -> (state, ppid, comm), from the host's /proc."""
    return {p.pid: (p.state, p.ppid, p.comm) for p in procstat.scan()}


def descendants(root: int) -> dict[int, tuple[str, int, str]]:
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out[pid] = table[pid]
        todo.extend(children.get(pid, ()))
    return out


def zombies(root: int) -> list[str]:
    return [f"{pid} ({comm}, parent {ppid})" for pid, (state, ppid, comm) in sorted(descendants(root).items()) if state == "Z"]


def host_pid(root: int, ns_pid: int) -> int | None:
    """The host's pid of the process that is `ns_pid` inside the namespace whose init is `root`."""
    for pid in descendants(root):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and int(line.split()[-1]) == ns_pid:
                    return pid
        except (OSError, ValueError):
            continue
    return None


class Pid1Daemon(DaemonProcess):
    """The daemon as PID 1 of a new PID namespace. `pid` is its pid as seen from here."""

    def __init__(self, config_path: Path, log_path: Path, *args: str, env: dict[str, str] | None = None):
        super().__init__(config_path, log_path, *args)
        self.env = env or {}
        self.init_pid: int | None = None

    def start(self) -> Pid1Daemon:
        self._log = open(self.log_path, "ab")
        # --kill-child: should unshare die, the namespace dies with it (no engine left behind by a failed test).
        argv = [UNSHARE, "--pid", "--fork", "--mount-proc", "--kill-child",
                sys.executable, "-m", "r3090d", "--config", str(self.config_path), *self.args]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "R3090D_CONFIG", "R3090D_INSTANCE")}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**env, **self.env})
        self.init_pid = wait_until(lambda: next(iter(psutil.Process(self.proc.pid).children()), None), 10, what="the namespace's init").pid
        return self

    @property
    def pid(self) -> int:
        return self.init_pid

    def signal(self, sig: int) -> None:
        # unshare does not pass signals on; PID 1 gets them only for signals it handles.
        os.kill(self.init_pid, sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # --kill-child takes the namespace down with it
            return self.proc.wait()


@pytest.fixture
def pid1(tmp_path):
    started: list[Pid1Daemon] = []

    def run(sections: dict, *args: str, env: dict[str, str] | None = None) -> Pid1Daemon:
        cfg = write_config(tmp_path / f"r3090d-{len(started)}.toml", sections)
        d = Pid1Daemon(cfg, tmp_path / f"daemon-{len(started)}.log", *args, env=env).start()
        started.append(d)
        return d

    yield run
    for d in started:
        d.cleanup()


@needs_pidns
def test_as_pid1_engine_crashes_leave_no_zombie_and_each_exit_keeps_its_real_status(pid1, tmp_path, fake_engine_python):
    d = pid1(engine_config(tmp_path, fake_engine_python, extra_args=["--fake-orphan-linger", "1"],
                           watchdog={"min_uptime": 0.0, "backoff_initial": 0.0}))  # fmt: skip
    st = d.wait_ready(timeout=60)
    assert st["daemon"]["pid"] == 1, "the daemon must be PID 1 of its namespace"
    for n in range(CRASHES):
        main_ns = st["engine"]["pid"]  # the engine's launcher, the API server's parent
        launcher = host_pid(d.pid, main_ns)
        assert launcher is not None, f"engine pid {main_ns} not found in the namespace"
        tree = descendants(d.pid).items()
        main = next(pid for pid, (_, ppid, _) in tree if ppid == launcher)
        core = [pid for pid, (_, ppid, comm) in tree if ppid == main and "EngineCore" in comm]
        assert core, f"crash {n}: the engine should run an EngineCore child, to be orphaned"
        os.kill(main, signal.SIGKILL)  # the API server dies; its EngineCore and Worker go to PID 1
        st = d.wait_ready(timeout=60, generation_pid=main_ns)
    # Orphans are reaped within a few ticks (poll 0.2 s); without a reaper they stay zombies for good.
    wait_until(
        lambda: not zombies(d.pid),
        10,
        what="no zombie left in the namespace",
        details=lambda: f"zombies: {zombies(d.pid)}",
    )
    assert st["restarts"]["by_reason"].get("exited") == CRASHES, st["restarts"]
    records = [json.loads(p.read_text()) for p in forensics.list_records(tmp_path / "state")]
    details = sorted(r["detail"] for r in records if r["reason"] == "exited")
    assert details == ["engine exited with code -9"] * CRASHES, details
    assert d.proc.poll() is None


@needs_pidns
def test_as_pid1_sigterm_drains_the_stream_in_flight_and_exits_0(pid1, tmp_path, fake_engine_python):
    tokens = 100
    d = pid1(engine_config(tmp_path, fake_engine_python, extra_args=["--fake-token-delay", "0.02"]))  # 2 s stream
    st = d.wait_ready(timeout=60)
    assert st["daemon"]["pid"] == 1
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(timeout=30, trust_env=False) as client, client.stream("POST", st["engine"]["url"] + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for _, payload in sse_events(r):
            if not events:
                d.signal(signal.SIGTERM)  # with the first token out: the stream is in flight
            events.append(payload)
    assert d.wait_exit(timeout=60) == 0, d.log()[-3000:]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert len(chunks) == tokens and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-2:]
    assert "SIGTERM: stopping the engine (drained)" in d.log()


def _livez(port: int) -> tuple[int, str]:
    r = httpx.get(f"http://127.0.0.1:{port}/livez", timeout=3, trust_env=False)
    return r.status_code, r.text.strip()


def _write_card(path: Path, card: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(card))
    os.replace(tmp, path)  # whole: a reader never sees half a card


@needs_pidns
def test_as_pid1_a_hung_nvml_call_does_not_stall_the_loop_so_livez_stays_200(pid1, tmp_path, fake_engine_python):
    """NVML is read only by the monitor's worker thread; the loop reads its last sample and a "hung" flag."""
    card = tmp_path / "card.json"
    _write_card(card, {})
    port = free_port()
    sections = engine_config(tmp_path, fake_engine_python, watchdog={"nvml_hung_after": 1.0},
                             daemon={"exporter_enabled": True, "exporter_host": "127.0.0.1", "exporter_port": port})  # fmt: skip
    sections["gpu"] = {"required": True, "card": "any"}
    d = pid1(sections, "--skip-preflight", env={"PYTHONPATH": str(FAKE_NVML), "R3090D_FAKE_NVML": str(card)})
    d.wait_ready(timeout=60)
    assert _livez(port) == (200, "alive")

    _write_card(card, {"hang": True})
    d.wait_for(lambda s: s["gpu"]["hung"], 20, "the NVML call reported hung")
    # A hang is a non-event for /livez: watch it past the bound at which a stalled loop would read 503.
    bound = exporter.STALE_MIN_S + 2
    seen, written = set(), set()
    until = time.monotonic() + bound
    while time.monotonic() < until:
        seen.add(_livez(port))
        written.add(d.state()["written_at"])
        time.sleep(0.5)  # an observation window on purpose: /livez must stay 200 all along, nothing is awaited
    assert seen == {(200, "alive")}
    assert len(written) >= bound  # the loop kept writing its state throughout
    assert d.state()["gpu"]["hung"]

    _write_card(card, {})
    d.wait_for(lambda s: not s["gpu"]["hung"] and s["gpu"]["status"] == "ok", 20, "NVML answering again")


class NotifyListener:
    """A systemd-style notify socket that can stop reading, as a stuck service manager does."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.reading = threading.Event()
        self.reading.set()
        self.received: list[bytes] = []
        self._done = threading.Event()
        self._fillers: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            if not self.reading.wait(0.05):
                continue
            try:
                self.received.append(self.sock.recv(4096))
            except TimeoutError:
                pass

    def stop_reading_and_fill(self) -> int:
        """Stop reading and fill the socket's queue, so that the next sender blocks. Returns datagrams queued."""
        self.reading.clear()
        time.sleep(0.1)  # the reader is out of its last recv (its timeout is 0.05 s)
        queued = 0
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.setblocking(False)
            s.connect(self.path)
            self._fillers.append(s)
            sent = 0
            try:
                while True:
                    s.send(b"X")
                    sent += 1
            except BlockingIOError:
                pass
            queued += sent
            if sent == 0:  # a fresh sender is refused at once: the receiver's queue is full
                return queued

    def resume(self) -> None:
        self.reading.set()

    def close(self) -> None:
        self.resume()
        self._done.set()
        self._thread.join(2)
        for s in self._fillers:
            s.close()
        self.sock.close()


@needs_pidns
def test_as_pid1_livez_turns_503_while_the_loop_is_stalled_and_200_once_it_moves(pid1, tmp_path, sockdir, fake_engine_python):
    """The loop stalls in sd_notify when the service manager stops reading its socket (the sender blocks)."""
    listener = NotifyListener(sockdir / "notify.sock")
    port = free_port()
    try:
        d = pid1(engine_config(tmp_path, fake_engine_python,
                               daemon={"exporter_enabled": True, "exporter_host": "127.0.0.1", "exporter_port": port}),
                 env={"NOTIFY_SOCKET": listener.path})  # fmt: skip
        d.wait_ready(timeout=60)
        wait_until(lambda: any(m.startswith(b"READY=1") for m in listener.received), 10, what="READY=1 on the notify socket")
        assert _livez(port) == (200, "alive")

        assert listener.stop_reading_and_fill() > 0
        code, why = wait_until(lambda: (r := _livez(port))[0] == 503 and r, exporter.STALE_MIN_S + 20, what="/livez 503")
        assert "the daemon loop is stuck" in why
        stalled_at = d.state()["written_at"]
        assert time.time() - stalled_at > exporter.STALE_MIN_S  # the loop has not written its state since

        listener.resume()
        wait_until(lambda: _livez(port) == (200, "alive"), 20, what="/livez 200 again once the loop moves")
        assert d.state()["written_at"] > stalled_at
    finally:
        listener.close()  # reading again, so that the daemon can send its STOPPING=1 at teardown
