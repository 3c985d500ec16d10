"""`controlplane autoscale backtest`: autoscaling policies side by side on a simulated fleet."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autoscaler.backtest import (
    DEFAULT_TRACES,
    POLICY_NAMES,
    BacktestConfig,
    BacktestResult,
    backtest,
)
from autoscaler.backtest_traces import BACKTEST_GPU, BACKTEST_MODEL, BACKTEST_TP, BACKTEST_TRACES
from autoscaler.hosts.sim import AutoscaleConfig
from controlplane.cli.autoscale import autoscale_app
from controlplane.errors import ConfigError

out = Console(width=None if sys.stdout.isatty() else 200)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h)?\s*$")
_UNIT = {None: 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds from "240", "240s", "4m", "1.5h" or "500ms"."""
    m = _DURATION.match(text.lower())
    if m is None:
        raise ConfigError(f"not a duration: {text!r} (use e.g. 240, 240s, 4m)")
    return float(m.group(1)) * _UNIT[m.group(2)]


def print_backtest(result: BacktestResult, console: Console = out) -> None:
    slo = result.config.autoscale.ttft_slo_s
    for name, tb in result.traces.items():
        table = Table(title=f"{name}: {tb.requests} requests over {tb.span_s / 3600:.1f} h")
        cols = (
            "policy",
            f"TTFT <= {slo:g}s",
            "TPOT att.",
            "GPU-hours",
            "vs static",
            "scale events",
            "dir. changes",
            "peak replicas",
            "TTFT p99 s",
        )
        for i, col in enumerate(cols):
            table.add_column(col, justify="left" if i == 0 else "right")
        static = tb.runs.get("static_peak")
        base = static.gpu_hours() if static is not None else 0.0
        for policy, run in tb.runs.items():
            j = run.to_json()
            table.add_row(
                policy,
                f"{run.slo_attainment():.2%}",
                f"{run.tpot_attainment():.2%}",
                f"{run.gpu_hours():.1f}",
                f"{run.gpu_hours() / base:.0%}" if base else "-",
                str(j["scale_events"]),
                str(j["direction_changes"]),
                str(j["peak_ordered"]),
                f"{j['ttft_p99_s']:.2f}",
            )
        console.print(table)
        setup = ", ".join(f"{k}={v:.3g}" for k, v in tb.setup.items())
        console.print(f"load time {tb.load_time_s:.0f} s; {setup}")
    console.print(f"backtest wall time {result.wall_s:.0f} s")


def _trace_params(
    traces: list[str],
    *,
    seed: int,
    day_s: float,
    rate_scale: float,
    trough: float,
    flat: bool,
    as_is: bool,
) -> dict[str, dict[str, object]]:
    """Per trace: the built-in builders take the seed; any other spec becomes a day."""
    params: dict[str, dict[str, object]] = {}
    for name in traces:
        if name in BACKTEST_TRACES:
            params[name] = {"seed": seed}
        elif not as_is:
            params[name] = {
                "seed": seed,
                "day_s": day_s,
                "rate_scale": rate_scale,
                "trough": trough,
                "diurnal_swing": not flat,
            }
    return params


@autoscale_app.command("backtest")
def backtest_cmd(
    trace: Annotated[
        str, typer.Option(help=f"Comma-separated traces ({', '.join(DEFAULT_TRACES)}, or a spec).")
    ] = ",".join(DEFAULT_TRACES),
    load_time: Annotated[str, typer.Option(help="Replica load time: 240, 240s, 4m.")] = "240s",
    policies: Annotated[str, typer.Option(help="Comma-separated policies.")] = ",".join(
        POLICY_NAMES
    ),
    tick: Annotated[str, typer.Option(help="Seconds between decisions.")] = "5s",
    min_replicas: Annotated[int, typer.Option(min=1)] = 1,
    max_replicas: Annotated[int, typer.Option(min=1)] = 48,
    slo_ttft: Annotated[float, typer.Option(help="TTFT SLO (s).")] = 2.0,
    slo_tpot: Annotated[float, typer.Option(help="TPOT SLO (s).")] = 0.1,
    gpu: Annotated[str, typer.Option()] = BACKTEST_GPU,
    model: Annotated[str, typer.Option()] = BACKTEST_MODEL,
    tp: Annotated[int, typer.Option(min=1)] = BACKTEST_TP,
    seed: Annotated[int, typer.Option(help="Seed of the traces' draws (thinning, arrivals).")] = 0,
    day: Annotated[
        str, typer.Option(help="A trace file is repeated and swung over a day this long.")
    ] = "2h",
    rate_scale: Annotated[
        float, typer.Option(min=1e-9, help="A trace file's arrivals this many times faster.")
    ] = 1.0,
    trough: Annotated[
        float, typer.Option(min=1e-9, max=1.0, help="Night-time share of a file's peak rate.")
    ] = 0.25,
    flat: Annotated[
        bool, typer.Option(help="Keep a file's own shape (no day swing; repeat and scale only).")
    ] = False,
    as_is: Annotated[
        bool, typer.Option(help="Replay a trace file exactly as it is (no day, no scaling).")
    ] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the timeline PNG here.")] = None,
) -> None:
    """Replay each trace once per autoscaling policy on a simulated fleet and compare them.

    A trace is a built-in name or anything the replay reads (a JSONL or CSV file with arrival
    times and lengths, optionally tenants; `gen:` specs). A file is turned into a day as the
    built-in traces are: arrivals --rate-scale x faster, repeated to cover --day, thinned by the
    day's swing (seeded by --seed) unless --flat; --as-is replays it untouched."""
    names = [p.strip() for p in policies.split(",") if p.strip()]
    traces = [t.strip() for t in trace.split(",") if t.strip()]
    if not names or not traces:
        raise ConfigError("--policies and --trace must not be empty")
    trace_params = _trace_params(
        traces,
        seed=seed,
        day_s=parse_duration(day),
        rate_scale=rate_scale,
        trough=trough,
        flat=flat,
        as_is=as_is,
    )
    auto = AutoscaleConfig(
        load_time_s=parse_duration(load_time),
        tick_s=parse_duration(tick),
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        ttft_slo_s=slo_ttft,
        tpot_slo_s=slo_tpot,
    )
    config = BacktestConfig(gpu=gpu, model=model, tp=tp, autoscale=auto)
    with Progress(
        TextColumn("{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=True,
    ) as bar:
        current: list[object] = []

        def start(name: str, total: int) -> None:
            current[:] = [bar.add_task(name, total=total)]

        def advance(done: int) -> None:
            bar.update(current[0], completed=done)  # type: ignore[arg-type]

        result = backtest(
            traces,
            names,
            config,
            trace_params=trace_params,
            on_policy_start=start,
            progress=advance,
        )
    if json_path is not None:  # first: a long run's figures must not hang on the printing
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.to_json(), indent=2))
        out.print(f"wrote {json_path}")
    print_backtest(result)
    if plot is not None:
        from autoscaler.backtest_plot import plot_backtest

        plot_backtest(result, plot)
        out.print(f"wrote {plot}")
