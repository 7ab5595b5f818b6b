"""engine.listen: where the engines serve (a unix socket, or a TCP port), in the config, the argv, preflight and the link."""

from __future__ import annotations

import os
import socket
import stat
import threading

import httpx
import pytest

from r3090d import argv as argvmod
from r3090d import config
from r3090d.config import ConfigError, EngineListen
from r3090d.core.snapshot import GpuSample, GpuStatus, HealthStatus
from r3090d.preflight import gather
from r3090d.preflight.checks import PreflightFacts, Status, check_engine_listen, run_checks
from r3090d.probes.engine import probe_health
from r3090d.probes.http import engine_client
from r3090d.router.link import LinkError, decode
from r3090d.service import enginesocket
from r3090d.service.safedir import UnsafeDirectory
from tests.unit.test_router_link import entry, table_line

V032 = argvmod.parse_version("0.32.0")
MODELS = [{"name": "chat", "model": "/m/chat"}, {"name": "coder", "model": "/m/coder"}]


def single(**engine) -> config.Config:
    return config.from_dict({"profile": "none", "engine": {"model": "/m", **engine}, "daemon": {"runtime_dir": "/run/r3090d"}},
                            check_files=False)  # fmt: skip


def swap(**engine) -> config.Config:
    return config.from_dict({"engine": engine, "models": MODELS, "gpu": {"required": False}}, check_files=False)


# ------------------------------------------------------------------ the config and the argv


def test_the_one_engine_stays_on_tcp_by_default():
    cfg = single()
    assert cfg.engine.listen is EngineListen.TCP and cfg.engine.uds == "" and cfg.engine_url == "http://127.0.0.1:8000"
    argv = argvmod.build_argv(cfg, V032)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8000" and "--uds" not in argv


def test_the_one_engine_on_a_unix_socket_when_the_file_asks():
    cfg = single(listen="uds")
    assert cfg.engine.uds == "/run/r3090d/engines/0.sock"
    assert cfg.engine_url == "http://localhost" and cfg.engine_address == "unix:/run/r3090d/engines/0.sock"
    argv = argvmod.build_argv(cfg, V032)
    assert argv[argv.index("--uds") + 1] == "/run/r3090d/engines/0.sock" and "--port" not in argv and "--host" not in argv


def test_swap_modes_engines_default_to_unix_sockets_and_the_router_stays_on_its_port():
    cfg = swap()
    assert cfg.engine.listen is EngineListen.UDS and cfg.engine.uds == "" and cfg.engine_url == "http://127.0.0.1:8000"
    assert swap(listen="tcp").engine.listen is EngineListen.TCP


@pytest.mark.parametrize("value", ["unix", "", 1])
def test_a_wrong_listen_is_one_line(value):
    with pytest.raises(ConfigError) as err:
        single(listen=value)
    line = err.value.one_line()
    assert err.value.key == "engine.listen" and "use one of tcp, uds" in line and "\n" not in line


def test_uds_in_extra_args_is_refused():
    with pytest.raises(ConfigError) as err:
        single(extra_args=["--uds=/tmp/x.sock"])
    assert err.value.key == "engine.extra_args[0]" and 'use engine.listen = "uds" instead' in err.value.one_line()


def test_a_runtime_dir_too_long_for_the_socket_is_refused_only_on_uds():
    long = "/" + "d" * 100
    cfg = config.from_dict({"profile": "none", "engine": {"model": "/m"}, "daemon": {"runtime_dir": long}}, check_files=False)
    assert cfg.engine.uds == ""
    with pytest.raises(ConfigError) as err:
        config.from_dict({"profile": "none", "engine": {"model": "/m", "listen": "uds"}, "daemon": {"runtime_dir": long}}, check_files=False)
    assert err.value.key == "daemon.runtime_dir" and "the limit is 107" in err.value.one_line()


# ------------------------------------------------------------------ preflight

