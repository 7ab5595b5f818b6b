"""The known-answer canary on a real NVIDIA GPU: flipped weight bits are caught, a suspend and resume is not.

For a host with an NVIDIA GPU, driver 570 or newer (process checkpointing),
nvidia-ml-py and torch with CUDA; elsewhere it says so in one line and exits 69.
Not run by `make bench` (which runs bench/bench_*.py only). From the repository root:

    python3 bench/gpu_canary.py [--interval 10] [--poll 0.5] [--weight-gib 4] [--hold 3] [--gpu 0]
    python3 bench/gpu_canary.py --cpu-standin     # dry run of the plumbing, no GPU needed

The engine is bench/gpu_engine_standin.py with GPU_IDLE_CANARY=1: the vLLM
double (tests/fakevllm) for HTTP, plus a torch worker in the same process group
holding --weight-gib GiB of bf16 weights drawn from a fixed seed and stepping a
decode-like GEMV loop. The worker reports a checksum of y = W.x (every weight,
x fixed) in its status file, and the double mixes the newest worker's checksum
into its greedy answers (FAKE_VLLM_ANSWER_SALT_DIR): the canary's answer is a
function of what is in the GPU's memory, as a real model's is. The daemon
(`python3 -m r3090d --skip-preflight`) runs with gpu.required = true, the
canary on with canary.interval = --interval, watchdog.poll_interval = --poll,
suspend.drain_timeout = 3 s, the exporter on a free port, syslog off, in a
temporary directory; the real CUDA checkpoint calls (r3090ctl suspend/resume).

Steps:
  start       the engine ready, its worker computing; its checksum
  baseline    the daemon's first canary (the baseline), then one periodic check: match
  suspend     `r3090ctl suspend --wait --json` (the drain re-takes the baseline, the lock
              and checkpoint free the worker's GPU memory), held --hold seconds
  resume      `r3090ctl resume --wait --json`: the resumed engine must give the
              baseline back before READY; canary.last_verdict match, restarts 0,
              the worker's checksum unchanged
  flip        just after a periodic check (the worst case: the next one is a whole
              interval away), the worker is asked (a request file in its status dir;
              only it can write its GPU memory) to XOR --flip-bit of --flip-count bf16
              weights spread over the tensor; its checksum changes, so do the
              double's answers. Measured from the flip (the worker's own clock): the
              first canary sent after it (the double's request log) and the restart
              (the state file's restarts.last_at, the deciding tick), whose reason
              must be wrong_output, within canary.interval + poll_interval of the flip
              plus the canary's own answer time
  fresh       the restarted engine's new worker draws the same weights: its checksum
              is the original one, its baseline agrees with the persisted one (no
              canary_start_mismatch), and its first periodic check matches

--cpu-standin: the worker is a CPU loop over 4 MiB of "weights" (its checksum a
hash of them), NVML is tests/fakenvml (the card lists the workers, less one the
fake driver holds checkpointed) and the checkpoint calls are tests/fakecuda
(lock SIGSTOPs the worker, unlock SIGCONTs it): the whole path can be checked on
a host without a GPU. Its times say nothing about a GPU.

One run on an H200 (driver 580, torch 2.11, 2026-12-02; the defaults: 4 GiB of
weights, interval 10 s, poll 0.5 s, hold 3 s): suspend 4.92 s (4.7 GiB freed),
resume 2.84 s with the canary matched, last_verdict match, restarts 0; the flip
(8 x bit 14) changed the checksum and was caught 10.12 s after it, reason
wrong_output; the fresh worker's checksum was the original one, its periodic
check matched, no canary_start_mismatch.

Progress goes to stderr, the table to stdout. Exit 0 when every step did what
it should, 1 otherwise, 69 when this host cannot run it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # r3090d and bench/ from this checkout, installed or not

from bench import gpu_engine_standin as standin  # noqa: E402
from bench import gpu_idle as gi  # noqa: E402
from bench import gpu_suspend_daemon as gsd  # noqa: E402

FAKE_CUDA_DIR = ROOT / "tests" / "fakecuda"
TOKEN_DELAY_S = 0.01  # the double's step: a 16-token canary answers in about 0.2 s
CANARY_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 3.0
LB_GRACE_S = 1.0
SETTLE_S = 10.0
REQUEST_LOG_EVERY_S = 0.05  # the canary is sent and decided within about 0.2 s, then the engine (and its log) goes


@dataclass(frozen=True)
class Row:
    step: str
    ok: bool
    result: str
    seconds: float | None
    notes: str


class DryCard(gi.FakeCard):
    """The dry run's card: gpu_idle's, less the workers the fake checkpoint driver holds checkpointed."""

    def __init__(self, path: Path, status_dir: Path, states: Path):
        self.states = states
        super().__init__(path, status_dir)

    def off_the_card(self) -> set[int]:
        """The workers the fake driver holds checkpointed: their memory is off the card."""
        try:
            states = json.loads(self.states.read_text())
        except (OSError, ValueError):
            return set()
        return {int(pid) for pid, e in states.items() if e.get("state") == "CHECKPOINTED"}


def write_engine_python(base: Path, args) -> Path:
    """gpu_idle's engine python, with the worker's checksum and the double's answers tied to it."""
    status_dir = base / "workers"
    status_dir.mkdir()
    env = {"GPU_IDLE_WORKER": "cpu" if args.cpu_standin else "torch", "GPU_IDLE_WEIGHT_GIB": str(args.weight_gib),
           "GPU_IDLE_STATUS_DIR": str(status_dir), "GPU_IDLE_CANARY": "1", "GPU_IDLE_SEED": str(args.seed)}  # fmt: skip
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    path = base / "engine-python"
    path.write_text(f"#!/bin/sh\n# The engine python r3090d launches: see bench/gpu_engine_standin.py.\n"
                    f"exec env {exports} {shlex.quote(sys.executable)} {shlex.quote(str(gi.STANDIN))} \"$@\"\n")  # fmt: skip
    path.chmod(0o755)
    return path


