"""Journal priorities: vLLM's lines classified by their own level, and the daemon's
records prefixed with `<N>` only when stderr really is the journal stream."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3090d.effectors import journal
from r3090d.effectors.child import EngineProcess
from r3090d.vllmlines import MAX_TRACEBACK_LINES, Priority, VllmLineClassifier
from tests.waiting import wait_until

E, W, N, D = Priority.ERR, Priority.WARNING, Priority.INFO, Priority.DEBUG  # N: normal (info)
CAUSE = "ValueError: To serve at least one request with the model's max seq len (4096), 0.05 GiB KV cache is needed"


def classify_all(lines: list[str]) -> list[Priority]:
    c = VllmLineClassifier()
    return [c.classify(line) for line in lines]


# ----------------------------------------------------------------- classifier


@pytest.mark.parametrize(
    "line, expected",
    [
        ("DEBUG 11-30 12:00:01 [utils.py:10] text", D),
        ("INFO 11-30 12:00:01 [api_server.py:1000] vLLM API server version 0.32.0", N),
        ("WARNING 11-30 12:00:01 [config.py:5] text", W),
        ("ERROR 11-30 12:00:01 [core.py:708] EngineCore failed to start.", E),
        ("CRITICAL 11-30 12:00:01 [launcher.py:99] text", Priority.CRIT),
        ("(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708] text", E),
        ("(EngineCore_DP0 pid=4242) WARNING 11-30 12:00:19 [core.py:708] text", W),
        ("(EngineCore_DP0 pid=4242) DEBUG 11-30 12:00:19 [core.py:708] text", D),
        ("(APIServer pid=1) INFO 11-30 12:00:19 [api_server.py:1] text", N),
        ("(VllmWorker TP0 pid=9) ERROR 11-30 12:00:19 [worker.py:1] text", E),
        ('INFO:     127.0.0.1:53422 - "GET /health HTTP/1.1" 200 OK', N),
        ("WARNING:  Invalid HTTP request received.", W),
        ("ERROR:    Exception in ASGI application", E),
        ("DEBUG:    text", D),
        # No level word: info.
        ("Loading safetensors checkpoint shards: 100% 1/1", N),
        ("(EngineCore_DP0 pid=4242) plain text", N),
        ("ERRORS: none", N),
        ("INFORMATION", N),
        ("", N),
        # A Python warning has no level word but is one.
        ("/opt/vllm/x.py:12: FutureWarning: `torch.cuda.amp` is deprecated", W),
        ("Fatal Python error: Segmentation fault", E),
    ],
)
def test_level_word_gives_the_priority(line, expected):
    assert VllmLineClassifier().classify(line) is expected


def test_a_bare_traceback_is_error_until_its_exception_line():
    lines = [
        "INFO 11-30 12:00:01 [api_server.py:1000] starting",
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        "    return _run_code(code, main_globals, None,",
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        "after the exception",
        "(APIServer pid=1) plain again",
    ]
    assert classify_all(lines) == [N, E, E, E, E, E, N, N]


def test_the_shape_of_a_vllm_start_failure():
    lines = [
        "(EngineCore_DP0 pid=4242) INFO 11-30 12:00:09 [core.py:90] Initializing a V1 LLM engine",
        "(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708] EngineCore failed to start.",
        "(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708] Traceback (most recent call last):",
        '(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708]   File "/opt/vllm/v1/engine/core.py", line 699',
        f"(EngineCore_DP0 pid=4242) ERROR 11-30 12:00:19 [core.py:708] {CAUSE}",
        "(EngineCore_DP0 pid=4242) Process EngineCore_DP0:",
        "(EngineCore_DP0 pid=4242) Traceback (most recent call last):",
        '(EngineCore_DP0 pid=4242)   File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap',
        "(EngineCore_DP0 pid=4242)     self.run()",
        f"(EngineCore_DP0 pid=4242) {CAUSE}",
        "(EngineCore_DP0 pid=4242) after",
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        "",
    ]
    assert classify_all(lines) == [N, E, E, E, E, E, E, E, E, E, N, E, E, E, N]


@pytest.mark.parametrize(
    "exception",
    [
        "KeyboardInterrupt",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        "test.<locals>.Oops: x",
        "SystemExit: 1",
        "StopIteration",
        "OSError:",
    ],
)
def test_any_exception_line_at_column_0_ends_the_block(exception):
    lines = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>', exception, "next"]
    assert classify_all(lines) == [E, E, E, N]


def test_chained_exceptions_stay_error_throughout():
    lines = [
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in f',
        "KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "a.py", line 3, in f',
        "ValueError: y",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        "RuntimeError: z",
        "done",
    ]
    assert classify_all(lines) == [E, E, E, N, E, N, E, E, E, N, E, N, E, E, N]


def test_each_process_has_its_own_traceback():
    """vLLM's processes share the pipe: the API server's lines during an EngineCore
    traceback keep their own level, and an EngineCore exception does not end
    the API server's traceback."""
    lines = [
        "(EngineCore_DP0 pid=4242) Traceback (most recent call last):",
        "(APIServer pid=1) INFO 11-30 12:00:19 [api_server.py:1] still serving",
        "(APIServer pid=1) plain line of the API server",
        '(EngineCore_DP0 pid=4242)   File "core.py", line 1, in run',
        "(APIServer pid=1) Traceback (most recent call last):",
        "(EngineCore_DP0 pid=4242) ValueError: core",
        '(APIServer pid=1)   File "api.py", line 1, in serve',
        "(EngineCore_DP0 pid=4242) after the core's exception",
        "(APIServer pid=1) RuntimeError: api",
        "(APIServer pid=1) after the api's exception",
    ]
    assert classify_all(lines) == [E, N, N, E, E, E, E, N, E, N]


