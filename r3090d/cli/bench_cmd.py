"""`r3090ctl bench`: streaming latency and throughput across concurrency levels.

Exit codes: 0 every measured request succeeded; 1 the run finished but some
requests failed (the reasons are in the output); 64 bad input (options, wrong
model, rejected API key, missing matplotlib for --plot); 69 the engine cannot
be reached or does not serve.

Prompts are made before the first timed request: each one `--prompt-tokens`
tokens long by the server's POST /tokenize, or that many words where the
server has none. The JSON (--json, --output) uses `vllm bench serve`'s keys
per level; measure/bench_result.py and the README's bench section map them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict

import click

from r3090d import exitcodes
from r3090d.cli.common import UsageExit, config_option, ctl, instance_option
from r3090d.measure import bench_result, loadgen, tokenize_client
from r3090d.measure.plan import GB
from r3090d.measure.prompts import PromptUnit

EX_UNAVAILABLE = loadgen.EX_UNAVAILABLE


class BenchExit(click.ClickException):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(f"r3090ctl bench: {self.message}", err=True)


def _levels(ctx, param, value):
    try:
        return loadgen.parse_levels(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _check_plot_backend(path: str | None) -> None:
    if not path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchExit("--plot needs matplotlib: pip install 'r3090d[plot]'", exitcodes.USAGE) from None


def tpot_floor(model_dir: str | None, bandwidth_gbs: float | None, card: str | None, gpu_index: int) -> dict | None:
    """The plan's TPOT floor for MBU, or None (with a note on stderr) when an input is missing."""
    if not model_dir:
        return None
    from r3090d.measure import inputs
    from r3090d.measure import plan as planmod

    try:
        model = inputs.read_model(model_dir)
    except planmod.PlanError as exc:
        raise UsageExit(str(exc)) from None
    if model.measured_weight_bytes:
        weight_bytes, source = model.measured_weight_bytes, model.weight_note
    else:
        try:
            est = planmod.estimate_weights(model.shape)
        except planmod.PlanError as exc:
            click.echo(f"r3090ctl bench: no MBU: {exc}", err=True)
            return None
        weight_bytes, source = est.bytes, est.assumption
    try:
        hardware = inputs.resolve_hardware(None, bandwidth_gbs, need_memory=False, card=card, gpu_index=gpu_index)
    except planmod.PlanError as exc:
        click.echo(f"r3090ctl bench: no MBU: {exc}", err=True)
        return None
    floor = planmod.tpot_floor_s(weight_bytes, hardware.bandwidth_bytes_per_s)
    return {
        "weight_bytes": weight_bytes,
        "weights_source": source,
        "bandwidth_bytes_per_s": hardware.bandwidth_bytes_per_s,
        "bandwidth_source": hardware.source,
        "tpot_floor_s": floor,
    }


def server_itl_reader(url: str, model: str):
    """A function returning vLLM's ITL histogram (sum, count) now, or None if /metrics is unreadable."""

    from r3090d.probes import engine as engine_probe
    from r3090d.probes.http import engine_client

    client = engine_client()  # the engine is reached directly, never through a proxy

    def read() -> tuple[float, float] | None:
        text, _why = engine_probe.fetch_metrics(client, url, 5.0)
        if text is None:
            return None
        sample = engine_probe.parse(text, model)
        if sample.itl_sum is None or sample.itl_count is None:
            return None
        return sample.itl_sum, sample.itl_count

    return read


