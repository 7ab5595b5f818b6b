"""Swap mode end to end: the daemon, its router, two vLLM doubles, and a GPU faked at its two boundaries.

NVML is tests/fakenvml (a JSON card this test keeps: each engine's fake-EngineCore is
listed once it runs, as a real card lists vLLM's EngineCore), the checkpoint calls are
tests/fakecuda (lock SIGSTOPs the core, checkpoint takes it off the card, restore puts
it back). Everything else is real: the daemon, the router (aiohttp, its own process),
the link between them, r3090ctl and HTTP clients on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from r3090d.effectors.checkpoint import FAKE_ENV
from tests.ctl_harness import ctl
from tests.daemon_harness import DaemonProcess, free_port, free_port_block, toml_value
from tests.waiting import wait_until

pytestmark = pytest.mark.component

ROOT = Path(__file__).resolve().parents[2]
FAKE_PATHS = f"{ROOT / 'tests' / 'fakenvml'}{os.pathsep}{ROOT / 'tests' / 'fakecuda'}"
ENGINE_MIB = 15349
TOTAL_MIB = 24576  # one engine fits, two do not
BOUND = 90.0  # a worker process per driver operation, two engines and a router on a busy 2-core machine
STREAM_TOKENS = 60
TOKEN_DELAY = 0.05  # 3 s per stream: longer than the swap's drain deadline below, so the streams are frozen


def write_atomically(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def swap_config(tmp: Path, engine_python: str, runtime_dir: Path, *, models=("alpha", "beta"), swap=None, gpu=True, extra=None,
                kinds=None, watchdog=None, listen=None, park=None, model_args=None) -> tuple[Path, int, int]:  # fmt: skip
    """A swap-mode config: one [[models]] entry per name, each a directory of its own (`kinds`: name -> kind; `park`:
    name -> park; `model_args`: name -> the double's extra flags). (path, router port, exporter port)."""
    port, exporter = free_port(), free_port()
    lines = ['profile = "none"', "[engine]", f"python = {toml_value(engine_python)}", 'host = "127.0.0.1"', f"port = {port}",
             "shutdown_timeout = 5", "startup_timeout = 60"] + ([f"listen = {toml_value(listen)}"] if listen else [])  # fmt: skip
    for name in models:
        model = tmp / f"model-{name}"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text("{}")
        lines += ["[[models]]", f"name = {toml_value(name)}", f"model = {toml_value(str(model))}",
                  f"extra_args = {toml_value(['--fake-token-delay', str(TOKEN_DELAY), *(model_args or {}).get(name, ())])}"]  # fmt: skip
        if (park or {}).get(name):
            lines.append(f"park = {toml_value(park[name])}")
        if (kinds or {}).get(name):
            lines.append(f"kind = {toml_value(kinds[name])}")
    sections = {
        "swap": {"min_residency": 0.0, "drain_timeout": 1.0, "queue_timeout": 60.0, "engine_port_base": free_port_block(len(models)),
                 "host_memory_budget_mib": 65536, **(swap or {})},  # this host's own budget may not hold a 15 GiB engine
        "gpu": {"required": gpu, "card": "any"},
        "watchdog": {"poll_interval": 0.2, "health_timeout": 1.0, "metrics_timeout": 1.0, "probe_idle_seconds": 600, "stall_seconds": 30.0,
                     "min_uptime": 0.0, "lb_grace": 0.5, **(watchdog or {})},
        "suspend": {"verify_timeout": 30.0, "lock_timeout": 2.0},
        "alerts.syslog": {"enabled": False},
        "daemon": {"state_dir": str(tmp / "state"), "runtime_dir": str(runtime_dir), "exporter_enabled": True, "exporter_port": exporter},
        **(extra or {}),
    }  # fmt: skip
    for name, table in sections.items():
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    path = tmp / "swap.toml"
    path.write_text("\n".join(lines) + "\n")
    return path, port, exporter


class Card:
    """The fake card: every engine core that runs is listed with ENGINE_MIB (the checkpoint driver takes it off and
    puts it back); a core that is gone is dropped. `held_by`: (pid, MiB) of processes outside the daemon on the card."""

    def __init__(self, path: Path, held_by=(), extra: dict | None = None):
        self.path = path
        self.daemon_pid: int | None = None  # only this daemon's engines: other tests may run doubles too
        self.seen: set[int] = set()
        self.stop = threading.Event()
        self.lock = threading.Lock()  # one read-modify-write of the card at a time: keep() and release()
        procs = [list(h) for h in held_by]
        write_atomically(path, {"memory_total_mib": TOTAL_MIB, "memory_used_mib": sum(mib for _, mib in procs), "util": 50,
                                "processes": procs, **(extra or {})})  # fmt: skip

    def keep(self) -> None:
        while not self.stop.wait(0.05):
            cores = self.cores()
            new, gone = cores - self.seen, {pid for pid in self.seen if pid not in cores}
            if not new and not gone:
                continue
            with self.lock:
                card = json.loads(self.path.read_text())
                procs = [[pid, mib] for pid, mib in card["processes"] if pid not in gone] + [[pid, ENGINE_MIB] for pid in sorted(new)]
                write_atomically(self.path, {**card, "processes": procs, "memory_used_mib": sum(mib for _, mib in procs)})
            self.seen = (self.seen | new) - gone

    def release(self, pid: int) -> None:
        """A process outside the daemon lets go of the card."""
        with self.lock:
            card = json.loads(self.path.read_text())
            procs = [[p, mib] for p, mib in card["processes"] if p != pid]
            write_atomically(self.path, {**card, "processes": procs, "memory_used_mib": sum(mib for _, mib in procs)})

    def cores(self) -> set[int]:
        if self.daemon_pid is None:
            return set()
        try:
            family = psutil.Process(self.daemon_pid).children(recursive=True)
        except psutil.Error:
            return set()
        out = set()
        for p in family:
            try:
                if p.name() == "fake-EngineCore":
                    out.add(p.pid)
            except psutil.Error:
                pass
        return out


@pytest.fixture
def swap_rig(tmp_path, fake_engine_python):
    started = []

    def start(preflight=False, held_by=(), card_extra: dict | None = None, **kw):
        """`preflight`: run it (with a give-up of 1 s) rather than --skip-preflight; `held_by`: see Card;
        `card_extra`: keys of the fake card from the start (tests/fakenvml), e.g. {"fail": ...}."""
        runtime = Path(tempfile.mkdtemp(prefix="r3090d-", dir="/tmp"))
        if preflight:
            kw["extra"] = {**kw.get("extra", {}), "preflight": {"transient_retry_s": 0.5, "transient_give_up_s": 1.0}}
        config, port, exporter = swap_config(tmp_path, fake_engine_python, runtime, **kw)
        card = Card(tmp_path / "card.json", held_by, card_extra)
        control = tmp_path / "cuda.json"
        write_atomically(control, {"log": str(tmp_path / "calls.jsonl")})
        args = () if preflight else ("--skip-preflight",)
        proc = DaemonProcess(config, tmp_path / "daemon.log", *args)
        proc._log = open(proc.log_path, "ab")  # noqa: SIM115 (closed by cleanup)
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "R3090D_CONFIG", "R3090D_INSTANCE")}
        env.update(PYTHONPATH=FAKE_PATHS, R3090D_FAKE_NVML=str(card.path), **{FAKE_ENV: str(control)})
        proc.proc = subprocess.Popen([sys.executable, "-m", "r3090d", "--config", str(config), *args], stdout=proc._log,
                                     stderr=subprocess.STDOUT, env=env)  # fmt: skip
        card.daemon_pid = proc.proc.pid
        threading.Thread(target=card.keep, daemon=True).start()
        rig = SwapRig(proc, config, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{exporter}", card)
        started.append((rig, runtime))
        # The router listens once it has started and taken the daemon's table.
        proc.wait_for(lambda st: (st.get("swap") or {}).get("router", {}).get("linked"), BOUND, "the router, linked")
        wait_until(lambda: httpx.get(rig.url + "/v1/models", timeout=2.0, trust_env=False).status_code == 200, BOUND,
                   what="the router's /v1/models", ignoring=(httpx.HTTPError,))  # fmt: skip
        return rig

    yield start
    for rig, runtime in started:
        rig.card.stop.set()
        rig.proc.cleanup()
        shutil.rmtree(runtime, ignore_errors=True)


class SwapRig:
    def __init__(self, proc: DaemonProcess, config: Path, url: str, exporter: str, card: Card):
        self.proc, self.config, self.url, self.exporter, self.card = proc, config, url, exporter, card

    def model(self, st: dict, name: str) -> dict:
        return next(m for m in st["models"] if m["name"] == name)

    def engine_get(self, st: dict, name: str, path: str) -> httpx.Response:
        """GET `path` from `name`'s engine itself, on its unix socket (or its port), as the daemon's user."""
        address = self.model(st, name)["engine"]["url"]
        if address.startswith("unix:"):
            with httpx.Client(transport=httpx.HTTPTransport(uds=address.removeprefix("unix:")), trust_env=False, timeout=5.0) as c:
                return c.get("http://localhost" + path)
        return httpx.get(f"http://127.0.0.1:{self.model(st, name)['port']}{path}", timeout=5.0, trust_env=False)

    def wait_model(self, name: str, residency: str, timeout: float = BOUND) -> dict:
        return self.proc.wait_for(lambda st: st if self.model(st, name)["residency"] == residency else None, timeout, f"{name} {residency}")

    def complete(self, model: str, tokens: int = 5, timeout: float = BOUND) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": tokens}, timeout=timeout,
                          trust_env=False)  # fmt: skip


