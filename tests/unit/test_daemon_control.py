"""The one-engine daemon's answers to requests that name a model: it has none to choose, so it refuses them."""

from __future__ import annotations

import pytest

from r3090d import config
from r3090d.service.daemon import Daemon


@pytest.mark.parametrize("cmd", [{"cmd": "restart"}, {"cmd": "suspend"}, {"cmd": "resume"}, {"cmd": "swap"}])
def test_a_request_naming_a_model_is_refused_without_touching_the_engine(tmp_path, cmd):
    cfg = config.from_dict({"engine": {"model": "m"}, "gpu": {"required": False}, "daemon": {"state_dir": str(tmp_path)}},
                           check_files=False)  # fmt: skip
    d = Daemon(cfg, ["true"])
    reply = d.control({**cmd, "model": "chat"})
    assert reply["ok"] is False and "drop --model" in reply["error"]
    assert (d.pending.restart, d.pending.suspend, d.pending.resume) == (None, None, None)