class Progress:
    """One line on stderr: level, round, requests done / total, failures."""

    def __init__(self, total: int, enabled: bool, stage: str = "warmup"):
        self.total, self.done, self.failed = total, 0, 0
        self.enabled = enabled
        self.stage = stage
        self.last_draw = 0.0
        self.drawn = False

    def level(self, concurrency: int, round_index: int) -> None:
        self.stage = f"c={concurrency} round {round_index + 1}"
        self.draw(force=True)

    def request_done(self, result: loadgen.RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        self.draw()

    def step_done(self) -> None:
        self.done += 1
        self.draw()

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last_draw < 0.1 and self.done < self.total):
            return
        self.last_draw, self.drawn = now, True
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        fail = f" {self.failed} failed" if self.failed else ""
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {self.stage:<18}{fail}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.drawn:  # a bar that never started (no /tokenize) leaves no line
            self.draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def prompt_note(stats: dict) -> str:
    """How long the prompts are, as the table's header says it."""
    if stats["unit"] == PromptUnit.WORDS.value:
        return f"prompt ~{stats['wanted']} words (the server has no /tokenize)"
    if stats["exact"] == stats["prompts"]:
        return f"prompt {stats['wanted']} tokens (exact, via /tokenize)"
    return (
        f"prompt {stats['wanted']} tokens via /tokenize, {stats['prompts'] - stats['exact']} of {stats['prompts']} "
        f"not exact ({stats['shortest']}..{stats['longest']})"
    )


