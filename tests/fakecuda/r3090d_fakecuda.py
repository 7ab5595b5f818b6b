"""A stand-in for the CUDA driver's process checkpoint calls on a machine without a GPU.

Selected by r3090d.effectors.checkpoint.load_driver() when
$R3090D_FAKE_CUDA_CHECKPOINT names a JSON control file; put this directory on
PYTHONPATH of the process that calls it (the engine's launcher, or the suspender's worker). It pairs with
tests/fakenvml: the card it edits is the one $R3090D_FAKE_NVML names.

What each call does to the process and the card, so a test can see it:
    lock        SIGSTOP the pid (a locked engine makes no progress)
    checkpoint  take the pid's entry out of the card's "processes", and its MiB out
                of "memory_used_mib" (the file is replaced atomically); remember them
    restore     put them back
    unlock      SIGCONT the pid
States follow cuda.h: lock needs RUNNING, checkpoint LOCKED, restore
CHECKPOINTED (and leaves LOCKED), unlock LOCKED; otherwise CUDA_ERROR_ILLEGAL_STATE.
A pid that does not exist, or that the card does not list, is CUDA_ERROR_INVALID_VALUE.

The control file, re-read on every call (all keys optional):
    {"fail": {"checkpoint": 999},      step -> CUresult: that step fails with it
     "leave": {"checkpoint": "FAILED"}, the state a failed step leaves (default: unchanged)
     "delay_s": {"checkpoint": 5},     seconds a step takes before it acts
     "unavailable": "no GPU here",     available() answers False with this reason
     "log": "/path/calls.jsonl",       default: <control>.calls.jsonl
     "states": "/path/states.json"}    default: <control>.states.json
Every call (steps lock, checkpoint, restore, unlock, state) appends
{"step": ..., "pid": ..., "caller": ..., "at": time.time()} to the log as it
begins, so tests can assert the order of calls per pid, and which process made
them ("caller": its pid; the real driver refuses a caller that ptrace's rules
would refuse). The per-pid state lives in the states file because operations
run in different processes (the engine's launcher, or a worker each).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from r3090d.core.suspend_types import ProcessState, Step
from r3090d.effectors.checkpoint import CheckpointError

INVALID_VALUE = 1
ILLEGAL_STATE = 401


def _read(path: Path, default):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


def _write_atomically(path: Path, data) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def available(control: str) -> tuple[bool, str]:
    reason = _read(Path(control), {}).get("unavailable")
    return (False, str(reason)) if reason else (True, "fake CUDA checkpoint driver")


def driver(control: str) -> FakeDriver:
    return FakeDriver(Path(control))


class FakeDriver:
    def __init__(self, control: Path):
        self._control = control

    def _conf(self) -> dict:
        return _read(self._control, {})

    def _paths(self, conf: dict) -> tuple[Path, Path]:
        log = Path(conf.get("log") or f"{self._control}.calls.jsonl")
        states = Path(conf.get("states") or f"{self._control}.states.json")
        return log, states

    def _card_path(self) -> Path:
        return Path(os.environ["R3090D_FAKE_NVML"])

    def _begin(self, step: Step, pid: int) -> dict:
        conf = self._conf()
        log, _ = self._paths(conf)
        with open(log, "a") as fh:
            fh.write(json.dumps({"step": str(step), "pid": pid, "caller": os.getpid(), "at": time.time()}) + "\n")
        delay = conf.get("delay_s", {}).get(str(step), 0)
        if delay:
            time.sleep(delay)
            conf = self._conf()
        return conf

    def _states(self, conf: dict) -> dict:
        return _read(self._paths(conf)[1], {})

    def _set(self, conf: dict, pid: int, state: ProcessState, **extra) -> None:
        states = self._states(conf)
        entry = states.get(str(pid), {})
        entry.update(state=state.name, **extra)
        states[str(pid)] = entry
        _write_atomically(self._paths(conf)[1], states)

    def _current(self, conf: dict, pid: int) -> ProcessState:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise CheckpointError(Step.STATE, INVALID_VALUE) from None
        entry = self._states(conf).get(str(pid))
        if entry is not None:
            return ProcessState[entry["state"]]
        card = _read(self._card_path(), {})
        if any(p == pid for p, _ in card.get("processes", [])):
            return ProcessState.RUNNING
        raise CheckpointError(Step.STATE, INVALID_VALUE)  # not a CUDA process

    def _transition(self, step: Step, pid: int, need: ProcessState, act) -> None:
        conf = self._begin(step, pid)
        try:
            state = self._current(conf, pid)
        except CheckpointError as exc:
            raise CheckpointError(step, exc.code) from None
        code = conf.get("fail", {}).get(str(step))
        if code:
            left = conf.get("leave", {}).get(str(step))
            if left:
                self._set(conf, pid, ProcessState[left])
                if left == ProcessState.RUNNING.name:
                    os.kill(pid, signal.SIGCONT)
            raise CheckpointError(step, int(code))
        if state is not need:
            raise CheckpointError(step, ILLEGAL_STATE)
        act(conf)

    # ---------------------------------------------------------------- the calls

    def lock(self, pid: int, timeout_ms: int) -> None:
        def act(conf):
            os.kill(pid, signal.SIGSTOP)
            self._set(conf, pid, ProcessState.LOCKED)

        self._transition(Step.LOCK, pid, ProcessState.RUNNING, act)

    def checkpoint(self, pid: int) -> None:
        def act(conf):
            card_path = self._card_path()
            card = _read(card_path, {})
            mine = [[p, mib] for p, mib in card.get("processes", []) if p == pid]
            card["processes"] = [[p, mib] for p, mib in card.get("processes", []) if p != pid]
            moved = sum(mib for _, mib in mine)
            card["memory_used_mib"] = card.get("memory_used_mib", 0) - moved
            _write_atomically(card_path, card)
            self._set(conf, pid, ProcessState.CHECKPOINTED, saved=mine, checkpointed_mib=moved)

        self._transition(Step.CHECKPOINT, pid, ProcessState.LOCKED, act)

    def restore(self, pid: int) -> None:
        def act(conf):
            saved = self._states(conf)[str(pid)].get("saved", [])
            card_path = self._card_path()
            card = _read(card_path, {})
            card["processes"] = card.get("processes", []) + saved
            card["memory_used_mib"] = card.get("memory_used_mib", 0) + sum(mib for _, mib in saved)
            _write_atomically(card_path, card)
            self._set(conf, pid, ProcessState.LOCKED, saved=[])

        self._transition(Step.RESTORE, pid, ProcessState.CHECKPOINTED, act)

    def unlock(self, pid: int) -> None:
        def act(conf):
            os.kill(pid, signal.SIGCONT)
            self._set(conf, pid, ProcessState.RUNNING)

        self._transition(Step.UNLOCK, pid, ProcessState.LOCKED, act)

    def state(self, pid: int) -> ProcessState:
        conf = self._begin(Step.STATE, pid)
        code = conf.get("fail", {}).get(str(Step.STATE))
        if code:
            raise CheckpointError(Step.STATE, int(code))
        return self._current(conf, pid)
