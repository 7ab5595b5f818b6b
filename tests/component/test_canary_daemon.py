"""The known-answer canary, end to end: the daemon, the vLLM double, real HTTP.

The double answers a greedy request as a function of its prompt and gives vLLM's
completions logprobs; its `canary_fault` control makes logprobs-bearing answers
take the runner-up from a position on, with a chosen margin, as corrupted weights
or a botched restore would. The daemon cannot tell the double from vLLM.

One daemon shows the periodic canary (a baseline once idle, a match while streams
run, a near tie that is only inconclusive, a mismatch that restarts the engine);
the fake checkpoint interface shows the canary around a suspension, idle and with
streams frozen with the engine; two daemons on one state_dir show the start
comparison, a warning only.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from r3090d.config.schema import DEFAULT_CANARY_PROMPT
from r3090d.service import forensics
from r3090d.service.baselines import FILE_NAME as BASELINES_FILE
from tests.component.test_gpu_idle import streams  # endless streams: requests keep running
from tests.component.test_suspend_daemon import Rig, proc_state
from tests.ctl_harness import Daemon, ctl
from tests.waiting import wait_until

pytestmark = pytest.mark.component

INTERVAL = 10.0  # canary.interval's minimum
SEED = 4242
CANARY = {"interval": INTERVAL, "timeout": 10.0, "seed": SEED}
BOUND = 60.0  # generous: a loaded 2-core machine
LONG = 5000  # tokens of a stream frozen with the engine: 100 s at the suspend rig's 0.02 s a token
# The double's greedy answers, as the daemon's canary asks for them (a prompt of its own, so nothing else shares it).
CANARY_BODY = {"model": "fake-model", "prompt": DEFAULT_CANARY_PROMPT, "max_tokens": 16, "temperature": 0, "seed": SEED,
               "ignore_eos": True, "logprobs": 2, "return_tokens_as_token_ids": True}  # fmt: skip


# ------------------------------------------------------------------ helpers


def control(d: Daemon, **changes) -> dict:
    r = d.fake("POST", "/fake/control", json=changes)
    assert r.status_code == 200, r.text
    return r.json()


def canaries(d: Daemon) -> list[dict]:
    """The canary requests in the double's request log, oldest first."""
    log = d.fake("GET", "/fake/requests").json()["requests"]
    return [r for r in log if r["path"] == "/v1/completions" and (r.get("body") or {}).get("logprobs") == 2]


def canary_text(d: Daemon) -> str:
    """What the double answers the canary now (its control as it stands)."""
    r = d.fake("POST", "/v1/completions", json=CANARY_BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def scrape(d: Daemon) -> dict[str, float]:
    text = httpx.get(d.exporter_url + "/metrics", timeout=5.0, trust_env=False).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name.startswith("r3090d_canary_")}


def alert_lines(d: Daemon, key: str) -> list[str]:
    """The daemon's own log line for each time alert `key` fired."""
    return [line for line in d.log().splitlines() if f"alert {key} firing:" in line]


def sent_as(d: Daemon, key: str) -> list[str]:
    """The severity of each FIRING the alert channels were given for `key` (the log-only channel's lines)."""
    marker = f"alert {key} FIRING ("
    return [line.split(marker, 1)[1].split(")", 1)[0] for line in d.log().splitlines() if marker in line]


def records(d: Daemon, reason: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in forensics.list_records(d.sections["daemon"]["state_dir"]) if p.name.endswith(f"-{reason}.json")]


def running_streams(d: Daemon) -> int:
    return d.fake("GET", "/fake/state").json()["active_streams"]