class CanaryDaemon(gsd.SuspendDaemon):
    """gpu_suspend_daemon's daemon run, with the canary on, a short interval and --poll."""

    def __init__(self, base: Path, args, env: dict[str, str]):
        gi.DaemonRun.__init__(self, base, args.poll, 1, args, env)
        self.exporter_url = f"http://127.0.0.1:{gi.free_port()}"
        doc = tomllib.loads(self.config.read_text())
        doc["engine"]["extra_args"] = ["--fake-token-delay", str(TOKEN_DELAY_S)]
        doc["daemon"].update(exporter_enabled=True, exporter_host="127.0.0.1", exporter_port=int(self.exporter_url.rsplit(":", 1)[1]))
        doc["watchdog"]["lb_grace"] = LB_GRACE_S
        doc["suspend"] = {"drain_timeout": DRAIN_TIMEOUT_S}
        doc["canary"] = {"enabled": True, "interval": args.interval, "timeout": CANARY_TIMEOUT_S, "restart_on_mismatch": True}
        self.config.write_text(gsd.toml_text(doc))
        from r3090d import config as configmod

        self.cfg = configmod.load(self.config, check_files=False)  # a bad config fails here, before the daemon starts

    def canary(self) -> dict:
        return (self.state() or {}).get("canary") or {}

    def next_check(self, after: int, budget: gi.Budget, what: str) -> dict:
        """The state once the canary has ended more than `after` comparisons."""
        return self.wait(lambda st: st if st["canary"]["checks"] > after else None, self.cfg.canary.interval + 30, what, budget)

    def request_log(self) -> list[dict] | None:
        import httpx

        try:
            return httpx.get(self.url + "/fake/requests", timeout=2.0, trust_env=False).json()["requests"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def log_count(self, text: str) -> int:
        try:
            return self.log_path.read_text(errors="replace").count(text)
        except OSError:
            return 0


def worker_status(run: CanaryDaemon, pid: int) -> dict:
    try:
        return json.loads(standin.worker_status_path(run.status_dir, pid).read_text())
    except (OSError, ValueError):
        return {}


def worker_until(run: CanaryDaemon, pid: int, done: Callable[[dict], bool], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = worker_status(run, pid)
        if done(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def canary_requests(log: list[dict] | None) -> list[float]:
    """When the double received each canary (a greedy completion with logprobs 2 and a cache salt)."""
    out = []
    for e in log or []:
        body = e.get("body") or {}
        if e.get("path") == "/v1/completions" and body.get("logprobs") == 2 and "cache_salt" in body:
            out.append(e["t"])
    return out


def flip(run: CanaryDaemon, pid: int, args) -> None:
    req = standin.flip_request_path(run.status_dir, pid)
    tmp = req.with_name(f".{req.name}.tmp")
    tmp.write_text(json.dumps({"count": args.flip_count, "bit": args.flip_bit}))
    os.replace(tmp, req)  # the worker reads it whole


def bench(args, base: Path, cleanup: list[Callable[[], None]]) -> int:
    dry = args.cpu_standin
    card_path = base / "fake-nvml.json" if dry else None
    nvml = gi.load_nvml(dry, card_path)
    write_engine_python(base, args)
    control = base / "fake-cuda.json"
    if dry:
        control.write_text("{}")
        card = DryCard(card_path, base / "workers", Path(f"{control}.states.json")).start()
        cleanup.append(card.stop)
    gpu = gi.check_host(args, nvml)
    if dry:
        driver = "fake CUDA checkpoint driver (tests/fakecuda)"
    else:
        from r3090d.effectors.checkpoint import available

        ok, driver = available()
        if not ok:
            raise gi.Unavailable(f"the driver cannot checkpoint processes (needs 570 or newer): {driver}")
    env, notes = gi.daemon_env(base, dry)
    if dry:
        from r3090d.effectors.checkpoint import FAKE_ENV

        env["PYTHONPATH"] = os.pathsep.join([str(FAKE_CUDA_DIR), env["PYTHONPATH"]])
        env[FAKE_ENV] = str(control)
    poller = gi.NvmlPoller(nvml, args.gpu)  # readings on demand
    gi.say(f"GPU {args.gpu}: {gpu}; {driver}; worker weights {args.weight_gib:g} GiB (seed {args.seed}); "
           f"canary.interval {args.interval:g} s, poll_interval {args.poll:g} s; budget {args.budget:.0f} s")  # fmt: skip
    for note in notes:
        gi.say(note)
        print(f"note: {note}")
    budget = gi.Budget(args.budget)
    rows: list[Row] = []
    summary: dict[str, str] = {}

    run = CanaryDaemon(base, args, env)
    cleanup.append(run.kill_group)
    cleanup.append(run.stop)
    gi.say(f"daemon: config {run.config}")
    try:
        # ---------------------------------------------------------- start
        t0 = time.monotonic()
        run.start()
        pgid = run.wait_ready(budget, None)
        worker = gi.wait_worker(run, pgid, budget)
        c0 = worker.status.get("checksum")
        rows.append(Row("start", c0 is not None, "ready", time.monotonic() - t0,
                        f"engine {pgid}, worker {worker.pid}: {worker.status.get('kind')} dim {worker.status.get('dim', '-')}, "
                        f"checksum {c0}; NVML {gsd.mib(dict(poller.processes()).get(worker.pid))} MiB for the worker"))  # fmt: skip
        gi.say(f"engine {pgid} ready, worker {worker.pid} checksum {c0}")

        # ---------------------------------------------------------- baseline, one periodic check
        t1 = time.monotonic()
        st = run.wait(lambda s: s if s["engine"]["pid"] == pgid and s["canary"]["baseline_tokens"] is not None else None,
                      60, "the canary's baseline", budget)  # fmt: skip
        st = run.next_check(st["canary"]["checks"], budget, "a periodic canary check")
        cn = st["canary"]
        rows.append(Row("baseline + check", cn["last_verdict"] == "match", str(cn["last_verdict"]), time.monotonic() - t1,
                        f"baseline confident over {cn['baseline_tokens']} token(s); checks {cn['checks']}, mismatches {cn['mismatches']}"))  # fmt: skip

        # ---------------------------------------------------------- (b) suspend, hold, resume
        restarts0 = run.restarts()
        checks0 = cn["checks"]
        before_mib = dict(poller.processes()).get(worker.pid)
        gi.say(f"suspend --wait (worker {gsd.mib(before_mib)} MiB on the GPU)")
        sus = run.ctl("suspend", "--wait", "--json", timeout=gsd.ctl_timeout(run, budget, False))
        suspended = sus.rc == 0 and sus.doc.get("result") == "suspended"
        held = worker_status(run, worker.pid)
        gone = None
        if suspended:
            deadline = time.monotonic() + SETTLE_S
            while (gone := dict(poller.processes()).get(worker.pid)) is not None and time.monotonic() < deadline:
                time.sleep(0.1)
        rows.append(Row("suspend", suspended, sus.doc.get("result") or f"exit {sus.rc}", sus.seconds,
                        f"{sus.doc.get('detail') or sus.doc.get('error') or sus.stderr[-200:]}; worker NVML "
                        f"{gsd.mib(before_mib)} -> {gsd.mib(gone)} MiB"))  # fmt: skip
        summary["suspend (s)"] = gi.fmt(sus.seconds)
        if not suspended:
            print(gi.diagnose(run, poller))
            return finish(rows, summary)
        time.sleep(budget.cap(args.hold))
        phase = ((run.state() or {}).get("engine") or {}).get("phase")
        still = worker_status(run, worker.pid)
        rows.append(Row("hold", phase == "suspended" and still.get("steps") == held.get("steps"), f"phase {phase}", args.hold,
                        f"worker steps {held.get('steps')} -> {still.get('steps')} (frozen)"))  # fmt: skip
        res = run.ctl("resume", "--wait", "--json", timeout=gsd.ctl_timeout(run, budget, True))
        resumed = res.rc == 0 and res.doc.get("result") == "resumed"
        back = worker_until(run, worker.pid, lambda s: (s.get("steps") or 0) > (still.get("steps") or 0), SETTLE_S)
        st = run.wait(lambda s: s if s["engine"]["phase"] == "ready" else None, SETTLE_S, "the engine ready after resume", budget)
        cn, total = st["canary"], st["restarts"]["total"]
        hz = run.healthz_until(200, SETTLE_S)
        verdict_ok = resumed and cn["last_verdict"] == "match" and cn["checks"] > checks0 and total == (restarts0 or 0) == 0
        rows.append(Row("resume", resumed, res.doc.get("result") or f"exit {res.rc}", res.seconds,
                        f"{res.doc.get('detail') or res.doc.get('error') or res.stderr[-200:]}; worker NVML "
                        f"{gsd.mib(dict(poller.processes()).get(worker.pid))} MiB, checksum {back.get('checksum')} "
                        f"({'unchanged' if back.get('checksum') == c0 else 'CHANGED'})"))  # fmt: skip
        rows.append(Row("canary after resume", verdict_ok and back.get("checksum") == c0, f"last_verdict {cn['last_verdict']}", None,
                        f"checks {checks0} -> {cn['checks']}, mismatches {cn['mismatches']}, restarts {total}; /healthz {hz[0]}"))  # fmt: skip
        summary.update({"resume (s)": gi.fmt(res.seconds), "verdict after resume": str(cn["last_verdict"]), "restarts after resume": str(total)})

        # ---------------------------------------------------------- (a) flip bits of the weights
        restarts1 = total
        st = run.next_check(cn["checks"], budget, "a periodic canary check before the flip")
        cn = st["canary"]
        if cn["last_verdict"] != "match":
            raise RuntimeError(f"the periodic check before the flip says {cn['last_verdict']}: {cn.get('last_mismatch')}")
        gi.say(f"check {cn['checks']} matched: flipping bit {args.flip_bit} of {args.flip_count} weights in worker {worker.pid}")
        flip(run, worker.pid, args)
        flipped = worker_until(run, worker.pid, lambda s: (s.get("flips") or 0) >= 1, SETTLE_S)
        if not flipped.get("flips"):
            raise RuntimeError(f"the worker {worker.pid} did not take the flip request within {SETTLE_S:.0f} s")
        t_flip, c1 = flipped["flipped_at"], flipped.get("checksum")
        gi.say(f"flipped at {time.strftime('%H:%M:%S', time.localtime(t_flip))}: checksum {c0} -> {c1}; waiting for the restart")
        log, last_log = None, 0.0
        deadline = time.monotonic() + budget.cap(args.interval + args.poll + 30)
        while True:
            st = run.state()
            if st is not None and (st["restarts"]["total"] or 0) > restarts1:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no restart within {args.interval + args.poll + 30:.0f} s of the flip; the daemon's log ends:\n{run.log_tail()}")
            if time.monotonic() - last_log >= REQUEST_LOG_EVERY_S:  # the engine's log goes with it: keep the last one read
                log = run.request_log() or log
                last_log = time.monotonic()
            time.sleep(0.05)
        reason, detection = st["restarts"]["last_reason"], st["restarts"]["last_at"] - t_flip
        sent = next((t for t in canary_requests(log) if t >= t_flip), None)
        to_sent = None if sent is None else sent - t_flip
        answer_s = None if sent is None else st["restarts"]["last_at"] - sent
        cn = st["canary"]
        bound = args.interval + args.poll + (answer_s or 0.0)
        rows.append(Row("flip", c1 is not None and c1 != c0, f"{args.flip_count} x bit {args.flip_bit}", None,
                        f"worker {worker.pid}: checksum {c0} -> {c1}"))  # fmt: skip
        rows.append(Row("flip -> restart", reason == "wrong_output" and detection <= bound + 0.05, str(reason), detection,
                        f"flip -> canary sent {gi.fmt(to_sent)} s, sent -> restart decided {gi.fmt(answer_s)} s; bound interval + poll "
                        f"+ answer = {bound:.2f} s; mismatches {cn['mismatches']}: {(cn.get('last_mismatch') or '')[:120]}"))  # fmt: skip
        summary.update({"flip -> restart (s)": gi.fmt(detection), "flip -> canary sent (s)": gi.fmt(to_sent), "restart reason": str(reason)})

        # ---------------------------------------------------------- the fresh engine
        t2 = time.monotonic()
        pgid2 = run.wait_ready(budget, pgid)
        worker2 = gi.wait_worker(run, pgid2, budget)
        c2 = worker2.status.get("checksum")
        back_up = time.monotonic() - t2
        st = run.wait(lambda s: s if s["engine"]["pid"] == pgid2 and s["canary"]["baseline_tokens"] is not None else None,
                      60, "the fresh engine's baseline", budget)  # fmt: skip
        st = run.next_check(st["canary"]["checks"], budget, "the fresh engine's periodic check")
        cn, total = st["canary"], st["restarts"]["total"]
        start_mismatch = run.log_count("canary_start_mismatch")
        rows.append(Row("fresh engine", c2 == c0 and cn["last_verdict"] == "match" and total == restarts1 + 1 and start_mismatch == 0,
                        f"last_verdict {cn['last_verdict']}", back_up,
                        f"engine {pgid2}, worker {worker2.pid}: checksum {c2} ({'the original' if c2 == c0 else 'NOT the original'}); "
                        f"restarts {total}; canary_start_mismatch in the log: {start_mismatch}; checks {cn['checks']}, "
                        f"mismatches {cn['mismatches']}"))  # fmt: skip
        summary["fresh engine checksum"] = "original" if c2 == c0 else "DIFFERENT"
    except gi.OutOfTime as exc:
        gi.say(str(exc))
        rows.append(Row("budget", False, "ran out", None, str(exc)))
    except RuntimeError as exc:
        gi.say(f"error: {exc}")
        rows.append(Row("error", False, "error", None, str(exc).splitlines()[0]))
    summary.update({"canary.interval (s)": f"{args.interval:g}", "poll_interval (s)": f"{args.poll:g}"})
    return finish(rows, summary)


def finish(rows: list[Row], summary: dict[str, str]) -> int:
    print(gi.table(["step", "result", "ok", "seconds", "notes"],
                   [[r.step, r.result, "yes" if r.ok else "NO", gi.fmt(r.seconds), r.notes] for r in rows]))  # fmt: skip
    print()
    print(gi.table(["measure", "value"], [[k, v] for k, v in summary.items()]))
    good = bool(rows) and all(r.ok for r in rows)
    print("result: " + ("the flip was caught with a wrong_output restart; suspend and resume kept the canary's answer"
                        if good else "FAILED: " + ", ".join(r.step for r in rows if not r.ok)))  # fmt: skip
    return 0 if good else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=10.0, help="canary.interval in seconds (default 10, the least allowed)")
    parser.add_argument("--poll", type=float, default=0.5, help="watchdog.poll_interval in seconds (default 0.5)")
    parser.add_argument("--weight-gib", type=float, default=4.0, help="GiB of bf16 weights the worker holds (default 4)")
    parser.add_argument("--seed", type=int, default=standin.DEFAULT_SEED, help="the weights' seed (default 3090)")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds to stay suspended (default 3)")
    parser.add_argument("--flip-count", type=int, default=8, help="weights whose bit is flipped (default 8)")
    parser.add_argument("--flip-bit", type=int, default=14, help="bit of the bf16 flipped, 0-15 (default 14: the exponent's top bit)")
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU (default 0)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run (default 330)")
    parser.add_argument("--cpu-standin", action="store_true", help="dry run without a GPU: CPU worker, fake NVML and checkpoint driver")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (config, logs)")
    args = parser.parse_args()
    if args.interval < 10 or args.poll <= 0 or args.weight_gib <= 0 or args.hold < 0 or args.flip_count < 1 or not 0 <= args.flip_bit <= 15:
        parser.error("--interval must be at least 10 (the config's least), --poll and --weight-gib positive, --hold not negative, "
                     "--flip-count at least 1, --flip-bit 0-15")  # fmt: skip
    args.streams = 0  # gpu_idle's helpers take its arguments
    return gi.run_cleanly("gpu_canary", "r3090d-gpu-canary-", bench, args)


if __name__ == "__main__":
    sys.exit(main())
