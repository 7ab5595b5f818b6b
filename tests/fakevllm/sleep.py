"""The double's sleep mode and pause: vLLM's dev endpoints, with vLLM's semantics and faults on demand.

vLLM (0.3x, vllm/entrypoints/serve: the sleep, rpc and rlhf routers, engine core's pause_scheduler)
serves these only with VLLM_SERVER_DEV_MODE=1 (without it they are unknown routes: 404):

  POST /sleep?level=L&mode=M   L from the query string only (default 1; 0 pauses only); M abort (default),
                               wait or keep, as /pause; then the weights go (level 1: to pinned host memory;
                               2: dropped) with the KV cache. Empty 200. A second sleep changes nothing.
  POST /wake_up?tags=T...      T weights, kv_cache (none: all). Empty 200. /is_sleeping stays true until
                               every tag is awake; the scheduler resumes.
  GET  /is_sleeping            {"is_sleeping": bool}: the scheduler paused or any tag asleep
  POST /pause?mode=M           abort: in-flight requests end (finish_reason "abort"); wait: answers once they
                               have finished; keep: they freeze and go on after /resume. {"status": "paused"}
  POST /resume                 {"status": "resumed"}
  GET  /is_paused              {"is_paused": bool}
  POST /collective_rpc         {"method": "reload_weights"}: weights read again (after a level-2 sleep, the
                               woken weights are garbage until then). {"results": [null]}

While paused or asleep, new completions and embeddings are accepted and wait (vLLM's scheduler queues
them) until the engine is awake and resumed; /health answers 200 throughout.

Without --enable-sleep-mode the routes still exist (dev mode alone adds them) and a sleep frees nothing.

GPU memory: when $R3090D_FAKE_NVML names a card (tests/fakenvml) that lists this engine's fake-EngineCore,
a sleep sets that entry to the residual (--fake-sleep-residual-mib, growing by
--fake-sleep-residual-growth-mib per sleep) and a full wake puts the awake size back, adjusting
memory_used_mib, as the checkpoint fake (tests/fakecuda) does.

With $FAKE_VLLM_SLEEP_WORKER_DIR (bench/gpu_swap_engine.py: the engine's status dir), sleep, wake and reload
are also asked of the stand-in's torch worker (bench/gpu_sleep_worker.py), which moves its real weights;
the double answers once the worker has done it, and its report is in /fake/state's "sleep"."worker".
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs

ENV_DEV_MODE = "VLLM_SERVER_DEV_MODE"
ENV_CARD = "R3090D_FAKE_NVML"
ENV_WORKER_DIR = "FAKE_VLLM_SLEEP_WORKER_DIR"
PAUSE_MODES = ("abort", "wait", "keep")
TAGS = ("weights", "kv_cache")
WORKER_REQUEST = (
    "sleep-request.json"  # in the worker dir; the worker answers in its worker-<pid>.json "sleep"
)
WORKER_POLL_S = 0.01
WORKER_WAIT_S = 900.0  # a 24 GiB level-2 reload from a slow disk, with room


def dev_mode() -> bool:
    # vLLM's envs: VLLM_SERVER_DEV_MODE is true for "1" or "true" (any case).
    return os.environ.get(ENV_DEV_MODE, "0").strip().lower() in ("1", "true")


def add_flags(parser) -> None:
    parser.add_argument("--enable-sleep-mode", action="store_true")
    f = parser.add_argument_group("test double: sleep mode")
    f.add_argument("--fake-sleep-residual-mib", type=int, default=1200, metavar="MIB",
                   help="what a sleeping engine keeps on the card (CUDA context, graph pool)")  # fmt: skip
    f.add_argument(
        "--fake-sleep-residual-growth-mib",
        type=int,
        default=0,
        metavar="N",
        help="the residual grows by N MiB per sleep",
    )
    f.add_argument(
        "--fake-wake-corrupts",
        action="store_true",
        help="every wake changes the weights: greedy answers differ",
    )
    f.add_argument(
        "--fake-wake-500", action="store_true", help="/wake_up answers 500 and the engine stays asleep"
    )
    f.add_argument(
        "--fake-sleep-hangs", action="store_true", help="/sleep pauses the engine, then never answers"
    )


class SleepError(Exception):
    """What vLLM's exception handler turns into a 500."""