class Stream:
    """One streamed completion of `max_tokens` tokens, read in a thread: when each token came (wall clock,
    as the double's request log), how it ended. `stop` ends it early (the client goes away)."""

    def __init__(self, url: str, max_tokens: int, stop: threading.Event | None = None):
        self.times: list[float] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.stop = stop or threading.Event()
        self.body = {"model": "fake-model", "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=self.body, timeout=120, trust_env=False) as r:
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "choices" not in event:
                        self.error = line
                        return
                    self.times.append(time.time())
                    self.finish = event["choices"][0]["finish_reason"] or self.finish
        except httpx.HTTPError as e:
            self.error = repr(e)  # the engine was restarted under it

    def running_through(self, start: float, end: float) -> bool:
        """It had a token before `start` and one after `end`, and had not ended in between."""
        return bool(self.times) and self.times[0] < start and self.times[-1] > end and self.finish is None and self.error is None


def make(tmp: Path, engine_python: str, name: str, *, extra_args=(), canary=None) -> Daemon:
    d = Daemon(tmp, engine_python, name=name, args=("--skip-preflight",), extra_args=extra_args,
               watchdog={"poll_interval": 0.3, "probe_idle_seconds": 600, "stall_seconds": 600, "min_uptime": 1.0})  # fmt: skip
    d.rewrite(canary={**CANARY, **(canary or {})})
    return d


# ------------------------------------------------------------------ one daemon: the periodic canary


@pytest.fixture(scope="module")
def periodic(tmp_path_factory, fake_engine_python):
    """One daemon for the periodic cases. Its engine starts with /metrics showing requests running
    (`--fake-metrics-shape load`), so its first canary waits until the test turns /metrics live (within
    canary.interval; past it, the baseline would be taken under load)."""
    d = make(tmp_path_factory.mktemp("canary"), fake_engine_python, "periodic", extra_args=("--fake-metrics-shape", "load", "--fake-kv-usage", "0.1"))
    d.start()
    try:
        yield d
    finally:
        d.cleanup()


def baseline_taken(d: Daemon) -> dict:
    """Lets /metrics show the engine idle (once per engine) and waits for the baseline."""
    st = d.wait_ready(timeout=BOUND)
    if st["canary"]["baseline_tokens"] is None:
        control(d, metrics="live")
    return d.proc.wait_for(lambda s: s if s["canary"]["baseline_tokens"] is not None else None, BOUND, "the canary's baseline")


def just_checked(d: Daemon) -> dict:
    """The state right after a periodic check has counted: the next one is a whole interval away, so a
    fault set now, and the double asked about it, cannot race a check of the daemon's."""
    checks = baseline_taken(d)["canary"]["checks"]
    return d.proc.wait_for(lambda s: s if s["canary"]["checks"] > checks else None, INTERVAL + BOUND, "a periodic check counted")


def test_a_baseline_once_idle_then_a_periodic_check_matches_while_streams_run(periodic):
    d = periodic
    st = d.wait_ready(timeout=BOUND)
    assert st["canary"]["enabled"] is True and st["canary"]["interval_s"] == INTERVAL
    # /metrics shows requests running: no baseline for canary.interval (past it, one is taken under load, twice).
    d.proc.wait_for(lambda s: s["written_at"] > st["written_at"] + 2.0, BOUND, "two seconds of READY")
    assert canaries(d) == [] and d.state()["canary"]["baseline_tokens"] is None
    # Idle: the baseline goes, its body pinning every sampling parameter.
    control(d, metrics="live")
    st = d.proc.wait_for(lambda s: s if s["canary"]["baseline_tokens"] is not None else None, BOUND, "the canary's baseline")
    assert st["canary"]["baseline_tokens"] == 16  # the double's margins are 3 nats everywhere: every token is compared
    [baseline] = canaries(d)
    body = baseline["body"]
    assert body["prompt"] == DEFAULT_CANARY_PROMPT[:200] and body["model"] == "fake-model"
    pinned = {"max_tokens": 16, "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1, "presence_penalty": 0,
              "frequency_penalty": 0, "seed": SEED, "ignore_eos": True, "logprobs": 2, "return_tokens_as_token_ids": True, "stream": False}  # fmt: skip
    assert {k: body.get(k) for k in pinned} == pinned
    assert isinstance(body["cache_salt"], str) and len(body["cache_salt"]) >= 16
    assert (Path(d.sections["daemon"]["state_dir"]) / BASELINES_FILE).exists()

    # Two long streams, running through the next check.
    stop = threading.Event()
    threads = streams(d.engine_url, 2, stop)
    try:
        wait_until(lambda: running_streams(d) == 2, BOUND, what="two streams running")
        checks = st["canary"]["checks"]
        st = d.proc.wait_for(lambda s: s if s["canary"]["checks"] > checks else None, INTERVAL + BOUND, "a periodic check")
        assert running_streams(d) == 2 and all(t.is_alive() for t in threads)  # they ran through it
    finally:
        stop.set()
    c = st["canary"]
    assert (c["last_verdict"], c["mismatches"], c["inconclusive"], c["errors"]) == ("match", 0, 0, 0)
    assert c["last_match_at"] == c["last_ok_at"] and c["last_match_at"] > baseline["t"] and c["last_margin"] == pytest.approx(3.0)
    first, check = canaries(d)[:2]
    assert check["body"]["cache_salt"] != first["body"]["cache_salt"]  # the prefix cache never answers it
    assert {k: check["body"].get(k) for k in pinned} == pinned
    assert check["t"] >= baseline["t"] + INTERVAL - 1
    assert st["restarts"]["total"] == 0
    gauges = wait_until(lambda: (g := scrape(d)).get("r3090d_canary_checks_total", 0) >= c["checks"] and g, 10, what="the exporter's counters")
    assert gauges["r3090d_canary_last_match_timestamp_seconds"] == pytest.approx(c["last_match_at"])
    assert gauges["r3090d_canary_last_ok_timestamp_seconds"] == pytest.approx(c["last_ok_at"])
    assert gauges["r3090d_canary_last_margin_nats"] == pytest.approx(3.0)
    assert gauges["r3090d_canary_interval_seconds"] == INTERVAL and gauges["r3090d_canary_baseline_tokens"] == 16
    for counter in ("mismatches", "inconclusive", "errors"):
        assert gauges[f"r3090d_canary_{counter}_total"] == 0
    shown = ctl(d.config, "status")
    [line] = [x for x in shown.stdout.splitlines() if x.startswith("Canary     ")]
    assert "last match " in line and "0 mismatches, 0 inconclusive" in line and "compared over 16 token(s)" in line, line


def test_a_near_tie_that_flips_is_inconclusive_after_one_retry_and_restarts_nothing(periodic):
    d = periodic
    st = baseline_taken(d)
    api, before = st["engine"]["pid"], st["canary"]
    # Two long streams, running through the check and its retry.
    stop = threading.Event()
    flowing = [Stream(d.engine_url, 30000, stop) for _ in range(2)]
    try:
        wait_until(lambda: running_streams(d) == 2 and all(s.times for s in flowing), BOUND, what="two streams running")
        # From position 2 the answer takes the baseline's runner-up, and its own runner-up is the baseline's token 0.1 nats behind.
        control(d, canary_fault={"from": 2, "margin": 0.1})
        sent = len(canaries(d))
        try:
            st = d.proc.wait_for(lambda s: s if s["canary"]["inconclusive"] > before["inconclusive"] else None, INTERVAL + BOUND, "an inconclusive check")
        finally:
            control(d, canary_fault=None)
        counted = time.time()
        check, retry = canaries(d)[sent:]
        # They were running when the canary was sent, and still ran once its retry had counted.
        wait_until(lambda: all(s.times[-1] > counted for s in flowing), BOUND, what="the streams' tokens after the check")
        assert all(s.running_through(check["t"], counted) for s in flowing) and running_streams(d) == 2
        assert check["t"] < retry["t"] < counted
    finally:
        stop.set()
    c = st["canary"]
    assert c["last_verdict"] == "inconclusive" and c["inconclusive"] == before["inconclusive"] + 1
    assert c["mismatches"] == before["mismatches"] and c["checks"] == before["checks"] + 1  # the retry is part of the one check
    assert c["last_margin"] == pytest.approx(3.0)  # the baseline's margin where they differ
    assert c["last_ok_at"] > (before["last_ok_at"] or 0) and c["last_match_at"] == before["last_match_at"]
    assert len(canaries(d)) - sent == 2  # sent once more before it counted
    assert st["engine"]["pid"] == api and st["restarts"]["total"] == 0 and not alert_lines(d, "wrong_output")
    # The next check matches again, the same engine serving.
    st = d.proc.wait_for(lambda s: s if s["canary"]["checks"] > c["checks"] else None, INTERVAL + BOUND, "the next check")
    assert st["canary"]["last_verdict"] == "match" and st["engine"]["pid"] == api and st["restarts"]["total"] == 0
    assert scrape(d)["r3090d_canary_inconclusive_total"] == c["inconclusive"]


def test_a_periodic_mismatch_while_streams_run_alerts_wrong_output_and_restarts(periodic):
    d = periodic
    st = just_checked(d)
    api, before = st["engine"]["pid"], st["canary"]
    expected = canary_text(d)
    control(d, canary_fault={"from": 2, "margin": 5.0})
    received = canary_text(d)
    assert received != expected and received.split()[:2] == expected.split()[:2]
    stop = threading.Event()
    streams(d.engine_url, 2, stop)
    try:
        wait_until(lambda: running_streams(d) == 2, BOUND, what="two streams running")
        st = d.proc.wait_for(lambda s: s if s["restarts"]["by_reason"].get("wrong_output") else None, INTERVAL + BOUND, "the wrong_output restart")
    finally:
        stop.set()
    c = st["canary"]
    assert c["mismatches"] == before["mismatches"] + 1 and c["last_verdict"] == "mismatch"
    assert st["restarts"]["last_reason"] == "wrong_output" and st["restarts"]["by_reason"] == {"wrong_output": 1}
    said = f"expected {expected!r}; received {received!r}"
    assert said in c["last_mismatch"] and "at token 2 (baseline margin 3.000 nats, compared 16 token(s))" in c["last_mismatch"]
    # The alert: critical (logged as an ERROR), quoting the prompt, both outputs, the position and the margin.
    [line] = wait_until(lambda: alert_lines(d, "wrong_output"), 10, what="the wrong_output alert")
    assert " ERROR " in line and said in line and "at token 2 (baseline margin 3.000 nats" in line and "the engine is restarted" in line
    assert f"prompt {DEFAULT_CANARY_PROMPT[:100]!r}"[:-1] in line
    assert sent_as(d, "wrong_output") == ["critical"]
    # A fast restart (no drain), and its forensics record holds both outputs.
    [record] = wait_until(lambda: records(d, "wrong_output"), 10, what="the restart's record")
    assert record["reason"] == "wrong_output" and said in record["detail"]
    assert record["snapshot"]["metrics"]["running"] >= 2  # the streams were running when it was found
    assert "stopping engine (fast, wrong_output)" in d.log()
    st = d.wait_ready(timeout=BOUND, old_pid=api)
    assert st["restarts"]["total"] == 1


# ------------------------------------------------------------------ suspend and resume: the canary before READY


class CanaryRig(Rig):
    """The suspend rig with the canary configured; the periodic check is far off, so any comparison is the resume's."""

    def start(self) -> None:
        self.d.rewrite(canary={"interval": 600, "timeout": 10.0})
        super().start()


def test_a_resume_must_give_back_the_known_answer_before_it_serves(make_daemon, tmp_path):
    r = CanaryRig(make_daemon, tmp_path, watchdog={"probe_idle_seconds": 600})
    core = r.ready()
    st = r.d.proc.wait_for(lambda s: s if s["canary"]["baseline_tokens"] is not None else None, BOUND, "the canary's baseline")
    api = st["engine"]["pid"]

    # No fault: a baseline again before the lock, the same answer after the restore, then READY.
    sent = len(canaries(r.d))
    out = json_of(r.ctl("suspend", "--wait", "--json"))
    assert out["result"] == "suspended", out
    before_lock = canaries(r.d)[sent:]
    assert len(before_lock) == 1, before_lock  # the suspension's baseline, taken once nothing ran
    done = r.ctl("resume", "--wait", "--json")
    out = json_of(done)
    assert (done.returncode, out["result"]) == (0, "resumed"), out
    assert "the canary matched" in out["detail"]
    st = r.d.state()
    c = st["canary"]
    assert (c["last_verdict"], c["checks"], c["mismatches"]) == ("match", 1, 0)
    assert st["engine"]["phase"] == "ready" and st["engine"]["pid"] == api and st["restarts"]["total"] == 0
    after = canaries(r.d)[sent + 1 :]
    assert len(after) == 1 and after[0]["t"] > before_lock[0]["t"]
    assert st["suspend"]["last"]["result"] == "resumed"
    wait_until(lambda: r.d.healthz()[0] == 200, 10, what="/healthz 200")

    # The engine answers differently after the restore: failed, a cold restart with reason wrong_output.
    assert json_of(r.ctl("suspend", "--wait", "--json"))["result"] == "suspended"
    control(r.d, canary_fault={"from": 2, "margin": 5.0})  # the API server answers; its EngineCore is locked
    done = r.ctl("resume", "--wait", "--json")
    out = json_of(done)
    assert (done.returncode, out["result"]) == (1, "failed"), out
    assert "wrong output after resume: the canary answered differently at token 2" in out["detail"] and "the engine restarts cold" in out["detail"]
    st = r.d.state()
    assert st["restarts"]["last_reason"] == "wrong_output" and st["restarts"]["by_reason"] == {"wrong_output": 1}
    assert st["canary"]["mismatches"] == 1 and st["canary"]["last_verdict"] == "mismatch"
    assert st["suspend"]["last"]["result"] == "failed"
    [line] = wait_until(lambda: alert_lines(r.d, "wrong_output"), 10, what="the wrong_output alert")
    assert " ERROR " in line and "the resumed engine serves wrong output" in line and "it restarts cold" in line
    assert sent_as(r.d, "wrong_output") == ["critical"]
    [record] = wait_until(lambda: records(r.d, "wrong_output"), 10, what="the restart's record")
    assert "after resume: the canary answered differently at token 2" in record["detail"]
    assert "expected " in record["detail"] and "received " in record["detail"]
    r.hold()
    new_core = r.ready(old_pid=api)
    assert new_core != core and r.d.state()["restarts"]["total"] == 1


def test_streams_frozen_with_the_engine_keep_the_last_baseline_and_run_through_the_resume_canary(make_daemon, tmp_path):
    r = CanaryRig(make_daemon, tmp_path, watchdog={"probe_idle_seconds": 600})  # suspend.drain_timeout: 2 s
    core = r.ready()
    st = r.d.proc.wait_for(lambda s: s if s["canary"]["baseline_tokens"] is not None else None, BOUND, "the canary's baseline")
    api = st["engine"]["pid"]
    assert len(canaries(r.d)) == 1  # the engine's first canary, taken once idle: the baseline a resume must give back

    # Two streams (100 s of tokens at 0.02 s each) still run at the drain's deadline: frozen with the engine,
    # and nothing is compared before the lock, since a baseline waits for idle: the last baseline stands.
    flowing = [Stream(r.d.engine_url, LONG) for _ in range(2)]
    r.d.proc.wait_for(lambda s: (s["metrics"]["running"] or 0) == 2, BOUND, "two requests running")
    sent = len(canaries(r.d))
    out = json_of(r.ctl("suspend", "--wait", "--json"))
    assert out["result"] == "suspended" and "2 request(s) frozen with it, to finish after resume" in out["detail"], out
    assert canaries(r.d)[sent:] == []  # no baseline re-taken before the lock
    st = r.d.state()
    assert st["suspend"]["frozen_requests"] == 2 and proc_state(core) == "T"
    held = [len(s.times) for s in flowing]
    r.d.proc.wait_for(lambda s: s["written_at"] > st["written_at"] + 1.0, BOUND, "a second suspended")  # time passing on purpose
    assert [len(s.times) for s in flowing] == held and running_streams(r.d) == 2  # paused, their connections open

    # Resumed: the streams go on, and the canary compared while they ran matches the baseline from before.
    done = r.ctl("resume", "--wait", "--json")
    resumed = time.time()
    out = json_of(done)
    assert (done.returncode, out["result"]) == (0, "resumed") and "the canary matched" in out["detail"], out
    [check] = canaries(r.d)[sent:]
    unlocked = [c["at"] for c in calls(r) if c["step"] == "unlock"][-1]
    wait_until(lambda: all(s.times[-1] > resumed for s in flowing), BOUND, what="the streams' tokens after the resume")
    for s in flowing:
        assert s.running_through(check["t"], resumed), (s.finish, s.error)
        assert any(unlocked < t < check["t"] for t in s.times)  # flowing again when the canary was sent
    st = r.d.state()
    c = st["canary"]
    assert (c["last_verdict"], c["checks"], c["mismatches"]) == ("match", 1, 0)
    assert st["engine"]["phase"] == "ready" and st["engine"]["pid"] == api and st["restarts"]["total"] == 0
    # They finish, after the resume, nothing lost (the rest of their tokens sped up).
    control(r.d, token_delay=0.002)
    for s in flowing:
        s.thread.join(BOUND)
        assert (s.thread.is_alive(), s.finish, s.error) == (False, "length", None)
        assert len(s.times) == LONG and s.times[-1] > resumed
    control(r.d, token_delay=0.02)
    wait_until(lambda: r.d.healthz()[0] == 200, 10, what="/healthz 200")

    # Frozen again, and the restored engine answers differently: wrong_output, a cold restart, the streams cut.
    flowing = [Stream(r.d.engine_url, LONG) for _ in range(2)]
    r.d.proc.wait_for(lambda s: (s["metrics"]["running"] or 0) == 2, BOUND, "two requests running")
    sent = len(canaries(r.d))
    out = json_of(r.ctl("suspend", "--wait", "--json"))
    assert out["result"] == "suspended" and "2 request(s) frozen with it" in out["detail"], out
    assert canaries(r.d)[sent:] == []
    control(r.d, canary_fault={"from": 2, "margin": 5.0})
    done = r.ctl("resume", "--wait", "--json")
    out = json_of(done)
    assert (done.returncode, out["result"]) == (1, "failed"), out
    assert "wrong output after resume: the canary answered differently at token 2" in out["detail"] and "the engine restarts cold" in out["detail"]
    unlocked = [c["at"] for c in calls(r) if c["step"] == "unlock"][-1]
    assert all(s.times and s.times[0] < unlocked < s.times[-1] for s in flowing)  # frozen with the engine, and running again after the restore
    st = r.d.state()
    assert st["restarts"]["last_reason"] == "wrong_output" and st["restarts"]["by_reason"] == {"wrong_output": 1}
    assert st["canary"]["mismatches"] == 1 and st["canary"]["last_verdict"] == "mismatch"
    [line] = wait_until(lambda: alert_lines(r.d, "wrong_output"), 10, what="the wrong_output alert")
    assert " ERROR " in line and "the resumed engine serves wrong output" in line and "it restarts cold" in line
    r.hold()
    new_core = r.ready(old_pid=api)
    assert new_core != core and r.d.state()["restarts"]["total"] == 1
    for s in flowing:
        s.thread.join(BOUND)
        assert not s.thread.is_alive() and s.finish is None  # cut with the engine they ran on


def calls(r: Rig) -> list[dict]:
    """The fake checkpoint driver's calls, oldest first."""
    return [json.loads(line) for line in r.calls.read_text().splitlines()] if r.calls.exists() else []


def json_of(done) -> dict:
    try:
        return json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (rc {done.returncode}):\n{done.stdout}\n{done.stderr}") from None


# ------------------------------------------------------------------ the start comparison against a persisted baseline


def test_a_new_engine_that_differs_from_the_persisted_baseline_is_a_warning_only(tmp_path, fake_engine_python):
    # No streams here, by design: the start comparison rides on the engine's baseline, which waits until nothing runs.
    d = make(tmp_path, fake_engine_python, "start")
    try:
        d.start()
        d.wait_ready(timeout=BOUND)
        saved = Path(d.sections["daemon"]["state_dir"]) / BASELINES_FILE
        d.proc.wait_for(lambda s: s["canary"]["baseline_tokens"] is not None, BOUND, "the first daemon's baseline")
        wait_until(saved.exists, 10, what=f"{BASELINES_FILE}")
        first = json.loads(saved.read_text())["entries"][0]
        expected = first["answer"]["text"]
        assert d.proc.stop() == 0

        # A second daemon on the same state_dir and model: its engine's /metrics shows requests
        # running until the fault is set, so its first canary (the baseline) is faulted.
        d.proc._log.close()
        d.rewrite(engine={"extra_args": ["--fake-metrics-shape", "load", "--fake-kv-usage", "0.1"]})
        d.start()
        st = d.wait_ready(timeout=BOUND)
        api = st["engine"]["pid"]
        assert st["canary"]["baseline_tokens"] is None and canaries(d) == []
        control(d, canary_fault={"from": 0, "margin": 5.0})
        received = canary_text(d)
        assert received != expected
        control(d, metrics="live")
        [line] = wait_until(lambda: alert_lines(d, "canary_start_mismatch"), BOUND, what="the canary_start_mismatch alert")
        assert " WARNING " in line and "only a warning" in line
        assert f"expected {expected!r}; received {received!r}" in line and "at token 0" in line
        assert sent_as(d, "canary_start_mismatch") == ["warning"]
        st = d.state()
        # No restart: the engine serves, compared with its own baseline from now on.
        assert st["engine"]["phase"] == "ready" and st["engine"]["pid"] == api and st["restarts"]["total"] == 0
        assert not alert_lines(d, "wrong_output") and st["canary"]["mismatches"] == 0
        r = d.fake("POST", "/v1/completions", json={"model": "fake-model", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        # On disk its answer is kept beside the earlier one, never over it: the earlier one stays the reference.
        def entries(beside: bool) -> list[dict]:
            return [e for e in json.loads(saved.read_text())["entries"] if e["key"] == first["key"] and bool(e.get("beside")) == beside]

        [kept] = wait_until(lambda: entries(True), 10, what="the differing first answer saved beside the reference")
        assert kept["answer"]["text"] == received and [e["answer"]["text"] for e in entries(False)] == [expected]
        d.proc.wait_for(lambda s: s["written_at"] > st["written_at"] + 2.0, BOUND, "two more seconds of READY")
        st = d.state()
        assert st["engine"]["pid"] == api and st["restarts"]["total"] == 0
    finally:
        d.cleanup()
