"""The inference probe's deadline, and when a missed one is the host's fault, not the engine's.

A probe waits its turn for a CPU like everything else: on a host whose CPUs are
all taken (a CPU engine, a request loop, other work), an engine that is working
can miss a deadline that suits a quiet host. Two rules keep that from reading as
a frozen engine:

- the deadline learns from the engine's own answers: the larger of the configured
  `probe_timeout` and ANSWER_MULTIPLE x the slowest of the recent answers, capped at
  DEADLINE_CAP x `probe_timeout` so a frozen engine is still found in bounded time;
- a miss (no answer by the deadline, not an error answer) while the host is
  saturated (load above its CPU count) and the engine's own CPU time rose by at
  least ENGINE_BUSY_SHARE of a CPU over the probe's span is retried, not counted,
  at most EXCUSED_MISSES_MAX times in a row: an engine frozen in a busy loop burns
  CPU too, and must not hide behind a loaded host for ever.
"""

from __future__ import annotations

from collections.abc import Sequence

from r3090d.core.snapshot import HostLoad, InferenceProbeSample

ANSWER_MULTIPLE = 3.0
DEADLINE_CAP = 5.0  # x probe_timeout
RECENT_ANSWERS = 8  # the answers the deadline learns from: the last this many
# Of one CPU. An idle vLLM (API server and EngineCore waiting on their sockets) uses far less; an engine
# that computes on a host with load L over C CPUs gets about C / L of a CPU a thread, 0.2 at load 10 on
# 2 CPUs, where one bench run saw misses of a working engine counted against a threshold of 0.2.
ENGINE_BUSY_SHARE = 0.05
EXCUSED_MISSES_MAX = 5


def learned_probe_timeout(configured: float, answers: Sequence[float]) -> float:
    """The next probe's deadline: `configured`, or ANSWER_MULTIPLE x the slowest of `answers`
    (recent answer times, seconds) where that is larger, at most DEADLINE_CAP x `configured`."""
    learned = ANSWER_MULTIPLE * max(answers, default=0.0)
    return min(max(configured, learned), DEADLINE_CAP * configured)


def engine_computed(before: tuple[float, float] | None, cpu_now: float | None, now: float) -> bool:
    """The engine's CPU time rose by at least ENGINE_BUSY_SHARE of a CPU since `before` ((time, CPU seconds))."""
    share = engine_cpu_share(before, cpu_now, now)
    return share is not None and share >= ENGINE_BUSY_SHARE


def starved_miss(
    inf: InferenceProbeSample,
    load: HostLoad,
    before: tuple[float, float] | None,
    cpu_now: float | None,
    now: float,
) -> bool:
    """The finished probe missed its deadline while the engine computed on a saturated host: the host's fault."""
    return inf.ok is False and inf.timed_out and load.saturated and engine_computed(before, cpu_now, now)


def engine_cpu_share(before: tuple[float, float] | None, cpu_now: float | None, now: float) -> float | None:
    """The CPUs the engine used on average since `before` ((time, CPU seconds)); None when not known."""
    if before is None or cpu_now is None or now <= before[0]:
        return None
    return (cpu_now - before[1]) / (now - before[0])


def miss_facts(load: HostLoad, before: tuple[float, float] | None, cpu_now: float | None, now: float) -> str:
    """What the starved-host rule saw at a counted miss, for the restart's detail ("" when it saw nothing)."""
    facts = []
    if load.load_1m is not None and load.cores:
        facts.append(f"host load {load.load_1m:.1f} on {load.cores} CPUs")
    share = engine_cpu_share(before, cpu_now, now)
    if share is not None:
        facts.append(f"the engine used {share:.2f} of a CPU during the probe")
    return ", ".join(facts)
