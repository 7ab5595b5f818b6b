"""Fault-to-restart latency under the SHIPPED watchdog settings, against the vLLM double and the real CPU vLLM.

Run: python bench/bench_detection.py [--engine double|real|all] [--trials N] [--real-trials N]

Scenarios (each trial runs a fresh daemon, so every restart is at backoff level 0):
  idle frozen    SIGSTOP of EngineCore on an idle engine: /health stays 200, only the
                 active inference probe can see it;
  busy frozen    SIGSTOP of EngineCore under 4 long streams (ignore_eos): the passive
                 rule (requests running, no progress for stall_seconds) sees it;
  hung (SIGSTOP) SIGSTOP of the API server's main pid: /health times out;
  hung (fault)   the double only: every request accepted and never answered.
The idle scenarios inject their fault at offsets spread evenly over the probe
cycle (offset i of N: (i + 0.5) / N x (probe_idle_seconds + poll_interval) after a
probe answered), since where in that cycle a freeze lands decides how long it goes
unseen; the busy one 3 s + (i + 0.5) / N x poll_interval after tokens were seen
flowing, spread over the daemon's tick.

Measured, all wall clock, from the moment of the fault:
  record   the state file's restarts.last_at (the snapshot time of the tick that decided);
  acted    the daemon's "engine restart:" log line (when the restart was acted on);
  spawned  the daemon's "starting engine (restart after ...)" log line.
Target: <= 15 s, judged on record and on acted (record is stamped at the start of
the deciding tick, before that tick's own probes ran; acted is when it took effect).
The double runs by default (about two minutes); the real
engine (the engine-bound tiny model, a few minutes, under the real-vLLM lock) with
R3090D_BENCH_LONG=1 or --engine real|all.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import Daemon, Streams, fmt, median, say  # noqa: E402

from r3090d.config import WatchdogConfig  # noqa: E402
from tests.daemon_harness import api_server_pid  # noqa: E402

TARGET_S = 15.0
BUSY_STREAMS = 4


@dataclass(frozen=True)
class Scenario:
    name: str
    idle: bool  # inject at an offset after a probe answered (else under streams)
    inject: Callable[[Daemon, int], None]  # (daemon, API server pid)
    double_only: bool = False


def freeze_core(d: Daemon, api_pid: int) -> None:
    os.kill(benchlib.engine_core_pid(api_pid), signal.SIGSTOP)


def stop_api_server(d: Daemon, api_pid: int) -> None:
    os.kill(api_pid, signal.SIGSTOP)


def hang_fault(d: Daemon, api_pid: int) -> None:
    import httpx

    httpx.post(d.url + "/fake/control", json={"hang": True}, timeout=5, trust_env=False).raise_for_status()


SCENARIOS = (
    Scenario("idle frozen (SIGSTOP EngineCore)", True, freeze_core),
    Scenario("busy frozen (SIGSTOP EngineCore)", False, freeze_core),
    Scenario("hung API server (SIGSTOP main pid)", True, stop_api_server),
    Scenario("hung API server (double's hang fault)", True, hang_fault, double_only=True),
)


@dataclass(frozen=True)
class Trial:
    scenario: str
    engine: str
    offset: float  # idle: seconds after the last probe answered; busy: after tokens were seen flowing
    record_s: float
    acted_s: float | None
    spawned_s: float | None
    reason: str
    detail: str
    killed_after_grace: bool  # the fast stop's SIGTERM was not enough: SIGKILL after the grace
    running_at_fault: float | None


@dataclass(frozen=True)
class Engine:
    name: str
    make_config: Callable[[Path], Path]
    ready_timeout: float
    busy_max_tokens: int


def run_trial(engine: Engine, sc: Scenario, offset: float, tmp: Path) -> Trial:
    config = engine.make_config(tmp)
    d = Daemon(config, tmp / "daemon.log").start()
    streams = None
    try:
        st = d.wait_ready(engine.ready_timeout)
        api_pid = api_server_pid(st["engine"]["pid"])  # the engine's pid is its launcher's
        wd = benchlib.watchdog_of(config)
        if sc.idle:
            # A probe that answered anchors the offset in the probe cycle.
            st = d.wait_for(lambda s: s["inference"]["ok"] is True and s["inference"]["finished_at"] and s, 4 * wd.probe_idle_seconds + 60, "an answered probe")
            time.sleep(max(0.0, st["inference"]["finished_at"] + offset - time.time()))
        else:
            streams = Streams(d.url, d.model, BUSY_STREAMS, max_tokens=engine.busy_max_tokens).start()
            try:
                first = d.wait_for(lambda s: (s["metrics"]["running"] or 0) >= 1 and s, 60, "streams running")
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\nlast stream error: {streams.last_error}") from None
            tokens = first["metrics"]["generation_tokens_total"]
            d.wait_for(lambda s: s["metrics"]["generation_tokens_total"] > tokens and s["written_at"] > first["written_at"], 30, "tokens flowing")
            time.sleep(offset)
        running = (d.state() or {}).get("metrics", {}).get("running")
        sc.inject(d, api_pid)
        fault = time.time()
        st = d.wait_for(lambda s: s["restarts"]["total"] >= 1 and s, 120, f"a restart after {sc.name}")
        spawned = d.wait_event("starting engine (restart after", fault, 60)
        acted = d.first_event("engine restart:", fault)
        killed = d.first_event("SIGKILL to engine group", fault)
        detail = acted.message.split(": ", 2)[-1] if acted else ""
        return Trial(
            sc.name, engine.name, offset, st["restarts"]["last_at"] - fault,
            acted.at - fault if acted else None, spawned.at - fault, st["restarts"]["last_reason"], detail,
            killed is not None and killed.at <= spawned.at, running,
        )  # fmt: skip
    finally:
        if streams is not None:
            streams.stop()
        d.cleanup()


def offsets(sc: Scenario, trials: int, wd: WatchdogConfig) -> list[float]:
    """Spread evenly over a probe cycle, which is about probe_idle_seconds plus up to a poll.
    Whole multiples of the poll interval would land every fault at the same point of the
    daemon's tick, which decides the hang's latency: the poll is added to the span so they do not."""
    if not sc.idle:
        # Under streams: seconds after tokens were seen flowing, spread over one tick.
        return [round(3.0 + (i + 0.5) / trials * wd.poll_interval, 2) for i in range(trials)]
    cycle = wd.probe_idle_seconds + wd.poll_interval
    return [round((i + 0.5) / trials * cycle, 2) for i in range(trials)]


def run_double(trials: int, tmp: Path, python: str, wd: WatchdogConfig) -> list[Trial]:
    engine = Engine("double", lambda d: benchlib.double_config(d, python), 60, 30_000)  # under its 32768 context
    results: list[Trial] = []
    errors: list[str] = []

    def scenario_thread(k: int, sc: Scenario) -> None:
        # The scenarios run side by side (each its own daemon and double): they wait
        # on seconds-long timers, not on the CPU.
        for i, offset in enumerate(offsets(sc, trials, wd)):
            where = tmp / f"s{k}t{i}"
            where.mkdir(parents=True)
            try:
                t = run_trial(engine, sc, offset, where)
            except Exception as exc:  # noqa: BLE001 - report it, go on with the others
                errors.append(f"{sc.name} trial {i + 1}: {exc}")
                say(f"double / {sc.name} trial {i + 1}: FAILED: {str(exc).splitlines()[0]}")
                continue
            results.append(t)
            say(f"double / {sc.name} trial {i + 1}: record {t.record_s:.2f} s, spawned {fmt(t.spawned_s)} s, {t.reason}: {t.detail}")

    threads = [threading.Thread(target=scenario_thread, args=(k, sc)) for k, sc in enumerate(SCENARIOS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        print(f"error: {e.splitlines()[0]}", file=sys.stderr)
    return results


def run_real(trials: int, tmp: Path, wd: WatchdogConfig) -> list[Trial]:
    engine = Engine("real vLLM", lambda d: benchlib.real_config(d), 600, 4000)
    results = []
    with benchlib.VllmLock():
        for k, sc in enumerate(s for s in SCENARIOS if not s.double_only):
            for i, offset in enumerate(offsets(sc, trials, wd)):
                where = tmp / f"s{k}t{i}"
                where.mkdir(parents=True)
                say(f"real vLLM / {sc.name} trial {i + 1}: starting a daemon (vLLM loads in about a minute)")
                try:
                    t = run_trial(engine, sc, offset, where)
                except Exception as exc:  # noqa: BLE001
                    say(f"real vLLM / {sc.name} trial {i + 1}: FAILED: {exc}")
                    continue
                results.append(t)
                say(f"real vLLM / {sc.name} trial {i + 1}: record {t.record_s:.2f} s, spawned {fmt(t.spawned_s)} s, {t.reason}: {t.detail}")
    return results


def report(results: list[Trial], wd: WatchdogConfig) -> bool:
    print(f"fault-to-restart under the shipped watchdog settings ({benchlib.describe_watchdog(wd)})")
    rows, ok = [], True
    groups: dict[tuple[str, str], list[Trial]] = {}
    for t in results:
        groups.setdefault((t.scenario, t.engine), []).append(t)
    order = [sc.name for sc in SCENARIOS]
    for (name, eng), ts in sorted(groups.items(), key=lambda kv: (kv[0][1] != "double", order.index(kv[0][0]))):
        rec = [t.record_s for t in ts]
        acted = [t.acted_s for t in ts if t.acted_s is not None]
        spawned = [t.spawned_s for t in ts if t.spawned_s is not None]
        reasons = sorted({t.reason for t in ts})
        verdicts = ["met" if v and max(v) <= TARGET_S else "MISSED" for v in (rec, acted)]
        ok &= verdicts == ["met", "met"]
        rows.append([
            name, eng, str(len(ts)), fmt(median(rec)), fmt(max(rec)), fmt(median(acted)), fmt(max(acted) if acted else None),
            fmt(median(spawned)), "/".join(reasons), "/".join(verdicts),
        ])  # fmt: skip
    print(benchlib.table(
        ["scenario", "engine", "n", "record s (median)", "max", "acted s (median)", "max", "spawned s", "reason", f"<= {TARGET_S:g} s record/acted"],
        rows,
    ))  # fmt: skip
    for (name, eng), ts in groups.items():
        tick = median([t.acted_s - t.record_s for t in ts if t.acted_s is not None]) or 0.0
        if tick > 1.0:
            first = math.ceil(wd.hang_timeout / tick) * tick
            print(
                f"{name} / {eng}: the deciding tick ran {tick:.1f} s before it acted: its /health request timed out "
                f"({wd.health_timeout:g} s; /metrics is not asked after that). Such ticks also space the hang rule's "
                f"checks {tick:.0f} s apart, so hang_timeout {wd.hang_timeout:g} s is first seen met at {first:.0f} s."
            )
        grace = median([t.spawned_s - t.acted_s for t in ts if t.killed_after_grace and t.acted_s is not None and t.spawned_s is not None])
        if grace is not None and grace > 1.0:
            print(f"{name} / {eng}: acted -> spawned {grace:.1f} s: the fast stop's SIGTERM grace, which a SIGSTOPped process cannot use, before SIGKILL.")
    print()
    print("per trial (offset: seconds after the last answered probe, or under streams after tokens were seen flowing;")
    print("running: the state file's vllm:num_requests_running just before the fault; grace: SIGKILL only after the fast stop's SIGTERM grace):")
    for t in results:
        extra = f"offset {t.offset:g} s, " + ("" if t.running_at_fault is None else f"{t.running_at_fault:g} running, ")
        print(
            f"  {t.engine:9s} {t.scenario:38s} {extra}record {t.record_s:5.2f} s, acted {fmt(t.acted_s)} s, "
            f"spawned {fmt(t.spawned_s)} s{' (grace)' if t.killed_after_grace else ''}; {t.reason}: {t.detail}"
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--engine", choices=("double", "real", "all"), default="all" if benchlib.long_enabled() else "double")
    cli.add_argument("--trials", type=int, default=3, help="trials per scenario against the double (default 3)")
    cli.add_argument("--real-trials", type=int, default=1, help="trials per scenario against the real vLLM (default 1)")
    args = cli.parse_args(argv)
    benchlib.exit_on_sigterm()

    results: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="r3090d-det-") as tmp:
        tmp = Path(tmp)
        from tests.fakevllm.harness import make_engine_python

        python = str(make_engine_python(tmp / "venv", "0.32.0"))
        (tmp / "wd").mkdir()
        wd_config = benchlib.double_config(tmp / "wd", python)
        for line in benchlib.shipped_drift(wd_config):
            print(f"warning: etc/r3090d.toml and the daemon's defaults differ: {line}", file=sys.stderr)
        wd = benchlib.watchdog_of(wd_config)
        if args.engine in ("double", "all"):
            results += run_double(args.trials, tmp / "double", python, wd)
        if args.engine in ("real", "all"):
            missing = benchlib.real_engine_missing()
            if missing:
                print(f"real vLLM skipped: {missing}")
            else:
                results += run_real(args.real_trials, tmp / "real", wd)
        elif not benchlib.long_enabled():
            print(f"real vLLM skipped: set {benchlib.LONG_ENV}=1 (or --engine real) to run it (a few minutes)")
    if not results:
        print("no trial finished", file=sys.stderr)
        return 1
    report(results, wd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
