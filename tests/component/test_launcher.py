"""The engine's launcher with real children: what it passes on, what it relays, what it adopts, and that it dies with its daemon.

The engine is a small stand-in with vLLM's shape (API server -> core), started
through EngineProcess exactly as the daemon starts vLLM: EngineProcess spawns
the launcher, the launcher the stand-in API server. Each process writes a mark
file for what it was sent, so a test sees which process got which signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from r3090d import procstat
from r3090d.core.suspend_types import Outcome, ProcessState
from r3090d.effectors.checkpoint import FAKE_ENV
from r3090d.effectors.child import EngineProcess, group_members
from r3090d.effectors.suspender import Suspender
from tests.waiting import wait_until

pytestmark = pytest.mark.component

BOUND = 30.0  # Python processes starting on a busy 2-core machine

# argv: MARKS EXIT_CODE MODE. On SIGTERM it marks and exits EXIT_CODE. MODE "tree" starts a core
# that marks any SIGTERM and carries on; "orphan" starts a middle process that starts two sleeps
# (one for 300 s, one for 0.2 s) and exits at once, leaving them without a parent.
SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    marks, code, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    def mark(name, text=""):
        with open(os.path.join(marks, name + ".tmp"), "w") as fh:
            fh.write(text)
        os.replace(os.path.join(marks, name + ".tmp"), os.path.join(marks, name))
    def on_term(signum, frame):
        mark("server.term")
        sys.exit(code)
    signal.signal(signal.SIGTERM, on_term)
    if mode == "tree":
        core = subprocess.Popen([sys.executable, "-c", sys.argv[4], marks])
        mark("core.pid", str(core.pid))
    else:
        middle = subprocess.Popen(["sh", "-c", f"sleep 300 & echo $! > {marks}/long.pid; sleep 0.2 & echo $! > {marks}/short.pid"])
        middle.wait()
    print("server says hello", flush=True)
    mark("server.pid", str(os.getpid()))
    while True:
        time.sleep(0.05)
""")
CORE = textwrap.dedent("""
    import os, signal, sys, time
    def on_term(signum, frame):
        open(os.path.join(sys.argv[1], "core.term"), "w").close()
    signal.signal(signal.SIGTERM, on_term)
    while True:
        time.sleep(0.05)
""")


class Rig:
    def __init__(self, tmp_path: Path):
        self.marks = tmp_path / "marks"
        self.marks.mkdir()
        self.lines: list[str] = []
        self.engine = EngineProcess(threading.Event(), echo=self.lines.append)

    def argv(self, code: int = 0, mode: str = "tree") -> list[str]:
        return [sys.executable, "-c", SERVER, str(self.marks), str(code), mode, CORE]

    def start(self, code: int = 0, mode: str = "tree", env: dict[str, str] | None = None) -> int:
        self.engine.spawn(self.argv(code, mode), env or dict(os.environ))
        wait_until(lambda: (self.marks / "server.pid").exists(), BOUND, what="the stand-in API server")
        return self.engine.sample().pid

    def pid(self, name: str) -> int:
        return int((self.marks / f"{name}.pid").read_text())

    def exited(self):
        sample = self.engine.sample()
        return sample if not sample.alive else None

    def close(self) -> None:
        self.engine.kill_now()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def gone(pid: int) -> bool:
    st = procstat.read(pid)
    return st is None or st.state == "Z"


def test_sigterm_goes_to_the_api_server_alone_and_its_exit_code_is_relayed(rig):
    launcher = rig.start(code=3)
    server, core = rig.pid("server"), rig.pid("core")
    assert procstat.read(server).ppid == launcher and procstat.read(core).ppid == server
    assert set(group_members(launcher)) == {launcher, server, core}
    rig.engine.stop(drain=True, drain_timeout=BOUND)
    sample = wait_until(rig.exited, BOUND, what="the engine's exit")
    assert sample.exit_code == 3 and sample.root_cause is None  # the API server's own exit code
    assert (rig.marks / "server.term").exists()
    wait_until(lambda: gone(core), BOUND, what="the core killed with the group")
    assert not (rig.marks / "core.term").exists()  # a drained stop never sends the core SIGTERM
    assert "server says hello" in rig.lines  # the engine's output reaches the daemon unchanged


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_death_of_the_api_server_by_a_signal_is_relayed_as_that_signal(rig, sig):
    launcher = rig.start()
    os.kill(rig.pid("server"), sig)
    sample = wait_until(rig.exited, BOUND, what="the engine's exit")
    assert sample.pid == launcher and sample.exit_code == -sig
    assert sample.root_cause == f"killed by {sig.name}"


