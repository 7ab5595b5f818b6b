"""/proc/PID/stat parsing: a process name may hold spaces and parentheses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from r3090d import procstat

TAIL = b" 0" * 15 + b" 8812345 0 0\n"  # fields 7 on; field 22 is the start time


def test_a_name_with_spaces_and_parentheses_is_read_from_the_last_parenthesis():
    st = procstat.parse(42, b"42 (VLLM::EngineCore) x (y)) S 7 42 42" + TAIL)
    assert st == procstat.ProcStat(pid=42, comm="VLLM::EngineCore) x (y)", state="S", ppid=7, pgrp=42, start_ticks=8812345)
    assert st.live


@pytest.mark.parametrize("state, live", [("R", True), ("T", True), ("D", True), ("Z", False), ("X", False)])
def test_zombies_and_the_dead_are_not_live(state, live):
    st = procstat.parse(5, f"5 (python3) {state} 1 5 5".encode() + TAIL)
    assert st is not None and st.live is live


@pytest.mark.parametrize("raw", [b"", b"5 (python3)", b"5 (python3) S 1 5", b"5 (python3) S one 5 5" + TAIL])
def test_text_that_is_not_a_stat_line_gives_none(raw):
    assert procstat.parse(5, raw) is None


def test_a_real_child_is_read_and_then_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        st = procstat.read(child.pid)
        assert st is not None and st.ppid == os.getpid() and st.pgrp == child.pid and st.live
        assert child.pid in {p.pid for p in procstat.scan()}
    finally:
        child.kill()
        child.wait()
    assert procstat.read(child.pid) is None


def test_cpu_time_is_user_plus_system_ticks():
    # Fields 14 (utime) and 15 (stime): here 700 and 50 ticks.
    raw = b"9 (VLLM::EngineCore) R 1 9 9 0 -1 4194560 10 0 0 0 700 50 0 0 20 0 4 0 8812345 0 0\n"
    st = procstat.parse(9, raw)
    assert st is not None and st.cpu_ticks == 750 and st.start_ticks == 8812345


def test_the_cpu_seconds_of_a_tree_rise_while_a_child_computes_and_not_while_it_sleeps():
    from tests.waiting import wait_until

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        start = procstat.cpu_seconds([busy.pid])
        assert start is not None
        wait_until(lambda: procstat.cpu_seconds([busy.pid]) >= start + 0.2, 30, what="the busy child's CPU time risen by 0.2 s")
        # A process that only waits: far less than the busy one over the same start-up (python's start is its only CPU).
        assert procstat.cpu_seconds([idle.pid]) < procstat.cpu_seconds([busy.pid])
        assert procstat.cpu_seconds([busy.pid, idle.pid]) >= procstat.cpu_seconds([busy.pid])
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
    assert procstat.cpu_seconds([busy.pid, idle.pid]) is None  # gone: not read, not zero
