"""False restarts under honest load: the shipped watchdog settings against the engine-bound CPU vLLM.

Opt-in (5 runs of 10 minutes plus a vLLM start each): R3090D_BENCH_LONG=1 python bench/bench_false_restarts.py
R3090D_BENCH_MINUTES=N (or --minutes N) shortens each run; --scenario NAME runs one;
--cpu-hog N adds N processes that each spin on a CPU from the engine's readiness to the
run's end: other work on the machine, so the host's CPUs are saturated (load above
their count) and the engine and its probe wait their turn.

Each run starts a fresh daemon on the engine-bound tiny model (tests/e2e/real_vllm.py,
ENGINE_BOUND_ARGS: decodes about 55 tokens/s on 2 cores, so requests stay in the
engine as on a busy GPU; steps capped at STEP_TOKENS tokens, see there) with nothing
in [watchdog] overridden, then:
  long prompts  4 closed-loop clients, each prompt max_model_len - 200 tokens long;
  max_num_seqs  the profile's max_num_seqs streams at once (ignore_eos), closed loop;
  kv sawtooth   a KV cache cut to KV_BLOCKS blocks (--num-gpu-blocks-override, and
                max_model_len to fit); clients ramp from 1 to SAWTOOTH_PEAK over 30 s
                and back over 30 s (dropped clients cancel their request), so the
                cache overflows into preemptions and recomputes and drains again;
  idle          nothing: only the daemon's inference probe reaches the engine;
  idle bursts   one long prompt (BURST_PROMPT tokens) after each pause of BURST_IDLE
                seconds: a prompt that lands just before a probe is due queues that
                probe behind its whole prefill, while the engine visibly progresses.
Per run: restarts (must be 0), requests finished/cancelled/failed, inference probes
(vLLM's own count of max_tokens <= 1 requests: the load never asks for fewer than 16;
the last engine's counters, should a restart have replaced it),
preemptions, the longest stretch with requests running and no progress (generation
tokens, prompt tokens or KV usage unchanged; sampled from the state file every tick)
and the slowest probe answer, against stall_seconds and probe_timeout; the highest
1-minute load average seen.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import Daemon, fmt, say  # noqa: E402

MINUTES_ENV = "R3090D_BENCH_MINUTES"
VOCAB = 2048  # the tiny model's vocabulary: every id decodes
# The sawtooth's KV cache: 12 blocks of 128 tokens. This engine computes about 50
# tokens/s, so a cache must be this small to overflow within a 30 s ramp (at the
# peak, SAWTOOTH_PEAK requests of up to SAWTOOTH_PROMPT + SAWTOOTH_OUTPUT tokens
# want about 45 blocks). It is below the shipped min_free_blocks (100), so the KV
# rule sees one long shortage: what it can still do is mistake the trough (blocks
# held, few requests) or a recompute (no token for seconds) for a leak.
KV_BLOCKS = 12
SAWTOOTH_MAX_MODEL_LEN = 1024  # at most (KV_BLOCKS - 1) x 128, or vLLM refuses to start
SAWTOOTH_PEAK = 6
SAWTOOTH_PROMPT, SAWTOOTH_OUTPUT = 300, 600
# Idle bursts: a BURST_PROMPT-token prompt (about 20 s of prefill here) after
# BURST_IDLE seconds of nothing, longer than probe_idle_seconds: the probe runs in
# the pauses, and each prompt lands somewhere in its cycle.
BURST_PROMPT = 1000
BURST_IDLE = (8.0, 20.0)
LONG_PROMPT_MARGIN = 200  # prompt = max_model_len - this; max_tokens = this - 50
# vLLM's token budget per engine step. This CPU engine computes about 50 tokens/s,
# prefill or decode alike, and vLLM publishes its metrics once per step: with its
# own budget a near-max prompt is one step of over a minute, flat metrics all the
# while, which no frozen-engine threshold meant for a GPU survives (a 3090 takes
# about 2 s for a 2048-token chunk of a 7B model). 128 tokens make a step about
# 2.5 s here, GPU-like; --step-tokens 0 keeps vLLM's default.
STEP_TOKENS = 128


class Load:
    """Closed-loop streaming clients; worker k sends while k < target(elapsed seconds), else cancels and waits."""

    def __init__(self, url: str, model: str, workers: int, target: Callable[[float], int], make_body: Callable[[random.Random], dict]):
        self.url, self.model, self.target, self.make_body = url, model, target, make_body
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.finished = self.cancelled = self.failed = 0
        self.last_error = ""
        self._threads = [threading.Thread(target=self._run, args=(k,), name=f"load-{k}", daemon=True) for k in range(workers)]

    def start(self) -> Load:
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def _wanted(self, k: int) -> bool:
        return not self._stop.is_set() and k < self.target(time.monotonic() - self.t0)

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def _run(self, k: int) -> None:
        rng = random.Random(3090 + k)
        with httpx.Client(timeout=httpx.Timeout(10.0, read=300.0), trust_env=False) as client:
            while not self._stop.is_set():
                if not self._wanted(k):
                    self._stop.wait(0.2)
                    continue
                body = {"model": self.model, "stream": True, "ignore_eos": True, "temperature": 0.8, **self.make_body(rng)}
                outcome = "failed"
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            self.last_error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                        for line in resp.iter_lines():
                            if not self._wanted(k):
                                outcome = "cancelled"  # leaving closes the connection: vLLM aborts the request
                                break
                            if line == "data: [DONE]" and resp.status_code == 200:
                                outcome = "finished"
                except httpx.HTTPError as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                if outcome == "failed" and self._stop.is_set():
                    outcome = "cancelled"  # cut off at the end of the run
                self._count(outcome)
                if outcome == "failed":
                    self._stop.wait(1.0)

    def stop(self) -> None:
        """Ask every client to leave; one blocked in a read ends when the engine stops."""
        self._stop.set()
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class Bursts:
    """One client: a long prompt, then BURST_IDLE seconds of nothing (random, seeded), again and again."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self._stop = threading.Event()
        self.finished = self.cancelled = self.failed = 0
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name="bursts", daemon=True)

    def start(self) -> Bursts:
        self._thread.start()
        return self

    def _run(self) -> None:
        rng = random.Random(3090)
        with httpx.Client(timeout=httpx.Timeout(10.0, read=600.0), trust_env=False) as client:
            while not self._stop.wait(rng.uniform(*BURST_IDLE)):
                body = {"model": self.model, "prompt": random_prompt(rng, BURST_PROMPT), "max_tokens": 16, "ignore_eos": True}
                try:
                    ok = client.post(self.url + "/v1/completions", json=body).status_code == 200
                except httpx.HTTPError as exc:
                    self.last_error, ok = f"{type(exc).__name__}: {exc}", False
                if self._stop.is_set():
                    self.cancelled += 1
                elif ok:
                    self.finished += 1
                else:
                    self.failed += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class CpuHog:
    """`n` processes spinning on a CPU each: other work that the engine shares the host's CPUs with.

    Each in a session of its own, as other services and users are: with the kernel's autogroup
    scheduling (sched_autogroup_enabled) the hogs of one session would share one group's CPU
    time against the engine's (the engine's tree has its own session), and take at most half."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def start(self) -> CpuHog:
        benchlib.kill_on_exit(self.stop)
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(self.n)]
        return self

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(5)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    # Token ids, so the length is exact; random, so the prefix cache saves no prefill.
    return [rng.randrange(VOCAB) for _ in range(n)]


def triangle(period: float, low: int, high: int) -> Callable[[float], int]:
    def target(t: float) -> int:
        phase = (t % period) / (period / 2)
        frac = phase if phase <= 1 else 2 - phase
        return low + round(frac * (high - low))

    return target


@dataclass(frozen=True)
class Scenario:
    name: str
    extra_args: tuple[str, ...]
    load: Callable[[Daemon, int, int], Load | Bursts | None]  # (daemon, max_model_len, max_num_seqs)
    profile: dict = field(default_factory=dict)  # [profiles.realtime] overrides


def long_prompts(d: Daemon, max_model_len: int, max_num_seqs: int) -> Load:
    n = max_model_len - LONG_PROMPT_MARGIN
    return Load(d.url, d.model, 4, lambda t: 4, lambda rng: {"prompt": random_prompt(rng, n), "max_tokens": LONG_PROMPT_MARGIN - 50})


def full_batch(d: Daemon, max_model_len: int, max_num_seqs: int) -> Load:
    return Load(d.url, d.model, max_num_seqs, lambda t: max_num_seqs, lambda rng: {"prompt": random_prompt(rng, 32), "max_tokens": 400})


def sawtooth(d: Daemon, max_model_len: int, max_num_seqs: int) -> Load:
    peak = min(SAWTOOTH_PEAK, max_num_seqs)
    return Load(d.url, d.model, peak, triangle(60.0, 1, peak),
                lambda rng: {"prompt": random_prompt(rng, SAWTOOTH_PROMPT), "max_tokens": SAWTOOTH_OUTPUT})  # fmt: skip


SCENARIOS = (
    Scenario("long prompts", (), long_prompts),
    Scenario("max_num_seqs", (), full_batch),
    Scenario("kv sawtooth", ("--num-gpu-blocks-override", str(KV_BLOCKS)), sawtooth, {"max_model_len": SAWTOOTH_MAX_MODEL_LEN}),
    Scenario("idle", (), lambda d, m, s: None),
    Scenario("idle bursts", (), lambda d, m, s: Bursts(d.url, d.model)),
)


@dataclass
class Watch:
    """What the state file showed, tick by tick."""

    longest_quiet: float = 0.0  # requests running and the progress mark unchanged, seconds
    max_running: float = 0.0
    max_waiting: float = 0.0
    min_free_blocks: float | None = None
    slowest_probe: float = 0.0
    probe_failures: int = 0
    alerts: set[str] = field(default_factory=set)
    max_load: float = 0.0  # the 1-minute load average


def watch_state(d: Daemon, stop: threading.Event, w: Watch) -> None:
    last_written, mark, mark_at = None, None, None
    seen_probe = None
    while not stop.wait(0.25):
        w.max_load = max(w.max_load, os.getloadavg()[0])
        st = d.state()
        if st is None or st.get("written_at") == last_written:
            continue
        last_written = st["written_at"]
        m, now = st["metrics"], st["written_at"]
        if m.get("error") is None and m.get("generation_tokens_total") is not None:
            new = (m["generation_tokens_total"], m["prompt_tokens_total"], m["kv_usage"])
            if new != mark or not m.get("running"):
                mark, mark_at = new, now
            else:
                w.longest_quiet = max(w.longest_quiet, now - mark_at)
            w.max_running = max(w.max_running, m.get("running") or 0)
            w.max_waiting = max(w.max_waiting, m.get("waiting") or 0)
            if m.get("free_blocks") is not None:
                w.min_free_blocks = m["free_blocks"] if w.min_free_blocks is None else min(w.min_free_blocks, m["free_blocks"])
        inf = st.get("inference") or {}
        if inf.get("finished_at") and inf["finished_at"] != seen_probe:
            seen_probe = inf["finished_at"]
            if inf.get("latency_s") is not None:
                w.slowest_probe = max(w.slowest_probe, inf["latency_s"])
            if inf.get("ok") is False:
                w.probe_failures += 1
        w.alerts |= set((st.get("alerts") or {}).get("firing") or {})


@dataclass(frozen=True)
class Result:
    name: str
    minutes: float
    restarts: int
    reasons: dict
    finished: int
    cancelled: int
    failed: int
    probes: float
    requests: float
    preemptions: float
    watch: Watch
    ready_s: float


def run(sc: Scenario, minutes: float, step_tokens: int, tmp: Path, hog: int = 0) -> Result:
    step = ["--max-num-batched-tokens", str(step_tokens)] if step_tokens else []
    overrides = {"profiles": {"realtime": sc.profile}} if sc.profile else None
    config = benchlib.real_config(tmp, extra_args=[*step, *sc.extra_args], overrides=overrides)
    from r3090d import config as configmod

    cfg = configmod.load(config, check_files=False)
    profile = cfg.active_profile
    d = Daemon(config, tmp / "daemon.log").start()
    load, stop, w, hogs = None, threading.Event(), Watch(), CpuHog(hog)
    watcher = threading.Thread(target=watch_state, args=(d, stop, w), daemon=True)
    try:
        t0 = time.monotonic()
        st = d.wait_ready(600)
        ready_s = time.monotonic() - t0
        say(f"{sc.name}: engine ready in {ready_s:.0f} s; {minutes:g} min of load" + (f", {hog} CPU hog(s)" if hog else ""))
        hogs.start()
        watcher.start()
        load = sc.load(d, profile.max_model_len, profile.max_num_seqs)
        if load is not None:
            load.start()
        end = time.monotonic() + minutes * 60
        while time.monotonic() < end:
            time.sleep(min(30.0, max(0.0, end - time.monotonic())))
            st = d.state() or st
            m = st["metrics"]
            extra = f", load {load.finished} finished {load.cancelled} cancelled {load.failed} failed" if load else ""
            say(f"{sc.name}: {st['engine']['phase']}, restarts {st['restarts']['total']}, running {m.get('running')}, "
                f"waiting {m.get('waiting')}, free blocks {fmt(m.get('free_blocks'), '.0f')}{extra}")  # fmt: skip
        try:
            text = benchlib.scrape(d.url)
        except httpx.HTTPError as exc:
            text = ""
            say(f"{sc.name}: cannot read the engine's /metrics at the end ({type(exc).__name__}): no probe count")
        st = d.state() or st
        restarts = [f"{time.strftime('%H:%M:%S', time.localtime(e.at))} {e.message}" for e in d.events() if e.message.startswith("engine restart:")]
    finally:
        hogs.stop()
        if load is not None:
            load.stop()
        stop.set()
        d.cleanup()
    if load is not None and load.failed:
        say(f"{sc.name}: last request error: {load.last_error}")
    if restarts:
        kept = Path(tempfile.mkdtemp(prefix=f"r3090d-false-{sc.name.replace(' ', '-')}-"))
        (kept / "daemon.log").write_bytes((tmp / "daemon.log").read_bytes())
        say(f"{sc.name}: {len(restarts)} restart(s); the daemon's log is kept in {kept}/daemon.log:\n  " + "\n  ".join(restarts))
    return Result(
        sc.name, minutes, st["restarts"]["total"], st["restarts"]["by_reason"],
        load.finished if load else 0, load.cancelled if load else 0, load.failed if load else 0,
        benchlib.metric_sum(text, "vllm:request_params_max_tokens_bucket", le="1.0"),
        benchlib.metric_sum(text, "vllm:request_success_total"),
        benchlib.metric_sum(text, "vllm:num_preemptions_total"),
        w, ready_s,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--minutes", type=float, default=float(os.environ.get(MINUTES_ENV) or 10), help=f"per run (default ${MINUTES_ENV} or 10)")
    cli.add_argument("--step-tokens", type=int, default=STEP_TOKENS, help=f"vLLM's --max-num-batched-tokens (default {STEP_TOKENS}; 0: vLLM's own)")
    cli.add_argument("--scenario", choices=[s.name for s in SCENARIOS], action="append", help="run only this one (repeatable)")
    cli.add_argument("--cpu-hog", type=int, default=0, metavar="N", help="N processes spinning on a CPU each during every run (default 0)")
    args = cli.parse_args(argv)
    benchlib.exit_on_sigterm()
    if benchlib.skipped_long_real("bench_false_restarts", f"{len(SCENARIOS)} runs of {args.minutes:g} min on the real vLLM"):
        return 0
    chosen = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    results = []
    with tempfile.TemporaryDirectory(prefix="r3090d-false-") as tmp, benchlib.VllmLock():
        tmp = Path(tmp)
        for k, sc in enumerate(chosen):
            where = tmp / f"run{k}"
            where.mkdir()
            results.append(run(sc, args.minutes, args.step_tokens, where, args.cpu_hog))
        wd = benchlib.watchdog_of(benchlib.real_config(tmp))
    step = f"--max-num-batched-tokens {args.step_tokens}" if args.step_tokens else "vLLM's own step budget"
    hog = f", {args.cpu_hog} CPU hog(s) on {len(os.sched_getaffinity(0))} CPUs" if args.cpu_hog else ""
    print(f"false restarts on the engine-bound CPU vLLM ({step}{hog}), shipped watchdog settings ({benchlib.describe_watchdog(wd)}):")
    rows = []
    for r in results:
        w = r.watch
        rows.append([
            r.name, f"{r.minutes:g}", str(r.restarts), ",".join(f"{k}:{v}" for k, v in r.reasons.items()) or "-",
            f"{r.finished}/{r.cancelled}/{r.failed}", f"{r.requests:.0f}", f"{r.probes:.0f}", f"{r.probes / r.minutes:.1f}",
            f"{r.preemptions:.0f}", f"{w.max_running:.0f}/{w.max_waiting:.0f}", fmt(w.min_free_blocks, ".0f"),
            f"{w.longest_quiet:.1f}", f"{w.slowest_probe:.2f}", str(w.probe_failures), f"{w.max_load:.1f}", ",".join(sorted(w.alerts)) or "-",
        ])  # fmt: skip
    print(benchlib.table(
        ["scenario", "min", "restarts", "by reason", "load done/cancel/fail", "vLLM requests", "probes", "probes/min",
         "preemptions", "max run/wait", "min free blk", f"longest quiet s (stall {wd.stall_seconds:g})",
         f"slowest probe s (timeout {wd.probe_timeout:g})", "probe fails", "max load 1m", "alerts firing"],
        rows,
    ))  # fmt: skip
    if any(r.minutes * 60 < wd.kv_cooldown for r in results):
        print(f"note: runs shorter than kv_cooldown ({wd.kv_cooldown:g} s) cannot show a KV restart: the rule is off until then")
    bad = [r.name for r in results if r.restarts]
    print("restarts: none" if not bad else f"restarts in: {', '.join(bad)} (FAILED: every run must have 0)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
