"""Fixtures for component tests."""

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.ctl_harness import make_daemon  # noqa: F401  (a daemon with the vLLM double, for r3090ctl tests)


@pytest.fixture
def sockdir(tmp_path):
    """A folder for unix sockets: sun_path holds 108 bytes, and pytest's tmp_path can be longer."""
    if len(str(tmp_path / "syslog.sock")) < 100:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="r3090d-syslog-"))
    yield short
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def rundir():
    """A runtime directory for the control socket, mode 0700 as mkdtemp makes it.

    Always a short name under /tmp: unix socket paths are limited to 107 bytes.
    """
    path = Path(tempfile.mkdtemp(prefix="r3090d-ctl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