NO_GPU = GpuSample(GpuStatus.DISABLED)


def facts() -> PreflightFacts:
    return PreflightFacts(gpu=NO_GPU, host=gather.gather_host("127.0.0.1", 1))


def test_preflight_warns_of_engines_on_tcp_in_swap_mode():
    r = check_engine_listen(swap(listen="tcp"))
    assert r.status is Status.WARN and "127.0.0.1:18100-18101" in r.measured and "take no key" in r.measured
    assert 'remove engine.listen = "tcp"' in r.hint
    ok = check_engine_listen(swap())
    assert ok.status is Status.OK and "/run/r3090d/engines" in ok.measured
    assert "engine_listen" in [r.name for r in run_checks(facts(), swap())]


def test_preflight_of_the_one_engine_has_no_listen_check_and_skips_the_port_on_a_socket():
    names = {r.name: r for r in run_checks(facts(), single())}
    assert "engine_listen" not in names and names["port"].measured != "not used"
    on_socket = {r.name: r for r in run_checks(facts(), single(listen="uds"))}
    assert on_socket["port"].status is Status.SKIP and "/run/r3090d/engines/0.sock" in on_socket["port"].hint


# ------------------------------------------------------------------ the link and the probes


def test_the_link_carries_a_unix_socket_upstream():
    table = decode(table_line(entry(upstream="unix:/run/r3090d/engines/0.sock")))
    assert table.models[0].upstream == "unix:/run/r3090d/engines/0.sock"


@pytest.mark.parametrize("upstream", ["unix:run/engines/0.sock", "unix:", "unix:/" + "x" * 107, "unix:/a\0b"])
def test_the_link_refuses_a_socket_that_is_not_an_absolute_short_path(upstream):
    with pytest.raises(LinkError, match="upstream"):
        decode(table_line(entry(upstream=upstream)))


def test_a_socket_not_there_reads_as_refused(tmp_path):
    with engine_client(uds=str(tmp_path / "none.sock")) as client:
        sample = probe_health(client, "http://localhost", 2.0)
    assert sample.status is HealthStatus.REFUSED and sample.detail == "no socket"


def test_a_socket_nobody_listens_on_reads_as_refused(tmp_path):
    path = tmp_path / "bound.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:  # bound, never listening: as vLLM while it loads
        bound.bind(str(path))
        with engine_client(uds=str(path)) as client:
            sample = probe_health(client, "http://localhost", 2.0)
    assert sample.status is HealthStatus.REFUSED and sample.detail == "connection refused"


def test_the_engine_client_goes_to_the_socket_whatever_the_urls_host(tmp_path):
    path = str(tmp_path / "engine.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        server.settimeout(10)
        with engine_client(5.0, uds=path) as client:

            def answer():
                conn, _ = server.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

            t = threading.Thread(target=answer, daemon=True)
            t.start()
            r = client.get("http://localhost/health")
            t.join(10)
    assert r.status_code == 200 and r.text == "ok"
    with pytest.raises(httpx.ConnectError):
        with engine_client(1.0, uds=str(tmp_path / "gone.sock")) as client:
            client.get("http://localhost/health")


# ------------------------------------------------------------------ the sockets' directory


def test_a_start_makes_the_directory_private_and_removes_a_socket_left_there(tmp_path):
    path = tmp_path / "engines" / "0.sock"
    enginesocket.clear_for_start(str(path))  # nothing there yet: the directory is made, 0700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and not path.exists()
    os.chmod(path.parent, 0o755)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:  # what a killed engine leaves
        left.bind(str(path))
    enginesocket.clear_for_start(str(path))
    assert not path.exists() and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as engine:  # the next engine binds where the last one was
        engine.bind(str(path))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_sockets_directory_of_another_user_is_refused(tmp_path):
    directory = tmp_path / "engines"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(UnsafeDirectory, match="belongs to"):
        enginesocket.ensure_directory(directory)