class WorkerLink:
    """Asks the stand-in's worker to move its weights, through a request file in its status dir."""

    def __init__(self, where: str):
        self.dir = Path(where)
        self.seq = 0
        self.report: dict = {}

    def _status(self) -> dict | None:
        newest = None
        for path in self.dir.glob("worker-*.json"):
            try:
                mtime = path.stat().st_mtime_ns
            except OSError:
                continue
            if newest is None or mtime > newest[0]:
                newest = (mtime, path)
        try:
            return json.loads(newest[1].read_text()) if newest else None
        except (OSError, ValueError):
            return None

    def ask(self, op: str, **fields) -> dict:
        self.seq += 1
        request = {"seq": self.seq, "op": op, **fields}
        tmp = self.dir / f".{WORKER_REQUEST}.tmp"
        tmp.write_text(json.dumps(request))
        os.replace(tmp, self.dir / WORKER_REQUEST)
        deadline = time.monotonic() + WORKER_WAIT_S
        while time.monotonic() < deadline:
            status = self._status() or {}
            sleep = status.get("sleep") or {}
            if sleep.get("seq") == self.seq:
                self.report = sleep
                if sleep.get("error"):
                    raise SleepError(f"worker: {sleep['error']}")
                return sleep
            pid = status.get("pid")
            if pid and not Path(f"/proc/{pid}").exists():
                raise SleepError(f"worker {pid} is gone")
            time.sleep(WORKER_POLL_S)
        raise SleepError(f"worker did not answer {op} within {WORKER_WAIT_S:.0f} s")


