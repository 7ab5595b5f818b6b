"""A real systemd booted as PID 1 in a new PID and mount namespace, for end-to-end tests.

The boot command is fixed on purpose. At boot systemd-tmpfiles-setup empties
/tmp and /var/tmp; without the private tmpfs mounts it would wipe the host's
(pytest's tmp_path, virtualenvs, a CI checkout). So /tmp and /var/tmp are
mounted first, and systemd is exec'ed only if both mounts succeeded. systemd
then mounts a private /run of its own. Everything else (/etc, /opt, /var/lib,
the network) is the host's: files the units need go outside /tmp.

`systemctl` reaches this systemd through `nsenter -t <pid> -m -p`; process
inspection happens from the host, through /proc, with host pids.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from r3090d import procstat
from tests.waiting import wait_until

SYSTEMD = "/lib/systemd/systemd"
MIN_SYSTEMD_VERSION = 252
BOOT_SCRIPT = (
    "mount -t tmpfs tmpfs /tmp && mount -t tmpfs tmpfs /var/tmp && exec /lib/systemd/systemd --system"
)
UNSHARE = [
    "unshare",
    "--pid",
    "--fork",
    "--mount",
    "--mount-proc",
    "--propagation",
    "private",
    "sh",
    "-c",
    BOOT_SCRIPT,
]


def unavailable_reason() -> str | None:
    """Why a namespaced systemd cannot be booted here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root: boots systemd as PID 1 in a new PID and mount namespace"
    for tool in ("unshare", "nsenter", "systemctl", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.access(SYSTEMD, os.X_OK):
        return f"{SYSTEMD} is not installed"
    out = subprocess.run([SYSTEMD, "--version"], capture_output=True, text=True)
    m = re.match(r"systemd (\d+)", out.stdout)
    if not m or int(m.group(1)) < MIN_SYSTEMD_VERSION:
        return f"systemd {MIN_SYSTEMD_VERSION} or later is needed, found {out.stdout.splitlines()[:1]}"
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "private", "true"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot create PID and mount namespaces here: {probe.stderr.strip()}"
    return None


class NamespacedSystemd:
    """One booted systemd. Use boot() and poweroff(), or the session fixture."""

    def __init__(self, console_log: Path):
        self.console_log = console_log
        self.unshare: subprocess.Popen | None = None
        self.pid: int | None = None  # systemd's pid as the host sees it
        self.pid_ns: str | None = None

    # ------------------------------------------------------------- lifecycle

    def boot(self, timeout: float = 90.0) -> float:
        """Boots and waits until the manager is up; returns the seconds it took."""
        start = time.monotonic()
        env = {**os.environ, "container": "other"}
        with open(self.console_log, "ab") as console:
            # start_new_session: the setsid of the documented recipe, so that no
            # terminal signal of ours reaches the namespace.
            self.unshare = subprocess.Popen(
                UNSHARE,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = wait_until(
            self._systemd_pid,
            start + timeout - time.monotonic(),
            what="systemd to start",
            interval=0.05,
            details=lambda: f"console: {self.console_text()}",
        )
        self.pid_ns = os.readlink(f"/proc/{self.pid}/ns/pid")
        wait_until(
            self._booted,
            start + timeout - time.monotonic(),
            what="systemd to finish booting",
            interval=0.25,
            details=lambda: f"state {self._state()!r}; console: {self.console_text()}",
        )
        return time.monotonic() - start

    def _state(self) -> str:
        return self.ctl("is-system-running", check=False).stdout.strip()

    def _booted(self) -> bool:
        # degraded is fine: units of the host that cannot run in a namespace fail.
        return self._state() in ("running", "degraded")

    def _systemd_pid(self) -> int | None:
        """systemd's pid, once unshare has started it."""
        assert self.unshare is not None
        if self.unshare.poll() is not None:
            raise AssertionError(
                f"unshare exited with {self.unshare.returncode}; console: {self.console_text()}"
            )
        for child in _children(self.unshare.pid):
            try:
                if os.readlink(f"/proc/{child}/exe") == SYSTEMD or _comm(child) == "systemd":
                    return child
            except OSError:
                pass
        return None

    def poweroff(self, timeout: float = 60.0) -> bool:
        """`systemctl poweroff`, then SIGKILL of PID 1 (which ends the namespace) if it hangs.
        Returns True if the poweroff was clean."""
        if self.unshare is None or self.unshare.poll() is not None:
            return True
        self.ctl("poweroff", "--no-block", check=False)
        try:
            self.unshare.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            pass
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.unshare.wait(30)
        return False

    def console_text(self) -> str:
        try:
            return self.console_log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    # -------------------------------------------------------------- commands

    def nsenter(
        self,
        argv: list[str],
        *,
        input: str | None = None,
        timeout: float = 120.0,
        check: bool = True,
        env=None,
    ):
        out = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", *argv],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"{shlex.join(argv)} exited {out.returncode}\nstdout: {out.stdout}\nstderr: {out.stderr}"
            )
        return out

    def ctl(self, *args: str, check: bool = True, timeout: float = 120.0):
        return self.nsenter(["systemctl", *args], check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        args = ["show", unit]
        for p in props:
            args += ["-p", p]
        text = self.ctl(*args).stdout
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def write_file(self, path: str, text: str) -> None:
        """Writes a file as this systemd's mount namespace sees it (/run is private to it)."""
        self.nsenter(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", path], input=text)

    def remove_file(self, path: str) -> None:
        self.nsenter(["rm", "-f", path])

    def journal(self, unit: str) -> str:
        return self.nsenter(
            ["journalctl", "--no-pager", "-o", "short-monotonic", "-u", unit], check=False
        ).stdout

    # ------------------------------------------------------------- processes

    def host_pid(self, ns_pid: int) -> int | None:
        """The host pid of a process systemctl names by its pid in the namespace."""
        for pid in _all_pids():
            if self._in_namespace(pid) and _nspid(pid)[-1:] == [ns_pid]:
                return pid
        return None

    def unit_pids(self, unit: str) -> set[int]:
        """Host pids of the live processes in `unit`'s cgroup."""
        # r3090d.service is in system.slice, r3090d@0.service in system.slice/system-r3090d.slice.
        suffix = f".slice/{unit}"
        found = set()
        for pid in _all_pids():
            if not self._in_namespace(pid):
                continue
            try:
                cgroups = Path(f"/proc/{pid}/cgroup").read_text()
                if not (st := procstat.read(pid)) or not st.live:
                    continue
            except OSError:
                continue
            for line in cgroups.splitlines():
                path = line.split(":", 2)[-1]
                if path.endswith(suffix) or f"{suffix}/" in path:
                    found.add(pid)
                    break
        return found

    def namespace_pids_matching(self, needle: str) -> dict[int, str]:
        """Host pid -> command line, for live processes in the namespace whose command line
        contains `needle`, ignoring case (vLLM's EngineCore calls itself VLLM::EngineCore)."""
        found = {}
        for pid in _all_pids():
            if not self._in_namespace(pid):
                continue
            try:
                cmdline = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                if not (st := procstat.read(pid)) or not st.live:
                    continue
            except OSError:
                continue
            if needle.lower() in cmdline.lower():
                found[pid] = cmdline.strip()
        return found

    def _in_namespace(self, pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/pid") == self.pid_ns
        except OSError:
            return False


# ------------------------------------------------------------- /proc helpers


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            kids += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        pass
    return kids


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _nspid(pid: int) -> list[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return []


def proc_status(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict (raises OSError once the process is gone)."""
    return dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )


def process_state(pid: int) -> str | None:
    """The state letter (R, S, T, Z, ...) or None if the pid is gone."""
    st = procstat.read(pid)
    return st.state if st is not None else None


def start_time_ticks(pid: int) -> int | None:
    """Start time in clock ticks since boot: tells a pid from its reuse."""
    st = procstat.read(pid)
    return st.start_ticks if st is not None else None
