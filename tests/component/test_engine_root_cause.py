"""Why a real engine process died, as EngineProcess reports it: a real child
prints what vLLM prints and dies as vLLM dies; the unit's memory.events is a
real file under a test's cgroup tree."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from r3090d.core.snapshot import ChildSample
from r3090d.effectors.child import EngineProcess
from r3090d.probes.cgroup import OomKillCounter
from tests.waiting import wait_until

DATA = Path(__file__).resolve().parent.parent / "data"
STARTUP_COMPLETE = "INFO:     Application startup complete."
OOM_EVENTS = "low 0\nhigh 0\nmax 0\noom {n}\noom_kill {n}\noom_group_kill 0\n"


@pytest.fixture
def cgroup(tmp_path):
    """(an OomKillCounter for a fake service cgroup, a function that sets its oom_kill count)."""
    group = tmp_path / "cgroup" / "system.slice" / "r3090d.service"
    group.mkdir(parents=True)
    (tmp_path / "self-cgroup").write_text("0::/system.slice/r3090d.service\n")

    def set_oom_kills(n: int) -> None:
        (group / "memory.events").write_text(OOM_EVENTS.format(n=n))

    set_oom_kills(0)
    return OomKillCounter(cgroup_root=tmp_path / "cgroup", self_cgroup=tmp_path / "self-cgroup"), set_oom_kills


@pytest.fixture
def engines():
    started: list[EngineProcess] = []

    def start(script: str, oom_kills: OomKillCounter | None = None) -> EngineProcess:
        engine = EngineProcess(threading.Event(), echo=lambda line: None, oom_kills=oom_kills)
        engine.spawn([sys.executable, "-c", script], dict(os.environ))
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.kill_now()


def exited(engine: EngineProcess) -> ChildSample:
    return wait_until(lambda: (s := engine.sample()) and not s.alive and s.exit_code is not None and s, 30, what="the engine's exit")


def printing(lines: list[str], then: str) -> str:
    return "import os, signal, sys\n" + "".join(f"print({line!r}, flush=True)\n" for line in lines) + then


def test_a_ready_engine_killed_by_sigkill_has_the_signal_as_its_cause_not_its_last_line(engines):
    engine = engines(printing(["INFO:     Started server process [1]", STARTUP_COMPLETE], "os.kill(os.getpid(), signal.SIGKILL)"))
    s = exited(engine)
    assert s.exit_code == -signal.SIGKILL
    assert (s.root_cause, s.root_cause_certain, s.last_log_line) == ("killed by SIGKILL", True, STARTUP_COMPLETE)


def test_an_exit_with_no_line_that_says_why_has_no_cause_only_a_last_log_line(engines):
    s = exited(engines(printing([STARTUP_COMPLETE], "sys.exit(0)")))
    assert (s.root_cause, s.root_cause_certain, s.last_log_line) == (None, False, STARTUP_COMPLETE)


def test_vllms_real_validation_error_gives_its_message_not_pydantics_footer(engines):
    lines = (DATA / "vllm-0.32-max-model-len-over-limit.txt").read_text().splitlines()
    s = exited(engines(printing(lines, "sys.exit(1)")))
    assert s.root_cause_certain and s.root_cause is not None
    assert s.root_cause.startswith("Value error, User-specified max_model_len (999999) is greater than the derived max_model_len"), s.root_cause
    assert s.last_log_line == lines[-1].strip()


def test_an_oom_kill_during_the_engines_life_is_its_cause(engines, cgroup, tmp_path):
    """The count rises between the engine's start and its death: the API server
    exits 0, as it does when the kernel kills its EngineCore."""
    counter, set_oom_kills = cgroup
    set_oom_kills(5)
    go = tmp_path / "go"
    engine = engines(printing([STARTUP_COMPLETE], f"import time, pathlib\nwhile not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\nsys.exit(0)"), counter)
    wait_until(lambda: STARTUP_COMPLETE in engine.log_tail(), 30, what="the engine's first line")
    set_oom_kills(6)
    go.touch()
    s = exited(engine)
    assert s.root_cause == "the kernel's OOM killer killed a process of the engine (memory.events oom_kill rose)"
    assert s.root_cause_certain and s.last_log_line == STARTUP_COMPLETE


def test_an_unchanged_oom_kill_count_is_no_cause(engines, cgroup):
    counter, set_oom_kills = cgroup
    set_oom_kills(5)
    s = exited(engines(printing([STARTUP_COMPLETE], "sys.exit(0)"), counter))
    assert s.root_cause is None and s.last_log_line == STARTUP_COMPLETE


def test_a_missing_memory_events_file_is_no_cause_and_no_exception(engines, tmp_path):
    counter = OomKillCounter(cgroup_root=tmp_path / "nowhere", self_cgroup=tmp_path / "nowhere" / "cgroup")
    s = exited(engines(printing([STARTUP_COMPLETE], "os.kill(os.getpid(), signal.SIGKILL)"), counter))
    assert s.root_cause == "killed by SIGKILL"


def test_the_exit_is_published_with_its_last_lines_while_an_orphan_holds_the_pipe(tmp_path):
    """The engine prints a long log, ending with why it fails, and exits; a child
    it left behind keeps the pipe open (EngineCore does, after an API server's
    death), so no EOF comes. The first sample that shows the exit already has the
    cause, from the very last lines."""
    lines = (DATA / "vllm-0.32-max-model-len-over-limit.txt").read_text().splitlines()
    script = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n    time.sleep(120)\n    os._exit(0)\n"  # the orphan, in the engine's group
        f"sys.stdout.write('INFO filler line of the engine, to fill the pipe\\n' * 3000 + {chr(10).join(lines)!r} + '\\n')\n"
        "sys.stdout.flush()\n"
        "sys.exit(1)\n"
    )
    wake = threading.Event()
    # A slow relay (a loaded journal): a full pipe's worth of lines is still
    # unread when the engine exits.
    engine = EngineProcess(wake, echo=lambda line: time.sleep(0.001))
    engine.spawn([sys.executable, "-c", script], dict(os.environ))
    try:
        assert wake.wait(60), "the engine's exit was not seen"
        s = engine.sample()
        assert not s.alive and s.exit_code == 1 and s.tree_pids, s
        assert s.root_cause is not None and s.root_cause.startswith("Value error, User-specified max_model_len (999999)"), s
        assert s.last_log_line == lines[-1].strip()
    finally:
        engine.kill_now()


def test_a_flood_of_output_is_relayed_whole_and_its_last_line_says_why():
    """More than one read round's worth (1 MiB) in one burst: no line is lost or
    split, and the cause printed last is found."""
    seen: list[str] = []
    script = (  # 80,000 lines of 44 bytes: 3.4 MiB
        "import sys\n"
        "sys.stdout.write(''.join('INFO 12-02 05:00:00 [x.py:1] filler %07d\\n' % i for i in range(80000)))\n"
        "print('ValueError: the flood says why', flush=True)\n"
        "sys.exit(1)\n"
    )
    engine = EngineProcess(threading.Event(), echo=seen.append)
    engine.spawn([sys.executable, "-c", script], dict(os.environ))
    try:
        s = exited(engine)
        assert (s.root_cause, s.last_log_line) == ("ValueError: the flood says why", "ValueError: the flood says why")
        assert len(seen) == 80001 and seen[12345] == "INFO 12-02 05:00:00 [x.py:1] filler 0012345", seen[12345]
    finally:
        engine.kill_now()
