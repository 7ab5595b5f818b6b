"""The pure policy: snapshots and `now` in, actions and state out."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from r3090d import config, exitcodes
from r3090d.core import alerting, policy, rules
from r3090d.core.actions import Exit, RecordRestart, SendAlert, SendInferenceProbe, StartEngine, StopEngine
from r3090d.core.policy import Phase
from r3090d.core.snapshot import (
    ChildSample,
    GpuProcess,
    GpuSample,
    GpuStatus,
    InferenceProbeSample,
    MetricsSample,
)
from r3090d.units import MIB
from tests import importgraph
from tests.configs import bare_config
from tests.snapshots import HTTP_503, REFUSED, SKIPPED, TIMEOUT, child, drive_to_ready, snap


def cfg(**watchdog) -> config.Config:
    alerts = watchdog.pop("alerts", {})
    return bare_config(gpu={"required": watchdog.pop("gpu_required", False)}, watchdog=watchdog, alerts=alerts)


def kinds(actions):
    return [type(a).__name__ for a in actions if not isinstance(a, SendAlert)]


def ready_state(c, now=0.0):
    """Drive the policy from STOPPED to READY; its first tick starts the engine and does nothing else but alert."""
    started, st = drive_to_ready(c, now)
    assert kinds(started) == ["StartEngine"]
    return st


# What the core may import from the standard library: data types and pure computation.
# Nothing that reads a clock, touches a file, a socket or a process, or starts a thread.
CORE_STDLIB = frozenset(
    {"__future__", "abc", "collections", "dataclasses", "enum", "functools", "itertools", "math", "operator", "re",
     "statistics", "typing"}
)  # fmt: skip
# Loaded by an interpreter that imports the core, these would mean I/O or concurrency came along.
NOT_LOADED_BY_CORE = frozenset(
    {"subprocess", "threading", "ctypes", "socket", "tomllib", "select", "selectors", "signal", "tempfile", "shutil",
     "asyncio", "multiprocessing", "ssl", "http", "urllib", "email", "smtplib", "json", "pathlib", "psutil", "pynvml",
     "httpx"}
)  # fmt: skip
CORE_MODULES = sorted(m for m in importgraph.module_files() if m.startswith("r3090d.core."))
# Pure modules outside the core: checked file by file (their own imports), not through their closures.
PURE_FILES = ("preflight/checks.py", "preflight/results.py", "preflight/swapchecks.py", "measure/plan.py", "measure/plancheck.py", "measure/prompts.py",
              "measure/bench_result.py", "config/steps.py", "engineflags.py", "units.py", "versions.py",
              "router/link.py")  # fmt: skip


def test_policy_imports_no_io():
    """Every module that loading the core loads (through the packages above each, and
    a core module's imports inside functions too) imports nothing of the standard
    library beyond CORE_STDLIB, and nothing from outside it."""
    assert "r3090d.core.policy" in CORE_MODULES and len(CORE_MODULES) >= 8, CORE_MODULES
    loaded = importgraph.closure(CORE_MODULES, follow_lazy=lambda module: module.startswith("r3090d.core"))
    assert "r3090d.config.schema" in loaded  # the closure does reach past the core
    offending = [
        f"{module} imports {imp.module} (line {imp.line})"
        for module in sorted(loaded)
        for imp in importgraph.imports_of(module)
        if not importgraph.is_internal(imp.module)
        and imp.module.split(".")[0] not in CORE_STDLIB
        and (not imp.lazy or module.startswith("r3090d.core"))
    ]
    assert offending == []


def test_importing_the_core_loads_no_io_modules():
    """A fresh interpreter (no site: nothing a .pth file pulls in) that imports every core module."""
    root = Path(__file__).resolve().parents[2]
    script = (
        "import sys; before = sorted(sys.modules); "
        + "; ".join(f"import {m}" for m in CORE_MODULES)
        + "; after = sorted(sys.modules); import r3090d; print(repr((before, after, r3090d.__file__)))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")} | {"PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-S", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after, package_file = ast.literal_eval(out.stdout)
    assert Path(package_file).resolve().is_relative_to(root)
    assert not {m.split(".")[0] for m in before} & NOT_LOADED_BY_CORE  # else the check below proves nothing
    assert "r3090d.core.policy" in after
    assert sorted({m.split(".")[0] for m in after} & NOT_LOADED_BY_CORE) == []


@pytest.mark.parametrize("relative", PURE_FILES)
def test_pure_module_imports_no_io(relative):
    forbidden = {"os", "time", "subprocess", "socket", "requests", "pynvml", "psutil", "smtplib", "threading", "urllib", "http"}
    module = "r3090d." + relative.removesuffix(".py").replace("/", ".")
    imported = [imp.module for imp in importgraph.imports_of(module)]
    pure = {"urllib.parse"}  # string parsing only; urllib.request is what the ban is for
    assert [m for m in imported if m.split(".")[0] in forbidden and m not in pure] == []


def test_start_then_ready_only_on_health_200():
    c = cfg()
    st = policy.initial_state(0)
    acts, st = policy.decide(snap(0, ch=ChildSample()), st, c, 0)
    assert acts == [StartEngine(reason="initial start")]
    assert st.phase is Phase.STARTING
    for h in (REFUSED, TIMEOUT, HTTP_503):
        acts, st = policy.decide(snap(5, health=h), st, c, 5)
        assert st.phase is Phase.STARTING and kinds(acts) == []
    acts, st = policy.decide(snap(6), st, c, 6)
    assert st.phase is Phase.READY


def test_startup_timeout_exactly_at_limit():
    c = dataclasses.replace(cfg(), engine=dataclasses.replace(cfg().engine, startup_timeout=100))
    st = policy.initial_state(0)
    _, st = policy.decide(snap(0, ch=ChildSample()), st, c, 0)
    acts, st = policy.decide(snap(100, health=REFUSED), st, c, 100)
    assert st.phase is Phase.STARTING and kinds(acts) == []
    acts, st = policy.decide(snap(100.5, health=REFUSED), st, c, 100.5)
    assert st.phase is Phase.RESTARTING
    assert StopEngine(drain=False, reason="startup_timeout") in acts


@pytest.mark.parametrize("code", [0, 1, -9])
def test_unrequested_exit_is_a_failure_whatever_the_code(code):
    c = cfg()
    st = ready_state(c)
    dead = ChildSample(pid=100, alive=False, exit_code=code, tree_pids=(101,), generation=1)
    acts, st = policy.decide(snap(10, ch=dead, health=SKIPPED), st, c, 10)
    assert st.phase is Phase.RESTARTING
    assert StopEngine(drain=False, reason="exited") in acts
    assert st.old_tree == (100, 101)
    assert any(isinstance(a, RecordRestart) for a in acts)
    # The orphan is still there: no start yet.
    acts, st = policy.decide(snap(10.01, ch=dead), st, c, 10.01)
    assert kinds(acts) == []
    gone = dataclasses.replace(dead, tree_pids=())
    acts, st = policy.decide(snap(10.02, ch=gone), st, c, 10.02)
    assert kinds(acts) == ["StartEngine"]  # the first restart is immediate
    assert st.phase is Phase.STARTING and st.generation == 2


def crash_and_restart(st, c, now, gen, *, cause=None, phase_ready=True):
    """One unrequested exit with the tree already gone; returns (delay until start, state, actions)."""
    dead = ChildSample(pid=100, alive=False, exit_code=0, tree_pids=(), generation=gen, root_cause=cause, root_cause_certain=cause is not None)
    acts, st = policy.decide(snap(now, ch=dead), st, c, now)
    if st.phase is Phase.GIVEN_UP:
        return None, st, acts
    t = now
    while not any(isinstance(a, StartEngine) for a in acts):
        t += 0.25
        acts, st = policy.decide(snap(t, ch=dead), st, c, t)
    return t - now, st, acts


def fail_during_start(st, c, now, gen, cause=None):
    """The engine of `gen` exits before /health ever answered."""
    dead = ChildSample(pid=100, alive=False, exit_code=1, tree_pids=(), generation=gen, root_cause=cause, root_cause_certain=cause is not None)
    return crash_and_restart(st, c, now, gen, cause=cause) if st.phase is not Phase.STARTING else _start_exit(st, c, now, dead)


def _start_exit(st, c, now, dead):
    acts, st = policy.decide(snap(now, ch=dead, health=REFUSED), st, c, now)
    if st.phase is Phase.GIVEN_UP:
        return None, st, acts
    t = now
    while not any(isinstance(a, StartEngine) for a in acts):
        t += 0.25
        acts, st = policy.decide(snap(t, ch=dead, health=REFUSED), st, c, t)
    return t - now, st, acts


def alerts_of(acts, key):
    return [a.state for a in acts if isinstance(a, SendAlert) and a.key == key]


def test_recoverable_faults_after_a_healthy_period_restart_at_once_for_ever():
    """20 faults, each 10 s after the engine is ready again: no backoff, no give-up, one storm alert."""
    c = cfg(min_uptime=5.0, backoff_initial=1.0, backoff_max=4.0, start_failures=3, restart_storm_restarts=3, restart_storm_window=120.0, alerts={"min_interval": 0.0})
    st = ready_state(c)
    now, sent = 10.0, []
    for gen in range(1, 21):
        delay, st, acts = crash_and_restart(st, c, now, gen)
        sent += alerts_of(acts, "restart_storm")
        assert delay == 0.0, f"fault {gen} waited {delay} s"
        assert st.phase is Phase.STARTING
        now += 1.0
        acts, st = policy.decide(snap(now, ch=child(gen=gen + 1)), st, c, now)  # ready again
        sent += alerts_of(acts, "restart_storm")
        assert st.phase is Phase.READY and st.start_failures == 0
        now += 10.0
        acts, st = policy.decide(snap(now, ch=child(gen=gen + 1)), st, c, now)
        sent += alerts_of(acts, "restart_storm")
    assert st.restarts_total == 20 and st.give_up_reason is None
    assert sent == ["firing"]
    # The storm ends: once the restarts age out of the window, one RESOLVED.
    for _ in range(200):
        now += 2.0
        acts, st = policy.decide(snap(now, ch=child(gen=21)), st, c, now)
        sent += alerts_of(acts, "restart_storm")
    assert sent == ["firing", "resolved"]


def test_start_failures_back_off_and_give_up_after_start_failures():
    c = cfg(min_uptime=60.0, backoff_initial=1.0, backoff_max=4.0, start_failures=5, same_cause_failures=100)
    st = policy.initial_state(0.0)
    _, st = policy.decide(snap(0, ch=ChildSample(), health=REFUSED), st, c, 0)
    delays, now = [], 1.0
    for gen in range(1, 6):
        delay, st, acts = fail_during_start(st, c, now, gen, cause=f"cause {gen}")
        delays.append(delay)
        if delay is None:
            break
        now += delay + 1
    assert delays == [0.0, 1.0, 2.0, 4.0, None]
    assert st.phase is Phase.GIVEN_UP and "5 start failures in a row" in st.give_up_reason and "cause 5" in st.give_up_reason
    assert alerts_of(acts, "gave_up") == ["firing"]
    assert not any(isinstance(a, Exit) for a in acts)


def test_a_failure_soon_after_ready_is_a_start_failure():
    c = cfg(min_uptime=60.0, backoff_initial=1.0, backoff_max=4.0, start_failures=3, same_cause_failures=100)
    st = ready_state(c)
    now = 10.0  # ready for 9 s < min_uptime
    delays = []
    for gen in range(1, 4):
        delay, st, _ = crash_and_restart(st, c, now, gen)
        delays.append(delay)
        if delay is None:
            break
        now += delay + 1
        _, st = policy.decide(snap(now, ch=child(gen=gen + 1)), st, c, now)  # ready again, briefly
        now += 5
    assert delays == [0.0, 1.0, None] and st.phase is Phase.GIVEN_UP


def test_two_identical_root_causes_give_up_early():
    c = cfg(start_failures=10, same_cause_failures=2, backoff_initial=0.0, backoff_max=0.0)
    st = policy.initial_state(0.0)
    _, st = policy.decide(snap(0, ch=ChildSample(), health=REFUSED), st, c, 0)
    why = "ValueError: To serve at least one request with the model's max seq len (1024)"
    delay, st, _ = fail_during_start(st, c, 1.0, 1, cause=why)
    assert delay == 0.0
    delay, st, acts = fail_during_start(st, c, 2.0, 2, cause=why)
    assert delay is None and st.phase is Phase.GIVEN_UP
    assert "2 start failures in a row with the same cause" in st.give_up_reason and why in st.give_up_reason
    assert RecordRestart(reason="exited", detail="engine exited during start with code 1", root_cause=why) in acts
    assert any(isinstance(a, SendAlert) and a.key == "gave_up" and why in a.summary for a in acts)


def test_different_root_causes_do_not_count_as_same_cause():
    c = cfg(start_failures=10, same_cause_failures=2, backoff_initial=0.0, backoff_max=0.0)
    st = policy.initial_state(0.0)
    _, st = policy.decide(snap(0, ch=ChildSample(), health=REFUSED), st, c, 0)
    for gen, why in enumerate(["A", "B", "A", "B"], start=1):
        delay, st, _ = fail_during_start(st, c, float(gen), gen, cause=why)
        assert delay is not None


def given_up_state(c):
    st = policy.initial_state(0.0)
    _, st = policy.decide(snap(0, ch=ChildSample(), health=REFUSED), st, c, 0)
    delay, st, _ = fail_during_start(st, c, 1.0, 1, cause="X")
    assert delay is None and st.phase is Phase.GIVEN_UP
    return st


def test_given_up_stays_up_until_an_operator_restart_then_resolves_on_ready():
    from r3090d.core.vocabulary import RestartKind

    c = cfg(start_failures=1, backoff_initial=0.0, backoff_max=0.0)
    st = given_up_state(c)
    gone = ChildSample(pid=100, alive=False, exit_code=1, tree_pids=(), generation=1)
    for t in range(2, 30):  # the daemon stays; nothing is started, nothing exits
        acts, st = policy.decide(snap(t, ch=gone, health=SKIPPED), st, c, t)
        assert kinds(acts) == [] and st.phase is Phase.GIVEN_UP
    # A reload's restart never cold-starts a given-up engine.
    acts, st = policy.decide(snap(30, ch=gone, restart_requested=RestartKind.CONFIG), st, c, 30)
    assert kinds(acts) == [] and st.phase is Phase.GIVEN_UP
    acts, st = policy.decide(snap(31, ch=gone, restart_requested=RestartKind.DRAIN), st, c, 31)
    assert kinds(acts) == ["StartEngine"] and st.phase is Phase.STARTING and st.start_failures == 0
    assert alerts_of(acts, "gave_up") == []  # not resolved until the engine is ready
    acts, st = policy.decide(snap(40, ch=child(gen=2)), st, c, 40)
    assert st.phase is Phase.READY
    resolved = alerts_of(acts, "gave_up")
    for t in range(41, 50):
        acts, st = policy.decide(snap(t, ch=child(gen=2)), st, c, t)
        resolved += alerts_of(acts, "gave_up")
    assert resolved == ["resolved"]


def test_exit_on_give_up_restores_exit_79():
    c = bare_config(watchdog={"start_failures": 1, "give_up_retry": 0}, daemon={"exit_on_give_up": True})
    st = given_up_state(c)
    acts, st = policy.decide(snap(5, ch=ChildSample(pid=1, alive=False, generation=1)), st, c, 5)
    assert Exit(code=exitcodes.GAVE_UP, reason=st.give_up_reason) in acts


def test_shutdown_drains_then_exits_zero():
    c = cfg()
    st = ready_state(c)
    acts, st = policy.decide(snap(5, shutdown_requested=True), st, c, 5)
    assert StopEngine(drain=True, reason="shutdown") in acts
    acts, st = policy.decide(snap(6, shutdown_requested=True), st, c, 6)
    assert not any(isinstance(a, Exit) for a in acts)
    gone = ChildSample(pid=100, alive=False, exit_code=0, generation=1)
    acts, st = policy.decide(snap(7, ch=gone, shutdown_requested=True), st, c, 7)
    assert Exit(code=0, reason="shutdown") in acts


def run_ready(c, samples, start=10.0, step=1.0):
    """Feed READY snapshots; return (index of the first restart or None, actions, state)."""
    st = ready_state(c)
    now = start
    for i, s in enumerate(samples):
        acts, st = policy.decide(dataclasses.replace(s, now=now), st, c, now)
        if any(isinstance(a, RecordRestart) for a in acts):
            return i, acts, st
        now += step
    return None, acts, st


def test_dead_after_k_refused_polls_not_earlier():
    c = cfg(dead_refused_polls=3)
    i, acts, st = run_ready(c, [snap(0, health=REFUSED)] * 5)
    assert i == 2
    assert st.restart_reason == "dead"
    # A 200 in between resets the count.
    i, _, _ = run_ready(c, [snap(0, health=REFUSED), snap(0, health=REFUSED), snap(0), snap(0, health=REFUSED), snap(0, health=REFUSED)])
    assert i is None


def test_503_is_dead_at_once():
    i, acts, st = run_ready(cfg(), [snap(0, health=HTTP_503)])
    assert i == 0 and st.restart_reason == "dead"


def test_hung_after_t_seconds_of_timeouts():
    c = cfg(hang_timeout=30.0)
    i, acts, st = run_ready(c, [snap(0, health=TIMEOUT)] * 40, step=1.0)
    assert i == 30  # timeouts since t=10 reach 30 s at the 31st poll
    assert st.restart_reason == "hung"
    assert StopEngine(drain=False, reason="hung") in acts


def metrics(free, usage, running=0, waiting=0, tokens=0.0, preempt=0.0):
    return MetricsSample(kv_usage=usage, num_gpu_blocks=1000, block_size=16, free_blocks=free, running=running, waiting=waiting, generation_tokens_total=tokens, preemptions_total=preempt)


def test_kv_leak_restarts_drained_at_exactly_k_polls():
    c = cfg(min_free_blocks=100, kv_low_polls=5, kv_cooldown=0.0, lb_grace=0.0)
    leak = [snap(0, metrics=metrics(50, 0.95, tokens=1000.0))] * 8
    i, acts, st = run_ready(c, leak)
    assert i == 4
    assert st.restart_reason == "kv"
    assert StopEngine(drain=True, reason="kv") in acts
    assert st.phase is Phase.DRAINING


def test_kv_under_load_alerts_and_does_not_restart():
    c = cfg(min_free_blocks=100, kv_low_polls=5, kv_cooldown=0.0, alerts={"hysteresis_polls": 1})
    load = [snap(0, metrics=metrics(50, 0.95, running=8, waiting=3, tokens=1000.0 + 50 * i, preempt=float(i))) for i in range(10)]
    i, acts, st = run_ready(c, load)
    assert i is None
    assert st.alerts.get("kv_pressure").firing
    assert "preemptions/min" in st.alerts.get("kv_pressure").summary


def test_kv_restart_under_load_restores_plain_rule():
    c = cfg(min_free_blocks=100, kv_low_polls=5, kv_cooldown=0.0, kv_restart_under_load=True)
    load = [snap(0, metrics=metrics(50, 0.95, running=8, tokens=1000.0 + 50 * i)) for i in range(10)]
    i, acts, st = run_ready(c, load)
    assert i == 4 and st.restart_reason == "kv"


def test_kv_cooldown_blocks_restart_right_after_ready():
    c = cfg(min_free_blocks=100, kv_low_polls=5, kv_cooldown=300.0)
    leak = [snap(0, metrics=metrics(50, 0.95, tokens=1000.0))] * 20
    i, _, _ = run_ready(c, leak, start=10.0, step=1.0)
    assert i is None  # ready at t=1, cooldown until t=301
    i, _, _ = run_ready(c, leak * 3, start=250.0, step=1.0)
    assert i == 51  # t=301: the first poll out of the cooldown (ready at t=1), long past 5 low polls


def test_passive_stall_restarts_after_s_seconds_flat_tokens():
    c = cfg(stall_seconds=60.0, probe_idle_seconds=1000.0)
    stalled = [snap(0, metrics=metrics(900, 0.1, running=2, tokens=500.0))] * 70
    i, acts, st = run_ready(c, stalled)
    assert st.restart_reason == "stalled"
    assert i == 60


def test_a_long_prefill_that_moves_only_kv_blocks_is_progress_not_a_stall():
    """vLLM counts prompt tokens when a prefill ends; its chunks allocate KV blocks as they go."""
    c = cfg(stall_seconds=10.0, probe_idle_seconds=1000.0)
    prefill = [snap(0, metrics=metrics(900 - i, 0.1 + i / 1000, running=1, tokens=500.0)) for i in range(40)]
    i, _, st = run_ready(c, prefill)
    assert i is None and st.phase is Phase.READY
    # Prompt tokens moving alone are progress too.
    prompt = [snap(0, metrics=dataclasses.replace(metrics(900, 0.1, running=1, tokens=500.0), prompt_tokens_total=100.0 + i)) for i in range(40)]
    i, _, st = run_ready(c, prompt)
    assert i is None
    # Nothing moving at all: a stall at stall_seconds.
    flat = [snap(0, metrics=metrics(900, 0.1, running=1, tokens=500.0))] * 40
    i, _, st = run_ready(c, flat)
    assert i == 10 and st.restart_reason == "stalled"


def test_kv_no_progress_arm_counts_block_movement_as_progress():
    c = cfg(min_free_blocks=100, kv_low_polls=5, kv_cooldown=0.0, lb_grace=0.0, stall_seconds=1000.0)
    # Short of blocks, tokens flat, but blocks allocated and freed (a recompute): load, not a leak.
    moving = [snap(0, metrics=metrics(50 - i % 3, 0.95 + (i % 3) / 1000, running=1, waiting=1, tokens=1000.0)) for i in range(12)]
    i, _, st = run_ready(c, moving)
    assert i is None and st.watch.kv_load
    # Short of blocks, nothing moving: a leak.
    frozen = [snap(0, metrics=metrics(50, 0.95, running=1, waiting=1, tokens=1000.0))] * 12
    i, _, st = run_ready(c, frozen)
    assert i == 4 and st.restart_reason == "kv"


def test_active_probe_sent_when_idle_and_two_failures_restart():
    c = cfg(probe_idle_seconds=60.0, probe_failures=2, stall_seconds=1000.0)
    st = ready_state(c)
    idle = metrics(900, 0.0, tokens=10.0)
    sent = []
    for t in range(2, 63):
        acts, st = policy.decide(snap(t, metrics=idle), st, c, t)
        sent += [t for a in acts if isinstance(a, SendInferenceProbe)]
    assert sent == [62]  # the counter was first read at t=2; 60 s of no new token
    # In flight: nothing more is sent.
    inflight = InferenceProbeSample(sent_at=61, finished_at=None, ok=None)
    acts, st = policy.decide(snap(70, metrics=idle, inference=inflight), st, c, 70)
    assert not any(isinstance(a, SendInferenceProbe) for a in acts)
    fail1 = InferenceProbeSample(sent_at=61, finished_at=81, ok=False, detail="timeout", consecutive_failures=1)
    acts, st = policy.decide(snap(82, metrics=idle, inference=fail1), st, c, 82)
    assert any(isinstance(a, SendInferenceProbe) for a in acts)  # retried at once
    assert st.phase is Phase.READY
    fail2 = InferenceProbeSample(sent_at=82, finished_at=102, ok=False, detail="timeout", consecutive_failures=2)
    acts, st = policy.decide(snap(103, metrics=idle, inference=fail2), st, c, 103)
    assert st.restart_reason == "probe_failed"


def test_probe_skipped_while_traffic_progresses():
    c = cfg(probe_idle_seconds=10.0)
    st = ready_state(c)
    for t in range(2, 60):
        acts, st = policy.decide(snap(t, metrics=metrics(900, 0.2, running=1, tokens=float(t * 10))), st, c, t)
        assert not any(isinstance(a, SendInferenceProbe) for a in acts)


def test_gpu_memory_alert_fire_remind_resolve():
    c = cfg(gpu_required=True, gpu_memory_alert_mib=1000, alerts={"hysteresis_polls": 3, "reminder_interval": 100.0, "min_interval": 0.0})
    st = ready_state(c)

    def gpu(used_mib):
        return GpuSample(GpuStatus.OK, memory_used=used_mib * MIB, memory_total=24576 * MIB)

    sent = []
    for t in range(2, 120):
        used = 1200 if t < 110 else 500
        acts, st = policy.decide(snap(t, gpu=gpu(used)), st, c, t)
        sent += [(t, a.state) for a in acts if isinstance(a, SendAlert) and a.key == "gpu_memory"]
    assert sent == [(4, "firing"), (104, "reminder"), (112, "resolved")]


def test_alert_book_survives_a_restart_of_the_daemon():
    from r3090d.service.report import book_info
    from r3090d.service.state import book_from_json

    c = cfg(gpu_required=True, gpu_memory_alert_mib=1000, alerts={"hysteresis_polls": 1, "reminder_interval": 3600.0})
    st = ready_state(c)
    hot = GpuSample(GpuStatus.OK, memory_used=2000 * MIB, memory_total=24576 * MIB)
    acts, st = policy.decide(snap(2, gpu=hot), st, c, 2)
    assert [a.state for a in acts if isinstance(a, SendAlert)] == ["firing"]
    # The daemon restarts: the book is persisted with wall times and read back with another offset.
    saved = dataclasses.asdict(book_info(st.alerts, offset=1_000_000.0))
    restored = book_from_json(saved, offset=1_000_000.0 - 50.0)  # the new process's clock is 50 s further on
    st2 = dataclasses.replace(ready_state(c, now=52.0), alerts=restored)
    acts, st2 = policy.decide(snap(53.0, gpu=hot), st2, c, 53.0)
    assert not [a for a in acts if isinstance(a, SendAlert) and a.key == "gpu_memory"]  # no re-send
    cool = GpuSample(GpuStatus.OK, memory_used=10 * MIB, memory_total=24576 * MIB)
    acts, st2 = policy.decide(snap(54.0, gpu=cool), st2, c, 54.0)
    assert [a.state for a in acts if isinstance(a, SendAlert) and a.key == "gpu_memory"] == ["resolved"]  # not forgotten


def test_gpu_lost_is_critical_and_not_a_restart_loop():
    c = cfg(gpu_required=True, alerts={"hysteresis_polls": 1}, backoff_initial=0.0)
    st = ready_state(c)
    lost = GpuSample(GpuStatus.LOST, lost=True, detail="GpuIsLost")
    dead = ChildSample(pid=100, alive=False, exit_code=1, tree_pids=(), generation=1)
    acts, st = policy.decide(snap(5, ch=dead, gpu=lost), st, c, 5)
    assert any(isinstance(a, SendAlert) and a.key == "gpu_lost" and a.severity == "critical" for a in acts)
    for t in range(6, 60):
        acts, st = policy.decide(snap(t, ch=dead, gpu=lost), st, c, t)
        assert not any(isinstance(a, StartEngine) for a in acts)
    assert st.phase is Phase.BACKOFF


def test_respawn_waits_while_nvml_lists_old_tree():
    c = cfg(gpu_required=True)
    st = ready_state(c)
    dead = ChildSample(pid=100, alive=False, exit_code=0, tree_pids=(), generation=1)
    holding = GpuSample(GpuStatus.OK, memory_used=0, memory_total=1, processes=(GpuProcess(100, 5 * MIB),))
    acts, st = policy.decide(snap(5, ch=dead, gpu=holding), st, c, 5)
    acts, st = policy.decide(snap(5.1, ch=dead, gpu=holding), st, c, 5.1)
    assert not any(isinstance(a, StartEngine) for a in acts)
    free = dataclasses.replace(holding, processes=())
    acts, st = policy.decide(snap(5.2, ch=dead, gpu=free), st, c, 5.2)
    assert any(isinstance(a, StartEngine) for a in acts)


def test_maintenance_pauses_remediation():
    c = cfg(dead_refused_polls=1)
    st = ready_state(c)
    acts, st = policy.decide(snap(2, maintenance=True), st, c, 2)
    assert st.maintenance
    for t in range(3, 10):
        acts, st = policy.decide(snap(t, health=REFUSED), st, c, t)
        assert not any(isinstance(a, RecordRestart) for a in acts)
    acts, st = policy.decide(snap(10, maintenance=False, health=REFUSED), st, c, 10)
    assert st.restart_reason == "dead"


def test_memory_growth_projects_crossing():
    c = cfg(gpu_required=True, gpu_memory_alert_mib=20000, growth_window=3600.0, growth_horizon=86400.0, alerts={"hysteresis_polls": 1})
    st = ready_state(c)
    fired = None
    for i in range(0, 130):
        t = 2.0 + i * 60.0
        used = (10000 + i * 10) * MIB  # 600 MiB/h: crosses 20000 MiB in about 16 h
        acts, st = policy.decide(snap(t, gpu=GpuSample(GpuStatus.OK, memory_used=used, memory_total=24576 * MIB)), st, c, t)
        if any(isinstance(a, SendAlert) and a.key == "gpu_memory_growth" for a in acts):
            fired = t
            break
    assert fired is not None
    assert "MiB/h" in st.alerts.get("gpu_memory_growth").summary
    assert rules.memory_slope(((0, 0), (1, 10), (2, 20))) == pytest.approx(10.0)


def test_silenced_alert_is_tracked_but_not_sent():
    c = cfg(gpu_required=True, gpu_memory_alert_mib=1000, alerts={"hysteresis_polls": 1})
    st = ready_state(c)
    st = dataclasses.replace(st, alerts=alerting.silence(st.alerts, "gpu_memory", until=100.0))
    hot = GpuSample(GpuStatus.OK, memory_used=2000 * MIB, memory_total=24576 * MIB)
    acts, st = policy.decide(snap(5, gpu=hot), st, c, 5)
    assert not [a for a in acts if isinstance(a, SendAlert) and a.key == "gpu_memory"]
    assert st.alerts.get("gpu_memory").firing


# ------------------------------------------------------------ the GPU's own view


def gpu(util, *, age=0.0, hung=False, compute=((100, 8000),), graphics=(), used_mib=8200, status=GpuStatus.OK):
    return GpuSample(
        status,
        utilization_gpu=util,
        age_s=age,
        hung=hung,
        memory_used=used_mib * MIB,
        memory_total=24576 * MIB,
        processes=tuple(GpuProcess(p, m * MIB) for p, m in compute) if compute is not None else None,
        graphics_processes=tuple(GpuProcess(p, m * MIB) for p, m in graphics),
    )


def busy_engine(tokens=500.0):
    return metrics(900, 0.1, running=2, tokens=tokens)


GPU_CFG = dict(gpu_required=True, gpu_idle_stall_seconds=5.0, stall_seconds=10.0, gpu_busy_cap_seconds=30.0, probe_idle_seconds=1000.0, poll_interval=1.0)


@pytest.mark.parametrize(
    "sample, restart_at, reason",
    [
        (gpu(0), 5, "gpu_idle"),  # idle for exactly the threshold: restart
        (gpu(0, graphics=((4242, 300),)), 10, "stalled"),  # a desktop on the card: counters only
        (gpu(0, compute=((100, 8000), (555, 2000))), 10, "stalled"),  # a foreign compute pid
        (gpu(0, used_mib=12000), 10, "stalled"),  # memory beyond the engine's share: another container
        (gpu(0, age=2.5), 10, "stalled"),  # a stale sample is neither busy nor idle
        (gpu(0, hung=True), 10, "stalled"),  # a hung NVML call
        (gpu(None), 10, "stalled"),  # utilization unknown
        (gpu(0, compute=None), 10, "stalled"),  # process lists not supported
        (gpu(100), 30, "stalled"),  # busy is progress, up to the busy cap
    ],
)
def test_gpu_idle_and_busy_table(sample, restart_at, reason):
    c = cfg(**GPU_CFG)
    samples = [snap(0, metrics=busy_engine(), gpu=sample)] * 40
    i, _, st = run_ready(c, samples)
    assert (i, st.restart_reason) == (restart_at, reason)


def test_gpu_idle_below_the_threshold_is_no_restart():
    c = cfg(**GPU_CFG)
    # Idle for 4 polls (under 5 s), then busy again, repeatedly: tokens move too.
    samples = [snap(0, metrics=busy_engine(tokens=500.0 + i), gpu=gpu(0 if i % 6 < 4 else 90)) for i in range(60)]
    i, _, st = run_ready(c, samples)
    assert i is None and st.phase is Phase.READY


def test_gpu_idle_needs_requests_running():
    c = cfg(**GPU_CFG)
    idle = [snap(0, metrics=metrics(900, 0.0, running=0, tokens=500.0), gpu=gpu(0))] * 40
    i, _, _ = run_ready(c, idle)
    assert i is None


def test_busy_gpu_postpones_the_probe_until_the_cap():
    c = cfg(**{**GPU_CFG, "probe_idle_seconds": 6.0})
    st = ready_state(c)
    sent = []
    for t in range(2, 40):
        acts, st = policy.decide(snap(t, metrics=metrics(900, 0.0, running=0, tokens=10.0), gpu=gpu(100)), st, c, t)
        sent += [t for a in acts if isinstance(a, SendInferenceProbe)]
    assert sent and sent[0] >= 30  # nothing while the GPU works, under the busy cap


def test_the_reason_for_not_using_the_gpu_is_kept_for_status():
    c = cfg(**GPU_CFG)
    _, _, st = run_ready(c, [snap(0, metrics=busy_engine(), gpu=gpu(50, graphics=((4242, 300),)))] * 2)
    assert st.watch.gpu_signal_off == "another process uses the GPU (pid 4242)"


def test_nvml_failing_for_blind_polls_fires_watchdog_blind_and_clears():
    c = cfg(gpu_required=True, blind_polls=3, alerts={"hysteresis_polls": 1, "min_interval": 0.0})
    st = ready_state(c)
    broken = GpuSample(GpuStatus.ERROR, "nvmlDeviceGetMemoryInfo: Unknown Error")
    sent = []
    for t in range(2, 8):
        acts, st = policy.decide(snap(t, gpu=broken), st, c, t)
        sent += [(t, a.state, a.summary) for a in acts if isinstance(a, SendAlert) and a.key == "watchdog_blind"]
    assert [s[:2] for s in sent] == [(4, "firing")], sent  # at the third failing poll
    assert "NVML failing for 3 polls" in sent[0][2] and "Unknown Error" in sent[0][2]
    ok = GpuSample(GpuStatus.OK, memory_used=1 * MIB, memory_total=24576 * MIB, utilization_gpu=50, age_s=0.0, processes=(), graphics_processes=())
    acts, st = policy.decide(snap(9, gpu=ok), st, c, 9)
    assert [(a.state, a.summary) for a in acts if isinstance(a, SendAlert) and a.key == "watchdog_blind"] == [("resolved", "the watchdog sees again")]


def test_a_probe_that_queued_behind_a_long_prefill_does_not_count_as_a_freeze():
    """Two probes time out while a long prompt's chunks move KV blocks: the engine works, no restart."""
    c = cfg(probe_idle_seconds=6.0, probe_timeout=3.0, probe_failures=2, stall_seconds=1000.0)
    st = ready_state(c)
    idle = metrics(900, 0.0, tokens=10.0)
    for t in range(2, 9):
        acts, st = policy.decide(snap(t, metrics=idle), st, c, t)
    assert any(isinstance(a, SendInferenceProbe) for a in acts)  # due at 8
    # A long prompt arrives: its prefill allocates blocks each tick; the probe queues behind it.
    first = InferenceProbeSample(sent_at=8.0, finished_at=11.0, ok=False, detail="timeout", consecutive_failures=1)
    acts, st = policy.decide(snap(9, metrics=metrics(890, 0.01, running=1, tokens=10.0), inference=InferenceProbeSample(sent_at=8.0)), st, c, 9)
    acts, st = policy.decide(snap(11, metrics=metrics(880, 0.02, running=1, tokens=10.0), inference=first), st, c, 11)
    second = InferenceProbeSample(sent_at=12.0, finished_at=15.0, ok=False, detail="timeout", consecutive_failures=2)
    acts, st = policy.decide(snap(13, metrics=metrics(870, 0.03, running=1, tokens=10.0), inference=InferenceProbeSample(sent_at=12.0, consecutive_failures=1)), st, c, 13)
    acts, st = policy.decide(snap(15, metrics=metrics(860, 0.04, running=1, tokens=10.0), inference=second), st, c, 15)
    assert st.phase is Phase.READY and not any(isinstance(a, RecordRestart) for a in acts)
    # The same two failures with nothing moving: frozen, restart.
    st = ready_state(c)
    for t in range(2, 9):
        acts, st = policy.decide(snap(t, metrics=idle), st, c, t)
    acts, st = policy.decide(snap(11, metrics=idle, inference=first), st, c, 11)
    acts, st = policy.decide(snap(15, metrics=idle, inference=second), st, c, 15)
    assert st.restart_reason == "probe_failed"


def test_the_same_last_line_is_not_the_same_cause():
    """A last-line fallback (an access-log line) says where the log stopped, not why: no early give-up."""
    c = cfg(start_failures=10, same_cause_failures=2, backoff_initial=0.0, backoff_max=0.0)
    st = policy.initial_state(0.0)
    _, st = policy.decide(snap(0, ch=ChildSample(), health=REFUSED), st, c, 0)
    line = 'INFO:     127.0.0.1:40000 - "GET /metrics HTTP/1.1" 200 OK'
    for gen in range(1, 5):
        dead = ChildSample(pid=100, alive=False, exit_code=1, tree_pids=(), generation=gen, root_cause=line, root_cause_certain=False)
        delay, st, _ = _start_exit(st, c, float(gen), dead)
        assert delay is not None, f"gave up at failure {gen}: {st.give_up_reason}"


@pytest.mark.parametrize(
    "code, cause, detail, said",
    [
        (0, None, "engine exited with code 0; nothing says why (last log line: INFO:     Application startup complete.)", None),
        (-9, "killed by SIGKILL", "engine exited with code -9", "root cause: killed by SIGKILL"),
    ],
)
def test_an_exit_names_its_cause_or_says_that_nothing_does(code, cause, detail, said):
    """The log's last line is quoted as such, never as a "root cause:"."""
    c = cfg()
    st = ready_state(c)
    dead = ChildSample(pid=100, alive=False, exit_code=code, generation=1, root_cause=cause, root_cause_certain=cause is not None,
                       last_log_line="INFO:     Application startup complete.")  # fmt: skip
    acts, st = policy.decide(snap(100, ch=dead, health=SKIPPED), st, c, 100)
    assert RecordRestart(reason="exited", detail=detail, root_cause=cause) in acts
    restarted = [a.summary for a in acts if isinstance(a, SendAlert) and a.key == "engine_restarted"]
    assert restarted and detail in restarted[0], acts
    assert ("root cause:" in restarted[0]) == (said is not None) and (said is None or said in restarted[0]), restarted


@pytest.mark.parametrize(
    "reading, key, active",
    [
        ({"temperature_c": 85}, "gpu_temperature", True),
        ({"temperature_c": 84}, "gpu_temperature", False),
        ({"power_w": 343.0, "power_limit_w": 350.0}, "gpu_power", True),  # 98 %
        ({"power_w": 340.0, "power_limit_w": 350.0}, "gpu_power", False),
        ({"clock_event_reasons": ("hw_thermal_slowdown",)}, "gpu_throttle", True),
        ({"clock_event_reasons": ("gpu_idle",)}, "gpu_throttle", False),
    ],
)
def test_hot_power_capped_or_throttled_gpu_conditions(reading, key, active):
    c = cfg(gpu_required=True)
    g = GpuSample(GpuStatus.OK, memory_used=0, memory_total=24 * 2**30, **reading)
    life = rules.LifecycleFacts(phase=Phase.READY, backoff_remaining=None, restart_reason=None, give_up_reason=None)
    (cond,) = [x for x in rules.conditions(snap(0, gpu=g), rules.WatchState(), c, 0.0, life) if x.key == key]
    assert cond.active is active and cond.severity == "warning"


def test_restarts_carried_on_from_an_earlier_daemon_keep_the_storm_alert_until_the_window_passes():
    c = cfg(min_uptime=5.0, restart_storm_restarts=3, restart_storm_window=120.0, alerts={"min_interval": 0.0, "hysteresis_polls": 1})
    st = ready_state(c)
    now, sent = 10.0, []
    for gen in range(1, 5):
        _, st, acts = crash_and_restart(st, c, now, gen)
        sent += alerts_of(acts, "restart_storm")
        for later in (now + 1.0, now + 10.0):  # ready again, then for longer than min_uptime
            acts, st = policy.decide(snap(later, ch=child(gen=gen + 1)), st, c, later)
            sent += alerts_of(acts, "restart_storm")
        now += 10.0
    assert sent == ["firing"] and len(st.restart_times) == 4
    # The daemon is killed; the next one starts from its state file a few seconds later (CLOCK_MONOTONIC goes on).
    history = policy.RestartHistory(st.restart_times, st.start_failures, st.same_cause_run, st.last_root_cause)
    now += 5.0
    new = policy.carry_on(dataclasses.replace(policy.initial_state(now), alerts=st.alerts), history, c, now)
    assert new.restart_times == st.restart_times and new.phase is Phase.STOPPED
    acts, new = policy.decide(snap(now, ch=ChildSample()), new, c, now)
    sent = alerts_of(acts, "restart_storm")
    while now < 10.0 + 120.0 + 30.0:
        now += 1.0
        acts, new = policy.decide(snap(now, ch=child(gen=1)), new, c, now)
        sent += alerts_of(acts, "restart_storm")
        if not sent:
            assert len(new.restart_times) >= 3, now
    assert sent == ["resolved"]  # once, when the window no longer holds 3 of the carried restarts


@pytest.mark.parametrize(
    "times, expected",
    [
        ((100.0, 500.0, 900.0), (500.0, 900.0)),  # the window is 600 s: 900 s ago is out
        ((400.0, 401.0), (401.0,)),  # exactly the window ago is out, as decide() counts
        ((999.0, 1005.0), (999.0, 1000.0)),  # stamped after now (the wall clock stepped back): now
        ((), ()),
    ],
)
def test_carry_on_keeps_the_restarts_inside_the_window(times, expected):
    c = cfg(restart_storm_window=600.0)
    st = policy.carry_on(policy.initial_state(1000.0), policy.RestartHistory(times, 3, 5, "boom"), c, 1000.0)
    assert st.restart_times == expected
    assert (st.start_failures, st.same_cause_run, st.last_root_cause) == (3, 3, "boom")  # a run no longer than the failures
