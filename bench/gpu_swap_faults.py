"""Swap mode under faults, on a GPU: three stand-in engines of 15 GiB behind the router, nobody at the keyboard.

For a host with an NVIDIA GPU, driver 570 or newer (process checkpointing),
nvidia-ml-py, aiohttp and torch with CUDA; elsewhere it says so in one line and
exits 69. Not run by `make bench` (which runs bench/bench_*.py only). From the
repository root:

    python3 bench/gpu_swap_faults.py [--weight-gib 15] [--load-seconds 120] [--third-every 30] [--window 60]
    python3 bench/gpu_swap_faults.py --cpu-standin     # dry run of the plumbing, no GPU needed (about a minute)

The rig is bench/gpu_swap.py's (its `prepare`): the daemon in swap mode with
models A, B and C (swap-a, swap-b, swap-c), each engine bench/gpu_swap_engine.py
holding --weight-gib GiB, a ballast so that one engine fits on the card and two
do not, the router on the public port. This bench adds to its config a quick
give-up (watchdog.start_failures = 2, watchdog.give_up_retry = --give-up-retry)
and gives every engine the double's --fake-fail-start-unless FILE: its starts
fail while FILE is missing (a mount that comes back), so a model can be made to
give up and then to recover without touching the daemon.

After a warm-up (C, B, A cold, as gpu_swap's), four phases, each a table of
checks (expected, observed):

  1 parked kill  the process group of a parked engine is SIGKILLed; its model is
                 then asked for: served again by a cold start, no give-up.
  2 router kill  a parked model is asked for and the router SIGKILLed while the
                 swap brings it in (restoring or checking it): a new router
                 listens within --router-back s (2), the swap completes, the
                 next request is served (the one the kill cut is reported). A
                 router killed earlier, while the outgoing engine drains or
                 parks, takes the only request for the target along: the daemon
                 then abandons a swap nobody asks for, as it should.
  3 give-up      C's start file is removed and C asked for: it gives up; A and B
                 keep swapping meanwhile; the file comes back, and once the
                 give-up's automatic retry has made C cold (not started by
                 itself), C is asked for: its start is a swap the arbiter makes
                 (from the resident model, cold), it serves, the card is not
                 deadlocked.
  4 load         --load-seconds of 4 clients asking A and B in a loop (each
                 alternating, two starting with each) plus one request to C every
                 --third-every s: no lost request, no engine restart, and no model
                 asked for --window s (its requests waiting) without one served.

Then one line: `verdict: passed: ...` or `verdict: FAILED: ...`. --cpu-standin
runs it all with CPU workers, tests/fakenvml and tests/fakecuda (gpu_swap's dry
run), with short defaults (a 20 s load, C every 6 s, a 20 s window, a 4 s
give-up retry, 10 s for the router: python and aiohttp take 1.5-2.5 s to start
on a loaded 2-core host); about 80 s there; its times say nothing about a GPU.
A GPU run is estimated (not yet measured) at 6-7 minutes with the defaults:
the default --budget, 570 s, fits a 10-minute slot.

Progress goes to stderr, the tables to stdout. Exit 0 when every check of every
phase holds, 1 otherwise, 69 when this host cannot run it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # r3090d and bench/ from this checkout, installed or not

from bench import gpu_idle as gi  # noqa: E402
from bench import gpu_swap as gs  # noqa: E402
from tests.waiting import WaitTimeout, wait_until  # noqa: E402

MODELS, LETTER = gs.MODELS, gs.LETTER
TOKENS = 16  # every request's answer
START_FAILURES = 2  # watchdog.start_failures: a give-up after two failed starts
GIVE_UP_MODEL = "C"
# Phase lengths: a GPU run's and the dry run's (--cpu-standin) defaults.
DEFAULTS = {"load_seconds": (120.0, 20.0), "third_every": (30.0, 6.0), "window": (60.0, 20.0), "give_up_retry": (30.0, 4.0), "router_back": (2.0, 10.0),
            "budget": (570.0, 300.0)}  # fmt: skip
REQUEST_WAIT_S = 330.0  # a load request may wait for swaps: past the router's queue_timeout, it is lost
NOTICE_WAIT_S = 60.0  # the daemon notices a dead parked engine
GIVE_UP_WAIT_S = (
    600.0,
    90.0,
)  # START_FAILURES starts of 15 GiB (a dry run: of CPU workers) and their backoff


@dataclass(frozen=True)
class Check:
    what: str
    expected: str
    observed: str
    ok: bool


@dataclass
class Phase:
    name: str
    checks: list[Check] = field(default_factory=list)
    error: str = ""  # what stopped the phase before its checks were done

    def check(self, what: str, expected: str, observed: str, ok: bool) -> bool:
        self.checks.append(Check(what, expected, observed, bool(ok)))
        gi.say(f"  {self.name}: {what}: {observed} ({'ok' if ok else 'NOT OK, expected ' + expected})")
        return bool(ok)

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.checks) and all(c.ok for c in self.checks)

    def failures(self) -> list[str]:
        return ([self.error] if self.error else []) + [
            f"{c.what}: {c.observed}" for c in self.checks if not c.ok
        ]


class FaultWatcher(gs.Watcher):
    """gpu_swap's watcher, also keeping every model's phases as read (wall clock, engine phase, residency)."""

    def __init__(self, run: gs.SwapRun):
        super().__init__(run)
        self.phases: dict[str, list[tuple[float, str, str]]] = {name: [] for name in MODELS.values()}

    def observe(self, st: dict) -> None:
        for m in st.get("models") or []:
            seen = self.phases.get(m.get("name"))
            now = (str((m.get("engine") or {}).get("phase")), str(m.get("residency")))
            if seen is not None and (not seen or seen[-1][1:] != now):
                seen.append((time.time(), *now))

    def phases_since(self, name: str, since: float) -> list[str]:
        with self.lock:
            return [phase for at, phase, _ in self.phases[name] if at >= since]

    def first(self, name: str, phase: str, since: float) -> float | None:
        """When the model was first seen in `phase` from `since` on (wall clock)."""
        with self.lock:
            return next((at for at, seen, _ in self.phases[name] if at >= since and seen == phase), None)


# After its retry, the given-up model asked for again is served within this (a swap in, with room to spare).
RETRY_READY_S = 60.0

def model(st: dict, letter: str) -> dict:
    return gs.model_doc(st, MODELS[letter])


def resident(st: dict) -> str | None:
    return next((letter for letter in MODELS if model(st, letter).get("residency") == "ready"), None)


def lost(m: dict, pid: int) -> dict | None:
    """The model's document once the daemon knows its parked engine (pid) is gone."""
    gone = (m.get("suspend") or {}).get("cold") or (
        m.get("residency") != "parked" and m["engine"].get("pid") != pid
    )
    return m if gone else None


