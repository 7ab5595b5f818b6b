"""The watchdog's no-progress windows against the engine's longest honest step.

vLLM publishes its counters once per engine step, so for as long as one step
lasts nothing moves, and a window that judges "no progress" (stall_seconds;
the KV rule's kv_low_polls x poll_interval) must be well above the longest
step the user's settings allow. That step is one chunk of a long prefill:
`--max-num-batched-tokens` tokens, the last of which attend to the whole
context.

The reference point is the one the shipped defaults were chosen from: on an
RTX 3090, a 2048-token chunk of Qwen2.5-7B (7.6 B parameters) at a 32K
context takes about 2 s. Its work is about half the weights' matrix products
(2 x parameters x tokens) and half attention (which grows with the context),
so the estimate scales the first half with tokens x parameters and the second
with tokens x parameters x context / 32K. The shipped windows are 5x that step
(10 s); a window under MARGIN x the estimate gets a warning with the numbers.

Pure: the caller reads the model's parameter count (None: the reference
model's is assumed, and the warning says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from r3090d.config.schema import WatchdogConfig
from r3090d.engineflags import VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS

REFERENCE_STEP_S = 2.0
REFERENCE_TOKENS = 2048
REFERENCE_PARAMS = 7.6e9
REFERENCE_CONTEXT = 32768
ATTENTION_SHARE = 0.47  # of the reference step: 4 x layers x hidden x tokens x context FLOPs against 2 x params x tokens
MARGIN = 4.0


@dataclass(frozen=True)
class StepEstimate:
    seconds: float
    step_tokens: int
    step_tokens_source: str  # "--max-num-batched-tokens" or "vLLM's default"
    params: float
    params_source: str  # "the model directory", "assumed (7.6 B, Qwen2.5-7B)"
    context: int
    params_known: bool = True

    def describe(self) -> str:
        return (f"{self.step_tokens} tokens per step ({self.step_tokens_source}) x {self.params / 1e9:.1f} B parameters "
                f"({self.params_source}) at a {self.context}-token context: about {self.seconds:.1f} s on an RTX 3090")  # fmt: skip


def estimate_step(step_tokens: int, params: float, context: int) -> float:
    """Seconds for one chunk of `step_tokens` tokens of a `params`-parameter model at `context` tokens, on a 3090."""
    scale = (step_tokens / REFERENCE_TOKENS) * (params / REFERENCE_PARAMS)
    return REFERENCE_STEP_S * scale * ((1 - ATTENTION_SHARE) + ATTENTION_SHARE * context / REFERENCE_CONTEXT)


def longest_step(step_tokens: int | None, context: int | None, params: float | None) -> StepEstimate:
    """The estimate for this config; `step_tokens` and `context` as read from extra_args and the profile."""
    tokens, tokens_source = (step_tokens, "--max-num-batched-tokens") if step_tokens else (VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS, "vLLM's default")
    known = params is not None and params > 0
    p, p_source = (params, "the model directory") if known else (REFERENCE_PARAMS, "assumed: Qwen2.5-7B's")
    ctx = context or REFERENCE_CONTEXT
    # A chunk never holds more than the whole context.
    tokens = min(tokens, ctx) if context else tokens
    return StepEstimate(estimate_step(tokens, p, ctx), tokens, tokens_source, p, p_source, ctx, known)


def window_warnings(wd: WatchdogConfig, step: StepEstimate) -> list[str]:
    """One line per no-progress window shorter than MARGIN x the longest step, naming the key and the fix.

    Only for a model whose size was read: a guess at an unknown model's size is
    shown with the estimate, never made into a warning (a small model's steps are
    far shorter than the reference's).
    """
    if not step.params_known:
        return []
    need = MARGIN * step.seconds
    out = []
    if wd.stall_seconds < need:
        out.append(
            f"watchdog.stall_seconds = {wd.stall_seconds:g} is under {MARGIN:g} x the longest engine step these settings allow "
            f"({step.describe()}): a long prefill could read as a frozen engine; raise it to {need:.0f} or lower --max-num-batched-tokens"
        )  # fmt: skip
    kv_window = wd.kv_low_polls * wd.poll_interval
    if kv_window < need:
        out.append(
            f"watchdog.kv_low_polls x poll_interval = {kv_window:g} s is under {MARGIN:g} x the longest engine step "
            f"({step.seconds:.1f} s): a full cache during a long prefill could read as a leak; "
            f"raise kv_low_polls to {int(need / wd.poll_interval) + 1}"
        )  # fmt: skip
    return out
