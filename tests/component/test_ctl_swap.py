"""r3090ctl in swap mode against the daemon's real control socket, with the daemon's answers and documents scripted.

`r3090ctl` runs as its own process, as an operator runs it. Behind the socket is
the real ControlServer (it validates every request, as for the daemon), fed by a
stand-in for the daemon's loop: it records what it was asked, answers as told,
and publishes a scripted sequence of state documents, one step per status read
once a command was accepted, so a --wait sees the swap go by.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import pytest

from r3090d import exitcodes
from r3090d.core.arbiter import Residency
from r3090d.core.suspension import Result, Stage
from r3090d.core.vocabulary import Phase
from r3090d.service import control
from r3090d.service.statedoc import LastRequest, StateDocument, SuspendInfo, SwapProgress, SwapRecord
from tests.ctl_harness import ctl, ctl_json
from tests.swapdocs import as_json, swap_doc, swap_info, with_model

pytestmark = pytest.mark.component

SWAP_CONFIG = """\
profile = "none"
[engine]
python = "/usr/bin/python3"
[gpu]
required = false
[daemon]
runtime_dir = "{run}"
state_dir = "{state}"
[[models]]
name = "chat"
model = "/srv/models/chat"
[[models]]
name = "coder"
model = "/srv/models/coder"
kind = "generate"
[[models]]
name = "embed"
model = "/srv/models/bge"
kind = "embed"
"""
SINGLE_CONFIG = """\
profile = "none"
[engine]
python = "/usr/bin/python3"
model = "/srv/models/chat"
[gpu]
required = false
[daemon]
runtime_dir = "{run}"
state_dir = "{state}"
"""


class ScriptedDaemon:
    """The control socket of a daemon whose loop is a script: `answers` by command, documents in `steps`."""

    def __init__(self, runtime_dir: Path, doc: StateDocument):
        self.requests: list[dict] = []
        self.answers: dict[str, dict] = {}
        self.steps: list[StateDocument] = []  # published one per status read, once a command was accepted
        self.current = as_json(doc)
        self.accepted = False
        self.server = control.ControlServer(runtime_dir, self._publish, self._submit).start()

    def _publish(self) -> dict:
        if self.accepted and self.steps:
            self.current = as_json(self.steps.pop(0))
        return self.current

    def _submit(self, request: dict, reply) -> None:
        self.requests.append(request)
        answer = self.answers.get(request["cmd"], {"ok": False, "error": f"not scripted: {request['cmd']}"})
        self.accepted = self.accepted or bool(answer.get("ok"))
        reply(answer)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def runtime_dir():
    path = Path(tempfile.mkdtemp(prefix="r3090d-", dir="/tmp"))  # unix socket paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(runtime_dir):
    d = ScriptedDaemon(runtime_dir, swap_doc(now=_now()))
    yield d
    d.stop()


def _now() -> float:
    import time

    return time.time()


def config_file(tmp_path: Path, runtime_dir: Path, text: str = SWAP_CONFIG) -> Path:
    path = tmp_path / "r3090d.toml"
    path.write_text(text.format(run=runtime_dir, state=tmp_path / "state"))
    return path


def fresh(doc: StateDocument) -> StateDocument:
    """The document as written now (a status reader judges an old one stale)."""
    return dataclasses.replace(doc, written_at=_now())


# ------------------------------------------------------------------ swap


def swapping_to_coder() -> list[StateDocument]:
    """What a swap from chat to coder publishes, tick by tick: chat parking, coder resuming, coder serving."""
    now = _now()
    base = swap_doc(now)
    going = dataclasses.replace(swap_info(now), in_progress=SwapProgress(from_model="chat", to_model="coder", stage="draining chat", since=now))
    parking = with_model(base, "chat", residency=Residency.PARKING)
    restoring = dataclasses.replace(going, in_progress=dataclasses.replace(going.in_progress, stage="restoring coder"))
    resuming = with_model(with_model(base, "chat", residency=Residency.PARKED), "coder", residency=Residency.RESUMING)
    done = SwapRecord(from_model="chat", to_model="coder", ok=True, seconds=9.8, drain_s=0.1, checkpoint_s=6.3, restore_s=2.5, canary_s=0.4,
                      routing_s=0.01, at=now)  # fmt: skip
    served = with_model(with_model(base, "chat", residency=Residency.PARKED), "coder", residency=Residency.READY)
    return [
        fresh(dataclasses.replace(parking, swap=going)),
        fresh(dataclasses.replace(resuming, swap=restoring)),
        fresh(dataclasses.replace(served, swap=dataclasses.replace(swap_info(now), total=8, last=done))),
    ]


def test_swap_wait_follows_the_swap_until_the_model_serves(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    daemon.answers["swap"] = {"ok": True, "message": "accepted: swapping chat out for coder"}
    daemon.steps = swapping_to_coder()
    out = ctl(config, "swap", "coder", "--wait")
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    assert daemon.requests == [{"cmd": "swap", "model": "coder"}]
    lines = out.stdout.splitlines()
    assert lines[0] == "accepted: swapping chat out for coder"
    shown = [line.split(maxsplit=3)[3] for line in lines[1:-1]]  # "+  0.1 s  resuming (restoring coder)"
    assert shown == ["parked (draining chat)", "resuming (restoring coder)", "ready"]
    assert lines[-1].startswith("coder serves after ")
    assert lines[-1].endswith("(swap chat -> coder in 9.8 s: drain 0.1 s, checkpoint 6.3 s, restore 2.5 s, canary 0.4 s, routing 0.0 s)")


def test_swap_wait_json_carries_the_swap_record(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    daemon.answers["swap"] = {"ok": True, "message": "accepted"}
    daemon.steps = swapping_to_coder()
    rc, reply = ctl_json(config, "swap", "coder", "--wait")
    assert rc == exitcodes.OK and reply["ok"] is True and reply["exit_code"] == 0
    assert reply["swap"]["to_model"] == "coder" and reply["swap"]["restore_s"] == 2.5 and reply["swap"]["cold"] is False


def test_a_swap_that_fails_exits_1_saying_why(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    daemon.answers["swap"] = {"ok": True, "message": "accepted"}
    now = _now()
    failed = SwapRecord(from_model="chat", to_model="coder", ok=False, seconds=4.0, restore_s=3.9, error="restore failed: CUDA error 999", at=now)
    daemon.steps = [fresh(dataclasses.replace(swap_doc(now), swap=dataclasses.replace(swap_info(now), total=8, failed=1, last=failed)))]
    out = ctl(config, "swap", "coder", "--wait")
    assert out.returncode == exitcodes.WARNING, out.stdout + out.stderr
    assert out.stderr.strip() == "r3090ctl: the swap chat -> coder failed: restore failed: CUDA error 999"


def test_a_refused_swap_exits_1_with_the_daemons_reason(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    daemon.answers["swap"] = {"ok": False, "error": "no model 'nope'; served: chat, coder, embed"}
    out = ctl(config, "swap", "nope", "--wait")
    assert out.returncode == exitcodes.WARNING
    assert out.stderr.strip() == "r3090ctl: refused: no model 'nope'; served: chat, coder, embed"
    rc, reply = ctl_json(config, "swap", "nope")
    assert rc == exitcodes.WARNING and reply == {"ok": False, "error": "no model 'nope'; served: chat, coder, embed", "exit_code": 1}


@pytest.mark.parametrize(
    "args, words",
    [
        (("swap", "a\tb"), "is not a served model name"),
        (("swap", "x" * 129), "is not a served model name"),
        (("swap",), "Missing argument 'NAME'"),
        (("restart", "--model", ""), "is not a served model name"),
    ],
)
def test_usage_errors_exit_64_and_ask_nothing(daemon, runtime_dir, tmp_path, args, words):
    out = ctl(config_file(tmp_path, runtime_dir), *args)
    assert out.returncode == exitcodes.USAGE, out.stdout + out.stderr
    assert words in out.stderr
    assert daemon.requests == []


@pytest.mark.parametrize("args", [("swap", "chat"), ("restart", "--model", "chat"), ("suspend", "--model", "chat"), ("resume", "--model", "chat")])
def test_a_model_needs_swap_mode(daemon, runtime_dir, tmp_path, args):
    config = config_file(tmp_path, runtime_dir, SINGLE_CONFIG)
    out = ctl(config, *args)
    assert out.returncode == exitcodes.USAGE, out.stdout + out.stderr
    [line] = out.stderr.splitlines()  # one line: the config file, and what to do
    assert line.startswith(f"r3090ctl {args[0]}: ") and f"{config} has no [[models]]" in line
    assert daemon.requests == []  # a daemon of one engine would restart or suspend that one


# ------------------------------------------------------------------ restart, suspend, resume --model


def test_suspend_model_wait_follows_that_models_suspension(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    daemon.answers["suspend"] = {"ok": True, "message": "accepted: draining, then suspending coder", "request": 12}
    now = _now()
    chat = swap_doc(now).models[0]
    draining = SuspendInfo(stage=Stage.DRAINING, since=None)
    done = SuspendInfo(stage=Stage.SUSPENDED, since=now, last=LastRequest(12, "suspend", Result.SUSPENDED, "pid 501 suspended", now))
    daemon.steps = [
        fresh(with_model(swap_doc(now), "chat", engine=dataclasses.replace(chat.engine, phase=Phase.SUSPENDING), suspend=draining)),
        fresh(with_model(swap_doc(now), "chat", residency=Residency.PARKED, engine=dataclasses.replace(chat.engine, phase=Phase.SUSPENDED), suspend=done)),
    ]  # fmt: skip
    out = ctl(config, "suspend", "--model", "chat", "--wait")
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    assert daemon.requests == [{"cmd": "suspend", "model": "chat"}]
    assert "suspending (draining)" in out.stdout and out.stdout.splitlines()[-1].startswith("suspended after ")
    assert out.stdout.splitlines()[-1].endswith(": pid 501 suspended")


def test_restart_model_wait_follows_that_models_engine(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    daemon.answers["restart"] = {"ok": True, "message": "drain restart of embed requested", "generation": 1}
    now = _now()
    embed = swap_doc(now).models[2]
    daemon.steps = [
        fresh(with_model(swap_doc(now), "embed", residency=Residency.STARTING, engine=dataclasses.replace(embed.engine, phase=Phase.STARTING, generation=2))),
        fresh(with_model(swap_doc(now), "embed", residency=Residency.READY, engine=dataclasses.replace(embed.engine, phase=Phase.READY, generation=2, pid=777))),
    ]  # fmt: skip
    out = ctl(config, "restart", "--model", "embed", "--wait")
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    assert daemon.requests == [{"cmd": "restart", "drain": True, "model": "embed"}]
    assert [line.split()[-1] for line in out.stdout.splitlines()[1:-1]] == ["starting", "ready"]
    assert out.stdout.splitlines()[-1].startswith("ready after ") and "(engine pid 777)" in out.stdout


def test_resume_model_refused_for_good_exits_69(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    daemon.answers["resume"] = {"ok": False, "error": "suspend needs a GPU (gpu.required = false)", "unavailable": True}
    out = ctl(config, "resume", "--model", "coder")
    assert out.returncode == 69 and daemon.requests == [{"cmd": "resume", "model": "coder"}]
    assert out.stderr.strip() == "r3090ctl: refused: suspend needs a GPU (gpu.required = false)"


def test_wait_for_a_model_the_daemon_does_not_serve_says_so(daemon, runtime_dir, tmp_path):
    # Accepted by a daemon whose document then has no such model (a reload took it away).
    config = config_file(tmp_path, runtime_dir)
    daemon.answers["restart"] = {"ok": True, "message": "restart requested", "generation": 1}
    daemon.steps = [fresh(dataclasses.replace(swap_doc(_now()), models=swap_doc().models[:2]))]
    out = ctl(config, "restart", "--model", "embed", "--wait")
    assert out.returncode == exitcodes.WARNING
    assert out.stderr.strip() == "r3090ctl: r3090d serves no model 'embed' (its models: chat, coder)"


# ------------------------------------------------------------------ status


def test_status_shows_every_model_and_one_in_full(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    daemon.current = as_json(fresh(swap_doc(_now())))
    out = ctl(config, "status")
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith("  ")}
    assert rows["MODEL"][:3] == ["MODEL", "KIND", "STATE"] and rows["coder"][:3] == ["coder", "generate", "parked"]
    assert out.stdout.splitlines()[-1] == "Status     OK: models: chat ready, coder parked, embed cold"

    out = ctl(config, "status", "--model", "coder")
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    assert "Served as  coder (generate) on port 18101: parked;" in out.stdout and "Engine     suspended for" in out.stdout
    assert out.stdout.splitlines()[-1] == "Status     OK: model coder parked"

    rc, doc = ctl_json(config, "status", "--model", "coder")
    assert rc == exitcodes.OK and doc["model"]["name"] == "coder" and doc["model"]["residency"] == "parked"
    assert doc["state"]["format"] == 3 and [m["name"] for m in doc["state"]["models"]] == ["chat", "coder", "embed"]

    out = ctl(config, "status", "--model", "nope")
    assert out.returncode == exitcodes.UNKNOWN
    assert out.stdout.strip() == "UNKNOWN: r3090d serves no model 'nope'; its models: chat, coder, embed"
    assert daemon.requests == []  # status is answered by the socket itself


def test_status_of_a_failed_model_is_critical_and_a_parked_one_is_not(daemon, runtime_dir, tmp_path):
    config = config_file(tmp_path, runtime_dir)
    doc = with_model(swap_doc(_now()), "embed", residency=Residency.FAILED, give_up_reason="cannot start: exited 1")
    daemon.current = as_json(fresh(doc))
    rc, reply = ctl_json(config, "status")
    assert rc == exitcodes.CRITICAL and reply["reasons"] == ["model embed failed: cannot start: exited 1"]
    rc, reply = ctl_json(config, "status", "--model", "coder")
    assert rc == exitcodes.OK and reply["reasons"] == ["model coder parked"]
    assert reply["state"]["swap"]["router"] == as_json(doc)["swap"]["router"]  # --json prints the document as written