class Stream:
    """One streaming completion in a thread: its chunks' arrival times, and how it ended."""

    def __init__(self, url: str, model: str, tokens: int):
        self.chunks: list[float] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.ended_at: float | None = None
        body = {"model": model, "prompt": "hi", "max_tokens": tokens, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=httpx.Timeout(BOUND * 2), trust_env=False) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    self.chunks.append(time.monotonic())
                    choice = json.loads(line[6:])["choices"][0]
                    self.finish = choice.get("finish_reason") or self.finish
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.ended_at = time.time()


def test_a_swap_under_load_freezes_the_outgoing_engines_streams_and_they_finish_after_it_returns(swap_rig):
    r = swap_rig()
    assert r.complete("alpha").status_code == 200  # alpha comes in cold
    st = r.wait_model("alpha", "ready")
    wait_until(lambda: any(p[0] for p in json.loads(r.card.path.read_text())["processes"]), BOUND, what="alpha's core on the card")
    r.proc.wait_for(lambda s: (s.get("gpu") or {}).get("processes"), BOUND, "NVML to list alpha's core")
    # The canary's baseline, taken at alpha's first idle moment: what its resume must give back.
    r.proc.wait_for(lambda s: r.model(s, "alpha")["canary"]["baseline_tokens"], BOUND, "alpha's canary baseline")

    streams = [Stream(r.url, "alpha", STREAM_TOKENS) for _ in range(3)]
    wait_until(lambda: all(s.chunks for s in streams), BOUND, what="the three streams' first tokens")
    beta = r.complete("beta")  # alpha is parked with the streams frozen in it, beta starts cold
    assert beta.status_code == 200, beta.text
    st = r.proc.state()
    alpha = r.model(st, "alpha")
    assert alpha["residency"] in ("parked", "resuming", "ready"), alpha["residency"]
    assert not any(s.finish for s in streams), "a stream finished while its engine was parked"

    # alpha's frozen requests are pending work: beta is parked and alpha comes back by itself.
    st = r.wait_model("alpha", "ready")
    back_at = r.model(st, "alpha")["engine"]["ready_since"]
    for s in streams:
        s.thread.join(BOUND)
    assert [(s.finish, s.error, len(s.chunks)) for s in streams] == [("length", None, STREAM_TOKENS)] * 3
    assert all(s.ended_at > back_at for s in streams), "every frozen stream ends after alpha's return"
    gaps = [max(b - a for a, b in zip(s.chunks, s.chunks[1:], strict=False)) for s in streams]
    assert min(gaps) >= 1.0, f"each stream paused while its engine was parked: longest gaps {gaps}"

    st = r.proc.state()
    assert r.model(st, "beta")["residency"] == "parked"
    assert r.model(st, "alpha")["swaps_in"] == 2 and r.model(st, "alpha")["swaps_out"] == 1
    assert [r.model(st, m)["restarts"]["total"] for m in ("alpha", "beta")] == [0, 0]
    last = st["swap"]["last"]
    assert last["ok"] and last["to_model"] == "alpha" and last["from_model"] == "beta" and not last["cold"]
    assert last["restore_s"] is not None and last["checkpoint_s"] is not None
    canary = r.model(st, "alpha")["canary"]
    assert canary["checks"] >= 1 and canary["last_verdict"] == "match", canary  # the resumed engine gave the known answer
    assert "Traceback" not in r.proc.log()