def test_a_logged_line_inside_a_traceback_keeps_its_own_level():
    lines = [
        "Traceback (most recent call last):",
        "INFO:     127.0.0.1:1 - \"POST /v1/completions HTTP/1.1\" 200 OK",
        "WARNING 11-30 12:00:19 [x.py:1] text",
        '  File "a.py", line 1, in f',
        "ValueError: y",
    ]
    assert classify_all(lines) == [E, N, W, E, E]


def test_a_traceback_that_never_ends_is_closed_after_a_bound():
    """A process killed mid-traceback must not leave every later line at ERROR."""
    c = VllmLineClassifier()
    assert c.classify("Traceback (most recent call last):") is E
    for _ in range(MAX_TRACEBACK_LINES - 1):
        assert c.classify('  File "a.py", line 1, in f') is E
    assert c.classify("not an exception line, just text") is E  # the last line of the bound
    assert c.classify("plain") is N


MAX_MODEL_LEN_LOG = (Path(__file__).resolve().parent.parent / "data" / "vllm-0.32-max-model-len-over-limit.txt").read_text().splitlines()


def test_every_line_of_a_validation_error_is_error_in_vllms_real_output():
    """vLLM 0.32's own output for --max-model-len 999999: the traceback, the
    ValidationError's header and the message under it (the line that says why)
    and its footer are all ERROR, so `journalctl -p warning` shows them."""
    start = MAX_MODEL_LEN_LOG.index("Traceback (most recent call last):")
    priorities = classify_all(MAX_MODEL_LEN_LOG)
    block = list(zip(priorities[start:], MAX_MODEL_LEN_LOG[start:], strict=True))
    assert [line for p, line in block if p is not E] == []
    assert MAX_MODEL_LEN_LOG[-2].startswith("  Value error, User-specified max_model_len (999999)")
    assert all(p is not E for p in priorities[:start])


def test_a_validation_errors_field_names_and_messages_stay_error_until_the_block_ends():
    lines = [
        "(APIServer pid=1) Traceback (most recent call last):",
        '(APIServer pid=1)   File "x.py", line 1, in <module>',
        "(APIServer pid=1) pydantic_core._pydantic_core.ValidationError: 2 validation errors for SchedulerConfig",
        "(APIServer pid=1) max_num_seqs",
        "(EngineCore_DP0 pid=2) interleaved, not in the block",
        "(APIServer pid=1)   Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]",
        "(APIServer pid=1)     For further information visit https://errors.pydantic.dev/2.14/v/greater_than",
        "(APIServer pid=1) max_num_batched_tokens",
        "(APIServer pid=1)   Input should be a valid integer [type=int_type, input_value='x', input_type=str]",
        "(APIServer pid=1)     For further information visit https://errors.pydantic.dev/2.14/v/int_type",
        "(APIServer pid=1) after the block",
    ]
    assert classify_all(lines) == [E, E, E, E, N, E, E, E, E, E, N]


def test_an_exceptions_indented_lines_after_it_are_error_and_a_blank_line_ends_them():
    lines = [
        "Traceback (most recent call last):",
        "ExceptionGroup: two (2 sub-exceptions)",
        "  +-+---------------- 1 ----------------",
        "    | ValueError: a",
        "",
        "  indented again, but after the end",
    ]
    assert classify_all(lines) == [E, E, E, E, N, N]


frame = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=40).map(lambda s: "  " + s)
exc_name = st.from_regex(r"\A(?:[a-z_][a-z0-9_]{0,8}\.){0,3}[A-Z][A-Za-z0-9_]{0,15}\Z")
message = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=40)


