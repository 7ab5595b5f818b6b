"""The GPU reset hold on disk: a daemon restart keeps it, a reboot (another boot id) drops it."""

from __future__ import annotations

import json

from r3090d.core.xid import ResetHold
from r3090d.service import resethold

HOLD = ResetHold("XID 79 (GPU has fallen off the bus)", 1_700_000_000.0)


def test_a_hold_is_kept_across_a_daemon_restart_of_the_same_boot(tmp_path):
    resethold.save(tmp_path, HOLD, boot="boot-a")
    assert resethold.load(tmp_path, boot="boot-a") == HOLD


def test_a_reboot_drops_the_hold_and_its_file(tmp_path):
    resethold.save(tmp_path, HOLD, boot="boot-a")
    assert resethold.load(tmp_path, boot="boot-b") is None
    assert not (tmp_path / resethold.HOLD_FILE).exists()


def test_clearing_the_hold_removes_the_file(tmp_path):
    resethold.save(tmp_path, HOLD, boot="boot-a")
    resethold.save(tmp_path, None, boot="boot-a")
    assert resethold.load(tmp_path, boot="boot-a") is None


def test_a_damaged_file_is_ignored_with_a_warning(tmp_path, caplog):
    (tmp_path / resethold.HOLD_FILE).write_text("{not json")
    assert resethold.load(tmp_path, boot="boot-a") is None
    (tmp_path / resethold.HOLD_FILE).write_text(json.dumps({"reason": 79, "since": "x"}))
    assert resethold.load(tmp_path, boot="boot-a") is None
    assert "ignoring" in caplog.text


def test_this_machines_boot_id_is_read():
    boot = resethold.boot_id()
    assert boot is None or len(boot) >= 32
