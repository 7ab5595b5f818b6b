"""Host facts for preflight: swap, swappiness, CPU governors, the engine port, the model directory.

/proc and /sys are read under an injectable root so tests can build fake
trees. A file that is missing or unreadable means "not measured" (None),
never an exception: containers often have no cpufreq, and hardened units
(ProcSubset=pid) hide /proc/swaps.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import psutil

from r3090d.core.snapshot import HostFacts, PortFacts, PortHolder
from r3090d.measure.modelinfo import ModelFacts, read_model_dir

# Connections a server's port can carry after its listener is gone (accepted
# sockets still open or closing). They keep a plain bind() out, but not the
# SO_REUSEADDR bind a server makes, so they do not make the port busy.
_LEFTOVER_STATES = {
    psutil.CONN_TIME_WAIT,
    psutil.CONN_FIN_WAIT1,
    psutil.CONN_FIN_WAIT2,
    psutil.CONN_CLOSE_WAIT,
    psutil.CONN_LAST_ACK,
    psutil.CONN_CLOSING,
    psutil.CONN_ESTABLISHED,
}


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def read_swap(root: Path | str = "/") -> tuple[int | None, tuple[str, ...]]:
    """(active swap bytes, swap devices) from /proc/swaps; (None, ()) when it cannot be read."""
    text = _read_text(Path(root) / "proc/swaps")
    if text is None:
        return None, ()
    total, devices = 0, []
    for line in text.splitlines()[1:]:  # the first line is the column header
        parts = line.split()
        if len(parts) < 3:
            continue
        try:
            total += int(parts[2]) * 1024  # Size, in KiB
        except ValueError:
            return None, ()
        devices.append(parts[0])
    return total, tuple(devices)


def read_swappiness(root: Path | str = "/") -> int | None:
    text = _read_text(Path(root) / "proc/sys/vm/swappiness")
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def read_governors(root: Path | str = "/") -> tuple[str, ...] | None:
    """The distinct cpufreq scaling governors, sorted; None when no CPU exposes cpufreq."""
    found = set()
    for path in sorted((Path(root) / "sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_governor")):
        text = _read_text(path)
        if text is not None and text.strip():
            found.add(text.strip())
    return tuple(sorted(found)) if found else None


def _bind_address(host: str, port: int) -> tuple[int, tuple]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if host in ("", "0.0.0.0"):
        return socket.AF_INET, ("0.0.0.0", port)
    info = socket.getaddrinfo(host, port, family if ":" in host else socket.AF_UNSPEC, socket.SOCK_STREAM)
    fam, _, _, _, addr = info[0]
    return fam, addr


def _try_bind(family: int, addr: tuple, *, reuse: bool) -> int | None:
    """None when a listening socket could take addr, else the errno."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1)
        return None
    except OSError as exc:
        return exc.errno or errno.EIO
    finally:
        sock.close()


def _port_connections(port: int) -> list | None:
    try:
        return [c for c in psutil.net_connections("inet") if c.laddr and c.laddr.port == port]
    except (psutil.AccessDenied, OSError):
        return None


def _holder(pid: int | None) -> PortHolder:
    if pid is None:
        return PortHolder(None)
    try:
        return PortHolder(pid, psutil.Process(pid).name())
    except (psutil.Error, OSError):
        return PortHolder(pid)


def check_port(host: str, port: int) -> PortFacts:
    """Can a server bind host:port now? If not, who holds it (where this user may see)."""
    try:
        family, addr = _bind_address(host, port)
    except (socket.gaierror, UnicodeError) as exc:
        return PortFacts(host, port, None, error=f"cannot resolve {host!r}: {exc}")
    plain = _try_bind(family, addr, reuse=False)
    if plain is None:
        return PortFacts(host, port, True, "bindable")
    if plain == errno.EACCES:
        return PortFacts(host, port, None, error=f"port {port} needs privileges this user lacks")
    if plain == errno.EADDRNOTAVAIL:
        return PortFacts(host, port, None, error=f"{host} is not an address of this machine")
    if plain != errno.EADDRINUSE:
        return PortFacts(host, port, None, error=f"bind failed: {errno.errorcode.get(plain, plain)}")
    conns = _port_connections(port)
    if _try_bind(family, addr, reuse=True) is not None:
        pids = sorted({c.pid for c in conns or () if c.status == psutil.CONN_LISTEN}, key=lambda p: (p is None, p or 0))
        return PortFacts(host, port, False, "listening", holders=tuple(_holder(p) for p in pids))
    # A server's SO_REUSEADDR bind works. Either only closed connections linger
    # (visible in /proc/net), or a socket is bound and not yet listening (vLLM
    # binds its port before loading the model), which /proc/net does not list.
    if conns is None:
        return PortFacts(host, port, None, error="port in use by something that is not listening, and connections are not readable")
    if conns and all(c.status in _LEFTOVER_STATES for c in conns):
        return PortFacts(host, port, True, "free (only leftover connections of an earlier server remain)")
    return PortFacts(host, port, False, "bound by a process that is not listening yet (a server still starting?)")


def gather_host(engine_host: str, engine_port: int, model_path: str | None, root: Path | str = "/") -> HostFacts:
    swap, devices = read_swap(root)
    model = local_model(model_path)
    return HostFacts(
        swap_total_bytes=swap,
        swap_devices=devices,
        swappiness=read_swappiness(root),
        governors=read_governors(root),
        port=check_port(engine_host, engine_port),
        model=model,
    )


def local_model(model_path: str | None) -> ModelFacts | None:
    """What a model directory holds; None for a hub name (or no model)."""
    return read_model_dir(model_path) if model_path and _is_local_path(model_path) else None


def _is_local_path(model: str) -> bool:
    """engine.model is a directory path, not a hub name such as Qwen/Qwen2.5-7B-Instruct."""
    return model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()
