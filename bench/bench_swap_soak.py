"""Swap-mode soak under a real systemd: every fault recovered by itself, no give-up, no stuck swap.

A real systemd 252 is booted as PID 1 in a PID and mount namespace (tests/e2e/systemd_ns.py,
private /tmp and /var/tmp), the checkout is installed into it (`make install`: the shipped
unit, ExecStart=/opt/r3090d/bin/r3090d, its hardening as shipped), and r3090d.service runs
etc/demo-swap.toml's two models on the real CPU vLLM (seeded-weight tiny model). The unit's
drop-in only names the config and sends the output to a file. The config is the demo's but
for free ports, the model's path (a copy the service user can read), the default state and
runtime directories, and syslog alerts off.

A client thread asks both models through the router in turn (a small completion, then
--think seconds). Every --interval seconds (default 60) from the unit's READY a fault,
cycling through:

  SIGKILL of the resident engine's process group       (a model ready, no swap under way)
  SIGKILL of the starting engine's process group       (a cold start at least 5 s into its load:
                                                        on CPU a swap is a drained stop and a cold
                                                        start; there is no parked engine)
  SIGKILL of the router                                (the public port's process)
  SIGSTOP of the resident engine's API server          (a hang)

Per fault: what, when (s after READY), the model hit, the daemon's first line about it (its
reason) and when, and the recovery: from the fault until that model (for the router, the
model resident then) answered 200 through the router to a request sent after the fault (the
bench asks at once, then each second; the client goes on meanwhile, so a recovery may include
a swap it asked for). A fault waits for the one before it to recover: a due time already
past is taken at once. At the end: give-ups (the daemon's "gave up:" lines; must be 0), stuck
swaps (seen in progress by `r3090ctl status --json`, every STATUS_EVERY_S, for longer than
swap.queue_timeout + engine.startup_timeout + 60 s: one more cold start and its backoff on top
of the longest swap the queue waits for; must be 0), the client's requests sent/ok/failed, the
engine restarts no fault caused, faults recovered/total (must be all).

Exit 0 when all hold; 1 otherwise; 69, in one line, when root, systemd, the CPU vLLM
(/opt/r3090d-engine/bin/python, --engine-python; `make engine-cpu`) or the model
(build/tiny-qwen2-weights, --model; `make tiny-model-weights`) is missing. Opt-in:
R3090D_BENCH_LONG=1 for 20 minutes (--duration 1200), or --duration given. A short run:
--duration 240 --interval 60 (four faults, one of each kind). Holds the e2e tests' locks:
one namespaced systemd, one real vLLM at a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import benchlib  # noqa: E402
from bench.bench_swap_cpu import free_port, free_port_pair, toml_text  # noqa: E402
from bench.benchlib import fmt, say, table  # noqa: E402
from tests.e2e import conftest as e2e  # noqa: E402
from tests.e2e.real_vllm import DEFAULT_ENGINE_PYTHON  # noqa: E402
from tests.e2e.systemd_ns import NamespacedSystemd, unavailable_reason  # noqa: E402
from tests.waiting import WaitTimeout  # noqa: E402

EX_UNAVAILABLE = 69
DEMO_CONFIG = ROOT / "etc" / "demo-swap.toml"
UNIT_NAME = "r3090d.service"
SOAK_DIR = e2e.TEST_ROOT / "swap-soak"  # the config and the model copy: the service user reads them
STATE_DIR = Path("/var/lib/r3090d")  # the unit's StateDirectory=, the config's default state_dir
R3090CTL = "/opt/r3090d/bin/r3090ctl"
READY_TIMEOUT = 600.0  # the unit's READY: the router up and the first cold start, on 2 loaded cores
TARGET_WAIT = 420.0  # for what a fault hits to be there (a resident engine, a start under way)
START_AGE_S = 5.0  # a starting engine is hit this long into its load at least
RECOVERY_TIMEOUT = 900.0  # the model served again; past it, the fault counts as not recovered
STATUS_EVERY_S = 10.0
PROMPT = "engine health the block process model memory token"
MAX_TOKENS = 8


# ------------------------------------------------------------------ requests through the router


@dataclass(frozen=True)
class Answer:
    model: str
    sent: float  # wall clock
    done: float
    ok: bool
    error: str = ""


def ask(client: httpx.Client, url: str, model: str) -> Answer:
    sent = time.time()
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    try:
        r = client.post(url + "/v1/completions", json=body)
        ok, error = (
            r.status_code == 200,
            "" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:120]!r}",
        )
    except httpx.HTTPError as exc:
        ok, error = False, type(exc).__name__
    return Answer(model, sent, time.time(), ok, error)


def http_client(queue_timeout: float) -> httpx.Client:
    # A request waits in the router's queue for its model's swap up to swap.queue_timeout, then 503.
    return httpx.Client(timeout=httpx.Timeout(10.0, read=queue_timeout + 60.0), trust_env=False)


class Client:
    """One thread asking the models in turn through the router, --think seconds between requests."""

    def __init__(self, url: str, models: list[str], think: float, queue_timeout: float):
        self.url, self.models, self.think, self.queue_timeout = url, models, think, queue_timeout
        self.answers: list[Answer] = []
        self.ended_at: float | None = (
            None  # a request that ends after it was cut by the run's end: not counted
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="client", daemon=True)

    def start(self) -> Client:
        self._thread.start()
        return self

    def _run(self) -> None:
        with http_client(self.queue_timeout) as client:
            n = 0
            while not self._stop.is_set():
                answer = ask(client, self.url, self.models[n % len(self.models)])
                self.answers.append(answer)
                n += 1
                self._stop.wait(self.think if answer.ok else 1.0)

    def stop(self) -> None:
        """Before the unit stops: a request still waiting then ends with the unit, and is left out of the count."""
        self.ended_at = time.time()
        self._stop.set()
        self._thread.join(5)

    def counted(self) -> list[Answer]:
        return [a for a in list(self.answers) if self.ended_at is None or a.done <= self.ended_at]

    def cut(self) -> int:
        """Requests sent before the end and not answered by then (one at most: the client asks one at a time)."""
        return int(self._thread.is_alive() or len(self.answers) > len(self.counted()))


# ------------------------------------------------------------------ the service


class Service:
    """The unit under the namespaced systemd: its state file, its status, its log, and host pids of its processes."""

    def __init__(self, ns: NamespacedSystemd, unit: e2e.Unit, config: Path):
        self.ns, self.unit, self.config = ns, unit, config

    def state(self) -> dict:
        try:
            return json.loads((STATE_DIR / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def status(self) -> dict | None:
        """`r3090ctl status --json`, as an operator in the namespace runs it."""
        out = self.ns.nsenter(
            [R3090CTL, "status", "--json", "--config", str(self.config)], check=False, timeout=60
        )
        try:
            return json.loads(out.stdout)
        except ValueError:
            return None

    def events(self) -> list[benchlib.LogEvent]:
        return benchlib.log_events(self.unit.output())

    def host_pid(self, ns_pid: int | None) -> int | None:
        return self.ns.host_pid(ns_pid) if ns_pid else None


def models_of(st: dict) -> dict[str, dict]:
    return {m.get("name"): m for m in st.get("models") or ()}


def swap_of(st: dict) -> dict:
    return st.get("swap") or {}


# ------------------------------------------------------------------ faults


@dataclass(frozen=True)
class Target:
    model: str
    ns_pid: int  # in the namespace, as the state document says it
    pid: int  # on the host


@dataclass(frozen=True)
class Fault:
    name: str
    find: Callable[[Service, dict], Target | None]  # what it hits, once the state shows it
    inject: Callable[[Target], None]
    log_prefix: Callable[[Target], str]  # the daemon's line that tells it saw the fault


def _resident(svc: Service, st: dict) -> Target | None:
    if swap_of(st).get("in_progress") or not (swap_of(st).get("router") or {}).get("linked"):
        return None
    for name, m in models_of(st).items():
        engine = m.get("engine") or {}
        if (
            m.get("residency") == "ready"
            and engine.get("phase") == "ready"
            and (pid := svc.host_pid(engine.get("pid")))
        ):
            return Target(name, engine["pid"], pid)
    return None


class _StartWatch:
    """A starting engine, once it has been seen starting (the same pid) for START_AGE_S."""

    def __init__(self) -> None:
        self.first_seen: dict[int, float] = {}

    def __call__(self, svc: Service, st: dict) -> Target | None:
        for name, m in models_of(st).items():
            engine = m.get("engine") or {}
            if m.get("residency") == "starting" and engine.get("phase") == "starting" and engine.get("pid"):
                seen = self.first_seen.setdefault(engine["pid"], time.time())
                if time.time() - seen >= START_AGE_S and (pid := svc.host_pid(engine["pid"])):
                    return Target(name, engine["pid"], pid)
        return None


def _router(svc: Service, st: dict) -> Target | None:
    router = swap_of(st).get("router") or {}
    resident = _resident(svc, st)
    if resident is None or not router.get("up") or not (pid := svc.host_pid(router.get("pid"))):
        return None
    return Target(resident.model, router["pid"], pid)  # recovered when the resident model is served again


def _kill_group(t: Target) -> None:
    os.killpg(os.getpgid(t.pid), signal.SIGKILL)


def _stop_api_server(t: Target) -> None:
    (api,) = psutil.Process(t.pid).children()  # the launcher's one child: vLLM's API server
    os.kill(api.pid, signal.SIGSTOP)


FAULTS = [
    Fault("SIGKILL of the resident engine's group", _resident, _kill_group, lambda t: f"[{t.model}] "),
    Fault("SIGKILL of the starting engine's group", _StartWatch(), _kill_group, lambda t: f"[{t.model}] "),
    Fault(
        "SIGKILL of the router",
        _router,
        lambda t: os.kill(t.pid, signal.SIGKILL),
        lambda t: f"router (pid {t.ns_pid})",
    ),
    Fault(
        "SIGSTOP of the resident engine's API server", _resident, _stop_api_server, lambda t: f"[{t.model}] "
    ),
]


@dataclass
class Outcome:
    fault: str
    model: str
    at: float  # wall clock
    after_ready: float  # s after the unit's READY
    reason: str = "-"
    detected: float | None = None
    line_at: float | None = None  # the daemon's line's wall clock
    recovered: float | None = None  # s from the fault until the model answered through the router
    probes: int = 0  # the bench's requests until then


def daemon_line(svc: Service, fault: Fault, target: Target, since: float) -> benchlib.LogEvent | None:
    """The daemon's first warning or error about what the fault hit, at or after `since`."""
    prefix = fault.log_prefix(target)
    for e in svc.events():
        if (
            e.at >= since - 0.001
            and e.message.startswith(prefix)
            and e.level in ("WARNING", "ERROR", "CRITICAL")
        ):
            return e
    return None