@settings(deadline=None, derandomize=True, max_examples=200)
@given(frames=st.lists(frame, max_size=20), name=exc_name, msg=message)
def test_every_traceback_is_error_and_closes_at_its_exception(frames, name, msg):
    exception = f"{name}: {msg}" if msg else name
    lines = ["Traceback (most recent call last):", *frames, exception, "back to normal"]
    assert classify_all(lines) == [E] * (len(frames) + 2) + [N]


# ----------------------------------------------------------------- formatter


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    vllm = logging.getLogger(journal.VLLM_LOGGER)
    saved = (root.handlers[:], root.level, vllm.level)
    yield
    for h in root.handlers:
        if h not in saved[0]:
            root.removeHandler(h)
    for h in saved[0]:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(saved[1])
    vllm.setLevel(saved[2])


@pytest.fixture
def stderr_file(tmp_path, monkeypatch, restore_logging):
    """redirect() makes sys.stderr a real file and returns (path, its JOURNAL_STREAM value).
    Called from the test itself: pytest's capture sets sys.stderr again between setup and call."""
    path = tmp_path / "stderr"
    fh = open(path, "w", buffering=1)  # noqa: SIM115

    def redirect() -> tuple:
        monkeypatch.setattr(sys, "stderr", fh)
        st_ = os.fstat(fh.fileno())
        return path, f"{st_.st_dev}:{st_.st_ino}"

    yield redirect
    fh.close()


def log_some(name: str = "r3090d.test") -> None:
    log = logging.getLogger(name)
    log.debug("hidden")
    log.info("an info line")
    log.warning("a warning")
    log.error("two lines\nsecond line")
    log.critical("critical")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("with a traceback")
    sys.stderr.flush()


def test_daemon_records_carry_their_priority_when_stderr_is_the_journal(stderr_file, monkeypatch):
    path, stream = stderr_file()
    monkeypatch.setenv("JOURNAL_STREAM", stream)
    journal.setup_logging()
    log_some()
    lines = path.read_text().splitlines()
    assert lines[:6] == [
        "<6>INFO r3090d.test: an info line",
        "<4>WARNING r3090d.test: a warning",
        "<3>ERROR r3090d.test: two lines",
        "<3>second line",
        "<2>CRITICAL r3090d.test: critical",
        "<3>ERROR r3090d.test: with a traceback",
    ]
    assert lines[6] == "<3>Traceback (most recent call last):"
    assert lines[-1] == "<3>ValueError: boom"
    assert all(line.startswith("<3>") for line in lines[6:]), lines


@pytest.mark.parametrize("stream", ["other", "0:0", "garbage", "1:", ":2", "1:2:3", ""])
def test_no_prefix_unless_journal_stream_names_stderr_itself(stderr_file, monkeypatch, tmp_path, stream):
    path, _ = stderr_file()
    if stream == "other":  # a real stream, but not this one: a shell started from a journal-connected service
        other = os.stat(tmp_path)
        stream = f"{other.st_dev}:{other.st_ino}"
    monkeypatch.setenv("JOURNAL_STREAM", stream)
    journal.setup_logging()
    log_some()
    text = path.read_text()
    assert "<" not in text.replace("<module>", ""), text
    first = text.splitlines()[0]
    # As before: a time stamp, then the level.
    assert time.strftime("%Y-") in first and first.endswith("INFO r3090d.test: an info line"), first


def test_a_crash_reaches_the_journal_at_priority_2(stderr_file, monkeypatch):
    """Python prints an uncaught exception bare: under the journal it goes through logging."""
    path, stream = stderr_file()
    monkeypatch.setenv("JOURNAL_STREAM", stream)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    journal.setup_logging()
    try:
        raise AttributeError("'Config' object has no attribute 'x'")
    except AttributeError:
        sys.excepthook(*sys.exc_info())
    worker = threading.Thread(target=lambda: 1 / 0, name="engine-output")
    worker.start()
    worker.join()
    sys.stderr.flush()
    lines = path.read_text().splitlines()
    assert lines[0] == "<2>CRITICAL r3090d: uncaught exception"
    assert "<2>AttributeError: 'Config' object has no attribute 'x'" in lines
    assert "<2>CRITICAL r3090d: uncaught exception in thread engine-output" in lines
    assert lines[-1] == "<2>ZeroDivisionError: division by zero"
    assert all(line.startswith("<2>") for line in lines), lines


def test_the_crash_hooks_stay_pythons_own_outside_the_journal(stderr_file, monkeypatch):
    stderr_file()
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    journal.setup_logging()
    assert sys.excepthook is sys.__excepthook__ and threading.excepthook is threading.__excepthook__


