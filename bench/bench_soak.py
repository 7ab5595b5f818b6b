"""Soak: an engine that has served is not a start failure, however often it fails.

The daemon (`python -m r3090d`, the shipped [watchdog]: min_uptime 60 s,
start_failures 5, same_cause_failures 2) runs the real CPU vLLM on the tiny
model while a thread sends small completions continuously. Every --interval
seconds (default 60) a recoverable fault hits the engine, once it has served
(its start succeeded), cycling through:

  SIGSTOP of the API server       /health times out: "hung"
  SIGSTOP of EngineCore           nothing moves: "stalled", or the probe's "probe_failed"
  SIGKILL of a worker             the engine dies
  SIGKILL of the API server       the engine dies

A fault often comes well within min_uptime of the engine's ready: only its
having served makes it no start failure. For --duration seconds (default 1200)
from the first ready. Per fault it prints the fault, its time after the
previous ready, the daemon's reason, fault -> restart decided, fault -> ready
again, the completions that generation served before the fault, and the start
failures the daemon counted; at the end the give-ups (must be 0), faults
recovered / total, and whether restart_storm fired (shipped: 3 restarts within
an hour, so a soak fires it: it is the operator's notice, not a failure).

Exit 0 when every fault was recovered with no start failure and no give-up; 1
otherwise; 69, saying why in one line, when the CPU vLLM or the tiny model is
not here. Opt-in (it takes minutes): R3090D_BENCH_LONG=1, or --duration given.
A short run: --duration 180 --interval 60 (two faults, about four minutes with
the engine's loads). The engine: --engine-python (default $R3090D_ENGINE_PYTHON,
else the installed engine) and --model (default $R3090D_TINY_MODEL, else
build/tiny-qwen2).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import benchlib  # noqa: E402
from bench.benchlib import Daemon, fmt, say, table  # noqa: E402
from tests.daemon_harness import api_server_pid  # noqa: E402
from tests.e2e.real_vllm import engine_python_path, engine_tree  # noqa: E402

EX_UNAVAILABLE = 69
MODEL_ENV = "R3090D_TINY_MODEL"
READY_TIMEOUT = 420.0  # a model load on 2 loaded cores
DETECT_TIMEOUT = 120.0  # every fault here is found within about 15 s under the shipped settings
MAX_TOKENS = 8


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[int], None]  # given the API server's pid


def _kill_worker(main: int) -> None:
    tree = engine_tree(main)
    worker = next((pid for name, pid in tree.items() if name.startswith("VLLM::Worker")), None)
    if worker is None:
        raise RuntimeError(f"no VLLM::Worker under pid {main}: {sorted(tree)}")
    os.kill(worker, signal.SIGKILL)


FAULTS = [
    Fault("SIGSTOP of the API server", lambda main: os.kill(api_server_pid(main), signal.SIGSTOP)),
    Fault("SIGSTOP of EngineCore", lambda main: os.kill(benchlib.engine_core_pid(main), signal.SIGSTOP)),
    Fault("SIGKILL of a worker", _kill_worker),
    Fault("SIGKILL of the API server", lambda main: os.kill(api_server_pid(main), signal.SIGKILL)),
]


class RequestLoop:
    """One thread sending small completions back to back; the wall-clock time of every success."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.successes: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="request-loop", daemon=True)

    def start(self) -> RequestLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "The quick brown fox", "max_tokens": MAX_TOKENS}
        # Under a hung API server a request waits out its read timeout: keep it short.
        with httpx.Client(timeout=httpx.Timeout(5.0, read=20.0), trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    ok = client.post(self.url + "/v1/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.successes.append(time.time())
                else:
                    self.failures += 1
                    self._stop.wait(0.5)  # the engine is down or restarting: no busy loop

    def served_between(self, start: float, end: float) -> int:
        return sum(1 for t in list(self.successes) if start <= t <= end)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@dataclass
class Outcome:
    fault: str
    after_ready: float
    served: int
    reason: str | None = None
    detected: float | None = None
    ready_again: float | None = None
    start_failures: int | None = None
    backoff_level: int | None = None

    @property
    def recovered(self) -> bool:
        return self.ready_again is not None


def gave_up(st: dict) -> bool:
    return st["engine"]["phase"] == "given-up" or st["give_up_reason"] is not None


def soak(d: Daemon, loop: RequestLoop, duration: float, interval: float, outcomes: list[Outcome]) -> None:
    """Faults every `interval` s for `duration` s from the first ready, each once the engine has served."""
    wd = benchlib.watchdog_of(d.config_path)
    st = d.wait_ready(READY_TIMEOUT)
    first_ready = st["engine"]["ready_since"]
    say(f"engine ready (pid {st['engine']['pid']}); soaking {duration:g} s, a fault every {interval:g} s")
    for n in itertools.count():
        due = first_ready + (n + 1) * interval
        if due - first_ready >= duration:
            return
        # An engine that served has a successful start: the fault must not count as a start failure.
        st = d.wait_for(lambda s: (s["healing"]["start_succeeded"] or gave_up(s)) and s, wd.min_uptime + 60, "the start succeeded")
        if gave_up(st):
            return
        while time.time() < due:
            time.sleep(0.2)
        st = d.state()
        main, ready_at, before = st["engine"]["pid"], st["engine"]["ready_since"], st["restarts"]["total"]
        fault = FAULTS[n % len(FAULTS)]
        t_fault = time.time()
        fault.inject(main)
        outcome = Outcome(fault.name, t_fault - ready_at, loop.served_between(ready_at, t_fault))
        outcomes.append(outcome)
        say(f"fault {n + 1}: {fault.name} (pid {main}), {outcome.after_ready:.0f} s after ready, {outcome.served} served")
        st = d.wait_for(lambda s, b=before: (s["restarts"]["total"] > b or gave_up(s)) and s, DETECT_TIMEOUT, f"the restart after {fault.name}")
        if gave_up(st):
            return
        outcome.reason, outcome.detected = st["restarts"]["last_reason"], st["restarts"]["last_at"] - t_fault
        outcome.start_failures, outcome.backoff_level = st["restarts"]["start_failures"], st["restarts"]["backoff_level"]
        st = d.wait_for(lambda s, old=main: (gave_up(s) or (s["engine"]["phase"] == "ready" and s["engine"]["pid"] not in (None, old))) and s,
                        READY_TIMEOUT, f"ready again after {fault.name}")  # fmt: skip
        if gave_up(st):
            return
        outcome.ready_again = st["engine"]["ready_since"] - t_fault
        say(f"fault {n + 1}: {outcome.reason} after {outcome.detected:.1f} s, ready again after {outcome.ready_again:.1f} s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=None, help="seconds of faults from the first ready (default 1200)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between faults (default 60)")
    parser.add_argument("--engine-python", default=engine_python_path(), help="the CPU vLLM's python")
    parser.add_argument("--model", type=Path, default=Path(os.environ.get(MODEL_ENV) or benchlib.TINY_MODEL), help="the tiny model's directory")
    args = parser.parse_args(argv)
    missing = benchlib.real_engine_missing(args.engine_python, args.model)
    if missing:
        print(f"bench_soak skipped: {missing}")
        return EX_UNAVAILABLE
    if args.duration is None and not benchlib.long_enabled():
        print(f"bench_soak skipped: 20 minutes of faults on the real vLLM; set {benchlib.LONG_ENV}=1 (or give --duration) to run it")
        return 0
    duration = 1200.0 if args.duration is None else args.duration
    benchlib.exit_on_sigterm()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="r3090d-soak-") as tmp, benchlib.VllmLock():
        tmp = Path(tmp)
        config = benchlib.real_config(tmp, engine_python=args.engine_python, model=args.model)
        drift = benchlib.shipped_drift(config)
        d = Daemon(config, tmp / "daemon.log").start()
        loop = RequestLoop(d.url, d.model).start()
        try:
            soak(d, loop, duration, args.interval, outcomes)
        except RuntimeError as exc:  # a wait ran out: that fault was not recovered
            say(f"soak stopped: {str(exc).splitlines()[0]}")
        finally:
            loop.stop()
            final = d.state() or {}
            events = d.events()
            d.cleanup()
    give_ups = sum(1 for e in events if e.message.startswith("gave up:"))
    storm = next((e for e in events if e.message.startswith("alert restart_storm firing")), None)
    recovered = sum(1 for o in outcomes if o.recovered)
    start_failures = sum(1 for o in outcomes if o.start_failures)
    wd = benchlib.watchdog_of(benchlib.SHIPPED_CONFIG)
    print(f"soak on the real CPU vLLM ({args.model.name}), shipped [watchdog] ({benchlib.describe_watchdog(wd)}, "
          f"start_failures {wd.start_failures}, same_cause_failures {wd.same_cause_failures}){'; DRIFT: ' + '; '.join(drift) if drift else ''}")  # fmt: skip
    print(f"a fault every {args.interval:g} s for {duration:g} s from the first ready; {len(loop.successes)} completions served, "
          f"{loop.failures} failed")  # fmt: skip
    print()
    rows = [(str(i + 1), o.fault, f"{o.after_ready:.0f} s", o.reason or "-", f"{fmt(o.detected, '.1f')} s", f"{fmt(o.ready_again, '.1f')} s",
             str(o.served), "-" if o.start_failures is None else str(o.start_failures), "-" if o.backoff_level is None else str(o.backoff_level))
            for i, o in enumerate(outcomes)]  # fmt: skip
    print(table(("#", "fault", "after ready", "reason", "detected", "ready again", "served", "start failures", "backoff"), rows))
    print()
    print(f"give-ups: {give_ups}{' (' + final.get('give_up_reason') + ')' if final.get('give_up_reason') else ''}")
    print(f"faults recovered: {recovered} / {len(outcomes)}")
    print(f"faults counted as start failures: {start_failures}")
    print(f"restart_storm fired: {'yes: ' + storm.message.split(': ', 1)[1] if storm else 'no'}")
    return 0 if outcomes and give_ups == 0 and recovered == len(outcomes) and start_failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