def recover(
    svc: Service, client: Client, url: str, model: str, since: float, queue_timeout: float, outcome: Outcome
) -> None:
    """Asks `model` through the router until it answers; the earliest answer to a request sent after `since`."""
    deadline = since + RECOVERY_TIMEOUT
    with http_client(queue_timeout) as http:
        while time.time() < deadline:
            answer = ask(http, url, model)
            outcome.probes += 1
            theirs = [a.done for a in list(client.answers) if a.ok and a.model == model and a.sent >= since]
            if answer.ok or theirs:
                outcome.recovered = min(([answer.done] if answer.ok else []) + theirs) - since
                return
            time.sleep(1.0)


def wait_target(svc: Service, fault: Fault) -> Target | None:
    deadline = time.time() + TARGET_WAIT
    while time.time() < deadline:
        target = fault.find(svc, svc.state())
        if target is not None:
            return target
        time.sleep(0.2)
    return None


class SwapWatch:
    """`r3090ctl status --json` every STATUS_EVERY_S: the longest each swap was seen in progress."""

    def __init__(self, svc: Service):
        self.svc = svc
        self.ages: dict[float, tuple[str, float]] = {}  # swap's start -> (from -> to, longest age seen)
        self.unanswered = 0
        self.last: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swap-watch", daemon=True)

    def start(self) -> SwapWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(STATUS_EVERY_S):
            self.look()

    def look(self) -> None:
        doc = self.svc.status()
        if doc is None or not doc.get("state"):
            self.unanswered += 1
            return
        self.last = doc
        progress = swap_of(doc["state"]).get("in_progress")
        if progress and progress.get("since"):
            what = f"{progress.get('from_model') or '(none)'} -> {progress.get('to_model')}"
            self.ages[progress["since"]] = (
                what,
                max(self.ages.get(progress["since"], ("", 0.0))[1], time.time() - progress["since"]),
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(STATUS_EVERY_S + 60)
        self.look()


# ------------------------------------------------------------------ the run


def write_config(python: str, model: Path) -> tuple[Path, dict]:
    """etc/demo-swap.toml with this run's engine, model copy, free ports, the unit's directories, no syslog."""
    doc = tomllib.loads(DEMO_CONFIG.read_text())
    doc["engine"]["python"] = python
    doc["engine"]["port"] = free_port()
    for m in doc["models"]:
        m["model"] = str(model)
    doc["swap"]["engine_port_base"] = free_port_pair()
    # state_dir and runtime_dir: the defaults, the unit's directories.
    doc["daemon"] = {"exporter_port": free_port()}
    doc["alerts"] = {"syslog": {"enabled": False}}
    return e2e.write_public(SOAK_DIR / "r3090d.toml", toml_text(doc)), doc


def soak(svc: Service, client: Client, url: str, ready_at: float, duration: float, interval: float, queue_timeout: float,
         outcomes: list[Outcome]) -> None:  # fmt: skip
    count = int(duration // interval)
    for n in range(count):
        fault = FAULTS[n % len(FAULTS)]
        due = ready_at + (n + 1) * interval
        while time.time() < due:
            time.sleep(0.2)
        target = wait_target(svc, fault)
        t_fault = time.time()
        try:
            if target is None:
                raise ValueError(f"nothing to hit within {TARGET_WAIT:.0f} s")
            fault.inject(target)
        # Not injected (nothing to hit, or it ended just before): it counts as not recovered.
        except (OSError, psutil.Error, ValueError) as exc:
            say(f"fault {n + 1}: {fault.name}: not injected: {exc}")
            model = target.model if target else "-"
            outcomes.append(
                Outcome(fault.name, model, t_fault, t_fault - ready_at, reason=f"not injected: {exc}")
            )
            continue
        outcome = Outcome(fault.name, target.model, t_fault, t_fault - ready_at)
        outcomes.append(outcome)
        say(
            f"fault {n + 1}: {fault.name} ({target.model}, pid {target.ns_pid} in the namespace), {outcome.after_ready:.0f} s after READY"
        )
        recover(svc, client, url, target.model, t_fault, queue_timeout, outcome)
        line = daemon_line(svc, fault, target, t_fault)
        if line is not None:
            outcome.reason, outcome.detected, outcome.line_at = line.message, line.at - t_fault, line.at
        say(
            f"fault {n + 1}: {outcome.reason!r} after {fmt(outcome.detected, '.1f')} s; {target.model} served again after {fmt(outcome.recovered, '.1f')} s"
        )


def clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%H:%M:%S")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--duration", type=float, default=None, help="seconds of faults from the unit's READY (default 1200)"
    )
    p.add_argument("--interval", type=float, default=60.0, help="seconds between faults (default 60)")
    p.add_argument(
        "--think", type=float, default=15.0, help="the client's pause between requests (default 15)"
    )
    p.add_argument(
        "--engine-python",
        default=DEFAULT_ENGINE_PYTHON,
        help="the CPU vLLM's python; the service user runs it",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=Path(os.environ.get("R3090D_TINY_MODEL_WEIGHTS") or ROOT / "build" / "tiny-qwen2-weights"),
    )
    args = p.parse_args(argv)
    missing = unavailable_reason()
    if missing is None and not os.access(args.engine_python, os.X_OK):
        missing = f"no CPU vLLM at {args.engine_python} (make engine-cpu)"
    if missing is None and not (args.model / "config.json").exists():
        missing = f"no model at {args.model} (make tiny-model-weights)"
    if missing:
        print(f"bench_swap_soak: {missing}")
        return EX_UNAVAILABLE
    if args.duration is None and not benchlib.long_enabled():
        print(
            f"bench_swap_soak skipped: 20 minutes of faults in swap mode under systemd; set {benchlib.LONG_ENV}=1 (or give --duration) to run it"
        )
        return 0
    duration = 1200.0 if args.duration is None else args.duration
    signal.signal(
        signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum)
    )  # the finally blocks still run
    outcomes: list[Outcome] = []
    systemd_lock = e2e._lock(e2e.SYSTEMD_LOCK, "another namespaced systemd is running")
    with benchlib.VllmLock():
        e2e.LOG_DIR.mkdir(parents=True, exist_ok=True)
        model = SOAK_DIR / "tiny-qwen2-weights"
        shutil.rmtree(SOAK_DIR, ignore_errors=True)
        shutil.copytree(args.model, model)
        subprocess.run(["chmod", "-R", "a+rX", str(e2e.TEST_ROOT)], check=True)
        config, doc = write_config(args.engine_python, model)
        queue_timeout = float(doc["swap"]["queue_timeout"])
        stuck_bound = queue_timeout + float(doc["engine"]["startup_timeout"]) + 60.0
        names = [m["name"] for m in doc["models"]]
        url = f"http://127.0.0.1:{doc['engine']['port']}"
        # The soak's models start with no history: a restart record or give-up left by an earlier run would count.
        for leftover in [STATE_DIR / "state.json", *(STATE_DIR / "models" / n for n in names)]:
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(
                missing_ok=True
            )
        ns = NamespacedSystemd(e2e.LOG_DIR / "swap-soak-console.log")
        unit = svc = client = watch = None
        try:
            say(f"booting systemd; then make install of {ROOT}")
            ns.boot()
            code, text = e2e.make_install(ns, e2e.copy_source())
            if code != 0:
                print(f"bench_swap_soak: make install failed:\n{text[-3000:]}")
                return 1
            unit = e2e.Unit(ns, UNIT_NAME, "r3090d-swap-soak.log")
            unit.reset()
            unit.configure(config)
            svc = Service(ns, unit, config)
            t_start = time.time()
            ns.ctl("start", "--no-block", UNIT_NAME)
            unit.wait_for(lambda: unit.state() == "active", READY_TIMEOUT, "active (READY)", interval=1.0)
            ready_at = time.time()
            say(
                f"{UNIT_NAME} active {ready_at - t_start:.0f} s after its start; the router on {url}; soaking {duration:g} s, a fault every {args.interval:g} s"
            )
            client = Client(url, names, args.think, queue_timeout).start()
            watch = SwapWatch(svc).start()
            soak(svc, client, url, ready_at, duration, args.interval, queue_timeout, outcomes)
        except WaitTimeout as exc:  # the unit never came up
            say(f"soak stopped: {str(exc).splitlines()[0]}")
        finally:
            if client is not None:
                client.stop()
            if watch is not None:
                watch.stop()
            events = svc.events() if svc is not None else []
            nrestarts = unit.show("NRestarts")["NRestarts"] if unit is not None else "-"
            left = {}
            if unit is not None:
                unit.remove()
                left = ns.namespace_pids_matching("vllm")
            ns.poweroff()
            systemd_lock.close()
    return report(args, duration, stuck_bound, outcomes, client, watch, events, nrestarts, left)


