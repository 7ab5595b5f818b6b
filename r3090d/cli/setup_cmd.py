"""`r3090ctl setup`: lay the service down from an installed r3090d, no checkout needed.

It does what `make install` does after the venv: the system user and group,
the units with ExecStart= pointing at this installation's `r3090d`, the config
unless one exists (never overwritten), bash completion, and `systemctl
daemon-reload` where systemd runs. `make install` runs this very command.

`r3090ctl example NAME` prints a shipped file (units, annotated config,
Prometheus rules, HAProxy example) for whoever has only the wheel.
"""

from __future__ import annotations

import enum
import grp
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import click

from r3090d import exitcodes, shipped
from r3090d.cli.common import CommandError, ctl

EX_NOPERM = 77  # sysexits: laying the service down needs root
PROG = "r3090ctl setup"

DEFAULT_UNIT_DIR = "/usr/local/lib/systemd/system"
DEFAULT_CONFIG_DIR = "/etc/r3090d"
DEFAULT_COMPLETION_DIR = "/usr/local/share/bash-completion/completions"
SERVICE_HOME = "/var/lib/r3090d"
SERVICE_SHELL = "/usr/sbin/nologin"
SERVICE_COMMENT = "r3090d vLLM supervisor"
# Directories the hardened unit cannot see (ProtectHome=yes).
HIDDEN_FROM_SERVICE = ("/root", "/home", "/run/user")
# What ExecStart= may hold without quoting or specifier escapes.
PLAIN_PATH = re.compile(r"/[A-Za-z0-9_./+@:-]*")


class Account(enum.Enum):
    GROUP = "group"
    USER = "passwd"


@dataclass(frozen=True)
class Target:
    """Where the service goes. Paths are as the target system sees them; root prefixes them all."""

    root: Path
    unit_dir: str
    config_dir: str
    completion_dir: str
    user: str
    group: str
    daemon: str  # the r3090d that ExecStart= runs

    @property
    def live(self) -> bool:
        """The running system itself, not a tree under --root."""
        return self.root == Path("/")

    def on_disk(self, path: str) -> Path:
        return self.root / path.lstrip("/")


# ------------------------------------------------------------------ actions


@dataclass(frozen=True)
class EnsureGroup:
    name: str


@dataclass(frozen=True)
class EnsureUser:
    name: str
    group: str


@dataclass(frozen=True)
class MakeDir:
    path: str
    mode: int
    group: str | None  # owned by root:group; None: root:root
    fix_existing: bool = False  # set mode and owner on a directory that is already there


@dataclass(frozen=True)
class WriteFile:
    path: str
    content: str
    mode: int
    group: str | None
    keep_existing: bool  # a config is never overwritten
    note: str = ""  # said when an existing file is kept


@dataclass(frozen=True)
class DaemonReload:
    pass


Action = EnsureGroup | EnsureUser | MakeDir | WriteFile | DaemonReload


