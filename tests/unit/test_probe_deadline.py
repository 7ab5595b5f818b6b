"""The inference probe on a starved host: its deadline learns from the engine's answers, and a miss
while the engine still computes on a saturated host is retried, not counted (core.probetime, core.rules)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from r3090d.core import policy
from r3090d.core.actions import RecordRestart, SendInferenceProbe
from r3090d.core.policy import Phase
from r3090d.core.probetime import EXCUSED_MISSES_MAX, learned_probe_timeout
from r3090d.core.snapshot import HostLoad, InferenceProbeSample, MetricsSample
from r3090d.core.vocabulary import RestartReason
from tests.configs import bare_config
from tests.snapshots import child, drive_to_ready, snap

PROBE_TIMEOUT = 3.0
PROBE_FAILURES = 2
# An idle engine: nothing running, counters still; only the probe can find it frozen.
IDLE = MetricsSample(kv_usage=0.0, num_gpu_blocks=1000, block_size=16, free_blocks=900.0, running=0, waiting=0,
                     generation_tokens_total=10.0, prompt_tokens_total=5.0)  # fmt: skip
SATURATED = HostLoad(load_1m=3.6, cores=2)
CALM = HostLoad(load_1m=0.9, cores=2)
UNKNOWN = HostLoad()
BUSY = 0.9  # the engine's CPU seconds per second: it computes (a starved CPU engine, a slow step)
IDLE_CPU = 0.01  # an idle vLLM's API server and EngineCore barely run


def _cfg():
    return bare_config(watchdog={"probe_idle_seconds": 6.0, "probe_timeout": PROBE_TIMEOUT, "probe_failures": PROBE_FAILURES,
                                 "stall_seconds": 1000.0})  # fmt: skip


def misses_until_restart(
    load: HostLoad, cpu_rate: float | None, *, timed_out: bool = True, answer_every: int = 0
) -> tuple[int, list]:
    """Drive a READY, idle engine whose every probe misses its deadline (or, with `answer_every`, every
    Nth probe answers); ticks every 0.5 s, the engine's CPU time growing `cpu_rate` s/s (None: not read).
    Returns the misses seen when the engine was restarted, and the restart records."""
    c = _cfg()
    _, st = drive_to_ready(c)
    inf, sent, misses = InferenceProbeSample(), 0, 0
    t = 2.0
    while t < 600.0:
        in_flight = inf.sent_at is not None and (inf.finished_at is None or inf.finished_at < inf.sent_at)
        if in_flight and t >= inf.sent_at + PROBE_TIMEOUT:
            if answer_every and sent % answer_every == 0:
                inf = replace(inf, finished_at=t - 2.5, ok=True, consecutive_failures=0)
            else:
                misses += 1
                detail = f"no answer within {PROBE_TIMEOUT:.0f} s (ReadTimeout)" if timed_out else "HTTP 500"
                inf = replace(
                    inf,
                    finished_at=t,
                    ok=False,
                    detail=detail,
                    timed_out=timed_out,
                    consecutive_failures=inf.consecutive_failures + 1,
                )
        ch = child(cpu_seconds=None if cpu_rate is None else 50.0 + cpu_rate * t)
        acts, st = policy.decide(snap(t, ch=ch, metrics=IDLE, inference=inf, host_load=load), st, c, t)
        if st.phase is not Phase.READY:
            return misses, [a for a in acts if isinstance(a, RecordRestart)]
        if any(isinstance(a, SendInferenceProbe) for a in acts):
            sent += 1
            inf = InferenceProbeSample(sent_at=t + 0.01, finished_at=inf.finished_at, consecutive_failures=inf.consecutive_failures,
                                       timeout_s=PROBE_TIMEOUT)  # fmt: skip
        t += 0.5
    return misses, []


@pytest.mark.parametrize(
    "load, cpu_rate, timed_out, misses",
    [
        # Starved, not frozen: the engine computes on a saturated host. Retried, not counted, up to the cap.
        (SATURATED, BUSY, True, PROBE_FAILURES + EXCUSED_MISSES_MAX),
        # Under a thread's fair share at load 10 on 2 CPUs (0.2): starved, still computing.
        (HostLoad(load_1m=10.0, cores=2), 0.15, True, PROBE_FAILURES + EXCUSED_MISSES_MAX),
        # The host is saturated but the engine does nothing with its CPU: frozen, counted as ever.
        (SATURATED, IDLE_CPU, True, PROBE_FAILURES),
        # The engine burns CPU on a host with CPUs to spare: a spinning freeze, counted.
        (CALM, BUSY, True, PROBE_FAILURES),
        # Not measured, either side: counted, as before the load was read.
        (UNKNOWN, BUSY, True, PROBE_FAILURES),
        (SATURATED, None, True, PROBE_FAILURES),
        # An answer that is an error is no missed deadline: no load excuses it.
        (SATURATED, BUSY, False, PROBE_FAILURES),
    ],
    ids=[
        "saturated+busy",
        "load-10+fair-share",
        "saturated+idle-cpu",
        "calm+busy",
        "load-unknown",
        "cpu-unknown",
        "error-answer",
    ],
)
def test_a_missed_deadline_counts_unless_the_engine_computes_on_a_saturated_host(
    load, cpu_rate, timed_out, misses
):
    seen, records = misses_until_restart(load, cpu_rate, timed_out=timed_out)
    assert seen == misses
    assert [r.reason for r in records] == [RestartReason.PROBE_FAILED]


def test_the_restart_after_the_excuses_run_out_says_how_many_were_retried():
    _, records = misses_until_restart(SATURATED, BUSY)
    assert f"{EXCUSED_MISSES_MAX} missed while the engine computed on a saturated host" in records[0].detail


def test_an_answer_between_starved_misses_starts_the_excuses_afresh():
    # Every third probe answers: the misses between answers are excused each time, and nothing restarts.
    seen, records = misses_until_restart(SATURATED, BUSY, answer_every=3)
    assert records == [] and seen > PROBE_FAILURES + EXCUSED_MISSES_MAX


@pytest.mark.parametrize(
    "configured, answers, deadline",
    [
        (3.0, (), 3.0),  # nothing learned yet: the configured timeout
        (3.0, (0.2, 0.3, 0.25), 3.0),  # quick answers never shorten it
        (3.0, (0.5, 1.5, 0.8), 4.5),  # 3 x the slowest recent answer
        (3.0, (2.0,), 6.0),
        (3.0, (9.0, 0.1), 15.0),  # capped at 5 x the configured timeout
        (10.0, (1.0,), 10.0),
        (0.5, (0.4,), 1.2),
    ],
)
def test_the_deadline_is_the_larger_of_the_timeout_and_a_multiple_of_recent_answers(
    configured, answers, deadline
):
    assert learned_probe_timeout(configured, answers) == pytest.approx(deadline)


def test_a_counted_miss_says_what_the_starved_host_rule_saw():
    _, records = misses_until_restart(SATURATED, IDLE_CPU)
    assert "(host load 3.6 on 2 CPUs, the engine used 0.01 of a CPU during the probe)" in records[0].detail
