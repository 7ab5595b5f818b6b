"""The suspension record on disk keeps the canary question its baseline answered."""

from __future__ import annotations

import json
import threading

from r3090d.core.actions import SuspendRecord
from r3090d.core.canary import request_key
from r3090d.core.snapshot import CanaryAnswer, ChildSample
from r3090d.service.suspend import SuspendService
from tests.configs import bare_config

BASELINE = CanaryAnswer((1, 2, 3, 4), (3.0,) * 4, (9,) * 4, "one two")


def service(tmp_path) -> SuspendService:
    cfg = bare_config(daemon={"state_dir": str(tmp_path)})
    return SuspendService(cfg, tmp_path, threading.Event(), lambda: None)


def test_the_record_keeps_the_question_its_baseline_answered(tmp_path):
    key = request_key(bare_config().canary)
    svc = service(tmp_path)
    svc.save(SuspendRecord(pid=0, engine_pid=None, bytes=5, since=100.0, baseline=BASELINE, baseline_for=key), ChildSample())
    assert json.loads(svc.path.read_text())["baseline_for"] == list(key)
    read = svc.load()
    assert read.baseline == BASELINE and read.baseline_for == key


def test_a_record_from_before_the_question_was_kept_has_none(tmp_path):
    svc = service(tmp_path)
    svc.path.write_text(json.dumps({"format": 1, "pid": 0, "engine_pid": None, "bytes": 5, "since": 100.0, "baseline": None}))
    assert svc.load().baseline_for == ()