def test_the_router_killed_mid_stream_is_started_again_and_serves(swap_rig):
    r = swap_rig(models=("alpha",), gpu=False)
    assert r.complete("alpha").status_code == 200
    st = r.proc.state()
    router = st["swap"]["router"]["pid"]
    s = Stream(r.url, "alpha", STREAM_TOKENS)
    wait_until(lambda: s.chunks, BOUND, what="the stream's first token")
    killed_at = time.monotonic()
    os.kill(router, signal.SIGKILL)
    s.thread.join(BOUND)
    assert s.finish is None and (s.error or len(s.chunks) < STREAM_TOKENS), "the stream through the killed router ended early"
    st = r.proc.wait_for(lambda st: st if st["swap"]["router"]["pid"] not in (None, router) and st["swap"]["router"]["linked"] else None,
                         BOUND, "a new router, linked")  # fmt: skip
    assert st["swap"]["router"]["restarts"] == 1
    ok = wait_until(lambda: r.complete("alpha", timeout=5.0).status_code == 200, BOUND, what="a completion through the new router",
                    ignoring=(httpx.HTTPError,))  # fmt: skip
    assert ok
    assert f"router (pid {router}) killed by SIGKILL; starting it again" in r.proc.log()
    assert time.monotonic() - killed_at < BOUND


