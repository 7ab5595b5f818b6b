"""Why an engine died, in one line: an OOM kill, a signal, or the line of its log that says why."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from r3090d.core.rootcause import MAX_CHARS, Explanation, explain, find, nothing_says_why
from r3090d.effectors.child import signal_name

DATA = Path(__file__).resolve().parent.parent / "data"


def root_cause(lines: list[str]) -> str | None:
    return find(lines).cause

CAUSE = (
    "ValueError: To serve at least one request with the model's max seq len (1024), (0.05 GiB KV cache is needed, "
    "which is larger than the available KV cache memory (0.04 GiB). Based on the available memory, the estimated "
    "maximum model length is 896."
)

# The shape of a vLLM 0.32 start failure: EngineCore's traceback (each line tagged
# and headed), then the API server's own follow-on traceback.
VLLM_START_FAILURE = [
    "INFO 11-30 12:00:01 [api_server.py:1000] vLLM API server version 0.32.0",
    "(EngineCore_DP0 pid=4242) INFO 11-30 12:00:09 [core.py:90] Initializing a V1 LLM engine",
    "(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708] EngineCore failed to start.",
    "(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708] Traceback (most recent call last):",
    '(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708]   File "/opt/vllm/v1/engine/core.py", line 699, in run_engine_core',
    "(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708]     engine_core = EngineCoreProc(*args, **kwargs)",
    f"(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708] {CAUSE}",
    "(EngineCore_DP0 pid=4242) Process EngineCore_DP0:",
    "(EngineCore_DP0 pid=4242) Traceback (most recent call last):",
    f"(EngineCore_DP0 pid=4242) {CAUSE}",
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
]


def test_engine_core_exception_wins_over_the_api_servers_follow_on():
    assert root_cause(VLLM_START_FAILURE) == CAUSE


def test_a_worker_exception_counts_too():
    lines = ["(VllmWorker rank=0 pid=7) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "RuntimeError: follow-on"]
    assert root_cause(lines) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_first_error_line_without_an_engine_exception():
    lines = [
        "INFO 11-30 12:00:01 [api_server.py:1000] starting",
        "ERROR 11-30 12:00:02 [api_server.py:90] address already in use",
        "ERROR 11-30 12:00:02 [api_server.py:91] second error",
        "INFO 11-30 12:00:03 [launcher.py:20] Shutting down",
    ]
    assert root_cause(lines) == "address already in use"


def test_nothing_says_why_without_an_exception_or_error_line():
    assert find(["starting", "loading weights", "", "   "]) == Explanation(None, "loading weights")
    assert find([]) == Explanation(None, None)


def test_the_api_servers_own_exception_is_the_cause_when_nothing_else_says_why():
    lines = ["Traceback (most recent call last):", "OSError: [Errno 98] Address already in use", "INFO:     Shutting down"]
    assert find(lines) == Explanation("OSError: [Errno 98] Address already in use", "INFO:     Shutting down")


def test_an_error_line_comes_before_the_api_servers_exception():
    lines = ["ERROR 11-30 12:00:02 [api_server.py:90] address already in use", "Traceback (most recent call last):", "RuntimeError: follow-on"]
    assert root_cause(lines) == "address already in use"


def test_an_indented_exception_name_inside_a_frame_is_not_an_exception_line():
    lines = ["Traceback (most recent call last):", "  ValueError: quoted in a frame", "RuntimeError: the real one"]
    assert root_cause(lines) == "RuntimeError: the real one"


def test_long_lines_are_clipped():
    cause = root_cause(["(EngineCore_DP0 pid=1) ValueError: " + "x" * 5000])
    assert cause is not None and len(cause) == MAX_CHARS and cause.startswith("ValueError: x")


def test_an_access_log_line_is_not_a_cause_but_the_last_log_line():
    assert find(VLLM_START_FAILURE) == Explanation(CAUSE, VLLM_START_FAILURE[-1])
    assert find(["INFO 11-30 12:00:01 [x.py:1] starting", "ERROR 11-30 12:00:02 [x.py:2] boom"]).cause == "boom"
    access = 'INFO:     127.0.0.1:1 - "GET /metrics HTTP/1.1" 200 OK'
    assert find(["starting", access]) == Explanation(None, access)


# ------------------------------------------------------ pydantic ValidationError

MAX_MODEL_LEN_LOG = (DATA / "vllm-0.32-max-model-len-over-limit.txt").read_text().splitlines()


def test_a_validation_error_is_explained_by_its_message_line_in_vllms_real_output():
    """vLLM 0.32's own output for --max-model-len 999999: the API server dies with
    pydantic's ValidationError; the line that says why is under its header, and
    pydantic's "For further information visit ..." footer is the log's last line."""
    why = find(MAX_MODEL_LEN_LOG)
    assert why.cause is not None
    assert why.cause.startswith("Value error, User-specified max_model_len (999999) is greater than the derived max_model_len"), why
    assert "[type=" not in why.cause and "input_value" not in why.cause
    assert why.last_log_line == "For further information visit https://errors.pydantic.dev/2.14/v/value_error"


def test_a_validation_errors_field_name_goes_with_its_message():
    lines = [
        "Traceback (most recent call last):",
        "pydantic_core._pydantic_core.ValidationError: 2 validation errors for SchedulerConfig",
        "max_num_seqs",
        "  Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]",
        "    For further information visit https://errors.pydantic.dev/2.14/v/greater_than",
        "max_num_batched_tokens",
        "  Input should be a valid integer [type=int_type, input_value='x', input_type=str]",
    ]
    assert root_cause(lines) == "max_num_seqs: Input should be greater than 0"


def test_an_engine_cores_logged_validation_error_gives_its_message():
    head = "(EngineCore_DP0 pid=7) ERROR 12-02 05:00:00 [core.py:708] "
    lines = [
        f"{head}EngineCore failed to start.",
        f"{head}Traceback (most recent call last):",
        f"{head}pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig",
        "(APIServer pid=6) INFO 12-02 05:00:00 [api_server.py:1] interleaved",
        f"{head}  Value error, the cache does not fit [type=value_error, input_value=1, input_type=int]",
        f"{head}    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ]
    assert root_cause(lines) == "Value error, the cache does not fit"


def test_a_validation_header_cut_from_its_message_is_taken_as_it_is():
    header = "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig"
    assert root_cause(["Traceback (most recent call last):", header]) == header


# ------------------------------------------------------------- signal, OOM kill

READY_THEN_KILLED = ["INFO:     Started server process [7]", "INFO:     Application startup complete."]


@pytest.mark.parametrize(
    "code, why",
    [(-signal.SIGKILL, "killed by SIGKILL"), (-signal.SIGSEGV, "killed by SIGSEGV"), (-signal.SIGTERM, "killed by SIGTERM"), (-200, "killed by signal 200")],
)
def test_a_death_by_signal_has_the_signal_as_its_cause(code, why):
    assert explain(killed_by=signal_name(-code), log_lines=READY_THEN_KILLED) == Explanation(why, "INFO:     Application startup complete.")


def test_a_signal_outranks_an_earlier_error_line():
    lines = ["ERROR:    Exception in ASGI application", *READY_THEN_KILLED]
    assert explain(killed_by="SIGKILL", log_lines=lines).cause == "killed by SIGKILL"


def test_an_exit_code_is_not_a_cause():
    assert explain(killed_by=None, log_lines=READY_THEN_KILLED) == Explanation(None, "INFO:     Application startup complete.")
    assert explain(killed_by=None, log_lines=MAX_MODEL_LEN_LOG).cause == find(MAX_MODEL_LEN_LOG).cause


@pytest.mark.parametrize("killed_by", [None, "SIGKILL"])
def test_a_risen_oom_kill_count_is_the_cause_whatever_the_exit(killed_by):
    """EngineCore OOM-killed: the API server exits 0 (or is the victim, SIGKILL). The words do not
    carry the counts, so two OOM kills in a row are the same cause."""
    why = explain(killed_by=killed_by, log_lines=VLLM_START_FAILURE, oom_kills_at_start=2, oom_kills_at_exit=3)
    assert why.cause == "the kernel's OOM killer killed a process of the engine (memory.events oom_kill rose)"
    assert why == explain(killed_by=killed_by, log_lines=VLLM_START_FAILURE, oom_kills_at_start=7, oom_kills_at_exit=9)
    assert why.last_log_line == VLLM_START_FAILURE[-1]


@pytest.mark.parametrize("start, end", [(2, 2), (None, 3), (2, None), (None, None)])
def test_an_unchanged_or_unread_oom_kill_count_says_nothing(start, end):
    assert explain(killed_by=None, log_lines=READY_THEN_KILLED, oom_kills_at_start=start, oom_kills_at_exit=end).cause is None


def test_no_cause_is_said_as_such_with_the_last_log_line_quoted():
    assert nothing_says_why("killed by SIGKILL", "INFO:     Application startup complete.") == ""
    assert nothing_says_why(None, "INFO:     Application startup complete.") == "; nothing says why (last log line: INFO:     Application startup complete.)"
    assert nothing_says_why(None, None) == "; nothing says why (the engine printed nothing)"
