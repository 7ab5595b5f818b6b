"""The daemon supervising the vLLM double: orphans, exit codes, backoff, give-up, SIGTERM."""

from __future__ import annotations

import os
import signal
import stat
import time

import psutil
import pytest

from r3090d import exitcodes
from tests.daemon_harness import DaemonProcess, engine_config, group_members, write_config
from tests.waiting import wait_until

pytestmark = pytest.mark.component


@pytest.fixture
def run_daemon(tmp_path):
    started: list[DaemonProcess] = []

    def run(sections: dict, *args: str) -> DaemonProcess:
        cfg = write_config(tmp_path / f"r3090d-{len(started)}.toml", sections)
        d = DaemonProcess(cfg, tmp_path / f"daemon-{len(started)}.log", *args).start()
        started.append(d)
        return d

    yield run
    for d in started:
        d.cleanup()


def test_orphaned_grandchild_is_killed_before_the_respawn(run_daemon, tmp_path, fake_engine_python):
    d = run_daemon(engine_config(tmp_path, fake_engine_python, extra_args=["--fake-orphan-linger", "300"]))
    st = d.wait_ready()
    main_pid = st["engine"]["pid"]
    tree = group_members(main_pid)
    grandchildren = [p for p in tree if p != main_pid]
    assert grandchildren, f"the double should run an engine-core grandchild; group {main_pid} = {tree}"
    core = psutil.Process(grandchildren[0])
    assert core.is_running() and core.status() != psutil.STATUS_ZOMBIE
    core_started = core.create_time()

    os.kill(main_pid, signal.SIGKILL)
    st = d.wait_ready(timeout=30, generation_pid=main_pid)
    assert st["engine"]["pid"] != main_pid
    # Nothing of the old group survives, the grandchild included.
    assert group_members(main_pid) == []
    assert dead(core.pid, core_started)
    assert st["restarts"]["total"] == 1 and st["restarts"]["last_reason"] == "exited"
    # The daemon logged the kill of the orphan before it started the new engine.
    log = d.log()
    assert log.index("already exited; killing what is left") < log.rindex("starting engine (restart after exited)")


def dead(pid: int, created: float | None = None) -> bool:
    """Gone, a zombie (killed; its new parent has not reaped it), or a reused pid."""
    try:
        p = psutil.Process(pid)
        return p.status() == psutil.STATUS_ZOMBIE or (created is not None and p.create_time() != created)
    except psutil.NoSuchProcess:
        return True


def spawn_logging_python(tmp_path, engine_python) -> str:
    """An engine python that records when each engine starts and exits, independently of the daemon."""
    stamps = tmp_path / "engine-times.txt"
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *api_server*) ;; *) exec {engine_python} "$@";; esac\n'
        f"echo start $(date +%s.%N) >> {stamps}\n"
        f'{engine_python} "$@"\n'
        "rc=$?\n"
        f"echo exit $(date +%s.%N) >> {stamps}\n"
        "exit $rc\n"
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def test_start_failures_back_off_doubling_capped_then_give_up_and_the_daemon_stays(run_daemon, tmp_path, fake_engine_python):
    """An engine that dies 1 s after ready (inside min_uptime) is a start failure each time."""
    python = spawn_logging_python(tmp_path, fake_engine_python)
    d = run_daemon(
        engine_config(
            tmp_path,
            python,
            extra_args=["--fake-exit-after", "1.0", "0", "--fake-dead-exit-delay", "0"],
            watchdog={"backoff_initial": 1.0, "backoff_max": 2.0, "start_failures": 5, "same_cause_failures": 100, "min_uptime": 60.0},
        )
    )
    st = wait_until(lambda: (s := d.state()) and s["engine"]["phase"] == "given-up" and s, 90, what="given-up")
    events = [line.split() for line in (tmp_path / "engine-times.txt").read_text().splitlines()]
    starts = [float(t) for kind, t in events if kind == "start"]
    exits = [float(t) for kind, t in events if kind == "exit"]
    assert len(starts) == 5  # the first start and 4 restarts; the 5th failure gives up
    gaps = [start - exit for exit, start in zip(exits, starts[1:], strict=False)]
    # Exit to next spawn is the backoff: immediate, then doubling, then capped.
    expected = [0.0, 1.0, 2.0, 2.0]
    # Each gap also holds noticing the exit, reaping the group and forking the next engine:
    # up to a second or so on a loaded machine. That overhead cancels out in the differences.
    for got, want in zip(gaps, expected, strict=True):
        assert want - 0.05 <= got <= want + 1.5, (gaps, expected)
    assert gaps[1] - gaps[0] > 0.5 and gaps[2] - gaps[1] > 0.5 and abs(gaps[3] - gaps[2]) < 0.9, gaps  # capped: 2 s, then 2 s again
    assert "5 start failures in a row" in st["give_up_reason"]
    assert "exited with code 0" in st["give_up_reason"]
    # Giving up stops the engine, not the supervisor.
    assert d.proc.poll() is None, "the daemon exited on give-up"
    assert st["engine"]["pid"] is None and "gave_up" in st["alerts"]["firing"]
    assert "gave up:" in d.log()


