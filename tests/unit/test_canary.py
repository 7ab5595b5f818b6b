"""The canary's comparison rule, its parser, and the canary in the policy: tables of answers and snapshots."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from r3090d.config.schema import CanaryConfig
from r3090d.core.actions import RecordRestart, SaveBaseline, SendAlert, SendCanary, StopEngine, SuspendEngine
from r3090d.core.canary import Verdict, agree, compare, confident_prefix, request_key
from r3090d.core.snapshot import CanaryAnswer, CanarySample, ChildSample, InferenceProbeSample, MetricsSample
from r3090d.core.suspend_types import Op, Outcome
from r3090d.core.suspension import Result, Stage
from r3090d.core.vocabulary import CanaryPurpose, Phase, RestartReason, Severity
from r3090d.probes.canary import CanaryError, parse, request_body
from r3090d.service.baselines import answer_from_json, answer_to_json
from tests.unit.test_policy_suspend import IDLE, Run, card, cfg, worker

CC = CanaryConfig()  # threshold 0.5 nats, min_prefix 4
BASE = CanaryAnswer(token_ids=(10, 11, 12, 13, 14, 15), margins=(3.0, 2.0, 1.5, 2.5, 0.2, 3.0), runner_up=(20, 21, 22, 23, 24, 25), text="abcdef")


def answer(ids, margins=None, runner_up=None, text="x") -> CanaryAnswer:
    n = len(ids)
    return CanaryAnswer(tuple(ids), tuple(margins or (3.0,) * n), tuple(runner_up or (0,) * n), text)


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("ids", "margins", "runner_up", "verdict", "position"),
    [
        ((10, 11, 12, 13, 14, 15), None, None, Verdict.MATCH, None),
        # Past the baseline's first near tie (position 4, margin 0.2) nothing is compared.
        ((10, 11, 12, 13, 99, 98), None, None, Verdict.MATCH, None),
        # A confident position changed, the baseline's token not even the answer's runner-up: a mismatch.
        ((10, 11, 77, 13, 14, 15), None, None, Verdict.MISMATCH, 2),
        # Changed, the baseline's token the runner-up, but by a wide margin: the logits moved far: a mismatch.
        ((10, 77, 12, 13, 14, 15), (3.0, 2.0, 3, 3, 3, 3), (0, 11, 0, 0, 0, 0), Verdict.MISMATCH, 1),
        # Changed at a near tie of the answer's own, the baseline's token second: inconclusive.
        ((10, 77, 12, 13, 14, 15), (3.0, 0.1, 3, 3, 3, 3), (0, 11, 0, 0, 0, 0), Verdict.INCONCLUSIVE, 1),
        # A near tie of the answer's own, but between two other tokens: a mismatch.
        ((10, 77, 12, 13, 14, 15), (3.0, 0.1, 3, 3, 3, 3), (0, 78, 0, 0, 0, 0), Verdict.MISMATCH, 1),
        # Shorter than the confident prefix (ignore_eos not honoured): a mismatch where it ends.
        ((10, 11), None, None, Verdict.MISMATCH, 2),
    ],
    ids=["same", "past-the-tie", "changed", "moved-far", "near-tie-flip", "other-tie", "short"],
)
def test_compare(ids, margins, runner_up, verdict, position):
    c = compare(BASE, answer(ids, margins, runner_up), CC)
    assert (c.verdict, c.position) == (verdict, position)
    assert c.compared == 4
    if verdict is Verdict.MATCH:
        assert c.margin == 1.5  # the smallest margin compared
    else:
        assert c.margin == BASE.margins[position]


@pytest.mark.parametrize(
    ("second", "same"),
    [
        (BASE, True),
        (replace(BASE, margins=(3.0,) * 6), True),  # other margins, the same tokens
        # Past both answers' first near tie (position 4) the path may differ: one baseline still.
        (answer((10, 11, 12, 13, 99, 98), (3.0, 2.0, 1.5, 2.5, 0.1, 3.0)), True),
        # Another token where the second answer is near a tie: which one is right is not known.
        (answer((10, 11, 77, 13, 14, 15), (3.0, 2.0, 0.1, 2.5, 0.2, 3.0), (20, 21, 12, 23, 24, 25)), False),
        (answer((10, 11, 77, 13, 14, 15)), False),
        # The second is confident where the first was near a tie, and differs there: they disagree.
        (answer((10, 11, 12, 13, 99, 15)), False),
    ],
    ids=["same", "same-tokens", "past-the-ties", "near-tie", "different", "different-where-second-is-sure"],
)
def test_two_answers_taken_under_load_agree(second, same):
    assert agree(BASE, second, CC) is same and agree(second, BASE, CC) is same


def test_a_baseline_confident_for_too_few_tokens_is_unusable():
    weak = replace(BASE, margins=(3.0, 0.1, 3.0, 3.0, 3.0, 3.0))
    assert confident_prefix(weak, 0.5) == 1
    assert compare(weak, BASE, CC).verdict is Verdict.UNUSABLE
    assert compare(weak, BASE, replace(CC, min_prefix=1)).verdict is Verdict.MATCH


def test_the_mismatch_text_gives_prompt_outputs_position_and_margin():
    c = compare(BASE, answer((10, 11, 77, 13, 14, 15), text="abXdef"), CC)
    text = c.text("Count on: 1, 2")
    assert "token 2" in text and "1.500 nats" in text and "'Count on: 1, 2'" in text and "'abcdef'" in text and "'abXdef'" in text


# ------------------------------------------------------------------ the request and the answer


def test_the_request_pins_every_sampling_parameter():
    body = request_body(CC, "m", "salt1")
    assert body["temperature"] == 0 and body["top_p"] == 1 and body["top_k"] == -1 and body["min_p"] == 0
    assert body["repetition_penalty"] == 1 and body["presence_penalty"] == 0 and body["frequency_penalty"] == 0
    assert body["seed"] == CC.seed and body["ignore_eos"] is True and body["max_tokens"] == CC.max_tokens
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True and body["cache_salt"] == "salt1"


def vllm_answer(tokens, tops, text="t"):
    return {"choices": [{"index": 0, "text": text, "logprobs": {"tokens": tokens, "top_logprobs": tops, "token_logprobs": [], "text_offset": []}}]}


def test_parse_takes_ids_margins_and_runners_up():
    body = vllm_answer(["token_id:5", "token_id:7"], [{"token_id:5": -0.1, "token_id:9": -2.1}, {"token_id:7": -0.5, "token_id:3": -0.6}])
    a = parse(body, 2)
    assert a.token_ids == (5, 7) and a.runner_up == (9, 3) and a.text == "t"
    assert a.margins == pytest.approx((2.0, 0.1))


def test_parse_a_position_with_one_candidate_has_an_infinite_margin_and_survives_json():
    a = parse(vllm_answer(["token_id:5"], [{"token_id:5": 0.0}]), 1)
    assert a.margins == (math.inf,) and a.runner_up == (None,)
    assert answer_from_json(json.loads(json.dumps(answer_to_json(a)))) == a


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, "no choices"),
        (vllm_answer(["5"], [{"5": -0.1}]), "not named by id"),
        (vllm_answer(["token_id:x"], [{"token_id:x": -0.1}]), "not a number"),
        (vllm_answer(["token_id:5"], [{"token_id:5": "a"}]), "log-probability"),
        (vllm_answer(["token_id:5"], [{"token_id:5": 3.0}]), "log-probability"),
        (vllm_answer(["token_id:5"], [{}]), "no top log-probabilities"),
        (vllm_answer(["token_id:5"], []), "one length"),
        (vllm_answer(["token_id:5", "token_id:6"], [{"token_id:5": -1}, {"token_id:6": -1}]), "2 token(s) came back, not 1"),
    ],
)
def test_parse_refuses_what_is_not_a_canary_answer(body, words):
    with pytest.raises(CanaryError, match=None) as info:
        parse(body, 1)
    assert words in str(info.value)


CAPTURED = Path(__file__).parents[1] / "data" / "vllm-canary-response.json"


@pytest.mark.skipif(not CAPTURED.exists(), reason="no captured vLLM answer in tests/data")
def test_parse_reads_the_answer_captured_from_the_real_vllm():
    body = json.loads(CAPTURED.read_text())
    a = parse(body, len(body["choices"][0]["logprobs"]["tokens"]))
    assert all(m >= 0 for m in a.margins) and len(a.token_ids) == len(a.runner_up)
    assert all(r != t for r, t in zip(a.runner_up, a.token_ids, strict=True))


# ------------------------------------------------------------------ the canary in the policy

BASELINE = CanaryAnswer((1, 2, 3, 4, 5, 6), (3.0,) * 6, (9,) * 6, "one two")
WRONG = CanaryAnswer((1, 2, 7, 8, 9, 9), (3.0,) * 6, (3, 3, 3, 3, 3, 3), "one bad")
NEAR = CanaryAnswer((1, 2, 7, 4, 5, 6), (3.0, 3.0, 0.1, 3.0, 3.0, 3.0), (9, 9, 3, 9, 9, 9), "one nea")
class Busy:
    """Requests running and tokens flowing (so no stall rule fires): each read is a later /metrics."""

    def __init__(self):
        self.tokens = 100.0

    def __call__(self) -> MetricsSample:
        self.tokens += 10
        return MetricsSample(running=3, waiting=1, generation_tokens_total=self.tokens, prompt_tokens_total=10.0, kv_usage=0.2)


BUSY = Busy()


def ccfg(**canary_keys):
    return cfg(canary={"enabled": True, "interval": 60.0, "timeout": 10.0, **canary_keys})


def answered(sent_at, a, persisted=None):
    return CanarySample(sent_at=sent_at + 0.01, finished_at=sent_at + 0.2, answer=a, sent_total=1, persisted=persisted)


def sent(r) -> list:
    return [a.purpose for a in r.of(SendCanary)]


def baseline_taken(r, a=BASELINE, persisted=None):
    """Tick until the baseline canary goes out, then answer it."""
    while not r.of(SendCanary):
        r.tick()
    at = r.now
    r.tick(canary=answered(at, a, persisted))
    return at


def test_the_baseline_waits_for_nothing_running_then_is_saved():
    r = Run(ccfg())
    for _ in range(5):
        r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY())
        assert not r.of(SendCanary)
    r.tick(metrics=IDLE)
    assert sent(r) == [CanaryPurpose.BASELINE]
    at = r.now
    r.tick(canary=CanarySample(sent_at=at + 0.01))  # in flight
    assert r.acts == [] and r.st.canary.pending is CanaryPurpose.BASELINE
    r.tick(canary=answered(at, BASELINE))
    assert r.of(SaveBaseline) == [SaveBaseline(BASELINE)] and r.st.canary.baseline == BASELINE


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_a_periodic_check_runs_every_interval_under_load_too_and_matches(busy):
    load = BUSY if busy else (lambda: IDLE)
    gpu = (lambda: card(r.now + 0.5, util=90)) if busy else (lambda: card(r.now + 0.5))
    r = Run(ccfg())
    t0 = baseline_taken(r)
    while not r.of(SendCanary):
        r.tick(metrics=load(), gpu=gpu())
        assert r.now < t0 + 61.5
    assert sent(r) == [CanaryPurpose.CHECK] and r.now >= t0 + 60
    r.tick(metrics=load(), gpu=gpu(), canary=answered(r.now, BASELINE))
    c = r.st.canary
    assert c.checks == 1 and c.last.verdict is Verdict.MATCH and c.last_match_wall is not None and r.st.phase is Phase.READY


def check_answered(r, a):
    while not r.of(SendCanary):
        r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY())
    r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY(), canary=answered(r.now, a))


def test_a_periodic_mismatch_alerts_critical_and_restarts_with_wrong_output_at_once():
    r = Run(ccfg())
    baseline_taken(r)
    check_answered(r, WRONG)
    assert r.st.restart_reason == RestartReason.WRONG_OUTPUT and r.st.canary.mismatches == 1
    assert StopEngine(drain=False, reason="wrong_output") in r.acts
    record = r.of(RecordRestart)[0]
    assert "expected 'one two'" in record.detail and "received 'one bad'" in record.detail and "token 2" in record.detail
    alert = [a for a in r.of(SendAlert) if a.key == "wrong_output"]
    assert alert and alert[0].severity is Severity.CRITICAL


def test_a_periodic_mismatch_without_restart_on_mismatch_only_alerts():
    r = Run(ccfg(restart_on_mismatch=False))
    baseline_taken(r)
    check_answered(r, WRONG)
    assert r.st.phase is Phase.READY and not r.of(RecordRestart)
    assert [a.key for a in r.of(SendAlert)] == ["wrong_output"] and "keeps serving" in r.of(SendAlert)[0].summary


def test_a_near_tie_flip_is_sent_once_more_then_counted_inconclusive_without_restart():
    r = Run(ccfg())
    baseline_taken(r)
    check_answered(r, NEAR)
    assert sent(r) == [CanaryPurpose.CHECK] and r.st.canary.inconclusive == 0  # the one retry
    r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY(), canary=answered(r.now, NEAR))
    c = r.st.canary
    assert c.inconclusive == 1 and c.mismatches == 0 and c.last_ok_wall is not None and r.st.phase is Phase.READY
    assert not r.of(SendCanary) and not r.of(RecordRestart)


def test_a_near_tie_then_a_match_counts_the_match():
    r = Run(ccfg())
    baseline_taken(r)
    check_answered(r, NEAR)
    r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY(), canary=answered(r.now, BASELINE))
    assert r.st.canary.inconclusive == 0 and r.st.canary.last.verdict is Verdict.MATCH


def test_a_canary_without_answer_is_an_error_never_a_restart():
    r = Run(ccfg())
    baseline_taken(r)
    while not r.of(SendCanary):
        r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY())
    at = r.now
    r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY(), canary=CanarySample(sent_at=at + 0.01, finished_at=at + 10, error="no answer within 10 s"))
    assert r.st.canary.errors == 1 and r.st.phase is Phase.READY and not r.of(RecordRestart)
    # A canary the prober never reports is failed here past its timeout and a margin.
    while not r.of(SendCanary):
        r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY())
    at = r.now
    while r.now < at + 16:
        r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY(), canary=CanarySample(sent_at=at + 0.01))
    assert r.st.canary.errors == 2 and r.st.canary.pending is None and r.st.phase is Phase.READY


def test_a_start_mismatch_against_an_earlier_engines_baseline_is_a_warning_only():
    r = Run(ccfg())
    baseline_taken(r, BASELINE, persisted=WRONG)
    alerts = [a for a in r.of(SendAlert) if a.key == "canary_start_mismatch"]
    assert alerts and alerts[0].severity is Severity.WARNING and "bit-identical" in alerts[0].summary
    assert r.st.phase is Phase.READY and not r.of(RecordRestart)
    # Kept beside the earlier one, not over it: a load gone wrong must not replace the good reference.
    assert r.of(SaveBaseline) == [SaveBaseline(BASELINE, start_mismatch=True)]


def test_a_first_answer_that_matches_the_earlier_engines_is_saved_as_the_reference():
    r = Run(ccfg())
    baseline_taken(r, BASELINE, persisted=BASELINE)
    assert r.of(SaveBaseline) == [SaveBaseline(BASELINE, start_mismatch=False)] and not r.alerts("canary_start_mismatch")


def test_a_baseline_too_short_to_compare_warns_once_and_nothing_is_compared():
    weak = replace(BASELINE, margins=(3.0, 0.1, 3.0, 3.0, 3.0, 3.0))
    r = Run(ccfg())
    baseline_taken(r, weak)
    alerts = [a for a in r.of(SendAlert) if a.key == "canary_prompt_unusable"]
    assert alerts and "canary.prompt" in alerts[0].summary and "1 token(s)" in alerts[0].summary
    t = r.now
    while r.now < t + 130:
        r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY())
        assert not r.of(SendCanary)


def test_a_new_engine_takes_its_own_baseline_the_counters_carry_on():
    r = Run(ccfg())
    baseline_taken(r)
    check_answered(r, WRONG)  # restarts
    while r.st.phase is not Phase.STARTING:
        r.tick(ch=ChildSample(), gpu=card(r.now + 0.5, procs=()))  # the old engine gone, its memory freed
        assert r.now < 100
    assert r.st.canary.baseline is None and r.st.canary.mismatches == 1


def test_the_daemons_own_canaries_never_count_as_the_engine_having_served():
    r = Run(ccfg())
    served = replace(IDLE, served_total=5.0)
    r.tick(metrics=served)
    r.tick(metrics=replace(IDLE, served_total=6.0), canary=CanarySample(sent_total=1))
    assert not r.st.succeeded
    r.tick(metrics=replace(IDLE, served_total=7.0), canary=CanarySample(sent_total=1))
    assert r.st.succeeded


# ------------------------------------------------------------------ around a suspension


def suspend_with_baseline(r, a=BASELINE):
    """Suspend: drained to nothing, the baseline is taken again before the lock, then the checkpoint."""
    r.tick(suspend_requested=1)
    while not r.of(SendCanary):
        r.tick()
    assert r.st.suspension.stage is Stage.BASELINING and sent(r) == [CanaryPurpose.BASELINE] and not r.of(SuspendEngine)
    at = r.now
    r.tick(canary=answered(at, a))
    assert r.of(SaveBaseline) == [SaveBaseline(a)] and r.of(SuspendEngine) and r.st.suspension.baseline == a
    op = r.now
    r.tick(suspender=worker(Op.SUSPEND, op + 0.01, Outcome.SUSPENDED), gpu=card(r.now + 0.5, procs=()))
    assert r.st.phase is Phase.SUSPENDED


def resumed_to_canary(r):
    sent_at = r.resume()
    assert sent_at is not None
    r.tick()  # /health 200: the probe goes out
    probe = r.now
    r.tick(inference=InferenceProbeSample(sent_at=probe + 0.01, finished_at=probe + 0.1, ok=True))
    assert r.st.suspension.stage is Stage.CANARY and sent(r) == [CanaryPurpose.CHECK] and r.st.phase is Phase.RESUMING


def test_a_resume_that_gives_back_the_baseline_is_ready():
    r = Run(ccfg())
    baseline_taken(r)
    suspend_with_baseline(r)
    resumed_to_canary(r)
    r.tick(canary=answered(r.now, BASELINE))
    assert r.st.phase is Phase.READY and r.st.suspend_last.result is Result.RESUMED and "canary matched" in r.st.suspend_last.detail
    assert r.st.canary.baseline == BASELINE and r.st.canary.checks == 1


def test_a_resume_that_answers_wrong_restarts_cold_with_wrong_output():
    r = Run(ccfg())
    baseline_taken(r)
    suspend_with_baseline(r)
    resumed_to_canary(r)
    r.tick(canary=answered(r.now, WRONG))
    assert r.st.restart_reason == RestartReason.WRONG_OUTPUT and r.st.phase is not Phase.READY
    assert r.st.suspend_last.result is Result.FAILED and "wrong output after resume" in r.st.suspend_last.detail
    assert StopEngine(drain=False, reason="wrong_output") in r.acts and r.st.canary.mismatches == 1
    assert [a.severity for a in r.of(SendAlert) if a.key == "wrong_output"] == [Severity.CRITICAL]


def test_a_resume_with_a_near_tie_flip_twice_is_ready_and_counted_inconclusive():
    r = Run(ccfg())
    baseline_taken(r)
    suspend_with_baseline(r)
    resumed_to_canary(r)
    r.tick(canary=answered(r.now, NEAR))
    assert sent(r) == [CanaryPurpose.CHECK] and r.st.phase is Phase.RESUMING
    r.tick(canary=answered(r.now, NEAR))
    assert r.st.phase is Phase.READY and r.st.canary.inconclusive == 1 and not r.of(RecordRestart)


def test_requests_frozen_with_the_engine_keep_the_last_baseline():
    r = Run(ccfg())
    baseline_taken(r)
    r.tick(suspend_requested=1)
    while not r.of(SuspendEngine):
        r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY())
        assert not r.of(SendCanary)
    assert r.st.suspension.baseline == BASELINE and r.of(SuspendEngine)[0].frozen_requests == 4


def test_a_reload_that_changes_the_question_drops_the_baseline_instead_of_finding_a_mismatch():
    r = Run(ccfg())
    baseline_taken(r)
    r.c = ccfg(prompt="Another question entirely")
    r.tick()
    assert r.st.canary.baseline is None
    assert sent(r) == [CanaryPurpose.BASELINE]  # nothing runs: the new question's baseline at once
    r.tick(canary=answered(r.now, WRONG))
    assert r.st.canary.baseline == WRONG and r.st.phase is Phase.READY and r.st.canary.mismatches == 0


def test_a_canary_change_while_suspended_drops_the_held_baseline_and_takes_a_new_one_after_the_resume():
    r = Run(ccfg())
    baseline_taken(r)
    suspend_with_baseline(r)
    assert r.st.suspension.baseline_for == request_key(r.c.canary)
    r.c = ccfg(prompt="Another question entirely")  # a reload while suspended
    assert r.resume() is not None
    r.tick()  # /health 200: the probe goes out
    probe = r.now
    r.tick(inference=InferenceProbeSample(sent_at=probe + 0.01, finished_at=probe + 0.1, ok=True))
    # The old answer says nothing about the new question: no comparison with it, ready at once.
    assert r.st.phase is Phase.READY and CanaryPurpose.CHECK not in sent(r) and r.st.suspend_last.result is Result.RESUMED
    assert r.st.canary.baseline is None
    r.tick()
    assert sent(r) == [CanaryPurpose.BASELINE]  # nothing runs: the new question's baseline at once
    r.tick(canary=answered(r.now, WRONG))
    assert r.st.canary.baseline == WRONG and r.st.canary.baseline_for == request_key(r.c.canary)
    assert r.st.phase is Phase.READY and r.st.canary.mismatches == 0 and not r.alerts("wrong_output")


# ------------------------------------------------------------------ a box that is never idle


def busy_tick(r, **kw):
    return r.tick(gpu=card(r.now + 0.5, util=90), metrics=BUSY(), **kw)


def test_a_box_never_idle_takes_its_baseline_under_load_after_an_interval_twice_and_then_checks():
    r = Run(ccfg())
    ready = r.now
    while not r.of(SendCanary):
        busy_tick(r)
        assert r.now < ready + 61.5
    assert sent(r) == [CanaryPurpose.BASELINE] and r.now >= ready + 60
    busy_tick(r, canary=answered(r.now, BASELINE))
    # Under load the first answer is kept only once a second one agrees with it.
    assert sent(r) == [CanaryPurpose.BASELINE] and r.st.canary.baseline is None and not r.of(SaveBaseline)
    busy_tick(r, canary=answered(r.now, NEAR))  # another token where the second answer is near a tie: no agreement
    assert r.st.canary.baseline is None and not r.of(SaveBaseline) and not r.alerts("wrong_output")
    # Disagreeing answers keep nothing and raise nothing; the next pair is tried later.
    t = r.now
    while not r.of(SendCanary):
        busy_tick(r)
        assert r.now < t + 61.5
    assert sent(r) == [CanaryPurpose.BASELINE]
    busy_tick(r, canary=answered(r.now, BASELINE))
    busy_tick(r, canary=answered(r.now, BASELINE))
    assert r.of(SaveBaseline) == [SaveBaseline(BASELINE)] and r.st.canary.baseline == BASELINE
    check_answered(r, BASELINE)
    assert r.st.canary.checks == 1 and r.st.canary.last.verdict is Verdict.MATCH and r.st.canary.mismatches == 0


def test_a_box_never_idle_checks_again_after_a_resume_of_an_engine_that_had_no_baseline():
    r = Run(ccfg())
    r.tick(suspend_requested=1)
    while not r.of(SuspendEngine):
        busy_tick(r)
        assert not r.of(SendCanary)  # never idle: no baseline before the lock either
    op = r.now
    r.tick(suspender=worker(Op.SUSPEND, op + 0.01, Outcome.SUSPENDED), gpu=card(r.now + 0.5, procs=()))
    assert r.st.phase is Phase.SUSPENDED and r.st.suspension.baseline is None
    r.resume()
    r.tick()
    probe = r.now
    r.tick(inference=InferenceProbeSample(sent_at=probe + 0.01, finished_at=probe + 0.1, ok=True))
    assert r.st.phase is Phase.READY
    ready = r.now
    while not r.of(SendCanary):
        busy_tick(r)
        assert r.now < ready + 61.5
    busy_tick(r, canary=answered(r.now, BASELINE))
    busy_tick(r, canary=answered(r.now, BASELINE))
    assert r.st.canary.baseline == BASELINE and r.of(SaveBaseline)
