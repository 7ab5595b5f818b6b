"""The known-answer canary: is the engine still computing what it computed before?

An engine can answer quickly and wrongly: flipped bits in weights on a card
without ECC, GPU state moved out and put back (our own suspend/resume). Nothing
that checks liveness sees it. The canary is one pinned greedy completion (every
sampling parameter fixed, the prefix cache bypassed) with the top-2
log-probabilities of each generated token. The engine's first canary is its
*baseline*; later ones are compared with it.

Numerical noise is told apart from a change of what the engine computes by the
baseline's *margins*: logprob(top-1) - logprob(top-2) at each position, in nats.
Batch composition changes the order of reductions, so a near tie can flip when
other requests share the batch. Only the baseline's *confident prefix*, the
positions before its first margin under `canary.margin_threshold`, is compared;
past it, the answer may legitimately take another path. Inside it:

- the same tokens: MATCH;
- a different token where the answer's own top-2 is the baseline's token within
  the threshold (the logit gap moved by less than twice the threshold):
  INCONCLUSIVE, and the canary is sent once more;
- any other difference: MISMATCH, counted.

A baseline confident for fewer than `canary.min_prefix` tokens cannot tell
anything (UNUSABLE): the prompt does not suit this model.

This module also runs the periodic check while the engine is READY (`step`), as
the policy's READY handler asks. The baseline is taken when nothing runs; on a
box that has had no idle moment for `canary.interval` it is taken under load,
twice, and kept only if the two answers agree (`agree`). After a resume the
suspension's stages compare (`core.suspension`); the start comparison against a
persisted baseline of an earlier engine is a warning only, since vLLM does not
promise bit-identical kernels across processes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from r3090d.config.schema import CanaryConfig, Config
from r3090d.core.actions import Action, SaveBaseline, SendCanary
from r3090d.core.rules import Condition
from r3090d.core.snapshot import CanaryAnswer, CanarySample, Snapshot
from r3090d.core.vocabulary import CanaryPurpose, Severity

# A canary past its timeout by this much is taken as failed here, whatever the prober says.
OVERDUE_MARGIN_S = 5.0
# Shown text is cut here: an alert and a record quote both outputs, not pages of them.
_MAX_SHOWN = 160
# A baseline that could not be taken (no answer) is tried again this soon.
BASELINE_RETRY_S = 30.0


class Verdict(enum.StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    INCONCLUSIVE = "inconclusive"
    UNUSABLE = "unusable"  # the baseline's confident prefix is too short to compare


@dataclass(frozen=True)
class Comparison:
    verdict: Verdict
    compared: int  # positions compared: the baseline's confident prefix
    position: int | None = None  # the first differing position (MISMATCH, INCONCLUSIVE)
    margin: float | None = None  # the baseline's margin there; on a MATCH, its smallest compared margin
    expected: str = ""  # the baseline's text
    received: str = ""  # the answer's text

    def text(self, prompt: str) -> str:
        """The alert's and the record's words: the prompt, both outputs, the position and the margin."""
        if self.verdict is Verdict.MATCH:
            return f"the canary matched its baseline over {self.compared} token(s)"
        where = f"at token {self.position} (baseline margin {self.margin:.3f} nats, compared {self.compared} token(s))" if self.position is not None else ""
        return (f"the canary answered differently {where}: prompt {_shown(prompt)!r}; "
                f"expected {_shown(self.expected)!r}; received {_shown(self.received)!r}")  # fmt: skip


def confident_prefix(baseline: CanaryAnswer, threshold: float) -> int:
    """How many leading positions the baseline decided by at least `threshold` nats."""
    for i, margin in enumerate(baseline.margins):
        if margin < threshold:
            return i
    return len(baseline.margins)


def compare(baseline: CanaryAnswer, answer: CanaryAnswer, cfg: CanaryConfig) -> Comparison:
    threshold = cfg.margin_threshold
    k = confident_prefix(baseline, threshold)
    texts = dict(expected=baseline.text, received=answer.text)
    if k < cfg.min_prefix:
        return Comparison(Verdict.UNUSABLE, k, **texts)
    for i in range(k):
        if i >= len(answer.token_ids):
            # ignore_eos and a fixed max_tokens: an answer shorter than the baseline is not the same computation.
            return Comparison(Verdict.MISMATCH, k, i, baseline.margins[i], **texts)
        if answer.token_ids[i] == baseline.token_ids[i]:
            continue
        near_tie = answer.runner_up[i] == baseline.token_ids[i] and answer.margins[i] < threshold
        verdict = Verdict.INCONCLUSIVE if near_tie else Verdict.MISMATCH
        return Comparison(verdict, k, i, baseline.margins[i], **texts)
    return Comparison(Verdict.MATCH, k, None, min(baseline.margins[:k]), **texts)


def _shown(text: str) -> str:
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


# ------------------------------------------------------------------ the canary's state in one engine's life


@dataclass(frozen=True)
class CanaryState:
    """What the policy keeps about the canary; a new engine starts with `fresh()`, keeping the counters."""

    baseline: CanaryAnswer | None = None  # this engine's
    baseline_for: tuple = ()  # the request it answered (request_key): a reload that changes it drops the baseline
    pending: CanaryPurpose | None = None  # a canary in flight, sent at `sent_at`
    sent_at: float | None = None
    retried: bool = False  # this comparison has been sent a second time after an inconclusive one
    next_at: float | None = None  # the next periodic comparison
    warned_unusable: bool = False
    wanted_since: float | None = None  # READY without a baseline since then: past canary.interval it is taken under load
    under_load: bool = False  # the baseline in flight was sent while requests ran: it is taken twice
    candidate: CanaryAnswer | None = None  # the first of the two, kept once the second agrees with it
    checks: int = 0  # comparisons that ended (any verdict)
    mismatches: int = 0
    inconclusive: int = 0
    errors: int = 0  # canaries with no answer: never a restart
    last_match_wall: float | None = None
    last_ok_wall: float | None = None  # a match, or an inconclusive one (nothing wrong seen)
    last_margin: float | None = None
    last: Comparison | None = None
    last_mismatch: Comparison | None = None
    last_mismatch_wall: float | None = None

    def fresh(self, baseline: CanaryAnswer | None = None, request: tuple = ()) -> CanaryState:
        """A new engine (or one resumed with `baseline`, the answer to `request`): nothing in flight, the counters kept."""
        return replace(self, baseline=baseline, baseline_for=request, pending=None, sent_at=None, retried=False, next_at=None,
                       wanted_since=None, under_load=False, candidate=None)  # fmt: skip

    def counted(self, c: Comparison, wall: float) -> CanaryState:
        """A comparison that ended, in the counters."""
        st = replace(self, checks=self.checks + 1, last=c, last_margin=c.margin if c.margin is not None else self.last_margin)
        if c.verdict is Verdict.MATCH:
            return replace(st, last_match_wall=wall, last_ok_wall=wall)
        if c.verdict is Verdict.INCONCLUSIVE:
            return replace(st, inconclusive=st.inconclusive + 1, last_ok_wall=wall)
        if c.verdict is Verdict.MISMATCH:
            return replace(st, mismatches=st.mismatches + 1, last_mismatch=c, last_mismatch_wall=wall)
        return st


def request_key(cc: CanaryConfig) -> tuple:
    """What makes two canaries the same question: another prompt, length or seed has another answer."""
    return (cc.prompt, cc.max_tokens, cc.seed)


def result(sample: CanarySample, sent_at: float | None, cfg: CanaryConfig, now: float) -> CanarySample | None:
    """The answer to the canary sent at `sent_at`, once it is in (an error when it is long overdue)."""
    if sent_at is None:
        return None
    if sample.sent_at is not None and sample.sent_at >= sent_at and sample.finished_at is not None:
        return sample
    if now - sent_at > cfg.timeout + OVERDUE_MARGIN_S:
        return CanarySample(sent_at=sent_at, finished_at=now, error=f"no answer within {cfg.timeout:.0f} s")
    return None


@dataclass(frozen=True)
class Step:
    """One READY tick of the canary: its state, what to send or save, alerts, and a restart if one is due."""

    state: CanaryState
    actions: tuple[Action, ...] = ()
    events: tuple[Condition, ...] = ()
    restart: str | None = None  # the detail of a wrong_output restart


def _send(cs: CanaryState, purpose: CanaryPurpose, now: float, **changes) -> Step:
    return Step(replace(cs, pending=purpose, sent_at=now, **changes), (SendCanary(purpose),))


def agree(first: CanaryAnswer, second: CanaryAnswer, cfg: CanaryConfig) -> bool:
    """Whether two answers taken under load are one baseline: the same tokens, or each matching the other."""
    if first.token_ids == second.token_ids:
        return True
    return compare(first, second, cfg).verdict is Verdict.MATCH and compare(second, first, cfg).verdict is Verdict.MATCH


def step(cs: CanaryState, snap: Snapshot, cfg: Config, now: float, *, maintenance: bool) -> Step:
    """The canary while the engine is READY: take the baseline when nothing runs (under load, twice, once
    canary.interval has passed without an idle moment), then compare every interval."""
    cc = cfg.canary
    if not cc.enabled:
        return Step(cs)
    if cs.baseline is not None and cs.baseline_for != request_key(cc):
        # A reload changed the question: the old answer says nothing about the new one.
        cs = cs.fresh()
    if cs.baseline is None and cs.wanted_since is None:
        cs = replace(cs, wanted_since=now)
    if cs.pending is not None:
        done = result(snap.canary, cs.sent_at, cc, now)
        if done is None:
            return Step(cs)
        cs = replace(cs, pending=None)
        if done.answer is None:
            wait = BASELINE_RETRY_S if cs.baseline is None else cc.interval
            return Step(replace(cs, errors=cs.errors + 1, retried=False, under_load=False, candidate=None, next_at=now + wait))
        if cs.baseline is None and cs.under_load:
            return _baseline_under_load(cs, done.answer, snap, cfg, now)
        if cs.baseline is None:
            return _baseline_taken(cs, done.answer, snap, cfg, now)
        return _compared(cs, done.answer, snap, cfg, now, maintenance=maintenance)
    if cs.baseline is None:
        if cs.next_at is not None and now < cs.next_at:
            return Step(cs)
        if snap.metrics.in_engine == 0:
            return _send(cs, CanaryPurpose.BASELINE, now)
        if now - cs.wanted_since >= cc.interval:
            # A box that is never idle would otherwise never be checked: the comparison is margin-aware, and
            # the answer is taken twice and kept only if it agrees with itself.
            return _send(cs, CanaryPurpose.BASELINE, now, under_load=True)
        return Step(cs)
    if cs.next_at is None:
        return Step(replace(cs, next_at=now + cc.interval))
    if now >= cs.next_at and confident_prefix(cs.baseline, cc.margin_threshold) >= cc.min_prefix:
        return _send(cs, CanaryPurpose.CHECK, now, retried=False)
    return Step(cs)


def _baseline_under_load(cs: CanaryState, answer: CanaryAnswer, snap: Snapshot, cfg: Config, now: float) -> Step:
    if cs.candidate is None:
        return _send(cs, CanaryPurpose.BASELINE, now, candidate=answer)
    first, cs = cs.candidate, replace(cs, under_load=False, candidate=None)
    if agree(first, answer, cfg.canary):
        return _baseline_taken(cs, first, snap, cfg, now)
    # Two answers that disagree say nothing about which is right: neither is kept, the pair is taken again later.
    return Step(replace(cs, next_at=now + cfg.canary.interval))


def _baseline_taken(cs: CanaryState, answer: CanaryAnswer, snap: Snapshot, cfg: Config, now: float) -> Step:
    cc = cfg.canary
    cs = replace(cs, baseline=answer, baseline_for=request_key(cc), next_at=now + cc.interval)
    events: list[Condition] = []
    k = confident_prefix(answer, cc.margin_threshold)
    if k < cc.min_prefix and not cs.warned_unusable:
        cs = replace(cs, warned_unusable=True)
        events.append(unusable_condition(k, cc))
    earlier = snap.canary.persisted
    mismatch = False
    if earlier is not None and k >= cc.min_prefix:
        c = compare(earlier, answer, cc)
        mismatch = c.verdict is Verdict.MISMATCH
        if mismatch:
            events.append(Condition(
                "canary_start_mismatch", True, Severity.WARNING,
                f"this engine's first canary differs from an earlier engine's with the same model, vLLM, dtype, GPU and flags: "
                f"{c.text(cc.prompt)}. vLLM does not promise bit-identical kernels across processes, so this is only a warning; "
                f"corruption present since load would show here", event=True,
            ))  # fmt: skip
    return Step(cs, (SaveBaseline(answer, start_mismatch=mismatch),), tuple(events))


def unusable_condition(k: int, cc: CanaryConfig) -> Condition:
    return Condition(
        "canary_prompt_unusable", True, Severity.WARNING,
        f"the canary's baseline is confident for only {k} token(s) (margin >= {cc.margin_threshold:g} nats; "
        f"canary.min_prefix = {cc.min_prefix}): canary.prompt does not suit this model and nothing is compared; "
        f"try a prompt the model continues with certainty, such as counting (\"Count on: 1, 2, 3, ...\")", event=True,
    )  # fmt: skip


def _compared(cs: CanaryState, answer: CanaryAnswer, snap: Snapshot, cfg: Config, now: float, *, maintenance: bool) -> Step:
    cc = cfg.canary
    c = compare(cs.baseline, answer, cc)
    if c.verdict is Verdict.INCONCLUSIVE and not cs.retried:
        return _send(cs, CanaryPurpose.CHECK, now, retried=True)
    cs = replace(cs.counted(c, snap.wall), retried=False, next_at=now + cc.interval)
    if c.verdict is not Verdict.MISMATCH:
        return Step(cs)
    restart = cc.restart_on_mismatch and not maintenance
    then = "the engine is restarted" if restart else "canary.restart_on_mismatch is false (or maintenance is on): the engine keeps serving"
    event = Condition("wrong_output", True, Severity.CRITICAL, f"the engine serves wrong output: {c.text(cc.prompt)}; {then}", event=True)
    return Step(cs, (), (event,), restart=c.text(cc.prompt) if restart else None)