def test_sigterm_drains_main_pid_then_kills_a_group_that_ignores_it(run_daemon, tmp_path, fake_engine_python):
    d = run_daemon(
        engine_config(
            tmp_path,
            fake_engine_python,
            extra_args=["--fake-ignore-sigterm", "--fake-grandchild-ignores-sigterm"],
            engine={"shutdown_timeout": 1},
        )
    )
    st = d.wait_ready()
    main_pid = st["engine"]["pid"]
    tree = group_members(main_pid)
    assert len(tree) >= 2
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.wait_exit(timeout=40)
    took = time.monotonic() - t0
    assert code == 0, d.log()[-3000:]
    assert group_members(main_pid) == [], "the engine's group outlived the daemon"
    for pid in tree:
        assert dead(pid)
    log = d.log()
    assert f"drained stop: SIGTERM to engine pid {main_pid}" in log
    assert "ignoring signal 15" in log  # the main pid got the SIGTERM (and ignored it)
    assert "SIGKILL to engine group" in log
    # The grace is shutdown_timeout + 10 s; then SIGKILL ends it at once.
    assert 1 + 10 <= took < 1 + 10 + 5


def test_spawn_failure_is_reported_not_a_crash(run_daemon, tmp_path, fake_engine_python):
    python = tmp_path / "vanishing-python"
    python.write_text(f'#!/bin/sh\nexec {fake_engine_python} "$@"\n')
    python.chmod(0o755)
    d = run_daemon(engine_config(tmp_path, str(python), watchdog={"start_failures": 5, "same_cause_failures": 2, "backoff_initial": 0.1}))
    d.wait_ready()
    python.unlink()  # the engine venv disappears under a running daemon
    os.kill(d.state()["engine"]["pid"], signal.SIGKILL)
    # Two spawns in a row fail with the same cause: a give-up, and the daemon stays up.
    st = wait_until(lambda: (s := d.state()) and s["engine"]["phase"] == "given-up" and s, 30, what="given-up")
    assert d.proc.poll() is None
    assert "Traceback" not in d.log()
    assert "cannot start" in st["give_up_reason"] and "same cause" in st["give_up_reason"]


def test_busy_port_is_waited_on_then_the_engine_starts(run_daemon, tmp_path, fake_engine_python):
    import socket

    sections = engine_config(tmp_path, fake_engine_python)
    sections["preflight"] = {"transient_retry_s": 0.5, "transient_give_up_s": 60.0}
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", sections["engine"]["port"]))
    squatter.listen()
    try:
        d = run_daemon(sections)
        wait_until(
            lambda: "preflight: waiting for port" in d.log(),
            20,
            what="preflight waiting for the port",
            details=lambda: d.log()[-2000:],
        )
        time.sleep(1.0)  # time passing on purpose: while the port stays busy, no engine starts
        assert d.proc.poll() is None
        assert "starting engine" not in d.log()
    finally:
        squatter.close()
    d.wait_ready(timeout=30)


def test_no_gpu_is_a_permanent_preflight_failure(run_daemon, tmp_path, fake_engine_python):
    sections = engine_config(tmp_path, fake_engine_python)
    sections["gpu"] = {"required": True}
    d = run_daemon(sections)
    assert d.wait_exit(timeout=60) == exitcodes.PREFLIGHT_PERMANENT
    log = d.log()
    assert "Traceback" not in log
    assert "preflight failed, not starting vLLM" in log
    assert "no NVIDIA driver" in log
    assert "starting engine" not in log
    # The verdict is left where `r3090ctl status` looks.
    assert "preflight failed" in d.state()["give_up_reason"]
