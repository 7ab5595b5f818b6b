"""Host facts from fake /proc and /sys trees, and the port check on real sockets."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import psutil
import pytest

from r3090d import config
from r3090d.core.snapshot import HostFacts
from r3090d.preflight import gather
from r3090d.preflight.checks import Status, check_governor, check_port, check_swap, check_swappiness
from r3090d.probes import host

SWAPS_HEADER = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def governor_files(*governors: str) -> dict[str, str]:
    return {f"sys/devices/system/cpu/cpu{i}/cpufreq/scaling_governor": g + "\n" for i, g in enumerate(governors)}


CFG = config.from_dict({"engine": {"model": "m"}}, check_files=False)


# ---------------------------------------------------------------------- swap


def test_swap_on_sums_every_device(tmp_path):
    root = tree(tmp_path, {"proc/swaps": SWAPS_HEADER
                           + "/dev/sda2                               partition\t8388604\t\t0\t\t-2\n"
                           + "/swapfile                               file\t\t1048576\t\t512\t\t-3\n"})  # fmt: skip
    total, devices = host.read_swap(root)
    assert total == (8388604 + 1048576) * 1024
    assert devices == ("/dev/sda2", "/swapfile")
    facts = host.gather_host("127.0.0.1", _free_port(), root)
    r = check_swap(facts)
    assert r.status is Status.WARN and "/dev/sda2" in r.measured and "swapoff" in r.hint


def test_swap_off(tmp_path):
    root = tree(tmp_path, {"proc/swaps": SWAPS_HEADER})
    assert host.read_swap(root) == (0, ())
    assert check_swap(host.gather_host("127.0.0.1", _free_port(), root)).status is Status.OK


def test_swap_not_readable_is_not_measured(tmp_path):
    assert host.read_swap(tmp_path) == (None, ())
    assert check_swap(host.gather_host("127.0.0.1", _free_port(), tmp_path)).status is Status.SKIP


def test_swap_garbage_is_not_measured(tmp_path):
    root = tree(tmp_path, {"proc/swaps": SWAPS_HEADER + "/dev/sda2 partition lots 0 -2\n"})
    assert host.read_swap(root) == (None, ())


# ---------------------------------------------------------------- swappiness


@pytest.mark.parametrize("text, value, status", [("1\n", 1, Status.OK), ("60\n", 60, Status.WARN), ("ten", None, Status.SKIP)])
def test_swappiness(tmp_path, text, value, status):
    root = tree(tmp_path, {"proc/sys/vm/swappiness": text})
    assert host.read_swappiness(root) == value
    assert check_swappiness(host.gather_host("127.0.0.1", _free_port(), root), CFG).status is status


def test_swappiness_missing(tmp_path):
    assert host.read_swappiness(tmp_path) is None


# ------------------------------------------------------------------ governor


def test_governors_all_performance(tmp_path):
    root = tree(tmp_path, governor_files("performance", "performance", "performance"))
    assert host.read_governors(root) == ("performance",)
    assert check_governor(host.gather_host("127.0.0.1", _free_port(), root), CFG).status is Status.OK


def test_governors_mixed(tmp_path):
    root = tree(tmp_path, governor_files("performance", "powersave", "performance"))
    assert host.read_governors(root) == ("performance", "powersave")
    r = check_governor(host.gather_host("127.0.0.1", _free_port(), root), CFG)
    assert r.status is Status.WARN and "powersave" in r.measured and "cpupower" in r.hint


def test_governor_missing_is_skipped(tmp_path):
    # CPUs without cpufreq (containers, some VMs): the directories exist, the files do not.
    (tmp_path / "sys/devices/system/cpu/cpu0").mkdir(parents=True)
    assert host.read_governors(tmp_path) is None
    r = check_governor(host.gather_host("127.0.0.1", _free_port(), tmp_path), CFG)
    assert r.status is Status.SKIP


def test_gather_reads_the_model_directory(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    facts = gather.model_facts(str(model))
    assert facts is not None and facts.architecture == "Qwen2ForCausalLM"
    assert gather.model_facts("Qwen/Qwen2.5-7B-Instruct") is None


# ---------------------------------------------------------------------- port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_free_port():
    p = host.check_port("127.0.0.1", _free_port())
    assert p.free is True and p.error is None


def test_listening_port_names_its_holder():
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = host.check_port("127.0.0.1", port)
    assert p.free is False and p.detail == "listening"
    assert [(h.pid, h.name) for h in p.holders] == [(os.getpid(), psutil.Process().name())]
    r = check_port(HostFacts(port=p), frozenset())
    assert r.status is Status.FAIL and not r.permanent and f"pid {os.getpid()}" in r.measured
    own = check_port(HostFacts(port=p), frozenset({os.getpid()}))
    assert own.status is Status.OK and f"held by r3090d's engine (pid {os.getpid()})" == own.measured


def test_wildcard_listener_blocks_loopback():
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        assert host.check_port("127.0.0.1", s.getsockname()[1]).free is False


def test_bound_but_not_listening_is_busy():
    # vLLM binds its port before loading the model and listens only after.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        p = host.check_port("127.0.0.1", s.getsockname()[1])
    assert p.free is False and "not listening" in p.detail


def test_leftover_connections_do_not_make_the_port_busy():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end goes to TIME_WAIT on `port`
        client.close()
    p = host.check_port("127.0.0.1", port)
    assert p.free is True, p


def test_address_not_on_this_machine():
    p = host.check_port("192.0.2.1", _free_port())  # TEST-NET-1, never local
    assert p.free is None and "not an address of this machine" in p.error
    r = check_port(HostFacts(port=p), frozenset())
    assert r.status is Status.FAIL and r.permanent


def test_the_hosts_load_is_read_with_the_cpus_this_process_may_use():
    load = host.read_load()
    assert load.load_1m is not None and load.load_1m >= 0
    assert load.cores == len(os.sched_getaffinity(0))
    assert load.saturated is (load.load_1m > load.cores)
