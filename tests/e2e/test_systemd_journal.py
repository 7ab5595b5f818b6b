"""The shipped unit's output in a real journal: `journalctl -p warning` shows what needs a human.

journald runs in the namespaced systemd (basic.target pulls in its sockets), so
the unit keeps its shipped StandardOutput=journal here, unlike the other tests,
which send the output to a file. Its storage is the host's /var/log/journal and
every namespaced boot has the host kernel's boot id, so `-b` cannot tell this
run from an earlier one: every query starts after a cursor taken first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from r3090d import exitcodes
from tests.e2e.conftest import TEST_ROOT, write_public
from tests.e2e.test_systemd_service import fake_config, fake_engine_python  # noqa: F401  (fixture)

pytestmark = pytest.mark.systemd

UNIT = "r3090d.service"
CAUSE = "ValueError: To serve at least one request"
GAVE_UP = "ERROR r3090d: gave up:"  # the daemon's own line, not the syslog alert channel's
_JOURNAL_PREFIX = re.compile(r"^<[0-7]>")
_VLLM_INFO = re.compile(r"\[vllm\] (?:\([^)]*\) )?INFO\b")


def _swappiness() -> int:
    return int(Path("/proc/sys/vm/swappiness").read_text())


def _cursor(ns) -> str:
    out = ns.nsenter(["journalctl", "-n", "0", "--show-cursor", "--no-pager"]).stdout
    m = re.search(r"^-- cursor: (\S+)", out, re.M)
    assert m, out
    return m.group(1)


def _entries(ns, cursor: str, *args: str) -> list[dict]:
    """The unit's journal entries after `cursor`, as journalctl's JSON.

    --cursor and not --after-cursor: with a filter that the cursor's own entry
    does not match, journalctl 252's --after-cursor skips the first entry that
    does (it always steps two entries past the seek point)."""
    out = ns.nsenter(
        ["journalctl", "--no-pager", "-u", UNIT, f"--cursor={cursor}", "-o", "json", "--output-fields=MESSAGE,PRIORITY,SYSLOG_IDENTIFIER", *args],
        check=False,
    )
    entries = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [e for e in entries if e.get("__CURSOR") != cursor]


def _ours(entries: list[dict]) -> list[tuple[int, str]]:
    """(priority, message) of the lines r3090d wrote, not systemd's own about the unit."""
    return [(int(e["PRIORITY"]), e["MESSAGE"]) for e in entries if e.get("SYSLOG_IDENTIFIER") == "r3090d" and isinstance(e.get("MESSAGE"), str)]


def _show(lines: list[tuple[int, str]]) -> str:
    return "\n".join(f"<{p}> {m}" for p, m in lines)


def _find(lines: list[tuple[int, str]], *needles: str) -> tuple[int, str] | None:
    return next((pm for pm in lines if all(n in pm[1] for n in needles)), None)


def test_journalctl_priority_warning_shows_what_needs_a_human(unit_factory, tiny_model, fake_engine_python, systemd_ns):  # noqa: F811
    if _swappiness() == 0:
        pytest.skip("vm.swappiness is 0 here: no preflight check WARNs")
    unit = unit_factory(UNIT, "r3090d-journal.log")
    unit.reset()
    Path("/var/lib/r3090d/state.json").unlink(missing_ok=True)  # no alert left firing by an earlier test
    config = TEST_ROOT / "config-journal.toml"
    # The shipped unit's own output settings: only the config is set here.
    systemd_ns.write_file(unit.dropin, f"[Service]\nEnvironment=R3090D_CONFIG={config}\n")
    systemd_ns.ctl("daemon-reload")
    assert unit.show("StandardOutput")["StandardOutput"] == "journal"
    cursor = _cursor(systemd_ns)

    # 1. A config error: exit 78, not restarted.
    write_public(config, fake_config(fake_engine_python, tiny_model, engine__prot="1"))
    assert systemd_ns.ctl("start", UNIT, check=False).returncode != 0
    assert unit.show("ExecMainStatus")["ExecMainStatus"] == str(exitcodes.CONFIG), unit.describe()
    systemd_ns.ctl("reset-failed", UNIT, check=False)

    # 2. Every engine start fails the same way (the double's 8 KV blocks cannot hold
    #    the profile's max_model_len): an engine restart with its root cause, then a
    #    give-up; the daemon stays up. max_swappiness = 0 makes preflight WARN.
    broken = fake_config(fake_engine_python, tiny_model, engine__extra_args='["--fake-num-gpu-blocks", "8"]')
    write_public(config, f"{broken}\n[preflight]\nmax_swappiness = 0\n")
    started = systemd_ns.ctl("start", UNIT, check=False, timeout=120)
    assert started.returncode == 0, unit.describe()

    def warnings_seen():
        lines = _ours(_entries(systemd_ns, cursor, "-p", "warning"))
        return lines if _find(lines, GAVE_UP) else None

    # journald reads the stream on its own time: wait for the give-up to arrive.
    warned = unit.wait_for(warnings_seen, 60, "the give-up in `journalctl -p warning`")
    everything = _ours(_entries(systemd_ns, cursor))
    shown = _show(warned)
    print(f"journalctl -p warning -u {UNIT}:\n{shown}")

    expected = {
        "config error": (3, ("config error", "engine.prot: unknown key")),
        "preflight WARN": (4, ("preflight swappiness WARN",)),
        "engine restart with its root cause": (4, ("engine restart:", f"root cause: {CAUSE}")),
        "vLLM's own exception line": (3, ("[vllm] (EngineCore_DP0", CAUSE)),
        "the API server's bare traceback": (3, ("[vllm] RuntimeError: Engine core initialization failed",)),
        "the give-up": (3, (GAVE_UP, CAUSE)),
    }
    for what, (priority, needles) in expected.items():
        found = _find(warned, *needles)
        assert found is not None, f"{what} missing from journalctl -p warning:\n{shown}\nall of it:\n{_show(everything)}"
        assert found[0] == priority, f"{what} at priority {found[0]}, expected {priority}: {found[1]}"

    # Nothing logged at INFO reaches -p warning, and journald took every prefix off.
    info_leaks = [m for _, m in warned if m.startswith(("INFO ", "DEBUG ")) or _VLLM_INFO.search(m)]
    assert info_leaks == [], info_leaks
    assert not [m for _, m in everything if _JOURNAL_PREFIX.match(m)], "a <N> prefix reached the journal"
    # The INFO lines are there, at priority 6: it is the filter that hides them.
    starting = _find(everything, "INFO r3090d", "starting engine")
    assert starting is not None and starting[0] == 6, starting
    vllm_info = [(p, m) for p, m in everything if _VLLM_INFO.search(m)]
    assert vllm_info and {p for p, _ in vllm_info} == {6}, vllm_info[:5]

    systemd_ns.ctl("stop", UNIT, timeout=120)
    assert unit.state() == "inactive"

