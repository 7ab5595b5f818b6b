"""`r3090ctl suspend` and `resume` end to end on a real NVIDIA GPU: the daemon, its engine, the driver's checkpoint.

For a host with an NVIDIA GPU, driver 570 or newer (process checkpointing),
nvidia-ml-py and torch with CUDA; elsewhere it says so in one line and exits 69.
Not run by `make bench` (which runs bench/bench_*.py only). From the repository root:

    python3 bench/gpu_suspend_daemon.py [--weight-gib 10] [--streams 2] [--hold 10] [--gpu 0]

The engine is bench/gpu_engine_standin.py, set up by bench/gpu_idle.py's own
functions: the vLLM double (tests/fakevllm) for HTTP, plus a torch worker in
the same process group holding --weight-gib GiB of bf16 weights and stepping a
decode-like GEMV loop, so the worker is the engine's one process on the GPU:
the process the daemon checkpoints. The daemon (`python3 -m r3090d
--skip-preflight`) runs with gpu.required = true, gpu.card = "any",
suspend.drain_timeout = 3 s, watchdog.lb_grace = 1 s, the exporter on a free
port (for /healthz), syslog off, in a temporary directory.

Steps, each through r3090ctl as an operator runs it:
  suspend   with --streams long streaming completions running, so the drain
            reaches its deadline and freezes them with the engine;
            `suspend --wait --json`: exit code, result, time; NVML memory used
            (device and the worker's pid) before and after; the worker's RSS
            growth; /healthz (503 expected) and `status --json` (exit 1 expected)
  hold      --hold seconds suspended: restarts.total must stay 0, the phase
            suspended, the worker's step count still
  resume    `resume --wait --json`: time, NVML memory after, /healthz 200 again,
            restarts.total 0, the worker stepping again, the streams producing
  test      `suspend --test --json` once: its step times and the VRAM it freed

The double serves HTTP in a process of its own that holds no GPU memory, so
the checkpoint does not freeze its token stream: the streams show that their
connections outlive the suspension, and the worker's step count (its status
file, bench/gpu_engine_standin.py) shows the GPU side frozen and resumed.

Progress goes to stderr, the table to stdout. Exit 0 when suspend and resume
both succeeded with no restart, 1 otherwise, 69 when this host cannot run it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
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
from r3090d.units import MIB  # noqa: E402

CTL = [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]  # the r3090ctl entry point
EX_UNAVAILABLE = gi.EX_UNAVAILABLE
DRAIN_TIMEOUT_S = 3.0  # requests still running then are frozen with the engine
LB_GRACE_S = 1.0  # /healthz 503 this long before the drain: short, the run has no load balancer
POLL_INTERVAL_S = 1.0
SETTLE_S = 10.0  # bound on waiting for NVML, /healthz or the worker to show the new state
WARNING = 1  # r3090ctl status: a suspended engine is a WARNING


@dataclass(frozen=True)
class CtlRun:
    """One r3090ctl command: its exit code, its JSON (empty when it printed none), and how long it took."""

    rc: int
    doc: dict
    seconds: float
    stderr: str


@dataclass(frozen=True)
class Reading:
    """The GPU and the worker at one moment."""

    device_mib: int | None  # NVML: memory used on the whole device
    worker_mib: int | None  # NVML: the worker pid's usedGpuMemory; None when NVML does not list it
    worker_rss_mib: float | None
    worker_steps: int | None
    chunks: int  # stream chunks received so far, all streams together


@dataclass(frozen=True)
class Row:
    step: str
    ok: bool
    result: str
    seconds: float | None
    before_mib: int | None
    after_mib: int | None
    notes: str


def mib(v: int | None) -> str:
    return "-" if v is None else str(v)


def worker_steps(status_dir: Path, pid: int) -> int | None:
    try:
        return int(json.loads(standin.worker_status_path(status_dir, pid).read_text())["steps"])
    except (OSError, ValueError, KeyError):
        return None


def rss_mib(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / MIB
    except psutil.Error:
        return None


def toml_text(doc: dict) -> str:
    """A TOML document back from tomllib's dict: scalars first, then each table (dotted names for nested ones)."""
    lines = [f"{k} = {gi.toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]

    def tables(prefix: str, d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                name = f"{prefix}.{k}" if prefix else k
                scalars = [f"{sk} = {gi.toml_value(sv)}" for sk, sv in v.items() if not isinstance(sv, dict)]
                if scalars:
                    lines.extend([f"\n[{name}]", *scalars])
                tables(name, v)

    tables("", doc)
    return "\n".join(lines) + "\n"


class SuspendDaemon(gi.DaemonRun):
    """gpu_idle's daemon run, with the exporter on (for /healthz) and a short suspend drain."""

    def __init__(self, base: Path, args, env: dict[str, str]):
        super().__init__(base, POLL_INTERVAL_S, 1, args, env)
        self.exporter_url = f"http://127.0.0.1:{gi.free_port()}"
        doc = tomllib.loads(self.config.read_text())
        doc["daemon"].update(exporter_enabled=True, exporter_host="127.0.0.1", exporter_port=int(self.exporter_url.rsplit(":", 1)[1]))
        doc["watchdog"]["lb_grace"] = LB_GRACE_S
        doc["suspend"] = {"drain_timeout": DRAIN_TIMEOUT_S}
        self.config.write_text(toml_text(doc))
        from r3090d import config as configmod

        self.cfg = configmod.load(self.config, check_files=False)  # a bad config fails here, before the daemon starts

    def ctl(self, *args: str, timeout: float) -> CtlRun:
        t0 = time.monotonic()
        try:
            out = subprocess.run([*CTL, *args, "--config", str(self.config)], capture_output=True, text=True,
                                 timeout=timeout, env=self.env, cwd=ROOT, stdin=subprocess.DEVNULL)  # fmt: skip
        except subprocess.TimeoutExpired:
            return CtlRun(124, {}, time.monotonic() - t0, f"r3090ctl {' '.join(args)}: no answer within {timeout:.0f} s")
        took = time.monotonic() - t0
        try:
            doc = json.loads(out.stdout)
        except ValueError:
            doc = {}
        return CtlRun(out.returncode, doc if isinstance(doc, dict) else {}, took, out.stderr.strip())

    def healthz(self) -> tuple[int | None, str]:
        import httpx

        try:
            r = httpx.get(self.exporter_url + "/healthz", timeout=2.0, trust_env=False)  # loopback: never through a proxy
        except httpx.HTTPError as exc:
            return None, type(exc).__name__
        return r.status_code, r.text.strip()

    def healthz_until(self, code: int, timeout: float) -> tuple[int | None, str]:
        """/healthz until it answers `code` (the exporter reads the state a tick late), or the last answer."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.healthz()
            if got[0] == code or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def restarts(self) -> int | None:
        st = self.state() or {}
        return (st.get("restarts") or {}).get("total")

    def kill_group(self) -> None:
        """The daemon's own process group (the suspend worker it runs included), once the daemon is gone."""
        if self.proc is None or self.proc.poll() is None:
            return
        if gi.group_members(self.proc.pid):
            gi.say(f"cleanup: the daemon's process group {self.proc.pid} outlived it: SIGKILL")
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Probe:
    """Readings of the GPU (NVML), the worker (RSS, its step count) and the streams."""

    def __init__(self, poller: gi.NvmlPoller, run: SuspendDaemon, worker_pid: int, streams: gi.Streams):
        self.poller = poller
        self.run = run
        self.pid = worker_pid
        self.streams = streams

    def worker_mib(self) -> int | None:
        return dict(self.poller.processes()).get(self.pid)

    def read(self) -> Reading:
        return Reading(self.poller.memory_used_mib(), self.worker_mib(), rss_mib(self.pid),
                       worker_steps(self.run.status_dir, self.pid), self.streams.chunks)  # fmt: skip

    def until(self, done: Callable[[Reading], bool], timeout: float) -> Reading:
        """Readings until `done` holds (NVML and the worker's status file lag the driver), or the last one."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.read()
            if done(r) or time.monotonic() > deadline:
                return r
            time.sleep(0.25)


def ctl_timeout(run: SuspendDaemon, budget: gi.Budget, resume: bool) -> float:
    """r3090ctl's own --wait limit (suspend_cmd's), plus room to start and print."""
    cfg = run.cfg
    own = (cfg.watchdog.nvml_hung_after + cfg.suspend.verify_timeout if resume else cfg.watchdog.lb_grace + cfg.suspend.drain_timeout)
    return budget.cap(own + cfg.suspend.operation_timeout + 60)


def one_engine_process(poller: gi.NvmlPoller, pgid: int, worker_pid: int) -> str:
    """'' when the worker is the engine group's only process NVML lists on the GPU (what suspend needs), else why not."""
    group = set(gi.group_members(pgid))
    listed = [pid for pid, _ in poller.processes()]
    mine = sorted(set(listed) & group)
    if mine == [worker_pid]:
        return ""
    return f"NVML lists {listed or 'no process'} on the GPU, {mine or 'none'} of them in the engine's group {sorted(group)}"


def bench(args, base: Path, cleanup: list[Callable[[], None]]) -> int:
    args.cpu_standin = False  # gpu_idle's helpers take its arguments; this bench has no dry run
    nvml = gi.load_nvml(False, None)
    gpu = gi.check_host(args, nvml)
    from r3090d.effectors.checkpoint import available

    ok, driver = available()
    if not ok:
        raise gi.Unavailable(f"the driver cannot checkpoint processes (needs 570 or newer): {driver}")
    gi.write_engine_python(base, args)
    env, notes = gi.daemon_env(base, False)
    poller = gi.NvmlPoller(nvml, args.gpu)  # not started: readings on demand, no utilization thread
    gi.say(f"GPU {args.gpu}: {gpu}; {driver}; worker weights {args.weight_gib:g} GiB; {args.streams} streams; budget {args.budget:.0f} s")
    for note in notes:
        gi.say(note)
        print(f"note: {note}")
    foreign = poller.processes()
    if foreign:
        gi.say(f"warning: the GPU already has processes (pid, MiB) {foreign}")
    budget = gi.Budget(args.budget)
    rows: list[Row] = []
    success = {"suspend": False, "resume": False, "no_restart": True}

    run = SuspendDaemon(base, args, env)
    cleanup.append(run.kill_group)
    cleanup.append(run.stop)
    gi.say(f"daemon: config {run.config}, exporter {run.exporter_url}")
    try:
        t0 = time.monotonic()
        run.start()
        pgid = run.wait_ready(budget, None)
        worker = gi.wait_worker(run, pgid, budget)
        rows.append(Row("start", True, "ready", time.monotonic() - t0, None, poller.memory_used_mib(),
                        f"engine {pgid}, worker {worker.pid}: {worker.status.get('dim')}^2 x {standin.LAYERS} bf16, "
                        f"{worker.status.get('step_ms', 0):.2f} ms/step"))  # fmt: skip
        gi.say(f"engine {pgid} ready, worker {worker.pid} computing")
        streams = gi.Streams(run.url, args.streams).start()
        cleanup.append(streams.stop)
        probe = Probe(poller, run, worker.pid, streams)
        run.wait(lambda st: st["engine"]["pid"] == pgid and (st["metrics"]["running"] or 0) >= args.streams, 30, "streams running", budget)
        lone = one_engine_process(poller, pgid, worker.pid)
        if lone:
            gi.say(f"warning: {lone}: the daemon will refuse to suspend")
        restarts0 = run.restarts()

        # ---------------------------------------------------------- suspend
        before = probe.read()
        gi.say(f"suspend --wait: NVML {before.device_mib} MiB used, worker {before.worker_mib} MiB, RSS {gi.fmt(before.worker_rss_mib)} MiB")
        sus = run.ctl("suspend", "--wait", "--json", timeout=ctl_timeout(run, budget, False))
        success["suspend"] = sus.rc == 0 and sus.doc.get("result") == "suspended"
        after = probe.until(lambda r: r.worker_mib is None, SETTLE_S) if success["suspend"] else probe.read()
        st = run.state() or {}
        section = st.get("suspend") or {}
        hz = run.healthz_until(503, SETTLE_S) if success["suspend"] else run.healthz()
        status = run.ctl("status", "--json", timeout=budget.cap(60))
        rss_growth = None if after.worker_rss_mib is None or before.worker_rss_mib is None else after.worker_rss_mib - before.worker_rss_mib
        note = [f"rc {sus.rc}", sus.doc.get("detail") or sus.doc.get("error") or sus.stderr[-200:],
                f"frozen requests {section.get('frozen_requests')}",
                f"worker NVML {mib(before.worker_mib)} -> {mib(after.worker_mib)} MiB (daemon: {int(section.get('gpu_bytes') or 0) // MIB} MiB)",
                f"worker RSS +{rss_growth:.0f} MiB" if rss_growth is not None else "worker RSS -"]  # fmt: skip
        if lone:
            note.append(lone)
        rows.append(Row("suspend", success["suspend"], sus.doc.get("result") or f"exit {sus.rc}", sus.seconds,
                        before.device_mib, after.device_mib, "; ".join(n for n in note if n)))  # fmt: skip
        rows.append(Row("healthz (suspended)", hz[0] == 503, str(hz[0]), None, None, None, hz[1][:80]))
        rows.append(Row("status (suspended)", status.rc == WARNING, f"exit {status.rc}", status.seconds, None, None,
                        "; ".join(status.doc.get("reasons") or []) or status.stderr[-200:]))  # fmt: skip
        if not success["suspend"]:
            print(gi.diagnose(run, poller))
            return finish(rows, success)

        # ---------------------------------------------------------- hold
        gi.say(f"suspended in {sus.seconds:.1f} s; holding {args.hold:g} s")
        t_hold = time.monotonic()
        phases, most = set(), restarts0 or 0
        while time.monotonic() - t_hold < budget.cap(args.hold):
            st = run.state()
            if st is not None:  # None: the file was being replaced
                phases.add(st["engine"]["phase"])
                most = max(most, st["restarts"]["total"] or 0)
            time.sleep(0.5)
        held = probe.read()
        frozen = held.worker_steps == after.worker_steps
        success["no_restart"] = most == (restarts0 or 0) == 0
        rows.append(Row("hold", success["no_restart"] and phases == {"suspended"} and frozen, f"restarts {most}",
                        time.monotonic() - t_hold, after.device_mib, held.device_mib,
                        f"phases {sorted(map(str, phases))}; worker steps {after.worker_steps} -> {held.worker_steps} "
                        f"({'frozen' if frozen else 'ADVANCED while suspended'}); stream chunks +{held.chunks - after.chunks}"))  # fmt: skip

        # ---------------------------------------------------------- resume
        res = run.ctl("resume", "--wait", "--json", timeout=ctl_timeout(run, budget, True))
        success["resume"] = res.rc == 0 and res.doc.get("result") == "resumed"
        back = probe.until(lambda r: r.worker_mib is not None and (r.worker_steps or 0) > (held.worker_steps or 0), SETTLE_S)
        flowing = probe.until(lambda r: r.chunks > back.chunks, SETTLE_S)
        hz = run.healthz_until(200, SETTLE_S)
        total = run.restarts()
        success["no_restart"] = success["no_restart"] and total == 0
        alive = sum(t.is_alive() for t in streams.threads)
        rows.append(Row("resume", success["resume"], res.doc.get("result") or f"exit {res.rc}", res.seconds, held.device_mib, back.device_mib,
                        f"rc {res.rc}; {res.doc.get('detail') or res.doc.get('error') or res.stderr[-200:]}; "
                        f"worker NVML {mib(back.worker_mib)} MiB, RSS {back.worker_rss_mib or 0:.0f} MiB; "
                        f"worker steps {held.worker_steps} -> {back.worker_steps}"))  # fmt: skip
        rows.append(Row("healthz (resumed)", hz[0] == 200, str(hz[0]), None, None, None, hz[1][:80]))
        rows.append(Row("restarts", total == 0, f"total {total}", None, None, None, "the state file's restarts.total after resume"))
        rows.append(Row("streams", flowing.chunks > back.chunks and alive == args.streams, f"{alive}/{args.streams} open", None, None, None,
                        f"chunks {before.chunks} before suspend, {held.chunks} at resume, {flowing.chunks} after"))  # fmt: skip
        streams.stop()

        # ---------------------------------------------------------- suspend --test
        if success["resume"]:
            run.wait(lambda st: st["engine"]["phase"] == "ready", SETTLE_S, "the engine ready after resume", budget)
            ready = probe.read()
            test = run.ctl("suspend", "--test", "--json", timeout=budget.cap(2 * ctl_timeout(run, budget, True)))
            d = test.doc
            steps = {**(d.get("suspend_steps") or {}), **(d.get("resume_steps") or {})}
            freed = d.get("vram_freed_bytes")
            rows.append(Row("suspend --test", test.rc == 0 and bool(d.get("ok")), f"exit {test.rc}", test.seconds, ready.device_mib, probe.read().device_mib,
                            f"suspend {gi.fmt(d.get('suspend_s'))} s, resume {gi.fmt(d.get('resume_s'))} s, completion {gi.fmt(d.get('completion_s'))} s; "
                            + ", ".join(f"{k} {v:.2f} s" for k, v in steps.items())
                            + f"; VRAM freed {'-' if freed is None else freed // MIB} MiB; {d.get('error') or test.stderr[-200:]}"))  # fmt: skip
            total = run.restarts()
            success["no_restart"] = success["no_restart"] and total == 0
            rows.append(Row("restarts", total == 0, f"total {total}", None, None, None, "after suspend --test"))
    except gi.OutOfTime as exc:
        gi.say(str(exc))
        rows.append(Row("budget", False, "ran out", None, None, None, str(exc)))
    except RuntimeError as exc:
        gi.say(f"error: {exc}")
        rows.append(Row("error", False, "error", None, None, None, str(exc).splitlines()[0]))
    return finish(rows, success)


def finish(rows: list[Row], success: dict[str, bool]) -> int:
    print(gi.table(["step", "result", "ok", "seconds", "VRAM before MiB", "VRAM after MiB", "notes"],
                   [[r.step, r.result, "yes" if r.ok else "NO", gi.fmt(r.seconds), mib(r.before_mib), mib(r.after_mib), r.notes] for r in rows]))  # fmt: skip
    print("\nVRAM: NVML's memory used on the whole device; the worker's own figure is in the notes.")
    good = all(success.values())
    print("result: " + ("suspend and resume succeeded with no restart" if good else
                        f"FAILED: suspend {'ok' if success['suspend'] else 'failed'}, resume {'ok' if success['resume'] else 'failed'}, "
                        f"restarts {'none' if success['no_restart'] else 'SEEN'}"))  # fmt: skip
    return 0 if good else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weight-gib", type=float, default=10.0, help="GiB of bf16 weights the worker holds (default 10)")
    parser.add_argument("--streams", type=int, default=2, help="long streaming completions running through the suspension (default 2)")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds to stay suspended (default 10)")
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU (default 0)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 480)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (config, logs)")
    args = parser.parse_args()
    if args.streams < 1 or args.weight_gib <= 0 or args.hold < 0:
        parser.error("--streams and --weight-gib must be positive, --hold not negative")

    return gi.run_cleanly("gpu_suspend_daemon", "r3090d-gpu-suspend-", bench, args)


if __name__ == "__main__":
    sys.exit(main())