def test_swap_by_hand_and_status_show_each_model(swap_rig):
    r = swap_rig(gpu=False)
    out = ctl(r.config, "swap", "beta")
    assert out.returncode == 0, out.stdout + out.stderr
    r.wait_model("beta", "ready")
    out = ctl(r.config, "status")
    assert "beta" in out.stdout and "alpha" in out.stdout and out.returncode == 0, out.stdout + out.stderr
    models = httpx.get(r.url + "/v1/models", timeout=5.0, trust_env=False).json()
    assert sorted(m["id"] for m in models["data"]) == ["alpha", "beta"]
    missing = httpx.post(r.url + "/v1/completions", json={"model": "gamma", "prompt": "x"}, timeout=5.0, trust_env=False)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_sigterm_drains_every_running_engine_at_once_and_their_streams_finish(swap_rig):
    r = swap_rig(gpu=False, swap={"max_resident": 2})
    for name in ("alpha", "beta"):
        assert r.complete(name).status_code == 200
    r.proc.wait_for(lambda st: all(m["residency"] == "ready" for m in st["models"]), BOUND, "both engines ready")
    streams = [Stream(r.url, name, STREAM_TOKENS) for name in ("alpha", "beta")]
    wait_until(lambda: all(s.chunks for s in streams), BOUND, what="both streams' first tokens")
    trees = [pid for m in r.proc.state()["models"] for pid in m["engine"]["tree_pids"]]
    r.proc.proc.send_signal(signal.SIGTERM)
    assert r.proc.wait_exit(BOUND) == 0
    for s in streams:
        s.thread.join(BOUND)
    assert [(s.finish, s.error, len(s.chunks)) for s in streams] == [("length", None, STREAM_TOKENS)] * 2
    log = r.proc.log()
    # Both drained stops were asked for before either stream ended: the engines drained side by side, not one by one.
    asked = [line for line in log.splitlines() if "stopping engine (drained, shutdown)" in line]
    assert len(asked) == 2, log[-3000:]
    first_end = min(s.chunks[-1] for s in streams)
    assert all(_log_time(line) < _wall(first_end) for line in asked), (asked, first_end)
    assert trees and not [pid for pid in trees if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def _log_time(line: str) -> float:
    stamp = line[:23]  # "2026-12-02 14:40:26,444"
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:23]) / 1000