def render(result: dict) -> None:
    echo = click.echo
    t = result["target"]
    echo(
        f"{t['url']}{'/v1/chat/completions' if t['chat'] else '/v1/completions'}  model {t['model']}  "
        f"max_tokens {t['max_tokens']}  ignore_eos {t['ignore_eos']}  {prompt_note(result['prompts'])}"
    )
    echo(f"{result['plan']['rounds']} round(s) per level, median shown; warmup {result['plan']['warmup']} request(s)")
    floor = result.get("floor")
    if floor and floor.get("tpot_floor_s"):
        echo(f"TPOT floor {floor['tpot_floor_s'] * 1000:.2f} ms = {floor['weight_bytes'] / GB:.2f} GB / {floor['bandwidth_bytes_per_s'] / GB:.0f} GB/s")
    head = ["conc", "ok", "fail", "TTFT p50", "p99", "TPOT mean", "p50", "p90", "p99", "ITL p50", "p99", "out tok/s", "req/s", "MBU", "vLLM ITL"]
    rows = []
    for lv in result["levels"]:
        rows.append([
            str(lv["max_concurrency"]), str(lv["completed"]), str(lv["failed"]),
            _ms(lv["median_ttft_ms"]), _ms(lv["p99_ttft_ms"]),
            _ms(lv["mean_tpot_ms"]), _ms(lv["median_tpot_ms"]), _ms(lv["p90_tpot_ms"]), _ms(lv["p99_tpot_ms"]),
            _ms(lv["median_itl_ms"]), _ms(lv["p99_itl_ms"]),
            f"{lv['output_throughput']:.1f}", f"{lv['request_throughput']:.2f}",
            "-" if lv["mbu"] is None else f"{lv['mbu'] * 100:.0f}%",
            _ms(lv["server_itl_mean_ms"]),
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    echo("latencies in ms; TPOT leaves the first token out; vLLM ITL is the server's own mean over the same rounds")
    for r in [head, *rows]:
        echo("  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)))
    for lv in result["levels"]:
        for reason, count in lv["failures_by_reason"].items():
            echo(f"c={lv['max_concurrency']}: {count} failed: {reason}")
        mean_out = lv.get("output_tokens_mean")
        if mean_out is not None and t["ignore_eos"] and abs(mean_out - t["max_tokens"]) > 0.5:
            echo(f"c={lv['max_concurrency']}: outputs averaged {mean_out:.1f} tokens, not {t['max_tokens']}: the server ignored ignore_eos")
    c = result["client"]
    echo(f"client CPU: {c['cpu_user_s']:.2f} s user + {c['cpu_system_s']:.2f} s system over {c['wall_s']:.1f} s")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    conc = [lv["max_concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    highest = 0.0
    for stat, label, style in (("median", "p50", "o-"), ("p90", "p90", "s--"), ("p99", "p99", "^:")):
        ms = [lv[f"{stat}_tpot_ms"] for lv in levels]
        highest = max([highest, *(v for v in ms if v is not None)])
        ax1.plot(conc, ms, style, label=f"TPOT {label}")
    floor = (result.get("floor") or {}).get("tpot_floor_s")
    if floor:
        ax1.axhline(floor * 1000, color="grey", linewidth=1, label="floor (weights / bandwidth)")
        highest = max(highest, floor * 1000)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(conc, [str(c) for c in conc])
    ax1.set_xlabel("concurrent streams")
    ax1.set_ylabel("ms per output token")
    ax1.set_title("TPOT (first token left out)")
    ax1.set_ylim(0, highest * 1.25 if highest > 0 else None)
    ax1.legend()
    ax2.plot(conc, [lv["output_throughput"] for lv in levels], "o-", color="tab:green")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(conc, [str(c) for c in conc])
    ax2.set_xlabel("concurrent streams")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("Output throughput")
    ax2.set_ylim(bottom=0)
    t = result["target"]
    fig.suptitle(f"{t['model']}: {t['max_tokens']} output tokens per request, median of {result['plan']['rounds']} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@ctl.command("bench")
@click.option("--url", help="engine base URL (default: the config's engine, else http://127.0.0.1:8000)")
@click.option("--model", help="served model name (default: the config's, else the first the engine lists)")
@config_option
@instance_option
@click.option("--concurrency", "levels", default="1,4,8,16,32", show_default=True, callback=_levels, help="comma-separated levels")
@click.option("--requests", "requests_per_round", type=click.IntRange(min=1), help="requests per round (default 4 x concurrency, at least 8)")
@click.option(
    "--prompt-tokens", type=click.IntRange(min=1), default=128, show_default=True,
    help="prompt length in tokens, made exact through the server's /tokenize (in words where it has none); usage's count is reported",
)  # fmt: skip
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True, help="output tokens per request")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="requests before measuring")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True, help="rounds per level; the median is reported")
@click.option("--api-key-env", default="OPENAI_API_KEY", show_default=True, metavar="NAME", help="environment variable holding the API key")
@click.option("--chat", is_flag=True, help="use /v1/chat/completions instead of /v1/completions")
@click.option("--no-ignore-eos", "no_ignore_eos", is_flag=True, help="do not send vLLM's ignore_eos (for servers that reject it)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True, help="seconds per request")
@click.option("--model-dir", help="model directory (or config.json) for the TPOT floor and MBU")
@click.option("--bandwidth-gbs", type=click.FloatRange(min=0.1), help="memory bandwidth (decimal GB/s) for MBU (default: NVML card profile)")
@click.option(
    "--json", "json_path", is_flag=False, flag_value="-", default=None, metavar="",
    help="print the results as JSON on stdout instead of the table (--json FILE: as --output FILE)",
)
@click.option("--output", "output_path", metavar="FILE", help="also write the results as JSON to FILE")
@click.option("--plot", "plot_path", metavar="FILE.png", help="draw TPOT and throughput against concurrency (needs matplotlib)")
@click.option("--progress/--no-progress", default=None, help="progress bar on stderr (default: when stderr is a terminal)")
def bench_command(
    url, model, config_path, instance, levels, requests_per_round, prompt_tokens, max_tokens, warmup, rounds,
    api_key_env, chat, no_ignore_eos, timeout_s, model_dir, bandwidth_gbs, json_path, output_path, plot_path, progress,
) -> int:  # fmt: skip
    """Stream requests at each concurrency level; report TTFT, TPOT, ITL percentiles, throughput and MBU.

    The JSON has `vllm bench serve`'s keys per level: completed, failed, duration,
    total_input_tokens, total_output_tokens, request_throughput, output_throughput,
    total_token_throughput, max_concurrency, and mean_/median_/std_/p90_/p99_ of
    ttft, tpot, itl and e2el in ms (median is the p50); r3090d's own figures keep
    their own names.
    """
    _check_plot_backend(plot_path)
    cfg = None
    if config_path or os.environ.get("R3090D_CONFIG"):
        from r3090d.cli.common import load_config
        from r3090d.config import ConfigError

        try:
            cfg = load_config(config_path, instance, check_files=True)
        except ConfigError as exc:
            if not url:
                raise
            # With --url the config only lends defaults (API key, model name):
            # one that is not finished yet must not stop a measurement.
            click.echo(f"r3090ctl bench: not using the config: {exc.one_line()}", err=True)
    if not url and cfg is not None and cfg.engine.uds:
        raise UsageExit(f"the engine serves on its unix socket {cfg.engine.uds} (engine.listen = \"uds\"), which bench does not "
                        "speak: give --url of an endpoint on TCP (in swap mode, the router's)")  # fmt: skip
    base = (url or (cfg.engine_url if cfg else "http://127.0.0.1:8000")).rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    if not base.startswith(("http://", "https://")):
        raise UsageExit(f"--url {base!r} is not an http(s) URL")
    api_key = os.environ.get(api_key_env, "") or (cfg.api_key if cfg else "")
    target = loadgen.Target(
        url=base,
        model=model or (cfg.model_name if cfg else ""),
        api_key=api_key,
        chat=chat,
        max_tokens=max_tokens,
        ignore_eos=not no_ignore_eos,
        timeout_s=timeout_s,
    )
    if not model_dir and cfg and os.path.isdir(os.path.expanduser(cfg.engine.model)):
        model_dir = cfg.engine.model  # the served model's own files give the floor
    floor = tpot_floor(model_dir or None, bandwidth_gbs, cfg.gpu.card if cfg else None, cfg.gpu.index if cfg else 0)
    bench_plan = loadgen.BenchPlan(levels=levels, requests=requests_per_round, rounds=rounds, warmup=warmup, prompt_tokens=prompt_tokens)

    show = progress if progress is not None else sys.stderr.isatty()
    to_stdout = json_path == "-"
    # A few dozen prompts tokenize in well under a second: no bar for those.
    tokenizing = Progress(bench_plan.total_requests(), enabled=show and bench_plan.total_requests() >= 32, stage="tokenizing prompts")
    try:
        target = asyncio.run(loadgen.check_target(target))
        try:
            prompt_set = asyncio.run(tokenize_client.prepare_prompts(target, bench_plan, on_prompt=tokenizing.step_done))
        finally:
            tokenizing.close()
    except loadgen.BenchError as exc:
        raise BenchExit(str(exc), exc.exit_code) from None
    if prompt_set.stats.unit is PromptUnit.WORDS and to_stdout:
        click.echo(f"r3090ctl bench: {prompt_note(prompt_set.stats.to_dict())}", err=True)  # the table says it otherwise
    progress = Progress(bench_plan.total_requests(), enabled=show)
    reader = server_itl_reader(target.url, target.model)
    usage_before = _rusage()
    started = time.perf_counter()
    try:
        level_results = asyncio.run(
            loadgen.run_bench(
                target,
                bench_plan,
                prompt_set,
                server_itl=reader,
                on_done=progress.request_done,
                on_level=progress.level,
                tpot_floor_s=floor["tpot_floor_s"] if floor else None,
            )
        )
    finally:
        progress.close()
    wall = time.perf_counter() - started
    usage_after = _rusage()
    result = {
        "target": {k: v for k, v in asdict(target).items() if k != "api_key"},
        "plan": asdict(bench_plan),
        "floor": floor,
        "prompts": prompt_set.stats.to_dict(),
        "levels": [bench_result.level_result(lv) for lv in level_results],
        "client": {
            "wall_s": wall,
            "cpu_user_s": usage_after[0] - usage_before[0],
            "cpu_system_s": usage_after[1] - usage_before[1],
        },
        "started_at": time.time() - wall,
    }
    files = [p for p in (output_path, None if to_stdout else json_path) if p]
    text = json.dumps(result, indent=2, sort_keys=True)
    if to_stdout:
        click.echo(text)
    else:
        render(result)
    for path in files:
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        except OSError as exc:
            raise BenchExit(f"cannot write {path}: {exc.strerror or exc}", exitcodes.USAGE) from None
    if plot_path:
        try:
            plot(result, plot_path)
        except OSError as exc:
            raise BenchExit(f"cannot write {plot_path}: {exc.strerror or exc}", exitcodes.USAGE) from None
        click.echo(f"plot: {plot_path}", err=to_stdout)  # stdout holds only the JSON
    failed = sum(lv.failed for lv in level_results)
    return exitcodes.WARNING if failed else exitcodes.OK


def _rusage() -> tuple[float, float]:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime
