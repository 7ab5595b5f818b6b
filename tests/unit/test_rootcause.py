"""The root-cause line of a failed engine start, from its log."""

from __future__ import annotations

from r3090d.core.rootcause import MAX_CHARS, root_cause

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


def test_last_line_when_nothing_else_says_why():
    assert root_cause(["starting", "loading weights", "", "   "]) == "loading weights"
    assert root_cause([]) is None


def test_api_server_exception_alone_is_not_taken_as_engine_cause_but_is_the_last_line():
    lines = ["Traceback (most recent call last):", "OSError: [Errno 98] Address already in use"]
    assert root_cause(lines) == "OSError: [Errno 98] Address already in use"


def test_long_lines_are_clipped():
    cause = root_cause(["(EngineCore_DP0 pid=1) ValueError: " + "x" * 5000])
    assert cause is not None and len(cause) == MAX_CHARS and cause.startswith("ValueError: x")


def test_only_an_exception_or_error_line_is_certain():
    from r3090d.core.rootcause import find

    assert find(VLLM_START_FAILURE) == (CAUSE, True)
    assert find(["INFO 11-30 12:00:01 [x.py:1] starting", "ERROR 11-30 12:00:02 [x.py:2] boom"]) == ("boom", True)
    assert find(["starting", 'INFO:     127.0.0.1:1 - "GET /metrics HTTP/1.1" 200 OK']) == ('INFO:     127.0.0.1:1 - "GET /metrics HTTP/1.1" 200 OK', False)
