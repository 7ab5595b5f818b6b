"""The daemon supervising a real vLLM 0.32 on CPU: orphans, a frozen EngineCore, KV exhaustion, drained stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest

from tests.daemon_harness import DaemonProcess, api_server_pid, group_members
from tests.e2e.real_vllm import CPU_EXTRA_ARGS, ENGINE_BOUND_ARGS, TINY_MODEL_NAME, engine_tree
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

READY_TIMEOUT = 420


def stream(url: str, max_tokens: int, results: list, timeout: float = 300.0, prompt_tokens: int = 0,
           first_chunk: threading.Event | None = None) -> None:  # fmt: skip
    prompt = [17] * prompt_tokens if prompt_tokens else "hello world"  # token ids: an exact prompt length
    body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    finish, tokens, error = None, None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first_chunk is not None:
                    first_chunk.set()
                if "error" in chunk:
                    error = chunk["error"]
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        error = repr(exc)
    results.append({"finish_reason": finish, "tokens": tokens, "error": error})


def test_supervises_real_vllm_orphans_frozen_core_and_drained_stop(vllm_lock, vllm_config_writer, tmp_path):
    poll, idle, probe_timeout, failures = 0.5, 5.0, 5.0, 2
    cfg = vllm_config_writer(
        overrides={
            "watchdog": {"poll_interval": poll, "probe_idle_seconds": idle, "probe_timeout": probe_timeout,
                         "probe_failures": failures, "stall_seconds": 600.0, "backoff_initial": 0.0},  # fmt: skip
        }
    )
    d = DaemonProcess(cfg, tmp_path / "daemon.log").start()
    try:
        t0 = time.monotonic()
        st = d.wait_ready(timeout=READY_TIMEOUT)
        print(f"real vLLM ready under the daemon in {time.monotonic() - t0:.1f} s")
        url = st["engine"]["url"]
        main = st["engine"]["pid"]

        # 1. SIGKILL of the API server orphans EngineCore and Worker; both are gone before the new vLLM starts.
        # The engine's pid is its launcher's; the API server is the launcher's one child.
        api = api_server_pid(main)
        tree = engine_tree(api)
        core, worker = tree["VLLM::EngineCore"], tree["VLLM::Worker"]
        print(subprocess.run(["ps", "-ww", "-o", "pid,ppid,pgid,sid,stat,args", "--forest", "-s", str(main)], capture_output=True, text=True).stdout)
        assert psutil.Process(core).is_running() and psutil.Process(worker).is_running()
        daemon = psutil.Process(d.pid)
        seen = {"old_last_alive": None, "new_first_seen": None}
        stop, watching = threading.Event(), threading.Event()

        def old_alive(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        def watch():
            # The new child is looked for first, each check with its own stamp: an old process
            # seen alive after the new one was seen must count as an overlap.
            while not stop.is_set():
                if seen["new_first_seen"] is None and any(c.pid != main for c in daemon.children()):
                    seen["new_first_seen"] = time.monotonic()
                if any(old_alive(p) for p in (core, worker)):
                    seen["old_last_alive"] = time.monotonic()
                watching.set()
                time.sleep(0.002)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # The kill waits for one whole pass of the watcher: the daemon clears the orphans within
        # tens of ms, less than a first pass can take on a loaded machine.
        assert watching.wait(10) and seen["old_last_alive"] is not None, "the watcher never saw EngineCore and Worker alive"
        os.kill(api, signal.SIGKILL)
        time.sleep(0.05)
        st = d.wait_ready(timeout=READY_TIMEOUT, generation_pid=main)
        assert st["restarts"]["last_reason"] == "exited" and "killed by SIGKILL" in d.log()  # relayed by the launcher
        stop.set()
        watcher.join()
        assert seen["new_first_seen"] is not None
        assert seen["old_last_alive"] is not None and seen["old_last_alive"] < seen["new_first_seen"], seen
        assert group_members(main) == []
        print(f"orphans gone {1000 * (seen['new_first_seen'] - seen['old_last_alive']):.1f} ms before the new vLLM started")

        # 2. SIGSTOP of EngineCore: /health stays 200; the active probe finds it; restart "probe_failed".
        main = st["engine"]["pid"]
        core = engine_tree(main)["VLLM::EngineCore"]
        time.sleep(1.0)
        t_freeze = time.time()
        os.kill(core, signal.SIGSTOP)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        st = d.wait_for(lambda s: s["restarts"]["last_reason"] == "probe_failed" and s, 120, "a probe-failure restart")
        detect = st["restarts"]["last_at"] - t_freeze
        bound = idle + failures * probe_timeout + poll
        st = d.wait_ready(timeout=READY_TIMEOUT, generation_pid=main)
        to_ready = st["engine"]["ready_since"] - st["restarts"]["last_at"]
        print(f"frozen EngineCore: detection-to-restart {detect:.1f} s (bound {bound:.1f} s), restart-to-ready {to_ready:.1f} s")
        assert detect <= bound + 2.0
        assert group_members(main) == [] and not psutil.pid_exists(core) or psutil.Process(core).status() == psutil.STATUS_ZOMBIE

        # 3. A drained stop: the in-flight stream finishes with "length"; nothing is left.
        main = st["engine"]["pid"]
        results: list = []
        streaming = threading.Event()
        client = threading.Thread(target=stream, args=(url, 400, results), kwargs={"first_chunk": streaming})
        client.start()
        assert streaming.wait(60), "the stream never started"
        d.proc.send_signal(signal.SIGTERM)
        assert d.wait_exit(timeout=60) == 0
        client.join(60)
        assert results and results[0]["finish_reason"] == "length" and results[0]["tokens"] == 400, results
        assert results[0]["error"] is None
        assert group_members(main) == []
    finally:
        d.cleanup()


def test_kv_exhaustion_is_load_then_restarts_when_told(vllm_lock, vllm_config_writer, tmp_path):
    # The leak rule's "no progress" window is kv_low_polls polls. Under this load the CPU engine
    # recomputes a preempted request each time others finish, and emits no token for up to 2.5 s
    # (docs/cpu-vllm-notes.md); a 1 s window that begins just before one reads it as a leak.
    # 13 polls at 0.5 s give at least 6 s.
    watchdog = {"poll_interval": 0.5, "min_free_blocks": 5, "kv_low_polls": 13, "kv_cooldown": 0.0, "health_timeout": 2.0, "metrics_timeout": 4.0,
                "probe_idle_seconds": 600.0, "stall_seconds": 600.0}  # fmt: skip
    # The engine must be the bottleneck, as on a GPU server; with the tiny model the API
    # server is, and /metrics mostly shows an empty cache while the client waits for its stream.
    overrides = {
        "profile": "none",
        "engine": {"extra_args": [*CPU_EXTRA_ARGS, *ENGINE_BOUND_ARGS,
                                  "--num-gpu-blocks-override", "8", "--max-model-len", "896", "--no-enable-prefix-caching"]},  # fmt: skip
        "watchdog": watchdog,
        "alerts": {"hysteresis_polls": 1},
    }
    cfg = vllm_config_writer(overrides=overrides)
    d = DaemonProcess(cfg, tmp_path / "daemon.log").start()
    try:
        st = d.wait_ready(timeout=READY_TIMEOUT)
        url, main = st["engine"]["url"], st["engine"]["pid"]
        assert st["metrics"]["num_gpu_blocks"] == 8

        # Prefix caching off, so each request owns its blocks although the prompts are alike.
        # A request is a 16-token prompt (1 block of 128) that decodes 300 tokens (3 blocks);
        # three clients started a second apart ask for up to 9 of the 7 usable blocks, so the
        # cache stays near full and vLLM preempts. The load is a closed loop that runs until
        # the test stops it, so how long the shortage lasts does not depend on this CPU.
        def load(clients=3, tokens=300):
            stop, results = threading.Event(), []

            def client():
                while not stop.is_set():
                    stream(url, tokens, results, prompt_tokens=16)

            threads = [threading.Thread(target=client) for _ in range(clients)]
            for t in threads:
                t.start()
                time.sleep(1.0)

            def finish():
                stop.set()
                for t in threads:
                    t.join(300)
                return results

            return finish

        # Under load: free blocks at the floor, tokens flowing -> kv_pressure, no restart.
        t_load = time.time()
        finish = load()
        try:
            st = d.wait_for(lambda s: "kv_pressure" in s["alerts"]["firing"] and s, 180, "kv_pressure alert")
            low, to_alert = st["metrics"]["free_blocks"], time.time() - t_load
            time.sleep(3.0)  # the shortage goes on; a load shortage never restarts
        finally:
            results = finish()
        st = d.state()
        assert st["restarts"]["total"] == 0 and st["engine"]["pid"] == main, f"{st['restarts']}\n{d.log()[-3000:]}"
        assert results and all(r["finish_reason"] == "length" and r["error"] is None for r in results), results
        print(f"KV under load: alert after {to_alert:.1f} s, free blocks {low}, {len(results)} requests, alert {st['alerts']}, preemptions {st['metrics']['preemptions_total']}")

        # kv_restart_under_load = true, applied by a reload (no engine restart for a watchdog change).
        text = cfg.read_text().replace("kv_cooldown = 0.0", "kv_cooldown = 0.0\nkv_restart_under_load = true")
        assert "kv_restart_under_load = true" in text
        cfg.write_text(text)
        os.kill(d.pid, signal.SIGHUP)
        assert d.wait_for(lambda s: "reload: applied" in d.log(), 10, "reload")
        assert d.state()["engine"]["pid"] == main

        t_load = time.time()
        finish = load()
        try:
            st = d.wait_for(lambda s: s["restarts"]["total"] >= 1 and s, 180, "a KV restart")
        finally:
            finish()
        assert st["restarts"]["last_reason"] == "kv"
        detect = st["restarts"]["last_at"] - t_load
        st = d.wait_ready(timeout=READY_TIMEOUT, generation_pid=main)
        to_ready = st["engine"]["ready_since"] - st["restarts"]["last_at"]
        print(f"KV threshold restart: load-to-restart {detect:.1f} s, restart-to-ready {to_ready:.1f} s")
        r = httpx.post(url + "/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": "hi", "max_tokens": 5}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        assert group_members(main) == []
    finally:
        d.cleanup()


def test_real_vllm_start_failure_gives_up_with_its_root_cause_in_the_alert(vllm_lock, vllm_config_writer, tmp_path):
    """vLLM's EngineCore raises at start (a max_model_len its 8 KV blocks cannot hold); the API
    server prints a follow-on traceback after it. The alert names EngineCore's line."""

    from tests.daemon_harness import bind_unix_dgram

    syslog_path = tmp_path / "syslog.sock"
    receiver = bind_unix_dgram(syslog_path, timeout=1.0)
    cfg = vllm_config_writer(
        overrides={
            "profile": "none",
            "engine": {"extra_args": [*CPU_EXTRA_ARGS, "--max-model-len", "1024", "--num-gpu-blocks-override", "8"]},
            "watchdog": {"start_failures": 5, "same_cause_failures": 2, "backoff_initial": 0.0},
            "alerts": {"syslog": {"enabled": True, "address": str(syslog_path)}},
        }
    )
    d = DaemonProcess(cfg, tmp_path / "daemon.log").start()
    try:
        t0 = time.monotonic()
        st = d.wait_for(lambda s: s if s["engine"]["phase"] == "given-up" else None, 2 * READY_TIMEOUT, "given-up")
        print(f"given up after two start failures in {time.monotonic() - t0:.1f} s: {st['give_up_reason']}")
        cause = "ValueError: To serve at least one request with the model's max seq len (1024)"
        assert cause in st["give_up_reason"] and "same cause" in st["give_up_reason"], st["give_up_reason"]
        assert "Engine core initialization failed" not in st["restarts"]["last_root_cause"]
        messages = []

        def gave_up_received() -> bool:
            try:
                messages.append(receiver.recv(65536))  # waits up to the socket's 1 s timeout
            except TimeoutError:
                pass
            return any(b"gave_up" in m and b"FIRING" in m for m in messages)

        wait_until(
            gave_up_received,
            30,
            what="gave_up FIRING on syslog",
            interval=0,
            details=lambda: f"received {messages}",
        )
        gave_up = [m.decode(errors="replace") for m in messages if b"gave_up" in m and b"FIRING" in m]
        assert gave_up and cause in gave_up[0], messages
        restarted = [m.decode(errors="replace") for m in messages if b"engine_restarted" in m]
        assert restarted and cause in restarted[0], messages
        assert d.proc.poll() is None  # the daemon stays up after a give-up
    finally:
        d.cleanup()
        receiver.close()


def test_real_vllm_invalid_argument_gives_up_with_the_validation_errors_message(vllm_lock, vllm_config_writer, tmp_path):
    """A max_model_len above the model's limit: vLLM's API server dies with pydantic's
    ValidationError before EngineCore exists. The cause is the line under its header
    that says why, not pydantic's footer, and twice the same cause gives up."""
    cfg = vllm_config_writer(
        overrides={
            "profile": "none",
            "engine": {"extra_args": [*CPU_EXTRA_ARGS, "--max-model-len", "999999"]},
            "watchdog": {"start_failures": 5, "same_cause_failures": 2, "backoff_initial": 0.0},
        }
    )
    d = DaemonProcess(cfg, tmp_path / "daemon.log").start()
    try:
        st = d.wait_for(lambda s: s if s["engine"]["phase"] == "given-up" else None, 2 * READY_TIMEOUT, "given-up")
        cause = "Value error, User-specified max_model_len (999999) is greater than the derived max_model_len"
        assert "same cause" in st["give_up_reason"] and cause in st["give_up_reason"], st["give_up_reason"]
        assert st["restarts"]["last_root_cause"].startswith(cause), st["restarts"]
        assert "errors.pydantic.dev" not in st["give_up_reason"]
    finally:
        d.cleanup()
