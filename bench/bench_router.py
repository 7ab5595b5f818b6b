"""The router's hot path: TTFT and streamed tokens/s at 64 streams, straight to a vLLM double and through the router.

Run: python bench/bench_router.py [--rounds N] [--concurrency C] [--token-delay S] [--loadgen-cpu K]

One double (tests/fakevllm) serves `chat`, one engine step every --token-delay s
(0.02: 50 tokens/s per stream, a 7B model's pace on a consumer card at this
load). One router (`python -m r3090d.router`) is linked to a stand-in for the
daemon that sends one table: `chat` ready and routable. The load generator is
r3090ctl bench's (r3090d.measure.loadgen): a closed loop of C streams, each
request 64 tokens with ignore_eos, timed chunk by chunk. Each round runs the
same requests straight to the double and through the router, in an order that
alternates from round to round, so that drift in the machine lands on both
alike. Printed: the median over rounds of TTFT p50 and p90 and of output
tokens/s, per path; the router's difference and ratio; the router's own CPU
per round; and where each process was pinned.

Pinning (taskset; on a 2-core machine): the double on CPU 1, the router on CPU
0, and the load generator on --loadgen-cpu (0 by default: it shares CPU 0 with
the router, so what the router's work costs the client is counted against the
router, an upper bound on its overhead). With more cores the three get a CPU
each. The goals (issue: the hot path) are at most 1 ms added at p50 TTFT and at
most 2% fewer tokens/s; they are printed as met or not, and the exit code is 1
only when a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.benchlib import fmt, say, table  # noqa: E402
from r3090d.measure import loadgen  # noqa: E402
from r3090d.router.link import EngineState, ModelEntry, ModelKind, Table, encode_table  # noqa: E402
from tests.fakevllm.harness import SHIM_DIR, FakeVllm, free_port, http  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

MODEL = "chat"
OUTPUT_TOKENS = 64
GOAL_TTFT_ADDED_S = 0.001
GOAL_TOKENS_RATIO = 0.98


def pinned(cpu: int | None, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *argv] if cpu is not None else argv


def cpu_plan(loadgen_cpu: int | None) -> tuple[int | None, int | None, int | None, str]:
    """(double, router, load generator) CPUs, and a sentence saying so."""
    cpus = sorted(os.sched_getaffinity(0))
    if shutil.which("taskset") is None or len(cpus) < 2:
        return (
            None,
            None,
            None,
            f"not pinned (taskset {'missing' if shutil.which('taskset') is None else 'pointless'} on {len(cpus)} CPU(s))",
        )
    if len(cpus) >= 3 and loadgen_cpu is None:
        double, router, client = cpus[1], cpus[0], cpus[2]
    else:
        double, router = cpus[1], cpus[0]
        client = cpus[0] if loadgen_cpu is None else loadgen_cpu
    shared = {router: "router", double: "double"}.get(client)
    note = f" (shared with the {shared})" if shared else ""
    return (
        double,
        router,
        client,
        f"double on CPU {double}, router on CPU {router}, load generator on CPU {client}{note}; {len(cpus)} CPUs",
    )


class OneTableLink:
    """The daemon's end of the link, for a benchmark: one table on every connection, the demand read and dropped."""

    def __init__(self, path: Path, table: Table):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.table = table
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.sendall(encode_table(self.table))
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    @staticmethod
    def _drain(conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_round(url: str, prompts: list[str], concurrency: int) -> loadgen.RoundSummary:
    target = loadgen.Target(
        url=url, model=MODEL, max_tokens=OUTPUT_TOKENS, ignore_eos=True, continuous_usage=False
    )
    async with loadgen.make_client(concurrency + 8) as client:
        results, wall = await loadgen.run_round(client, target, prompts, concurrency)
    return loadgen.summarize_round(results, concurrency, wall)


def ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds * 1000, ".2f")


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    cli.add_argument("--concurrency", type=int, default=64, help="streams at once (default 64)")
    cli.add_argument(
        "--requests", type=int, default=None, help="requests per round and path (default 4 x concurrency)"
    )
    cli.add_argument(
        "--token-delay", type=float, default=0.02, help="the double's engine step in seconds (default 0.02)"
    )
    cli.add_argument(
        "--loadgen-cpu",
        type=int,
        default=None,
        help="pin the load generator to this CPU (default: its own if there is a third, else CPU 0)",
    )
    args = cli.parse_args(argv)
    requests = args.requests or 4 * args.concurrency
    double_cpu, router_cpu, client_cpu, pinning = cpu_plan(args.loadgen_cpu)
    if client_cpu is not None:
        os.sched_setaffinity(0, {client_cpu})

    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="r3090d-bench-router-", dir="/tmp"))
    double = FakeVllm(sys.executable, "--fake-token-delay", str(args.token_delay), served_model_name=MODEL, log_path=tmp / "double.log",
                      env={"PYTHONPATH": str(SHIM_DIR)})  # fmt: skip
    double.argv = pinned(double_cpu, double.argv)
    link: OneTableLink | None = None
    router_port = free_port()
    router_log = open(tmp / "router.log", "wb")
    router = None
    try:
        double.start()
        double.wait_healthy(30)
        link = OneTableLink(
            tmp / "router.sock",
            Table(1, (ModelEntry(MODEL, ModelKind.GENERATE, EngineState.READY, True, double.url, ""),)),
        )
        router_argv = [sys.executable, "-m", "r3090d.router", "--host", "127.0.0.1", "--port", str(router_port),
                       "--link", str(tmp / "router.sock"), "--queue-timeout", "30", "--max-body-bytes", str(1 << 20)]  # fmt: skip
        router = subprocess.Popen(
            pinned(router_cpu, router_argv), cwd=ROOT, stdout=router_log, stderr=subprocess.STDOUT
        )
        router_url = f"http://127.0.0.1:{router_port}"
        wait_until(
            lambda: http().get(router_url + "/healthz").status_code == 200,
            30,
            what="the router linked",
            ignoring=(OSError, Exception),
        )
        say(f"double at {double.url}, router at {router_url}; {pinning}")

        prompts = [f"request {i} of the round: tell me about the quick brown fox" for i in range(requests)]
        paths = {"direct": double.url, "router": router_url}
        say("warm-up: one round each")
        for url in paths.values():
            asyncio.run(one_round(url, prompts[: args.concurrency], args.concurrency))
        rounds: dict[str, list[loadgen.RoundSummary]] = {"direct": [], "router": []}
        router_cpu_share: list[float] = []
        for r in range(args.rounds):
            order = ["direct", "router"] if r % 2 == 0 else ["router", "direct"]
            for name in order:
                before = cpu_seconds(router.pid)
                summary = asyncio.run(one_round(paths[name], prompts, args.concurrency))
                if name == "router":
                    router_cpu_share.append((cpu_seconds(router.pid) - before) / summary.wall_s)
                rounds[name].append(summary)
                if summary.failed and (double.proc.poll() is not None or double.state().get("engine_dead")):
                    # Not the router's doing: something outside this benchmark ended the double's engine.
                    raise SystemExit(
                        f"the double's engine died during round {r + 1} ({summary.failures}); run again on a quiet machine"
                    )
                say(
                    f"round {r + 1}/{args.rounds} {name}: TTFT p50 {ms(summary.ttft.p50)} ms, {summary.output_tok_s:.0f} tokens/s, {summary.failed} failed {summary.failures}"
                )
    finally:
        if router is not None:
            router.kill()
            router.wait(5)
        router_log.close()
        double.kill_all()
        if link is not None:
            link.close()

    levels = {name: loadgen.summarize_level(rs) for name, rs in rounds.items()}
    direct, routed = levels["direct"], levels["router"]
    rows = [
        [
            name,
            ms(level.ttft.p50),
            ms(level.ttft.p90),
            fmt(level.output_tok_s, ".0f"),
            str(level.completed),
            str(level.failed),
        ]
        for name, level in levels.items()
    ]
    added_p50 = routed.ttft.p50 - direct.ttft.p50
    added_p90 = routed.ttft.p90 - direct.ttft.p90
    ratio = routed.output_tok_s / direct.output_tok_s
    rows.append(
        ["router - direct", f"{added_p50 * 1000:+.2f}", f"{added_p90 * 1000:+.2f}", f"x{ratio:.4f}", "", ""]
    )
    print(f"router hot path: {args.concurrency} streams, {OUTPUT_TOKENS} tokens each, {requests} requests per round and path, "
          f"median of {args.rounds} interleaved rounds; double step {args.token_delay:g} s")  # fmt: skip
    print(f"pinning: {pinning}")
    print(
        f"load average (1 min) before and after: {load_before:.2f}, {os.getloadavg()[0]:.2f} (other work on the machine shows here)"
    )
    print(table(["path", "TTFT p50 ms", "TTFT p90 ms", "tokens/s", "completed", "failed"], rows))
    print(
        f"router CPU: {statistics.median(router_cpu_share) * 100:.0f}% of one core while streaming (median over rounds)"
    )
    met_ttft = "met" if added_p50 <= GOAL_TTFT_ADDED_S else "NOT met"
    met_tokens = "met" if ratio >= GOAL_TOKENS_RATIO else "NOT met"
    print(
        f"goal: <= {GOAL_TTFT_ADDED_S * 1000:g} ms added at p50 TTFT: {met_ttft} ({added_p50 * 1000:+.2f} ms)"
    )
    print(f"goal: >= {GOAL_TOKENS_RATIO:.0%} of direct tokens/s: {met_tokens} ({ratio:.2%})")
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if direct.failed or routed.failed else 0


if __name__ == "__main__":
    sys.exit(main())
