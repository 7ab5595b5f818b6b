"""Self-healing, timed: the daemon heals the faults that restarting alone would not, with the shipped watchdog settings.

The daemon runs as `python -m r3090d --skip-preflight` against the vLLM double
(tests/fakevllm) on the fake NVML (tests/fakenvml, a card described by a JSON
file this benchmark rewrites as the driver would). [watchdog] is the shipped
one; a case that shortens a key says so in its rows. Observed as an operator
would: the state file and the daemon's log.

  a. an application XID (31) right after a crash (SIGKILL of the engine's process
     group): restarted at once, the gpu_xid_application warning named, no start failure;
  b. a foreign process holding 12000 MiB of the card across a crash: the restart
     waits in waiting-for-gpu with the holder named, starts once it lets go, no start
     failure;
  c. a start that fails until a path exists (--fake-fail-start-unless): the daemon
     gives up, retries by itself every watchdog.give_up_retry (shortened to 10 s
     here: the shipped 1800 s is the point of the setting, not of the run), and once
     the path appears it is ready again; the gave_up alert fired once and resolved;
  d. gpu_idle tripping on engines that never served (the card at 0% with two
     endless streams running): the window doubles from the second trip in a row on,
     so at the shipped gpu_idle_stall_seconds = 5 the trips are held for 5, 5, 10
     and 20 s, under one detector_widened alert held while widened.

In a and b the engine has served one completion before the crash (its start
succeeded, so the crash is no start failure). Progress goes to stderr; the
tables to stdout. Exit 0 when every case ended as expected, 1 otherwise.
About two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import benchlib  # noqa: E402
from bench.benchlib import Daemon, Streams, fmt, say, table  # noqa: E402
from tests.fakevllm.harness import make_engine_python  # noqa: E402

FAKE_NVML_DIR = benchlib.ROOT / "tests" / "fakenvml"
ENGINE_MIB = 8000  # what the engine's processes hold on the fake card
HOLDER_MIB = 12000  # the foreign holder of case b: the engine's share no longer fits beside it
HOLD_POLLS = 3  # how many polls the holder keeps the card once the daemon is seen waiting
GIVE_UP_RETRY_S = 10.0  # case c's watchdog.give_up_retry (shipped: 1800 s)
IDLE_TRIPS = 4  # case d: the widening shows from the second trip in a row on
READY_S = 60.0  # the double is ready in a second or two; room for a loaded machine
XID_CASE = "a. XID 31 after a crash"
HOLDER_CASE = "b. foreign holder across a crash"
GIVE_UP_CASE = "c. give-up, cause removed"
WIDENING_CASE = "d. gpu_idle twice in a row"


@dataclass
class Case:
    name: str
    rows: list[tuple[str, str]] = field(default_factory=list)  # (measure, value)
    failures: list[str] = field(default_factory=list)  # what did not end as expected

    def measure(self, what: str, seconds: float | None) -> None:
        self.rows.append((what, f"{fmt(seconds)} s"))

    def note(self, what: str, value: object) -> None:
        self.rows.append((what, str(value)))

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


class Card:
    """The fake NVML's card: a JSON file, rewritten atomically (the fake re-reads it on every call)."""

    def __init__(self, path: Path, **fields):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fields: dict = {"util": 50, "processes": [], "graphics_processes": [], "xids": [], **fields}
        self.update()

    def update(self, **changes) -> None:
        self.fields.update(changes)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.fields))
        tmp.replace(self.path)

    def engine_holds_it(self, engine_pid: int) -> None:
        """The card lists the engine's process group as its compute processes, as NVML would."""
        pids = benchlib.group_members(engine_pid) or [engine_pid]
        self.update(processes=[[p, ENGINE_MIB // len(pids)] for p in pids], memory_used_mib=ENGINE_MIB)

    def add_xid(self, xid: int) -> None:
        # The fake hands out each entry once, in order: the list only grows.
        self.update(xids=[*self.fields["xids"], xid])


def start_daemon(tmp: Path, python: str, card: Card, *, extra_args=(), watchdog: dict | None = None) -> Daemon:
    """A daemon on the fake card, with the shipped [watchdog] but for `watchdog`."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = benchlib.double_config(tmp, python, extra_args=extra_args, watchdog=watchdog, gpu={"required": True, "card": "any"})
    os.environ["R3090D_FAKE_NVML"] = str(card.path)  # the daemon (and its engine) inherit it
    return Daemon(config, tmp / "daemon.log", args=("--skip-preflight",)).start()


def served_once(d: Daemon) -> dict:
    """One completion, once the daemon has read the ready engine's counters (the base its serving is counted
    from: a completion before that reading would be part of the base); the state once the start succeeded."""
    poll = benchlib.watchdog_of(d.config_path).poll_interval
    d.wait_for(lambda s: s["engine"]["ready_since"] and s["written_at"] - s["engine"]["ready_since"] >= poll / 2, READY_S,
               "a reading after ready")  # fmt: skip
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        body = {"model": d.model, "prompt": "hello", "max_tokens": 4}
        httpx.post(d.url + "/v1/completions", json=body, timeout=30, trust_env=False).raise_for_status()
        try:
            return d.wait_for(lambda s: s["healing"]["start_succeeded"] and s, 3 * poll, "the start succeeded")
        except RuntimeError:
            say("a completion did not count as served (the daemon's reading was late?): another")
    raise RuntimeError(f"the engine served and its start never counted as succeeded\n{d.log_text()[-3000:]}")


def crash(d: Daemon, card: Card, **card_changes) -> tuple[int, float]:
    """SIGKILL the engine's process group; the card says what the driver would after it. (old pid, when)"""
    pid = d.state()["engine"]["pid"]
    card.update(**{"processes": [], "memory_used_mib": 0, **card_changes})
    at = time.time()
    os.killpg(pid, signal.SIGKILL)
    return pid, at


def alert_lines(d: Daemon, key: str, state: str = "firing") -> list[benchlib.LogEvent]:
    return [e for e in d.events() if e.message.startswith(f"alert {key} {state}")]


# ------------------------------------------------------------------ the cases


def case_xid(d: Daemon, card: Card) -> Case:
    case = Case(XID_CASE)
    served_once(d)
    old, t_fault = crash(d, card)
    card.add_xid(31)
    st = d.wait_ready(READY_S, not_pid=old)
    started = d.first_event("starting engine", after=t_fault)
    case.measure("crash -> new engine started", started.at - t_fault if started else None)
    warning = d.first_event("alert gpu_xid_application firing", after=t_fault)
    case.measure("crash -> gpu_xid_application alert", warning.at - t_fault if warning else None)
    case.measure("crash -> ready again", st["engine"]["ready_since"] - t_fault)
    case.note("alert", warning.message if warning else "none")
    case.note("restart reason / start failures", f"{st['restarts']['last_reason']} / {st['restarts']['start_failures']}")
    case.expect(warning is not None and "XID 31" in warning.message, "no gpu_xid_application alert naming XID 31")
    case.expect(st["healing"]["xid_by_class"] == {"application": 1}, f"xid_by_class {st['healing']['xid_by_class']}")
    case.expect(st["healing"]["reset_hold"] is None, f"a reset hold: {st['healing']['reset_hold']}")
    case.expect(st["restarts"]["start_failures"] == 0, "the crash counted as a start failure")
    return case


def case_holder(d: Daemon, card: Card) -> Case:
    case = Case(HOLDER_CASE)
    poll = benchlib.watchdog_of(d.config_path).poll_interval
    served_once(d)
    holder = subprocess.Popen(["sleep", "600"])  # a real process, so the daemon can name it
    try:
        old, t_fault = crash(d, card, processes=[[holder.pid, HOLDER_MIB]], memory_used_mib=HOLDER_MIB)
        st = d.wait_for(lambda s: s["engine"]["phase"] == "waiting-for-gpu" and s, READY_S, "waiting-for-gpu")
        entered = st["engine"]["since"]
        holders = st["healing"]["gpu_wait_holders"]
        case.measure("crash -> waiting-for-gpu", entered - t_fault)
        case.note("holders named", ", ".join(f"pid {h['pid']} ({h.get('name') or 'name not read'}), {(h.get('used_bytes') or 0) >> 20} MiB" for h in holders))
        case.expect([h["pid"] for h in holders] == [holder.pid], f"holders {holders}, expected pid {holder.pid}")
        # The holder keeps the card a few polls: the daemon must keep waiting, start nothing.
        end = time.time() + HOLD_POLLS * poll
        while time.time() < end:
            phase = d.state()["engine"]["phase"]
            case.expect(phase == "waiting-for-gpu", f"phase {phase} while the holder still held the card")
            time.sleep(0.2)
        card.update(processes=[], memory_used_mib=0)  # the holder lets go
        t_release = time.time()
    finally:
        holder.kill()
        holder.wait()
    st = d.wait_ready(READY_S, not_pid=old)
    started = d.first_event("starting engine", after=t_release)
    case.measure("time in waiting-for-gpu", started.at - entered if started else None)
    case.measure("holder let go -> start", started.at - t_release if started else None)
    case.measure("holder let go -> ready again", st["engine"]["ready_since"] - t_release)
    case.note("start failures", st["restarts"]["start_failures"])
    case.expect(st["restarts"]["start_failures"] == 0, "the wait counted as a start failure")
    return case


def case_give_up_retry(tmp: Path, python: str) -> Case:
    case = Case(GIVE_UP_CASE)
    case.note("watchdog.give_up_retry (shortened)", f"{GIVE_UP_RETRY_S:g} s (shipped {benchlib.watchdog_of(benchlib.SHIPPED_CONFIG).give_up_retry:g} s)")
    mount = tmp / "mounted"  # a model's network mount, absent for now
    d = start_daemon(tmp, python, Card(tmp / "card.json"), extra_args=["--fake-fail-start-unless", str(mount)],
                     watchdog={"give_up_retry": GIVE_UP_RETRY_S})  # fmt: skip
    try:
        st = d.wait_for(lambda s: s["engine"]["phase"] == "given-up" and s, READY_S, "the give-up")
        first = d.first_event("starting engine")
        gave_up = d.first_event("gave up:")
        attempts = sum(1 for e in d.events() if e.message.startswith("starting engine") and e.at <= gave_up.at)
        case.measure("first start -> give-up", gave_up.at - first.at)
        case.note("starts before the give-up", attempts)
        case.note("give-up reason", st["give_up_reason"])
        # One automatic attempt, still failing: given up again, the alert not sent again.
        st = d.wait_for(lambda s: s["healing"]["retry_attempts"] >= 1 and s["engine"]["phase"] == "given-up" and s,
                        GIVE_UP_RETRY_S + READY_S, "a failed automatic attempt")  # fmt: skip
        retried = d.first_event("starting engine (automatic retry 1", after=gave_up.at)
        case.measure("give-up -> automatic attempt 1", retried.at - gave_up.at if retried else None)
        mount.mkdir()  # the mount comes back
        t_fix = time.time()
        st = d.wait_ready(GIVE_UP_RETRY_S + READY_S)
        retried = d.first_event("starting engine (automatic retry", after=t_fix)
        case.measure("cause removed -> next automatic attempt", retried.at - t_fix if retried else None)
        case.measure("cause removed -> ready again", st["engine"]["ready_since"] - t_fix)
        attempts_total = sum(1 for e in d.events() if e.message.startswith("starting engine (automatic retry"))
        case.note("automatic attempts in all", attempts_total)
        st = served_once(d)
        st = d.wait_for(lambda s: "gave_up" not in s["alerts"]["firing"] and s, 30, "gave_up resolved")
        resolved = alert_lines(d, "gave_up", "resolved")
        case.measure("ready -> gave_up resolved (served once)", resolved[0].at - st["engine"]["ready_since"] if resolved else None)
        fired = len(alert_lines(d, "gave_up"))
        case.note("gave_up alert fired / resolved", f"{fired} / {len(resolved)}")
        case.expect(attempts == 2, f"{attempts} starts before the give-up (shipped same_cause_failures = 2)")
        case.expect("does not exist" in (gave_up.message if gave_up else ""), "the give-up does not name the missing path")
        case.expect(fired == 1, f"gave_up fired {fired} times")
        case.expect(len(resolved) == 1, "gave_up never resolved in the log")
        case.expect(st["give_up_reason"] is None and st["healing"]["retry_attempts"] == 0, "the give-up was not cleared")
    finally:
        d.cleanup()
    return case


IDLE_DETAIL = re.compile(r"^engine restart: gpu_idle: .* for ([\d.]+) s")


def case_detector_widening(tmp: Path, python: str) -> Case:
    case = Case(WIDENING_CASE)
    wd = benchlib.watchdog_of(benchlib.SHIPPED_CONFIG)
    card = Card(tmp / "card.json", util=0)
    d = start_daemon(tmp, python, card, extra_args=["--fake-token-delay", "0.05"])
    streams = None
    try:
        old = None
        for trip in range(1, IDLE_TRIPS + 1):
            st = d.wait_ready(READY_S, not_pid=old)
            old = st["engine"]["pid"]
            window = wd.gpu_idle_stall_seconds * (st["healing"]["detector_scale"].get("gpu_idle", 1))
            if streams is None:  # endless streams: requests keep running, none ever completes (never served)
                streams = Streams(d.url, d.model, 2, max_tokens=30000).start()
            d.wait_for(lambda s: s["metrics"]["running"], 30, "requests running")
            card.engine_holds_it(old)  # the engine is the card's sole user, at 0%: gpu_idle's clock starts
            t_idle = time.time()
            st = d.wait_for(lambda s, n=trip: s["restarts"]["by_reason"].get("gpu_idle", 0) >= n and s,
                            window * 2 + 30, f"gpu_idle trip {trip}")  # fmt: skip
            card.update(processes=[], memory_used_mib=0)  # the old tree's pids leave the card with it
            event = next(e for e in reversed(d.events()) if IDLE_DETAIL.match(e.message))
            held = float(IDLE_DETAIL.match(event.message).group(1))
            case.note(f"trip {trip}: window / held (daemon) / card idle -> restart",
                      f"{window:g} s / {held:.1f} s / {fmt(st['restarts']['last_at'] - t_idle)} s")  # fmt: skip
            expected = wd.gpu_idle_stall_seconds * min(2 ** max(trip - 2, 0), 8)
            case.expect(window == expected, f"trip {trip}: window {window:g} s, expected {expected:g} s")
            case.expect(expected <= held < expected + 2 * wd.poll_interval + 1, f"trip {trip}: held {held:.1f} s for a {expected:g} s window")
        st = d.wait_for(lambda s: s["engine"]["phase"] in ("ready", "starting", "backoff") and s, READY_S, "the restart after the last trip")
        scale = st["healing"]["detector_scale"].get("gpu_idle", 1)
        case.note("gpu_idle window now", f"{wd.gpu_idle_stall_seconds * scale:g} s ({scale}x)")
        # One alert, held while widened: it fires once, its reminders carry the current window.
        widened = alert_lines(d, "detector_widened")
        for e in widened:
            case.note("detector_widened alert", e.message.split(": ", 1)[1].split(";")[0])
        case.note("start failures after the trips", st["restarts"]["start_failures"])
        case.expect(len(widened) >= 1 and "its window is 10 s, 2x" in widened[0].message, "no detector_widened alert naming the 10 s window")
        case.expect(scale == min(2 ** (IDLE_TRIPS - 1), 8), f"detector_scale {st['healing']['detector_scale']}")
        case.expect(st["give_up_reason"] is None, f"gave up: {st['give_up_reason']}")
    finally:
        if streams is not None:
            streams.stop()
        d.cleanup()
    return case


def run_case(cases: list[Case], name: str, body: Callable[[], Case]) -> None:
    say(f"case {name}")
    t0 = time.monotonic()
    try:
        case = body()
    except Exception as exc:  # a case that could not finish is a case not ended as expected
        case = Case(name)
        case.failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        say(f"case {name} failed: {exc}")
    case.note("case took", f"{time.monotonic() - t0:.0f} s")
    cases.append(case)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="abcd", help="which cases to run (letters, default abcd)")
    args = parser.parse_args(argv)
    benchlib.exit_on_sigterm()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAKE_NVML_DIR), str(benchlib.ROOT), os.environ.get("PYTHONPATH")) if p)
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="r3090d-bench-") as tmp:
        tmp = Path(tmp)
        python = str(make_engine_python(tmp / "venv", "0.32.0"))
        if {"a", "b"} & set(args.cases):  # both crash the engine of one daemon
            card = Card(tmp / "crashes" / "card.json")
            d = start_daemon(tmp / "crashes", python, card)
            try:
                d.wait_ready(READY_S)
                if "a" in args.cases:
                    card.engine_holds_it(d.state()["engine"]["pid"])
                    run_case(cases, XID_CASE, lambda: case_xid(d, card))
                if "b" in args.cases:
                    card.engine_holds_it(d.state()["engine"]["pid"])
                    run_case(cases, HOLDER_CASE, lambda: case_holder(d, card))
            finally:
                d.cleanup()
        if "c" in args.cases:
            run_case(cases, GIVE_UP_CASE, lambda: case_give_up_retry(tmp / "give-up", python))
        if "d" in args.cases:
            run_case(cases, WIDENING_CASE, lambda: case_detector_widening(tmp / "gpu-idle", python))
    wd = benchlib.watchdog_of(benchlib.SHIPPED_CONFIG)
    print(f"self-healing against the vLLM double and the fake NVML; shipped [watchdog] ({benchlib.describe_watchdog(wd)}, "
          f"gpu_idle_stall_seconds {wd.gpu_idle_stall_seconds:g}, give_up_retry {wd.give_up_retry:g}); "
          f"case c shortens give_up_retry to {GIVE_UP_RETRY_S:g} s")  # fmt: skip
    print()
    print(table(("case", "measure", "value"), [(c.name if i == 0 else "", what, value) for c in cases for i, (what, value) in enumerate(c.rows)]))
    print()
    for c in cases:
        print(f"{c.name}: {'as expected' if not c.failures else 'NOT as expected: ' + '; '.join(c.failures)}")
    return 1 if any(c.failures for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
