"""The daemon's memory across engine restarts: its RSS at the engine's first start and after 200 restarts.

Runs the real daemon against the vLLM double with what a restart costs the
daemon in production: the double serves real vLLM 0.32 /metrics text (read
every tick), the exporter is scraped twice a second, alerts go out by syslog
(over UDP, to the discard port), and every restart writes its record. The
fastest honest restart is the double's own fault: `--fake-exit-after` kills
its EngineCore a moment after /health turns 200, the API server exits, and
the daemon restarts it. min_uptime 0 makes each engine count as stable at
once, so every restart is immediate and none is a start failure (no backoff,
no give-up).

Prints the RSS (from /proc) at the first ready engine, along the way and
after the last restart, and exits 1 when it grew by more than --limit-mib.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
from benchlib import say  # noqa: E402

from r3090d.units import MIB  # noqa: E402
from tests.daemon_harness import engine_config, free_port, write_config  # noqa: E402

METRICS_TEXT = benchlib.ROOT / "tests" / "data" / "vllm-0.32-metrics-idle.txt"
ENGINE_LIFE_S = 0.3  # ready this long, then the double's EngineCore dies
SCRAPE_EVERY_S = 0.5


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def config(tmp: Path, python: str) -> Path:
    exporter_port = free_port()
    sections = engine_config(
        tmp,
        python,
        extra_args=["--fake-exit-after", str(ENGINE_LIFE_S), "--fake-dead-exit-delay", "0", "--fake-metrics-file", str(METRICS_TEXT)],
        watchdog={"min_uptime": 0.0, "backoff_initial": 0.0, "backoff_max": 0.0},
        alerts={"min_interval": 0.0},
        daemon={"exporter_enabled": True, "exporter_port": exporter_port},
    )
    sections["alerts.syslog"] = {"enabled": True, "address": "127.0.0.1:9"}
    return write_config(tmp / "r3090d.toml", sections)


def scrape_until(stop: threading.Event, url: str) -> None:
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while not stop.wait(SCRAPE_EVERY_S):
            try:
                client.get(url)
            except httpx.HTTPError:
                pass  # the daemon is between ticks or busy: the next scrape will do


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--restarts", type=int, default=200, help="engine restarts to run through (default 200)")
    cli.add_argument("--limit-mib", type=float, default=2.0, help="the most RSS may grow, in MiB (default 2)")
    args = cli.parse_args(argv)
    benchlib.exit_on_sigterm()

    from tests.fakevllm.harness import make_engine_python

    with tempfile.TemporaryDirectory(prefix="r3090d-mem-") as tmp:
        tmp = Path(tmp)
        python = str(make_engine_python(tmp / "venv", "0.32.0"))
        cfg = config(tmp, python)
        port = benchlib.configmod.load(cfg, check_files=False).daemon.exporter_port
        d = benchlib.Daemon(cfg, tmp / "daemon.log").start()
        stop = threading.Event()
        scraper = threading.Thread(target=scrape_until, args=(stop, f"http://127.0.0.1:{port}/metrics"), name="scraper", daemon=True)
        points: list[tuple[int, float, int]] = []  # (restarts, seconds since the first ready, RSS)
        try:
            d.wait_ready(60)
            t0 = time.monotonic()
            scraper.start()
            points.append((0, 0.0, rss_bytes(d.pid)))
            marks = sorted({*range(args.restarts // 4, args.restarts, max(1, args.restarts // 4)), args.restarts})
            for mark in marks:
                st = d.wait_for(lambda s, n=mark: s["restarts"]["total"] >= n and s["engine"]["phase"] == "ready" and s, 60 + 10 * mark,
                                f"{mark} restarts and the engine ready")  # fmt: skip
                points.append((st["restarts"]["total"], time.monotonic() - t0, rss_bytes(d.pid)))
                say(f"{points[-1][0]} restarts in {points[-1][1]:.0f} s: RSS {points[-1][2] / MIB:.1f} MiB")
            final = d.state()
        finally:
            stop.set()
            d.cleanup()

    start, end = points[0][2], points[-1][2]
    growth = end - start
    restarts, took = points[-1][0], points[-1][1]
    print(f"daemon RSS across {restarts} engine restarts against the double ({took:.0f} s, {took / restarts:.2f} s a restart):")
    print(benchlib.table(
        ["restarts", "seconds", "RSS MiB", "growth MiB"],
        [[str(n), f"{t:.0f}", f"{rss / MIB:.2f}", f"{(rss - start) / MIB:+.2f}"] for n, t, rss in points],
    ))  # fmt: skip
    print(f"start {start / MIB:.2f} MiB, end {end / MIB:.2f} MiB, growth {growth / MIB:+.2f} MiB ({growth / restarts / 1024:+.1f} KiB a restart); "
          f"limit {args.limit_mib:g} MiB: {'met' if growth <= args.limit_mib * MIB else 'MISSED'}")  # fmt: skip
    if final is not None and final["restarts"]["backoff_level"]:
        print(f"warning: the last restart waited at backoff level {final['restarts']['backoff_level']}: some restarts were start failures")
    return 0 if growth <= args.limit_mib * MIB else 1


if __name__ == "__main__":
    sys.exit(main())
