"""The no-progress windows against the longest engine step: the estimate, and config check's warning."""

from __future__ import annotations

import dataclasses

import pytest

from r3090d.config import WatchdogConfig, steps


def cfg(watchdog: dict | None = None) -> WatchdogConfig:
    return dataclasses.replace(WatchdogConfig(), **(watchdog or {}))


def test_the_reference_step_is_the_stated_one():
    assert steps.estimate_step(2048, 7.6e9, 32768) == pytest.approx(2.0)


def test_the_step_grows_with_tokens_per_step_parameters_and_context():
    base = steps.estimate_step(2048, 7.6e9, 32768)
    assert steps.estimate_step(8192, 7.6e9, 32768) == pytest.approx(4 * base)
    assert steps.estimate_step(2048, 15.2e9, 32768) == pytest.approx(2 * base)
    assert steps.estimate_step(2048, 7.6e9, 131072) > 2.4 * base  # attention over 4x the context
    assert steps.estimate_step(2048, 7.6e9, 4096) < base


def test_shipped_windows_hold_for_the_default_step_of_a_7b_model():
    step = steps.longest_step(None, 32768, 7.6e9)
    assert step.step_tokens == steps.VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS and step.step_tokens_source == "vLLM's default"
    assert steps.window_warnings(cfg(), step) == []


def test_a_large_step_budget_warns_with_the_numbers_and_the_fix():
    step = steps.longest_step(8192, 32768, 7.6e9)
    (stall, kv) = steps.window_warnings(cfg(), step)
    assert stall.startswith("watchdog.stall_seconds = 10 is under 4 x the longest engine step")
    assert "8192 tokens per step (--max-num-batched-tokens)" in stall and "about 8.0 s" in stall
    assert "raise it to 32" in stall
    assert kv.startswith("watchdog.kv_low_polls x poll_interval = 10 s") and "raise kv_low_polls to 17" in kv


def test_a_window_raised_to_match_is_quiet():
    step = steps.longest_step(8192, 32768, 7.6e9)
    assert steps.window_warnings(cfg({"stall_seconds": 40.0, "kv_low_polls": 17}), step) == []


def test_an_unknown_model_size_is_said_to_be_assumed_and_warns_of_nothing():
    step = steps.longest_step(8192, None, None)
    assert step.params_source == "assumed: Qwen2.5-7B's" and step.context == 32768
    assert "assumed" in step.describe()
    # The same settings warn for a model known to be that size; a guess never does.
    assert steps.window_warnings(cfg(), step) == []
    assert steps.window_warnings(cfg(), steps.longest_step(8192, None, 7.6e9)) != []


def test_a_chunk_never_exceeds_the_context():
    assert steps.longest_step(8192, 2048, 7.6e9).step_tokens == 2048