def render_unit(text: str, daemon: str) -> str:
    """The shipped unit with ExecStart= running `daemon`."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("ExecStart=")]
    if len(starts) != 1:
        raise ValueError(f"the shipped unit has {len(starts)} ExecStart= lines, not 1")
    lines[starts[0]] = f"ExecStart={daemon}\n"
    return "".join(lines)


def completion_script() -> str:
    """What `_R3090CTL_COMPLETE=bash_source r3090ctl` prints."""
    from click.shell_completion import BashComplete

    return BashComplete(ctl, {}, "r3090ctl", "_R3090CTL_COMPLETE").source()


def plan(target: Target, *, reload: bool = True) -> list[Action]:
    """Everything setup does, in order; pure, so --dry-run shows exactly this."""
    actions: list[Action] = [EnsureGroup(target.group), EnsureUser(target.user, target.group)]
    actions.append(MakeDir(target.unit_dir, 0o755, None))
    for unit in shipped.UNITS:
        content = render_unit(shipped.text(unit), target.daemon)
        actions.append(WriteFile(f"{target.unit_dir}/{unit.value}", content, 0o644, None, keep_existing=False))
    # The config may hold secrets' paths and the SMTP setup: root and the service group only.
    actions.append(MakeDir(target.config_dir, 0o750, target.group, fix_existing=True))
    config = f"{target.config_dir}/{shipped.Shipped.CONFIG.value}"
    actions.append(
        WriteFile(config, shipped.text(shipped.Shipped.CONFIG), 0o640, target.group, keep_existing=True,
                  note="the annotated reference: r3090ctl example config")  # fmt: skip
    )
    actions.append(MakeDir(target.completion_dir, 0o755, None))
    actions.append(WriteFile(f"{target.completion_dir}/r3090ctl", completion_script(), 0o644, None, keep_existing=False))
    if reload:
        actions.append(DaemonReload())
    return actions


# ---------------------------------------------------------------- the host


def installed_daemon() -> str | None:
    """The `r3090d` console script of the installation this r3090ctl runs from."""
    candidates = [Path(sysconfig.get_path("scripts")) / "r3090d", Path(sys.executable).parent / "r3090d"]
    user_scheme = f"{os.name}_user"
    if user_scheme in sysconfig.get_scheme_names():
        candidates.append(Path(sysconfig.get_path("scripts", user_scheme)) / "r3090d")
    for path in candidates:
        if os.access(path, os.X_OK):
            return str(path)
    return shutil.which("r3090d")


def hidden_from_service(daemon: str) -> str | None:
    """Why the hardened unit could not run `daemon` (the script or its interpreter under /root or /home), or None."""
    paths = [Path(daemon).resolve()]
    try:
        first = Path(daemon).read_bytes()[:256].split(b"\n", 1)[0]
    except OSError:
        first = b""
    if first.startswith(b"#!"):
        interpreter = first[2:].decode(errors="replace").split()
        if interpreter:
            paths.append(Path(interpreter[0]).resolve())
    for path in paths:
        if any(path == Path(top) or Path(top) in path.parents for top in HIDDEN_FROM_SERVICE):
            return f"{path} is under {', '.join(HIDDEN_FROM_SERVICE)}, which the unit hides (ProtectHome=yes)"
    return None


def systemd_running() -> bool:
    # /run/systemd/system can outlive a systemd that ran in another PID namespace.
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


def account_exists(kind: Account, name: str, root: Path) -> bool:
    if root == Path("/"):
        import pwd

        lookup = grp.getgrnam if kind is Account.GROUP else pwd.getpwnam
        try:
            lookup(name)
            return True
        except KeyError:
            return False
    return _entry(root / "etc" / kind.value, name) is not None


def _entry(path: Path, name: str) -> list[str] | None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        fields = line.split(":")
        if fields[0] == name and len(fields) >= 3:
            return fields
    return None


def group_id(name: str, root: Path) -> int | None:
    if root == Path("/"):
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            return None
    fields = _entry(root / "etc" / "group", name)
    return int(fields[2]) if fields and fields[2].isdigit() else None


# ------------------------------------------------------------ carrying out


class Runner:
    """Carries out (or, dry, describes) the actions; every step says one line."""

    def __init__(self, target: Target, dry_run: bool):
        self.target = target
        self.dry = dry_run

    def say(self, line: str) -> None:
        click.echo(f"setup: {line}")

    def run(self, action: Action) -> None:
        match action:
            case EnsureGroup(name):
                self.account(Account.GROUP, name, ["groupadd", "--system", name])
            case EnsureUser(name, group):
                argv = ["useradd", "--system", "--gid", group, "--no-create-home", "--home-dir", SERVICE_HOME,
                        "--shell", SERVICE_SHELL, "--comment", SERVICE_COMMENT, name]  # fmt: skip
                self.account(Account.USER, name, argv, f" (no login, home {SERVICE_HOME})")
            case MakeDir():
                self.make_dir(action)
            case WriteFile():
                self.write_file(action)
            case DaemonReload():
                self.reload()

    def account(self, kind: Account, name: str, argv: list[str], detail: str = "") -> None:
        word = "group" if kind is Account.GROUP else "user"
        t = self.target
        if not t.live and not (t.root / "etc" / kind.value).exists():
            self.say(f"no {t.on_disk('/etc/' + kind.value)}: not creating {word} {name} there")
            return
        if account_exists(kind, name, t.root):
            self.say(f"{word} {name} exists")
            return
        if self.dry:
            self.say(f"would create system {word} {name}{detail}")
            return
        self.say(f"creating system {word} {name}{detail}")
        prefix = [] if t.live else ["--prefix", str(t.root)]
        try:
            done = subprocess.run([*argv[:-1], *prefix, argv[-1]], capture_output=True, text=True)
        except FileNotFoundError:
            raise CommandError(f"{argv[0]} not found: create {word} {name} by hand", exitcodes.CONFIG, PROG) from None
        if done.returncode != 0:
            raise CommandError(f"{argv[0]} {name} failed: {done.stderr.strip()}", exitcodes.CONFIG, PROG)

    def owner(self, group: str | None) -> tuple[int, int]:
        if group is None:
            return 0, 0
        gid = group_id(group, self.target.root)
        if gid is None:
            self.say(f"no group {group} here: {'would leave' if self.dry else 'leaving'} it root's")
            return 0, 0
        return 0, gid

    def make_dir(self, action: MakeDir) -> None:
        path = self.target.on_disk(action.path)
        existed = path.is_dir()
        if existed and not action.fix_existing:
            return
        mode = f"root:{action.group or 'root'}, {action.mode:04o}"
        if self.dry:
            self.say(f"would {'set' if existed else 'create'} {path} ({mode})")
            return
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, *self.owner(action.group))
        os.chmod(path, action.mode)

    def write_file(self, action: WriteFile) -> None:
        path = self.target.on_disk(action.path)
        if action.keep_existing and (path.exists() or path.is_symlink()):
            self.say(f"keeping the existing {path}" + (f" ({action.note})" if action.note else ""))
            return
        group = f"root:{action.group or 'root'}, {action.mode:04o}"
        if self.dry:
            self.say(f"would write {path} ({group})")
            return
        self.say(f"{path} ({group})")
        new = path.with_name(path.name + ".new")
        with open(os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as fh:
            fh.write(action.content)
        os.chown(new, *self.owner(action.group))
        os.chmod(new, action.mode)
        os.replace(new, path)  # whole or not at all: systemd may read the unit at any time

    def reload(self) -> None:
        if not self.target.live:
            self.say(f"skipped systemctl daemon-reload (files went under {self.target.root})")
            return
        if not systemd_running():
            self.say("systemd is not running here; skipped daemon-reload")
            return
        if self.dry:
            self.say("would run systemctl daemon-reload")
            return
        self.say("systemctl daemon-reload")
        subprocess.run(["systemctl", "daemon-reload"], check=False)
        listed = subprocess.run(
            ["systemctl", "list-units", "--plain", "--no-legend", "--state=active", "r3090d.service", "r3090d@*.service"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        for line in listed.stdout.splitlines():
            if line.split():
                self.say(f"{line.split()[0]} is running the old version: systemctl restart {line.split()[0]}")


@ctl.command("setup")
@click.option("--root", "root", default="/", show_default=True, metavar="DIR", help="lay the service down in the system tree at DIR (an image, a test)")
@click.option("--dry-run", is_flag=True, help="say what would be done; change nothing")
@click.option("--unit-dir", default=DEFAULT_UNIT_DIR, show_default=True, metavar="DIR")
@click.option("--config-dir", default=DEFAULT_CONFIG_DIR, show_default=True, metavar="DIR")
@click.option("--completion-dir", default=DEFAULT_COMPLETION_DIR, show_default=True, metavar="DIR", help="bash completion goes here")
@click.option("--user", default="r3090", show_default=True, help="the service user (a system user, no login)")
@click.option("--group", default="r3090", show_default=True, help="the service group (reads the config, uses the control socket)")
@click.option("--daemon-path", metavar="PATH", help="the r3090d the units run (default: the one installed with this r3090ctl)")
@click.option("--no-reload", is_flag=True, help="leave systemctl daemon-reload to the caller (make install)")
def setup_command(root, dry_run, unit_dir, config_dir, completion_dir, user, group, daemon_path, no_reload) -> int:
    """Install the service from this r3090d: user, units, config, completion (root)."""
    if os.geteuid() != 0 and not dry_run:
        raise CommandError("must run as root (--dry-run shows what it would do)", EX_NOPERM, PROG)
    daemon = daemon_path or installed_daemon()
    if not daemon:
        raise CommandError("cannot find the r3090d command of this installation: give --daemon-path PATH", exitcodes.USAGE, PROG)
    if not PLAIN_PATH.fullmatch(daemon):
        raise CommandError(f"{daemon!r} cannot go into ExecStart= as it is: use an absolute path without spaces, quotes or %", exitcodes.USAGE, PROG)
    for name, value in (("--unit-dir", unit_dir), ("--config-dir", config_dir), ("--completion-dir", completion_dir)):
        if not value.startswith("/"):
            raise CommandError(f"{name} {value!r} must be an absolute path (--root prefixes it)", exitcodes.USAGE, PROG)
    target = Target(Path(root).resolve(), unit_dir.rstrip("/") or "/", config_dir.rstrip("/") or "/", completion_dir.rstrip("/") or "/",
                    user, group, daemon)  # fmt: skip
    if target.live:
        why = hidden_from_service(daemon)
        if why:
            click.echo(f"setup: warning: the service could not start: {why}; install r3090d into a venv made "
                       "from /usr/bin/python3 (see README: setup without a checkout)", err=True)  # fmt: skip
    runner = Runner(target, dry_run)
    for action in plan(target, reload=not no_reload):
        runner.run(action)
    config = target.on_disk(f"{target.config_dir}/{shipped.Shipped.CONFIG.value}")
    runner.say(f"{'dry run: nothing changed' if dry_run else 'done'}. Next: set engine.model and engine.python in {config},")
    runner.say("  check it with 'r3090ctl config check', then: systemctl enable --now r3090d   (or r3090d@N for GPU N)")
    return exitcodes.OK


@ctl.command("example")
@click.argument("name", type=click.Choice([item.key for item in shipped.Shipped]))
def example_command(name) -> int:
    """Print a file that ships with r3090d: the units, the annotated config, Prometheus rules, HAProxy."""
    item = next(item for item in shipped.Shipped if item.key == name)
    click.echo(shipped.text(item), nl=False)
    return exitcodes.OK