class SleepMode:
    """The engine's pause and sleep state; every HTTP handler thread goes through `lock`/`changed`."""

    def __init__(self, opts, engine, log=lambda message, level="INFO", where="": None):
        self.opts = opts
        self.engine = engine
        self.log = log  # server.log: vLLM's lines, so a daemon's log reads as with vLLM
        self.enabled = bool(opts.enable_sleep_mode)
        self.dev = dev_mode()
        self.changed = threading.Condition()
        self.paused: str | None = None  # the pause mode while the scheduler is paused
        self.asleep: set[str] = set()  # tags asleep
        self.level = 0
        self.sleeps = 0  # sleeps that freed memory (level >= 1)
        self.weights_garbage = False  # woken from level 2, not reloaded
        self.corrupt_wakes = 0
        self.held = 0  # requests waiting in wait_admitted: vLLM's scheduler counts them as waiting
        self.awake_mib: int | None = None
        self.residual_mib: int | None = None
        where = os.environ.get(ENV_WORKER_DIR)
        self.worker = WorkerLink(where) if where else None

    # -- what the rest of the double asks
    def is_sleeping(self) -> bool:
        return self.paused is not None or bool(self.asleep)

    def wait_admitted(self) -> None:
        """A new request waits here while the engine is paused or asleep, as vLLM's paused scheduler holds it."""
        with self.changed:
            self.held += 1
            try:
                while self.is_sleeping():
                    self.changed.wait(0.25)
            finally:
                self.held -= 1

    def answer_salt(self) -> bytes:
        """Mixed into greedy answers: weights changed by a faulty wake, or garbage after a level-2 wake."""
        if self.worker is not None:
            return b""  # the worker's own checksum says it (FAKE_VLLM_ANSWER_SALT_DIR)
        parts = []
        if self.corrupt_wakes:
            parts.append(f"corrupt-wake-{self.corrupt_wakes}")
        if self.weights_garbage:
            parts.append(f"garbage-{self.sleeps}")
        return "|".join(parts).encode()

    def state(self) -> dict:
        o = self.opts
        return {
            "enabled": self.enabled,
            "dev_mode": self.dev,
            "is_sleeping": self.is_sleeping(),
            "held_requests": self.held,
            "paused": self.paused,
            "asleep_tags": sorted(self.asleep),
            "level": self.level,
            "sleeps": self.sleeps,
            "weights_garbage": self.weights_garbage,
            "corrupt_wakes": self.corrupt_wakes,
            "awake_mib": self.awake_mib,
            "residual_mib": self.residual_mib,
            "faults": {
                "wake_corrupts": o.fake_wake_corrupts,
                "wake_500": o.fake_wake_500,
                "sleep_hangs": o.fake_sleep_hangs,
                "residual_growth_mib": o.fake_sleep_residual_growth_mib,
            },  # fmt: skip
            "worker": self.worker.report if self.worker else None,
        }

    # -- the scheduler
    def _pause(self, mode: str) -> None:
        """vLLM's pause_scheduler: abort ends in-flight requests, wait lets them finish, keep freezes them."""
        with self.changed:
            self.paused = mode
            self.changed.notify_all()
        e = self.engine
        if mode == "abort":
            with e.lock:
                running = list(e.generations.values())
            for gen in running:
                e.abort(gen)
                gen.events.put(("token", gen.generated, "abort"))
        elif mode == "keep":
            e.send({"op": "hold", "on": True})
        else:
            while True:  # wait: the requests in flight finish; new ones wait in wait_admitted
                with e.lock:
                    if not e.generations or e.dead:
                        break
                time.sleep(0.01)

    def _resume(self) -> None:
        with self.changed:
            if self.paused == "keep":
                self.engine.send({"op": "hold", "on": False})
            self.paused = None
            self.changed.notify_all()

    # -- the endpoints' work
    def pause(self, mode: str) -> None:
        self._pause(mode)

    def resume(self) -> None:
        self._resume()

    def sleep(self, level: int, mode: str) -> None:
        self._pause(mode)
        if level < 1:
            return
        if self.opts.fake_sleep_hangs:
            threading.Event().wait()  # the engine is paused; the sleep itself never ends
        if self.asleep:
            return  # vLLM's executor: "already sleeping", nothing done
        level = min(level, 2)
        start = time.monotonic()
        if self.worker is not None and self.enabled:
            self.worker.ask("sleep", level=level, growth_mib=self.opts.fake_sleep_residual_growth_mib)
        with self.changed:
            self.level = level
            self.asleep = set(TAGS)
            if self.enabled:
                self.sleeps += 1
                self._card_sleep()
        self.log(f"It took {time.monotonic() - start:.6f} seconds to fall asleep.", where="abstract.py")

    def wake_up(self, tags: list[str] | None) -> None:
        if self.opts.fake_wake_500:
            raise SleepError("CUDA error: out of memory (--fake-wake-500)")
        self.log(f"wake up the engine with tags: {tags}")
        waking = set(TAGS) if tags is None else {t for t in tags if t in TAGS}
        start = time.monotonic()
        if self.asleep & waking:
            if self.worker is not None and self.enabled and "weights" in (self.asleep & waking):
                self.worker.ask("wake", corrupt=8 if self.opts.fake_wake_corrupts else 0)
            with self.changed:
                if self.enabled and "weights" in (self.asleep & waking):
                    if self.level >= 2:
                        self.weights_garbage = True
                    if self.opts.fake_wake_corrupts:
                        self.corrupt_wakes += 1
                self.asleep -= waking
                if not self.asleep:
                    self._card_wake()
            named = tags if tags is not None else sorted(waking)
            self.log(
                f"It took {time.monotonic() - start:.6f} seconds to wake up tags {named}.",
                where="abstract.py",
            )
        self._resume()  # vLLM's engine core resumes the scheduler after every wake_up

    def reload_weights(self) -> None:
        if self.worker is not None and self.enabled:
            self.worker.ask("reload")
        with self.changed:
            self.weights_garbage = False

    # -- the card (tests/fakenvml), when one lists our core
    def _edit_card(self, mib_for) -> None:
        path = os.environ.get(ENV_CARD)
        core = self.engine.pid
        if not path or core is None:
            return
        try:
            card = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return
        procs = card.get("processes", [])
        for entry in procs:
            if entry[0] == core:
                old = entry[1]
                entry[1] = mib_for(old)
                card["memory_used_mib"] = card.get("memory_used_mib", 0) + entry[1] - old
                tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(card))
                os.replace(tmp, path)
                return

    def _card_sleep(self) -> None:
        o = self.opts
        self.residual_mib = o.fake_sleep_residual_mib + o.fake_sleep_residual_growth_mib * (self.sleeps - 1)

        def asleep(mib: int) -> int:
            self.awake_mib = mib
            return min(mib, self.residual_mib)

        self._edit_card(asleep)

    def _card_wake(self) -> None:
        if self.awake_mib is not None:
            self._edit_card(lambda _mib: self.awake_mib)


