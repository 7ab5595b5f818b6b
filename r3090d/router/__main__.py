"""`python -m r3090d.router`: the router in the foreground, until SIGTERM.

    python -m r3090d.router --host H --port P --link RUNTIME_DIR/router.sock \\
        --queue-timeout S --max-body-bytes N [--api-key-file F] [--drain-timeout S] [--parent PID]

Secrets never travel in argv: the public API key comes from --api-key-file or
the environment variable R3090D_ROUTER_API_KEY; the engines' keys come in the
daemon's table. A bad argument exits 64 (usage) and a key file that cannot be
used 78 (configuration), each with one line on stderr.

The daemon passes its pid as --parent: the router asks for SIGTERM when the
daemon dies (it drains and exits, freeing the public port, systemd or not), and
exits 75 at once if that daemon is already gone.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
from pathlib import Path

from r3090d import exitcodes
from r3090d.config.errors import ConfigError
from r3090d.config.secret import read_secret
from r3090d.effectors.parentdeath import die_with

ENV_API_KEY = "R3090D_ROUTER_API_KEY"
PROG = "python -m r3090d.router"


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage and exit 2
        raise UsageError(message)


def _positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError(text)
    return value


def _pid(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _body_limit(text: str) -> int:
    value = int(text)
    if value < 1024:
        raise ValueError(text)
    return value


# argparse says "invalid <name> value: 'x'".
_positive.__name__ = "seconds (> 0)"
_port.__name__ = "port (1..65535)"
_body_limit.__name__ = "byte count (>= 1024)"
_pid.__name__ = "pid (> 0)"


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Routes OpenAI requests by their `model` to the engines the daemon runs.",
                allow_abbrev=False)  # fmt: skip
    p.add_argument("--host", required=True, help="address to listen on (the public one, [engine].host)")
    p.add_argument("--port", required=True, type=_port, help="port to listen on ([engine].port)")
    p.add_argument(
        "--link", required=True, type=Path, help="the daemon's link socket (runtime_dir/router.sock)"
    )
    p.add_argument(
        "--queue-timeout", required=True, type=_positive, help="seconds a request waits for its model"
    )
    p.add_argument(
        "--max-body-bytes", required=True, type=_body_limit, help="the largest request body accepted"
    )
    p.add_argument("--api-key-file", help=f"file holding the public API key (or set {ENV_API_KEY})")
    p.add_argument(
        "--drain-timeout", type=_positive, default=5.0, help="seconds streams get to finish at SIGTERM (5)"
    )
    p.add_argument("--parent", type=_pid, help="the daemon's pid: the router stops when that process dies")
    return p


def api_key(key_file: str | None, environ: dict[str, str]) -> str | None:
    """The public API key from its file or the environment; ConfigError when unusable."""
    if key_file is None:
        return environ.get(ENV_API_KEY) or None
    text = read_secret("command line", "--api-key-file", key_file).strip()
    if not text:
        raise ConfigError("command line", "--api-key-file", f"{key_file} is empty", "write the key into it")
    if any(c in text for c in "\r\n\0"):
        raise ConfigError("command line", "--api-key-file", f"{key_file} holds more than the key (several lines or a NUL byte)",
                          "keep only the key in it")  # fmt: skip
    return text


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    if args.parent is not None:
        if not die_with(args.parent, signal.SIGTERM):  # SIGTERM: the router drains and exits
            print(f"{PROG}: the daemon that started it (pid {args.parent}) is gone; not serving",
                  file=sys.stderr)  # fmt: skip
            return exitcodes.TEMPFAIL
    try:
        key = api_key(args.api_key_file, dict(os.environ))
    except ConfigError as exc:
        print(f"{PROG}: {exc.one_line()}", file=sys.stderr)
        return exitcodes.CONFIG
    # Imported here: --help and argument errors need no aiohttp.
    from r3090d.effectors.journal import setup_logging
    from r3090d.router.app import Options, serve

    setup_logging()
    options = Options(host=args.host, port=args.port, link=args.link, queue_timeout=args.queue_timeout,
                      max_body_bytes=args.max_body_bytes, api_key=key, drain_timeout=args.drain_timeout)  # fmt: skip
    try:
        asyncio.run(serve(options))
    except OSError as exc:  # the port is taken, or the address is not ours: the daemon starts it again
        print(f"{PROG}: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return exitcodes.TEMPFAIL
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