def test_no_prefix_without_journal_stream(stderr_file, monkeypatch):
    path, _ = stderr_file()
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    journal.setup_logging()
    log_some()
    assert not any(line.startswith("<") for line in path.read_text().splitlines())


def test_a_pipe_is_recognised_by_its_own_device_and_inode():
    r, w = os.pipe()
    try:
        st_ = os.fstat(w)
        assert journal.is_journal_stream(w, f"{st_.st_dev}:{st_.st_ino}")
        assert not journal.is_journal_stream(w, f"{st_.st_dev}:{st_.st_ino + 1}")
        assert not journal.is_journal_stream(w, None)
    finally:
        os.close(r)
        os.close(w)


def test_a_closed_stderr_is_not_the_journal(monkeypatch, tmp_path):
    fh = open(tmp_path / "x", "w")  # noqa: SIM115
    fh.close()
    monkeypatch.setattr(sys, "stderr", fh)
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    assert journal.stderr_is_journal() is False
    assert journal.for_stderr("r3090d: config error", Priority.ERR) == "r3090d: config error"


def test_for_stderr_prefixes_only_the_journal(stderr_file, monkeypatch):
    _, stream = stderr_file()
    monkeypatch.setenv("JOURNAL_STREAM", stream)
    assert journal.for_stderr("a\nb", Priority.ERR) == "<3>a\n<3>b"


# ----------------------------------------------------------------- the relay


def test_relayed_engine_lines_reach_the_journal_at_vllms_level(stderr_file, monkeypatch):
    """The engine's real pipe, through EngineProcess: each line at vLLM's priority,
    DEBUG lines included (vLLM printed them because it was asked to)."""
    path, stream = stderr_file()
    monkeypatch.setenv("JOURNAL_STREAM", stream)
    journal.setup_logging()
    script = "\n".join(
        f"print({line!r}, flush=True)"
        for line in [
            "(EngineCore_DP0 pid=7) DEBUG 11-30 12:00:01 [core.py:1] debug",
            "INFO 11-30 12:00:01 [api_server.py:1] info",
            "(EngineCore_DP0 pid=7) WARNING 11-30 12:00:01 [core.py:1] warning",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "RuntimeError: follow-on",
            'INFO:     127.0.0.1:53422 - "POST /v1/completions HTTP/1.1" 200 OK',
        ]
    )
    engine = EngineProcess(threading.Event())
    engine.spawn([sys.executable, "-c", script], dict(os.environ))
    wait_until(
        lambda: "POST /v1/completions" in path.read_text(),
        30,
        what="the last engine line relayed",
        details=path.read_text,
    )
    relayed = [line for line in path.read_text().splitlines() if "[vllm]" in line]
    assert [line[:3] for line in relayed] == ["<7>", "<6>", "<4>", "<3>", "<3>", "<3>", "<6>"], relayed
    assert relayed[3] == "<3>ERROR r3090d.engine.vllm: [vllm] Traceback (most recent call last):"
    engine.kill_now()


def test_a_relayed_validation_error_reaches_the_journal_at_err_line_by_line(stderr_file, monkeypatch):
    """vLLM's real output for an over-long max_model_len, through the engine's pipe:
    every line from the traceback to pydantic's footer is stored at priority 3."""
    path, stream = stderr_file()
    monkeypatch.setenv("JOURNAL_STREAM", stream)
    journal.setup_logging()
    engine = EngineProcess(threading.Event())
    engine.spawn([sys.executable, "-c", f"print({chr(10).join(MAX_MODEL_LEN_LOG)!r}, flush=True)"], dict(os.environ))
    wait_until(lambda: "errors.pydantic.dev" in path.read_text(), 30, what="the footer relayed", details=path.read_text)
    relayed = [line for line in path.read_text().splitlines() if "[vllm]" in line]
    start = next(i for i, line in enumerate(relayed) if line.endswith("[vllm] Traceback (most recent call last):"))
    assert [line for line in relayed[start:] if not line.startswith("<3>")] == []
    assert any("[vllm]   Value error, User-specified max_model_len (999999)" in line for line in relayed[start:])
    engine.kill_now()


def test_the_http_clients_request_lines_stay_out_and_its_warnings_come_through(stderr_file, monkeypatch, tmp_path):
    """A real request through httpx: its "HTTP Request: GET ..." INFO line would go out every tick."""
    import httpx

    path, _ = stderr_file()
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    journal.setup_logging()
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200)), trust_env=False) as client:
        client.get("http://127.0.0.1:9/health")
    logging.getLogger("httpx").warning("a client warning")
    text = path.read_text()
    assert "HTTP Request" not in text and "a client warning" in text