# ----------------------------------------------------------------- HTTP


ROUTES = {
    "/sleep": "POST",
    "/wake_up": "POST",
    "/is_sleeping": "GET",
    "/pause": "POST",
    "/resume": "POST",
    "/is_paused": "GET",
    "/collective_rpc": "POST",
}


def handles(path: str, sleep: SleepMode) -> bool:
    """Whether `path` is one of these routes and they exist (dev mode)."""
    return sleep.dev and path in ROUTES


def _validation_error(where: str, value: str, expected: str) -> dict:
    # FastAPI's 422 for a query parameter it cannot parse
    return {
        "detail": [
            {"type": "enum", "loc": ["query", where], "msg": f"Input should be {expected}", "input": value}
        ]
    }


def serve(handler, path: str, query: str, sleep: SleepMode) -> None:
    """Answers one of ROUTES on `handler` (server.Handler: _json, _empty, _body_json)."""
    if handler.command != ROUTES[path]:
        handler._json(405, {"detail": "Method Not Allowed"})
        return
    params = parse_qs(query, keep_blank_values=True)
    mode = params.get("mode", ["abort"])[-1]
    if path in ("/sleep", "/pause") and mode not in PAUSE_MODES:
        handler._json(422, _validation_error("mode", mode, "'abort', 'wait' or 'keep'"))
        return
    try:
        if path == "/sleep":
            level = params.get("level", ["1"])[-1]
            try:
                level_n = int(level)
            except ValueError:
                raise SleepError(f"invalid literal for int() with base 10: {level!r}") from None
            sleep.sleep(level_n, mode)
            handler._empty(200)
        elif path == "/wake_up":
            sleep.wake_up(params.get("tags") or None)
            handler._empty(200)
        elif path == "/is_sleeping":
            handler._json(200, {"is_sleeping": sleep.is_sleeping()})
        elif path == "/pause":
            sleep.pause(mode)
            handler._json(200, {"status": "paused"})
        elif path == "/resume":
            sleep.resume()
            handler._json(200, {"status": "resumed"})
        elif path == "/is_paused":
            handler._json(200, {"is_paused": sleep.paused is not None})
        else:
            body = handler._body_json()
            method = body.get("method")
            if method is None:
                handler._json(400, {"detail": "Missing 'method' in request body"})
                return
            if method != "reload_weights":
                raise SleepError(
                    f"'Worker' object has no attribute {method!r} (the double knows only reload_weights)"
                )
            sleep.reload_weights()
            handler._json(200, {"results": [None]})
    except SleepError as e:
        handler._json(
            500, {"error": {"message": str(e), "type": "InternalServerError", "param": None, "code": 500}}
        )