def report(args, duration: float, stuck_bound: float, outcomes: list[Outcome], client: Client | None, watch: SwapWatch | None,
           events: list[benchlib.LogEvent], nrestarts: str, left: dict) -> int:  # fmt: skip
    give_ups = [e for e in events if "gave up:" in e.message]
    answers = client.counted() if client is not None else []
    ages = watch.ages if watch is not None else {}
    stuck = {since: v for since, v in ages.items() if v[1] > stuck_bound}
    final = ((watch.last or {}).get("state") or {}) if watch is not None else {}
    swap = swap_of(final)
    recovered = [o for o in outcomes if o.recovered is not None]
    print(f"swap-mode soak under systemd ({UNIT_NAME} as shipped, `make install`), etc/demo-swap.toml's models "
          f"({', '.join(models_of(final)) or '-'}) on the real CPU vLLM ({args.engine_python}), {os.cpu_count()} cores")  # fmt: skip
    print(
        f"a fault every {args.interval:g} s for {duration:g} s from READY; the client asks the models in turn, {args.think:g} s apart"
    )
    print()
    rows = [(str(i + 1), clock(o.at), f"{o.after_ready:.0f} s", o.fault, o.model, o.reason, f"{fmt(o.detected, '.1f')} s",
             f"{fmt(o.recovered, '.1f')} s") for i, o in enumerate(outcomes)]  # fmt: skip
    header = (
        "#",
        "UTC",
        "after READY",
        "fault",
        "model",
        "the daemon's line",
        "line after",
        "served again after",
    )
    print(table(header, rows))
    print()
    if recovered:
        times = sorted(o.recovered for o in recovered)
        print(f"recovery (fault -> the model served through the router): median {fmt(benchlib.median(times), '.1f')} s, "
              f"max {times[-1]:.1f} s; by fault: " + "; ".join(
                  f"{f.name} {', '.join(f'{o.recovered:.1f}' for o in recovered if o.fault == f.name) or '-'} s" for f in FAULTS))  # fmt: skip
    failed = [a for a in answers if not a.ok]
    cut = (
        f"; {client.cut()} waiting at the run's end, cut by the unit's stop, not counted"
        if client is not None and client.cut()
        else ""
    )
    print(
        f"requests (the client): {len(answers)} sent, {len(answers) - len(failed)} ok, {len(failed)} failed{cut}"
    )
    for a in failed:
        print(f"  {a.model} sent {clock(a.sent)}, failed {clock(a.done)}: {a.error}")
    # The daemon's restarts that no fault of the soak caused: a false restart, or a second one a fault brought.
    caused = {o.line_at for o in outcomes}
    unprovoked = [e for e in events if "engine restart:" in e.message and e.at not in caused]
    print(f"engine restarts no fault caused: {len(unprovoked)}")
    for e in unprovoked:
        print(f"  {clock(e.at)} {e.message}")
    print(f"swaps (the daemon): {swap.get('total', '-')} ended, {swap.get('failed', '-')} failed, {swap.get('abandoned', '-')} abandoned; "
          f"router restarts {(swap.get('router') or {}).get('restarts', '-')}; unit NRestarts {nrestarts}")  # fmt: skip
    longest = max(ages.values(), key=lambda v: v[1]) if ages else None
    seen = (
        f"the longest seen in progress {longest[1]:.0f} s ({longest[0]})"
        if longest
        else "none seen in progress"
    )
    print(f"stuck swaps (in progress > {stuck_bound:.0f} s, by `r3090ctl status --json` every {STATUS_EVERY_S:g} s, "
          f"{watch.unanswered if watch else '-'} unanswered): {len(stuck)}{' ' + str(sorted(stuck.values())) if stuck else ''}; {seen}")  # fmt: skip
    print(f"give-ups: {len(give_ups)}{''.join(chr(10) + '  ' + e.message for e in give_ups)}")
    print(f"faults recovered: {len(recovered)} / {len(outcomes)}")
    if left:
        print(f"vLLM processes left after the unit's stop: {left}")
    ok = outcomes and not give_ups and not stuck and len(recovered) == len(outcomes) and not left
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