def _wall(monotonic_t: float) -> float:
    return time.time() - (time.monotonic() - monotonic_t)


def test_an_embedding_model_is_probed_with_embeddings_and_served_through_the_router(swap_rig):
    r = swap_rig(gpu=False, kinds={"search": "embed"}, models=("alpha", "search"), watchdog={"probe_idle_seconds": 1.0})
    out = httpx.post(r.url + "/v1/embeddings", json={"model": "search", "input": ["a", "b"]}, timeout=BOUND, trust_env=False)
    assert out.status_code == 200, out.text
    assert [d["index"] for d in out.json()["data"]] == [0, 1]
    st = r.wait_model("search", "ready")
    # The liveness probe of an embedding engine is a 1-input embedding request, never a completion.
    r.proc.wait_for(lambda st: r.model(st, "search")["inference"]["ok"] is True, BOUND, "a passing probe of the embedding engine")
    log = r.engine_get(st, "search", "/fake/requests").json()["requests"]
    paths = {e["path"] for e in log if e["method"] == "POST"}
    assert "/v1/embeddings" in paths and "/v1/completions" not in paths, paths
    assert r.model(st, "search")["canary"]["enabled"] is False


def test_a_gpu_lent_by_the_operator_holds_every_swap_until_resume(swap_rig):
    r = swap_rig()
    assert r.complete("alpha").status_code == 200
    r.wait_model("alpha", "ready")
    r.proc.wait_for(lambda s: (s.get("gpu") or {}).get("processes"), BOUND, "NVML to list alpha's core")
    out = ctl(r.config, "suspend", "--model", "alpha", "--wait", timeout=BOUND)
    assert out.returncode == 0, out.stdout + out.stderr
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.setdefault("beta", r.complete("beta")), daemon=True)
    waiter.start()
    r.proc.wait_for(lambda st: r.model(st, "beta")["waiting"] == 1, BOUND, "beta's request waiting at the router")
    wait_until(lambda: "the GPU is lent (alpha suspended by the operator)" in r.proc.log(), BOUND, what="the arbiter holding")
    st = r.proc.state()
    assert r.model(st, "beta")["residency"] == "cold" and r.model(st, "alpha")["residency"] == "parked"
    out = ctl(r.config, "resume", "--model", "alpha", "--wait", timeout=BOUND)
    assert out.returncode == 0, out.stdout + out.stderr
    waiter.join(BOUND)
    assert result["beta"].status_code == 200, result["beta"].text  # once the card is back, beta's turn comes


def test_a_card_held_by_others_at_boot_leaves_the_daemon_up_and_the_model_asked_for_waits_naming_them(swap_rig):
    """Preflight finds the card taken: the daemon does not exit 75 after preflight's give-up (1 s here) but serves
    through its router; the model asked for waits in waiting-for-gpu naming the holder, and starts once it lets go."""
    borrower = os.getpid()  # a real process, so its name can be read
    r = swap_rig(models=("alpha",), preflight=True, held_by=((borrower, 20000),))
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.setdefault("alpha", r.complete("alpha")), daemon=True)
    waiter.start()
    st = r.proc.wait_for(lambda st: st if r.model(st, "alpha")["engine"]["phase"] == "waiting-for-gpu" else None, BOUND,
                         "alpha waiting for the GPU")  # fmt: skip
    assert [h["pid"] for h in r.model(st, "alpha")["healing"]["gpu_wait_holders"]] == [borrower]
    assert "preflight vram WARN" in r.proc.log()
    # Well past preflight's give-up: still up, alpha still waiting, its request still queued at the router.
    r.proc.wait_for(lambda s: r.model(s, "alpha")["engine"]["phase"] == "waiting-for-gpu" and s["written_at"] > st["written_at"] + 2.0,
                    BOUND, "two seconds of waiting-for-gpu")  # fmt: skip
    assert "alpha" not in result
    r.card.release(borrower)
    waiter.join(BOUND)
    assert result["alpha"].status_code == 200, result["alpha"].text
    assert r.model(r.proc.state(), "alpha")["restarts"]["start_failures"] == 0


