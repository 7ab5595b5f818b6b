"""The router's hot path: TTFT and streamed tokens/s at 64 streams, straight to a vLLM double and through the router.

Run: python bench/bench_router.py [--rounds N] [--concurrency C] [--token-delay S] [--loadgen-cpu K]

One double (tests/fakevllm) serves `chat`, one engine step every --token-delay s
(0.02: 50 tokens/s per stream, a 7B model's pace on a consumer card at this
load). One router (`python -m r3090d.router`) is linked to a stand-in for the
daemon that sends one table: `chat` ready and routable. The load generator is
r3090ctl bench's (r3090d.measure.loadgen): a closed loop of C streams, each
request 64 tokens with ignore_eos, timed chunk by chunk, each on a connection
of its own (as loadgen does). Each round runs the same requests straight to the
double and through the router, in an order that alternates from round to round,
so that drift in the machine lands on both alike. Printed, per placement: the
median over rounds of TTFT p50 and p90 and of output tokens/s, per path; the
router's difference and ratio; the router's own CPU; where each process ran;
and TTFT p50 of one stream at a time with 0.5 ms engine steps (the HTTP path
itself: the router's own latency, without the load's queueing).

Placement (taskset). With three CPUs or more, the double, the router and the
load generator get one each. On two, three processes cannot each have a CPU,
and where the load generator goes decides the figure, so both placements run
(or the one --loadgen-cpu names), the double on CPU 1 and the router on CPU 0
in both:
  - load generator on CPU 0, with the router: the router's work delays the
    client's, and every hand-off between them waits for the other's time slice;
    an upper bound on the router's cost;
  - load generator on CPU 1, with the double: the router has a CPU to itself,
    and, holding keep-alive connections to the double, spares it the accept and
    thread of a new connection per request that the direct path pays.
The goals (the hot path: at most 1 ms added at p50 TTFT, at most 2% fewer
tokens/s) are printed as met or not for each; the exit code is 1 only when a
request failed.
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
from dataclasses import dataclass
from pathlib import Path

import httpx

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
SINGLE_REQUESTS = 40
SINGLE_STEP_S = 0.0005
GOAL_TTFT_ADDED_S = 0.001
GOAL_TOKENS_RATIO = 0.98


def pinned(cpu: int | None, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *argv] if cpu is not None else argv


@dataclass(frozen=True)
class Placement:
    double: int | None
    router: int | None
    client: int | None

    def describe(self) -> str:
        if self.client is None:
            return "not pinned"
        shared = {self.router: "the router", self.double: "the double"}.get(self.client)
        return (
            f"double on CPU {self.double}, router on CPU {self.router}, load generator on CPU {self.client}"
            + (f" (shared with {shared})" if shared else "")
        )


def placements(loadgen_cpu: int | None) -> list[Placement]:
    cpus = sorted(os.sched_getaffinity(0))
    if shutil.which("taskset") is None or len(cpus) < 2:
        return [Placement(None, None, None)]
    double, router = cpus[1], cpus[0]
    if loadgen_cpu is not None:
        return [Placement(double, router, loadgen_cpu)]
    if len(cpus) >= 3:
        return [Placement(double, router, cpus[2])]
    return [Placement(double, router, router), Placement(double, router, double)]


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


async def one_round(
    url: str, prompts: list[str], concurrency: int, tokens: int = OUTPUT_TOKENS
) -> loadgen.RoundSummary:
    target = loadgen.Target(url=url, model=MODEL, max_tokens=tokens, ignore_eos=True, continuous_usage=False)
    async with loadgen.make_client(concurrency + 8) as client:
        results, wall = await loadgen.run_round(client, target, prompts, concurrency)
    return loadgen.summarize_round(results, concurrency, wall)


def ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds * 1000, ".2f")


@dataclass
class Measured:
    placement: Placement
    levels: dict[str, loadgen.LevelSummary]
    router_cpu_share: float
    single: dict[str, loadgen.LevelSummary]


def measure(placement: Placement, args: argparse.Namespace, requests: int) -> Measured:
    """One double and one router, started for this placement; warm-up, then the interleaved rounds."""
    if placement.client is not None:
        os.sched_setaffinity(0, {placement.client})
    tmp = Path(tempfile.mkdtemp(prefix="r3090d-bench-router-", dir="/tmp"))
    double = FakeVllm(sys.executable, "--fake-token-delay", str(args.token_delay), served_model_name=MODEL,
                      log_path=tmp / "double.log", env={"PYTHONPATH": str(SHIM_DIR)})  # fmt: skip
    double.argv = pinned(placement.double, double.argv)
    link: OneTableLink | None = None
    router_port = free_port()
    router_log = open(tmp / "router.log", "wb")  # closed in finally
    router = None
    try:
        double.start()
        double.wait_healthy(30)
        ready = ModelEntry(MODEL, ModelKind.GENERATE, EngineState.READY, True, double.url, "")
        link = OneTableLink(tmp / "router.sock", Table(1, (ready,)))
        router_argv = [sys.executable, "-m", "r3090d.router", "--host", "127.0.0.1", "--port", str(router_port),
                       "--link", str(tmp / "router.sock"), "--queue-timeout", "30", "--max-body-bytes", str(1 << 20)]  # fmt: skip
        router = subprocess.Popen(
            pinned(placement.router, router_argv), cwd=ROOT, stdout=router_log, stderr=subprocess.STDOUT
        )
        router_url = f"http://127.0.0.1:{router_port}"
        wait_until(lambda: http().get(router_url + "/healthz").status_code == 200, 30, what="the router linked",
                   ignoring=(httpx.HTTPError,))  # fmt: skip
        say(f"double at {double.url}, router at {router_url}; {placement.describe()}")
        prompts = [f"request {i} of the round: tell me about the quick brown fox" for i in range(requests)]
        paths = {"direct": double.url, "router": router_url}
        for url in paths.values():  # warm-up: connections, the router's pool, the double's threads
            asyncio.run(one_round(url, prompts[: args.concurrency], args.concurrency))
        rounds: dict[str, list[loadgen.RoundSummary]] = {"direct": [], "router": []}
        cpu_share: list[float] = []
        for r in range(args.rounds):
            for name in ["direct", "router"] if r % 2 == 0 else ["router", "direct"]:
                before = cpu_seconds(router.pid)
                summary = asyncio.run(one_round(paths[name], prompts, args.concurrency))
                if name == "router":
                    cpu_share.append((cpu_seconds(router.pid) - before) / summary.wall_s)
                rounds[name].append(summary)
                if summary.failed and (double.proc.poll() is not None or double.state().get("engine_dead")):
                    # Not the router's doing: something outside this benchmark ended the double's engine.
                    raise SystemExit(
                        f"the double's engine died in round {r + 1} ({summary.failures}); run again on a quiet machine"
                    )
                say(f"round {r + 1}/{args.rounds} {name}: TTFT p50 {ms(summary.ttft.p50)} ms, {summary.output_tok_s:.0f} tokens/s, "
                    f"{summary.failed} failed {summary.failures or ''}")  # fmt: skip
        # One stream at a time, 2 tokens each, engine steps of 0.5 ms: TTFT is the HTTP path itself,
        # without the load's queueing: the router's own latency.
        double.control(token_delay=SINGLE_STEP_S)  # so that no wait for the engine's next step hides the path
        single: dict[str, list[loadgen.RoundSummary]] = {"direct": [], "router": []}
        for r in range(args.rounds):
            for name in ["direct", "router"] if r % 2 == 0 else ["router", "direct"]:
                single[name].append(
                    asyncio.run(one_round(paths[name], prompts[:SINGLE_REQUESTS], 1, tokens=2))
                )
    finally:
        if router is not None:
            router.kill()
            router.wait(5)
        router_log.close()
        double.kill_all()
        if link is not None:
            link.close()
    shutil.rmtree(tmp, ignore_errors=True)
    levels = {name: loadgen.summarize_level(rs) for name, rs in rounds.items()}
    alone = {name: loadgen.summarize_level(rs) for name, rs in single.items()}
    return Measured(placement, levels, statistics.median(cpu_share), alone)


def report(m: Measured) -> list[str]:
    direct, routed = m.levels["direct"], m.levels["router"]
    rows = [
        [
            name,
            ms(level.ttft.p50),
            ms(level.ttft.p90),
            fmt(level.output_tok_s, ".0f"),
            str(level.completed),
            str(level.failed),
        ]
        for name, level in m.levels.items()
    ]
    added_p50 = routed.ttft.p50 - direct.ttft.p50
    added_p90 = routed.ttft.p90 - direct.ttft.p90
    ratio = routed.output_tok_s / direct.output_tok_s
    rows.append(
        ["router - direct", f"{added_p50 * 1000:+.2f}", f"{added_p90 * 1000:+.2f}", f"x{ratio:.4f}", "", ""]
    )
    met_ttft = "met" if added_p50 <= GOAL_TTFT_ADDED_S else "NOT met"
    met_tokens = "met" if ratio >= GOAL_TOKENS_RATIO else "NOT met"
    return [
        f"placement: {m.placement.describe()}",
        table(["path", "TTFT p50 ms", "TTFT p90 ms", "tokens/s", "completed", "failed"], rows),
        f"router CPU: {m.router_cpu_share * 100:.0f}% of one core while streaming (median over rounds), "
        f"{m.router_cpu_share / routed.output_tok_s * 1e6:.0f} us per token passed",
        f"one stream at a time ({SINGLE_REQUESTS} requests a round): TTFT p50 direct {ms(m.single['direct'].ttft.p50)} ms, "
        f"router {ms(m.single['router'].ttft.p50)} ms, "
        f"added {(m.single['router'].ttft.p50 - m.single['direct'].ttft.p50) * 1000:+.2f} ms",
        f"goal <= {GOAL_TTFT_ADDED_S * 1000:g} ms added at p50 TTFT: {met_ttft} ({added_p50 * 1000:+.2f} ms); "
        f"goal >= {GOAL_TOKENS_RATIO:.0%} of direct tokens/s: {met_tokens} ({ratio:.2%})",
    ]


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
        help="only this placement of the load generator (default: see above)",
    )
    args = cli.parse_args(argv)
    requests = args.requests or 4 * args.concurrency
    load_before = os.getloadavg()[0]
    measured = [measure(placement, args, requests) for placement in placements(args.loadgen_cpu)]
    print(f"router hot path: {args.concurrency} streams, {OUTPUT_TOKENS} tokens each, {requests} requests per round and path, "
          f"median of {args.rounds} interleaved rounds; double step {args.token_delay:g} s; {os.cpu_count()} CPUs")  # fmt: skip
    print(
        f"load average (1 min): {load_before:.2f} before (other work on the machine), {os.getloadavg()[0]:.2f} after (this run's own threads count too)"
    )
    for m in measured:
        print()
        print("\n".join(report(m)))
    failed = any(level.failed for m in measured for level in m.levels.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