def router(st: dict) -> dict:
    return (st.get("swap") or {}).get("router") or {}


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class Faults:
    def __init__(self, args, rig: gs.Rig):
        self.args, self.rig, self.run, self.budget = args, rig, rig.run, rig.budget
        self.watcher: FaultWatcher = rig.watcher  # type: ignore[assignment]
        self.b = gs.Bench(args, rig.run, rig.watcher, rig.budget)  # gpu_swap's requests and warm-up
        self.phases: list[Phase] = []
        self.load: list[list[str]] = []  # the load phase's table, per model
        self.last_at: float | None = None  # the last swap's end (wall clock): min_residency counts from it

    # ------------------------------------------------------------------ helpers

    def state(self) -> dict:
        st = self.run.state()
        if not isinstance(st, dict) or not st.get("models"):
            st = self.watcher.latest()
        return st

    def start_file(self, letter: str) -> Path:
        return self.rig.status_dirs[letter].parent / f"start-ok-{letter}"

    def record_to(self, after: int, letter: str, what: str, timeout: float = gs.SWAP_WAIT_S) -> dict | None:
        """The first swap record numbered above `after` whose target is `letter` (None: none within the bound)."""
        name = MODELS[letter]
        deadline = time.monotonic() + self.budget.cap(timeout)
        while time.monotonic() < deadline:
            with self.watcher.lock:
                found = [
                    rec
                    for n, rec in sorted(self.watcher.records.items())
                    if n > after and rec.get("to_model") == name
                ]
            if found:
                if found[0].get("ok") and found[0].get("routing_s") is None:
                    time.sleep(gs.ROUTING_SETTLE_S)  # routing_s is written a tick later
                    with self.watcher.lock:
                        found = [
                            rec
                            for n, rec in sorted(self.watcher.records.items())
                            if n > after and rec.get("to_model") == name
                        ]
                return found[0]
            if self.run.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited {self.run.proc.returncode} while waiting for {what}")
            time.sleep(gs.POLL_S)
        if self.budget.left() <= 0:
            raise gi.OutOfTime(f"the time budget (--budget) ran out while waiting for {what}")
        return None

    def swap_to(self, letter: str, label: str) -> tuple[dict | None, gs.Request]:
        """Ask for a model once the resident one has had its minimum residency; its swap's record and the request."""
        here = resident(self.state())
        self.b.wait_quiet()
        if here is not None and here != letter:
            self.b.wait_resident(here, self.last_at)
        n = self.watcher.count()
        q = self.b.ask(letter, TOKENS, label)
        rec = None if here == letter else self.record_to(n, letter, f"the swap to {MODELS[letter]} ({label})")
        self.b.wait_request(q, label)
        self.last_at = (rec or {}).get("at") or self.last_at
        return rec, q

    @staticmethod
    def swap_text(rec: dict | None) -> str:
        if rec is None:
            return "no swap record"
        return (f"{LETTER.get(rec.get('from_model') or '', '-')} -> {LETTER.get(rec.get('to_model'), '?')}, "
                f"{'cold' if rec.get('cold') else 'resumed'}, ok {rec.get('ok')}, {gi.fmt(rec.get('seconds'))} s"
                + (", abandoned" if rec.get("abandoned") else "") + (f", error: {rec['error']}" if rec.get("error") else ""))  # fmt: skip

    def phase(self, name: str, body: Callable[[Phase], None]) -> None:
        gi.say(f"phase {len(self.phases) + 1}: {name}")
        ph = Phase(name)
        self.phases.append(ph)
        try:
            body(ph)
        except RuntimeError as exc:
            ph.error = str(exc).splitlines()[0]
            gi.say(f"  {name}: error: {exc}")

    # ------------------------------------------------------------------ phases

    def parked_kill(self, ph: Phase) -> None:
        st = self.state()
        victim = next(v for v in ("B", "C", "A") if model(st, v).get("residency") == "parked")
        doc = model(st, victim)
        pid = doc["engine"]["pid"]
        since = time.time()
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        killed = time.monotonic()
        gi.say(f"  killed the process group of {MODELS[victim]}'s parked engine (pid {pid})")
        after = self.run.wait(lambda s: lost(model(s, victim), pid), NOTICE_WAIT_S, f"the daemon to notice {MODELS[victim]}'s dead engine",
                              self.budget)  # fmt: skip
        noticed = time.monotonic() - killed
        ph.check(
            "the dead parked engine noticed",
            "parked with nothing behind it, or cold",
            f"{after.get('residency')}, {'nothing behind it' if (after.get('suspend') or {}).get('cold') else after['engine'].get('phase')}, after {noticed:.1f} s",
            True,
        )
        rec, q = self.swap_to(victim, f"{victim} after its kill")
        ph.check(f"the swap to {victim}", "a cold start, ok", self.swap_text(rec), rec is not None and rec.get("ok") and rec.get("cold"))  # fmt: skip
        ph.check(f"the request to {victim}", "served", "served" if q.ok else q.why_not(), q.ok)
        seen = self.watcher.phases_since(MODELS[victim], since)
        given_up = "given-up" in seen or model(self.state(), victim).get("give_up_reason")
        ph.check("no give-up", "never given-up", "phases " + " > ".join(dict.fromkeys(seen)), not given_up)  # fmt: skip

    def router_kill(self, ph: Phase) -> None:
        st = self.state()
        here = resident(st)
        target = next(v for v in ("A", "B", "C") if v != here and model(st, v).get("residency") == "parked")
        self.b.wait_quiet()
        if here is not None:
            self.b.wait_resident(here, self.last_at)
        st = self.state()
        old, restarts = router(st).get("pid"), self.engine_restarts(st)
        n = self.watcher.count()
        cut = self.b.ask(target, TOKENS, f"{target}, cut by the router's kill")

        def under_way(s: dict) -> str | None:
            """The swap's stage once the target is on its way in (restoring, starting, checking): a router killed
            earlier takes the only request for it along, and the daemon rightly abandons a swap nobody asks for."""
            progress = (s.get("swap") or {}).get("in_progress") or {}
            stage = progress.get("stage") or ""
            return (
                stage
                if progress.get("to_model") == MODELS[target] and stage.endswith(MODELS[target])
                else None
            )

        try:
            stage = wait_until(lambda: (s := self.run.state()) and under_way(s), self.budget.cap(60), what="the swap", interval=0.01)  # fmt: skip
        except WaitTimeout:
            raise RuntimeError(
                f"no swap to {MODELS[target]} under way within 60 s: {self.swap_text(self.record_to(n, target, 'it', 1))}"
            ) from None
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        gi.say(f"  killed the router (pid {old}) during the swap to {MODELS[target]} ({stage})")
        while (gi.proc_stat(old) or ("Z",))[0] != "Z" and time.monotonic() - killed < 10:
            time.sleep(0.005)  # the kill has landed: the old listener is closed
        while not listening(self.run.port) and time.monotonic() - killed < 30:
            time.sleep(0.01)
        back = time.monotonic() - killed
        ph.check("a new router listening", f"within {self.args.router_back:g} s", f"after {back:.2f} s", back <= self.args.router_back)  # fmt: skip
        nxt = self.b.ask(target, TOKENS, f"{target} after the router's kill")
        rec = self.record_to(n, target, f"the swap to {MODELS[target]} the router's kill came in")
        ph.check(f"the swap to {target} under way at the kill", "completes, ok", self.swap_text(rec),
                 rec is not None and rec.get("ok") and not rec.get("abandoned"))  # fmt: skip
        self.b.wait_request(nxt, "the request after the router's kill")
        ph.check("the next request", "served", "served" if nxt.ok else nxt.why_not(), nxt.ok)
        cut.wait(self.budget.cap(30))
        self.b.requests.remove(cut)  # its connection was the router's: cut by design, not lost
        try:
            st = self.run.wait(lambda s: router(s).get("linked") and router(s).get("pid") != old and s, 30, "the new router linked", self.budget)  # fmt: skip
        except RuntimeError:
            st = self.state()
        ph.check("the router", "a new pid, restarts + 1, linked", f"pid {old} -> {router(st).get('pid')}, restarts {router(st).get('restarts')}, linked {router(st).get('linked')}",
                 router(st).get("pid") not in (None, old) and router(st).get("linked"))  # fmt: skip
        ph.check("engine restarts", "none", str(self.engine_restarts(st) - restarts), self.engine_restarts(st) == restarts)  # fmt: skip
        ph.check("the request the kill cut", "ended (reported only)", "served" if cut.ok else cut.why_not()[:80], True)  # fmt: skip
        self.last_at = (rec or {}).get("at") or self.last_at

    def give_up(self, ph: Phase) -> None:
        x = GIVE_UP_MODEL
        others = [v for v in MODELS if v != x]
        since = time.time()
        m = model(self.state(), x)
        if m.get("residency") == "parked" and not (m.get("suspend") or {}).get("cold"):
            # A parked engine resumes, it does not start: its process goes first, as a crash while parked would.
            pid = m["engine"]["pid"]
            os.killpg(os.getpgid(pid), signal.SIGKILL)
            self.run.wait(lambda s: lost(model(s, x), pid), NOTICE_WAIT_S, f"the daemon to notice {MODELS[x]}'s dead engine", self.budget)  # fmt: skip
        self.start_file(x).unlink()
        gi.say(f"  {MODELS[x]}'s starts fail from now on")
        here = resident(self.state())
        self.b.wait_quiet()
        if here is not None and here != x:
            self.b.wait_resident(here, self.last_at)
        doomed = self.b.ask(x, TOKENS, f"{x} while its starts fail")
        self.b.requests.remove(doomed)  # answered with an error by design
        gave_up = self.run.wait(lambda s: model(s, x)["engine"].get("phase") == "given-up" and model(s, x), GIVE_UP_WAIT_S[self.args.cpu_standin],
                                f"{MODELS[x]} given up", self.budget)  # fmt: skip
        gave_up_at = time.monotonic()
        ph.check(f"{x} gives up", f"after {START_FAILURES} failed starts", f"{gave_up['restarts'].get('start_failures')} start failures: "
                 f"{(gave_up.get('give_up_reason') or '')[:110]}", True)  # fmt: skip
        doomed.wait(self.budget.cap(60))
        ph.check(f"the request to {x}", "answered with an error, not left waiting",
                 f"HTTP {doomed.status}, {doomed.ended_at - gave_up_at:+.1f} s from the give-up seen" if doomed.finished else "still waiting",
                 doomed.finished and doomed.status not in (None, 200))  # fmt: skip
        first = others[0] if resident(self.state()) != others[0] else others[1]
        second = others[1] if first == others[0] else others[0]
        swaps = []
        for letter in (first, second, first):
            rec, q = self.swap_to(letter, f"{letter} while {x} is given up")
            swaps.append((letter, rec, q))
        served = [
            f"{letter}: {self.swap_text(rec)}, {'served' if q.ok else q.why_not()}"
            for letter, rec, q in swaps
        ]
        ph.check(f"{' and '.join(others)} keep swapping", "each swap ok, each request served", "; ".join(served),
                 all((rec is None or rec.get("ok")) and q.ok for _, rec, q in swaps) and len(swaps) >= 2)  # fmt: skip
        self.start_file(x).write_text("")
        gi.say(f"  {MODELS[x]}'s starts succeed again; waiting for the give-up's retry")
        cold = self.run.wait(lambda s: model(s, x)["engine"].get("phase") == "cold" and model(s, x),
                             self.args.give_up_retry + 120, f"{MODELS[x]} cold after its retry", self.budget)  # fmt: skip
        gave_up_wall = self.watcher.first(MODELS[x], "given-up", since)
        retried = self.watcher.first(MODELS[x], "cold", gave_up_wall or since)
        ph.check("the give-up's retry", "leaves it cold (no start of its own)",
                 f"{cold['engine'].get('phase')}, engine pid {cold['engine'].get('pid')}, "
                 f"{gi.fmt(retried - gave_up_wall if retried and gave_up_wall else None)} s after the give-up (give_up_retry {self.args.give_up_retry:g} s)",
                 cold["engine"].get("pid") is None)  # fmt: skip
        asked = time.time()
        rec, q = self.swap_to(x, f"{x} after its retry")
        ph.check(f"{x}'s start", "a swap of the arbiter's: from the resident model, cold, ok", self.swap_text(rec),
                 rec is not None and rec.get("ok") and rec.get("cold") and rec.get("from_model") is not None)  # fmt: skip
        ph.check(f"the request to {x}", "served", "served" if q.ok else q.why_not(), q.ok)
        phases = self.watcher.phases_since(MODELS[x], since)
        retry_phases = self.watcher.phases_since(MODELS[x], gave_up_wall or since)
        # The deadlock the arbiter prevents: a retry starting by itself finds the card held and waits there for ever.
        # (Before the give-up a restart may wait a moment for the driver to drop the dead engine's memory: not a retry.)
        # A start may still wait a moment for memory the driver has not yet released (the engine that just left):
        # that wait no longer holds the arbiter (rule 1), so it is reported, and the bound is what is checked.
        took = time.time() - asked
        waited = " (waited for GPU memory on the way)" if "waiting-for-gpu" in retry_phases else ""
        ph.check("the card", f"not deadlocked: {x} ready within {RETRY_READY_S:.0f} s of being asked for",
                 f"{x} ready {took:.1f} s after it was asked for{waited}; its phases: {' > '.join(dict.fromkeys(phases))}",
                 q.ok and took <= RETRY_READY_S)  # fmt: skip

    def under_load(self, ph: Phase) -> None:
        a, b, c = "A", "B", "C"
        st = self.state()
        restarts, swaps_before = self.engine_restarts(st), (st.get("swap") or {}).get("total") or 0
        self.b.wait_quiet()
        t0 = time.monotonic()
        deadline = t0 + self.args.load_seconds
        sent: list[gs.Request] = []
        lock = threading.Lock()

        def send(letter: str, label: str) -> gs.Request:
            q = gs.Request(self.run.url, MODELS[letter], TOKENS, label).start()
            with lock:
                sent.append(q)
            return q

        def client(i: int) -> None:
            k = 0
            while time.monotonic() < deadline:
                send((a, b)[(i + k) % 2], f"load client {i} #{k}").wait(REQUEST_WAIT_S)
                k += 1

        def third() -> None:
            k = 0
            while t0 + k * self.args.third_every < deadline:
                left = t0 + k * self.args.third_every - time.monotonic()
                if left > 0:
                    time.sleep(left)
                send(c, f"load {c} #{k}")
                k += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)] + [
            threading.Thread(target=third, daemon=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.budget.cap(self.args.load_seconds + REQUEST_WAIT_S))
        for q in sent:
            q.wait(self.budget.cap(REQUEST_WAIT_S))
        self.b.requests.extend(sent)
        lost = [q for q in sent if not q.ok]
        ph.check("requests", "none lost", f"{len(sent)} sent, {len(sent) - len(lost)} served, {len(lost)} lost"
                 + (f" ({lost[0].label}: {lost[0].why_not()[:80]})" if lost else ""), sent and not lost)  # fmt: skip
        for letter in (a, b, c):
            mine = [q for q in sent if q.model == MODELS[letter]]
            served = [q for q in mine if q.ok]
            starved = longest_unserved(mine)
            waits = sorted(q.ended_at - q.sent_at for q in served)
            self.load.append([letter, str(len(mine)), str(len(served)), gi.fmt(waits[len(waits) // 2] if waits else None),
                              gi.fmt(waits[-1] if waits else None), gi.fmt(starved)])  # fmt: skip
            ph.check(f"{letter} served while asked", f"no {self.args.window:g} s without one served",
                     f"{len(served)} served; longest while asked without one: {starved:.1f} s", served and starved < self.args.window)  # fmt: skip
        st = self.state()
        ph.check("engine restarts", "none", str(self.engine_restarts(st) - restarts), self.engine_restarts(st) == restarts)  # fmt: skip
        ph.check("swaps", "(reported only)", f"{((st.get('swap') or {}).get('total') or 0) - swaps_before} during the load", True)  # fmt: skip

    @staticmethod
    def engine_restarts(st: dict) -> int:
        return gs.restarts_total(st)


def longest_unserved(requests: list[gs.Request]) -> float:
    """The longest stretch in which the model was asked for (some request of it open) and none of its requests was
    served: over the union of the requests' open intervals, the longest gap between served ends (or the stretch's
    start and end)."""
    spans = sorted(
        (q.sent_at, q.ended_at if q.finished else time.monotonic()) for q in requests if q.sent_at is not None
    )
    served = sorted(q.ended_at for q in requests if q.ok)
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    longest = 0.0
    for s, e in merged:
        marks = [s, *(t for t in served if s <= t <= e), e]
        longest = max(longest, *(b - a for a, b in zip(marks, marks[1:], strict=False)))
    return longest


def bench(args, base: Path, cleanup: list[Callable[[], None]]) -> int:
    overrides = {
        "watchdog": {
            "start_failures": START_FAILURES,
            "give_up_retry": args.give_up_retry,
            "backoff_initial": 1.0,
            "backoff_max": 5.0,
        }
    }
    model_args = {letter: ["--fake-fail-start-unless", str(base / f"start-ok-{letter}")] for letter in MODELS}
    for letter in MODELS:
        (base / f"start-ok-{letter}").write_text("")
    rig = gs.prepare(args, base, cleanup, f"faults: parked kill, router kill, a give-up, {args.load_seconds:g} s of load",
                     overrides=overrides, model_args=model_args, watcher=FaultWatcher)  # fmt: skip
    f = Faults(args, rig)
    failure = ""
    try:
        rig.start()
        f.last_at = f.b.warm_up()
        warm_ok = all(r.ok for r in f.b.rows)
        if not warm_ok:
            raise RuntimeError("the warm-up failed: " + "; ".join(r.notes for r in f.b.rows if not r.ok))
        f.phase("parked engine killed", f.parked_kill)
        f.phase("router killed during a swap", f.router_kill)
        f.phase(f"{MODELS[GIVE_UP_MODEL]} gives up, then its retry", f.give_up)
        f.phase("load", f.under_load)
    except gi.OutOfTime as exc:
        gi.say(str(exc))
        failure = str(exc)
    except RuntimeError as exc:
        gi.say(f"error: {exc}")
        failure = str(exc).splitlines()[0]
    return report(f, rig, failure)


def report(f: Faults, rig: gs.Rig, failure: str) -> int:
    print(gi.table(["warm-up", "swap", "ok", "TTFT", "total", "start", "canary"],
                   [[r.label, f"{r.from_model} -> {r.to_model}", "yes" if r.ok else "NO", gi.fmt(r.ttft_s), gi.fmt(r.seconds),
                     gi.fmt(r.start_s), gi.fmt(r.canary_s)] for r in f.b.rows]))  # fmt: skip
    for i, ph in enumerate(f.phases, start=1):
        print(
            f"\nphase {i}: {ph.name}: {'ok' if ph.ok else 'FAILED'}" + (f" ({ph.error})" if ph.error else "")
        )
        print(gi.table(["check", "expected", "observed", "ok"], [[c.what, c.expected, c.observed, "yes" if c.ok else "NO"] for c in ph.checks]))  # fmt: skip
        if ph.name == "load" and f.load:
            print()
            print(gi.table(["model", "sent", "served", "median wait", "max wait", "longest unserved while asked"], f.load))  # fmt: skip
    st = f.watcher.latest() or (f.run.state() or {})
    swap = st.get("swap") or {}
    measures = {**rig.measures, "swaps (daemon)": f"total {swap.get('total')}, failed {swap.get('failed')}, abandoned {swap.get('abandoned')}",
                "router restarts": str(router(st).get("restarts")),
                "engine restarts": ", ".join(f"{LETTER.get(m['name'], m['name'])} {(m.get('restarts') or {}).get('total')}" for m in st.get("models") or []),
                "phase lengths": f"load {f.args.load_seconds:g} s, C every {f.args.third_every:g} s, window {f.args.window:g} s, give_up_retry {f.args.give_up_retry:g} s"}  # fmt: skip
    print()
    print(gi.table(["measure", "value"], [[k, v] for k, v in measures.items()]))
    expected = 4
    problems = ([failure] if failure else []) + [
        f"phase {ph.name}: {'; '.join(ph.failures())}" for ph in f.phases if not ph.ok
    ]
    if len(f.phases) < expected and not failure:
        problems.append(f"{len(f.phases)} of {expected} phases run")
    good = not problems and len(f.phases) == expected
    print()
    print(f"verdict: passed: a killed parked engine served again cold, a new router within {f.args.router_back:g} s, a give-up retried through the arbiter, "
          "no request lost under load" if good else f"verdict: FAILED: {' | '.join(problems)[:600]}")  # fmt: skip
    return 0 if good else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weight-gib", type=float, default=15.0, help="GiB of bf16 weights each engine's worker holds (default 15)")  # fmt: skip
    parser.add_argument(
        "--token-delay", type=float, default=0.01, help="the double's seconds per token (default 0.01)"
    )
    parser.add_argument(
        "--load-seconds", type=float, help="the load phase's length (default 120; dry run 20)"
    )
    parser.add_argument("--third-every", type=float, help="the load phase's one request to C every this many s (default 30; dry run 6)")  # fmt: skip
    parser.add_argument("--window", type=float, help="no model asked for this long without one served (default 60; dry run 20)")  # fmt: skip
    parser.add_argument("--give-up-retry", type=float, help="watchdog.give_up_retry (default 30; dry run 4)")
    parser.add_argument("--router-back", type=float, help="a killed router: a new one listens within this (default 2; dry run 10)")  # fmt: skip
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU (default 0)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (default 570; dry run 300)")
    parser.add_argument("--cpu-standin", action="store_true", help="dry run without a GPU: CPU workers, fake NVML and checkpoint driver")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (config, logs)")
    args = parser.parse_args()
    for name, (gpu, dry) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, dry if args.cpu_standin else gpu)
    numbers = (
        "weight_gib",
        "token_delay",
        "load_seconds",
        "third_every",
        "window",
        "give_up_retry",
        "router_back",
    )
    if min(getattr(args, name) for name in numbers) <= 0:
        parser.error(f"{', '.join('--' + n.replace('_', '-') for n in numbers)}: each must be positive")
    return gi.run_cleanly("gpu_swap_faults", "r3090d-gpu-swap-faults-", bench, args)


if __name__ == "__main__":
    sys.exit(main())