def test_on_cpu_a_busy_outgoing_engine_is_closed_and_stopped_only_once_its_streams_finished(swap_rig):
    """No checkpoint here: stopping a busy engine would cut its streams (a drain is bounded), so it takes no new
    request, finishes what it runs, and only then makes room."""
    r = swap_rig(gpu=False)
    assert r.complete("alpha").status_code == 200
    r.wait_model("alpha", "ready")
    long = Stream(r.url, "alpha", 160)  # 8 s at the double's pace: longer than the engine's shutdown_timeout of 5 s
    wait_until(lambda: long.chunks, BOUND, what="the stream's first token")
    beta = r.complete("beta")
    assert beta.status_code == 200, beta.text
    long.thread.join(BOUND)
    assert (long.finish, long.error, len(long.chunks)) == ("length", None, 160)
    log = r.proc.log()
    assert "it takes no new request and is stopped once its 1 running finish" in log, log[-3000:]
    st = r.proc.state()
    assert r.model(st, "alpha")["residency"] == "cold" and st["swap"]["last"]["drain_s"] is not None


def test_a_cold_started_model_is_routed_only_after_its_first_canary(swap_rig):
    r = swap_rig(gpu=False)
    assert r.complete("beta", tokens=3).status_code == 200
    st = r.wait_model("beta", "ready")
    log = r.engine_get(st, "beta", "/fake/requests").json()["requests"]
    completions = [e for e in log if e["method"] == "POST" and e["path"] == "/v1/completions"]
    assert completions and "logprobs" in json.dumps(completions[0].get("body")), completions[:2]  # the canary went first
    assert st["swap"]["last"]["canary_s"] is not None


# ------------------------------------------------------------------ park by sleep ([[models]].park = "sleep")

SLEEPERS = {"alpha": "sleep", "beta": "sleep"}


def fake_state(r: SwapRig, name: str) -> dict:
    """The double's own account of its engine (its sleep section: sleeps, wakes, faults)."""
    return r.engine_get(r.proc.state(), name, "/fake/state").json()


def checkpoint_calls(tmp: Path) -> list[str]:
    log = tmp / "calls.jsonl"
    return log.read_text().splitlines() if log.exists() else []


def test_a_swap_parks_by_sleep_and_the_woken_engine_is_routed_once_its_canary_matches(swap_rig, tmp_path):
    r = swap_rig(park=SLEEPERS)
    assert r.complete("alpha").status_code == 200  # alpha comes in cold
    r.wait_model("alpha", "ready")
    r.proc.wait_for(lambda s: r.model(s, "alpha")["canary"]["baseline_tokens"], BOUND, "alpha's canary baseline")
    alpha_pid = r.model(r.proc.state(), "alpha")["engine"]["pid"]

    beta = r.complete("beta")  # alpha sleeps, beta starts cold
    assert beta.status_code == 200, beta.text
    st = r.wait_model("alpha", "parked")
    alpha = r.model(st, "alpha")
    assert alpha["engine"]["pid"] == alpha_pid, "a sleeping engine keeps its process"
    assert alpha["host_bytes"] > 0  # its weights in pinned host memory count in the host budget
    sleep = fake_state(r, "alpha")["sleep"]
    assert (sleep["enabled"], sleep["dev_mode"], sleep["is_sleeping"], sleep["sleeps"]) == (True, True, True, 1), sleep

    back = r.complete("alpha")  # beta sleeps, alpha wakes: routed only once its canary gave the known answer
    assert back.status_code == 200, back.text
    st = r.wait_model("alpha", "ready")
    alpha = r.model(st, "alpha")
    assert alpha["engine"]["pid"] == alpha_pid and alpha["restarts"]["total"] == 0
    assert alpha["canary"]["checks"] >= 1 and alpha["canary"]["last_verdict"] == "match", alpha["canary"]
    assert r.model(st, "beta")["residency"] == "parked" and fake_state(r, "beta")["sleep"]["is_sleeping"]
    assert not fake_state(r, "alpha")["sleep"]["is_sleeping"]
    assert [r.model(st, m)["restarts"]["total"] for m in ("alpha", "beta")] == [0, 0]
    assert checkpoint_calls(tmp_path) == [], "a park by sleep asks nothing of the checkpoint driver"
    log = r.proc.log()
    assert "parking the engine by sleep" in log and "waking the sleeping engine" in log
    assert "Traceback" not in log