def test_an_orphan_is_adopted_by_the_launcher_and_killed_with_the_group(rig):
    launcher = rig.start(mode="orphan")
    long, short = rig.pid("long"), rig.pid("short")
    # Reaped by the launcher, not left a zombie (its parent is gone: only the adopter can reap it).
    wait_until(lambda: procstat.read(short) is None, BOUND, what="the short orphan to exit and be reaped by the launcher")
    assert procstat.read(long).ppid == launcher  # its parent exited: the subreaper, not init, adopted it
    rig.engine.stop(drain=False, drain_timeout=BOUND)
    wait_until(rig.exited, BOUND, what="the engine's exit")
    wait_until(lambda: gone(long), BOUND, what="the orphan killed with the group")
    assert group_members(launcher) == ()


def test_a_missing_api_server_is_a_spawn_error(rig):
    rig.engine.spawn(["/nonexistent/python", "-m", "vllm"], dict(os.environ))
    sample = wait_until(rig.exited, BOUND, what="the launcher's exit")
    assert sample.spawn_error == "cannot start /nonexistent/python: No such file or directory"
    assert sample.root_cause == sample.spawn_error and rig.lines == []  # the launcher itself wrote nothing


def test_a_sigkilled_daemon_leaves_no_engine_behind(rig, tmp_path):
    daemon = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import os, sys, threading, time
            from r3090d.effectors.child import EngineProcess
            engine = EngineProcess(threading.Event())
            engine.spawn(sys.argv[1:], dict(os.environ))
            print(engine.sample().pid, flush=True)
            time.sleep(300)
        """), *rig.argv()],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        launcher = int(daemon.stdout.readline())
        wait_until(lambda: (rig.marks / "server.pid").exists(), BOUND, what="the stand-in API server")
        tree = (launcher, rig.pid("server"), rig.pid("core"))
        assert set(group_members(launcher)) == set(tree)
        daemon.kill()
        daemon.wait()
        wait_until(lambda: all(gone(pid) for pid in tree), BOUND, what="the engine to go with its daemon")
        assert group_members(launcher) == ()
    finally:
        daemon.kill()
        daemon.wait()


def test_checkpoint_commands_run_in_the_launcher_and_its_end_cuts_one_short(rig, tmp_path):
    fake_cuda = Path(__file__).resolve().parents[1] / "fakecuda"
    card, control, calls = tmp_path / "card.json", tmp_path / "cuda.json", tmp_path / "calls.jsonl"
    control.write_text(json.dumps({"log": str(calls)}))
    env = {**os.environ, "PYTHONPATH": f"{fake_cuda}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", FAKE_ENV: str(control),
           "R3090D_FAKE_NVML": str(card)}  # fmt: skip
    suspender = Suspender(launcher=rig.engine.channel)
    assert suspender.query(4242)
    sample = suspender.wait(BOUND)
    assert (sample.outcome, sample.error) == (Outcome.FAILED, "no engine is running: no process 4242 to state")

    launcher = rig.start(env=env)
    core = rig.pid("core")
    card.write_text(json.dumps({"processes": [[core, 1000]]}))
    assert suspender.query(core)
    sample = suspender.wait(BOUND)
    assert (sample.outcome, sample.state) == (Outcome.REPORTED, ProcessState.RUNNING), sample
    assert [json.loads(line)["caller"] for line in calls.read_text().splitlines()] == [launcher]

    control.write_text(json.dumps({"log": str(calls), "delay_s": {"state": 60}}))
    assert suspender.query(core)
    wait_until(lambda: len(calls.read_text().splitlines()) == 2, BOUND, what="the second call to begin")
    os.kill(launcher, signal.SIGKILL)
    sample = suspender.wait(BOUND)
    assert (sample.outcome, sample.error) == (Outcome.UNKNOWN, "the engine's launcher exited without a result"), sample
    assert wait_until(rig.exited, BOUND, what="the engine's exit").exit_code == -signal.SIGKILL