def test_a_wake_that_corrupts_the_weights_is_caught_by_the_canary_and_the_engine_restarts_cold(swap_rig):
    r = swap_rig(park=SLEEPERS, model_args={"alpha": ["--fake-wake-corrupts"]})
    assert r.complete("alpha").status_code == 200
    r.wait_model("alpha", "ready")
    r.proc.wait_for(lambda s: r.model(s, "alpha")["canary"]["baseline_tokens"], BOUND, "alpha's canary baseline")
    alpha_pid = r.model(r.proc.state(), "alpha")["engine"]["pid"]
    assert r.complete("beta").status_code == 200  # alpha sleeps
    r.wait_model("alpha", "parked")

    back = r.complete("alpha")  # woken with changed weights: the canary sees it, alpha restarts cold and serves
    assert back.status_code == 200, back.text
    st = r.wait_model("alpha", "ready")
    alpha = r.model(st, "alpha")
    assert alpha["engine"]["pid"] != alpha_pid, "the corrupted engine was replaced"
    assert alpha["restarts"]["by_reason"].get("wrong_output") == 1, alpha["restarts"]
    assert alpha["fleet"]["sleep_failures"] == 1 and not alpha["fleet"]["sleep_off"], alpha["fleet"]
    assert fake_state(r, "alpha")["sleep"]["corrupt_wakes"] == 0  # the new engine has never been woken
    log = r.proc.log()
    assert "swap: alpha's wake failed (wrong output after resume" in log and "1 in a row" in log, log
    assert "Traceback" not in log


def test_a_sleep_that_hangs_falls_back_to_a_drained_stop_and_nothing_is_lost(swap_rig):
    r = swap_rig(park=SLEEPERS, model_args={"alpha": ["--fake-sleep-hangs"]}, swap={"sleep_timeout": 3.0})
    assert r.complete("alpha").status_code == 200
    r.wait_model("alpha", "ready")
    r.proc.wait_for(lambda s: r.model(s, "alpha")["canary"]["baseline_tokens"], BOUND, "alpha's canary baseline")
    stream = Stream(r.url, "alpha", STREAM_TOKENS)  # runs through the pause: /pause?mode=wait lets it finish
    wait_until(lambda: stream.chunks, BOUND, what="the stream's first token")
    beta = r.complete("beta")  # alpha's sleep hangs: past swap.sleep_timeout it is resumed and stopped drained
    assert beta.status_code == 200, beta.text
    stream.thread.join(BOUND)
    assert (stream.finish, stream.error, len(stream.chunks)) == ("length", None, STREAM_TOKENS)
    st = r.wait_model("alpha", "cold")
    assert r.model(st, "alpha")["fleet"]["sleep_failures"] == 1
    log = r.proc.log()
    assert "swap: alpha's park by sleep failed (sleep failed: " in log and "the engine is stopped drained, to cold" in log, log
    again = r.complete("alpha")  # started cold, beta parked by sleep
    assert again.status_code == 200, again.text
    assert "Traceback" not in r.proc.log()


def test_a_wake_that_answers_500_restarts_the_engine_cold_and_its_request_is_served(swap_rig):
    r = swap_rig(park=SLEEPERS, model_args={"alpha": ["--fake-wake-500"]})
    assert r.complete("alpha").status_code == 200
    r.wait_model("alpha", "ready")
    r.proc.wait_for(lambda s: r.model(s, "alpha")["canary"]["baseline_tokens"], BOUND, "alpha's canary baseline")
    assert r.complete("beta").status_code == 200  # alpha sleeps
    r.wait_model("alpha", "parked")
    back = r.complete("alpha")  # its /wake_up answers 500: restarted cold, the request waits for the new engine
    assert back.status_code == 200, back.text
    st = r.wait_model("alpha", "ready")
    alpha = r.model(st, "alpha")
    assert alpha["restarts"]["by_reason"].get("resume_failed") == 1, alpha["restarts"]
    assert alpha["fleet"]["sleep_failures"] == 1
    log = r.proc.log()
    assert "swap: alpha's wake failed (wake failed: POST /wake_up: HTTP 500" in log, log
    assert "Traceback" not in log
