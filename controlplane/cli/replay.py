"""`controlplane replay`: A/B routing policies on one trace through the fleet simulator."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from controlplane.cli import app
from controlplane.cli.common import build_profile, build_trace
from controlplane.errors import ConfigError
from controlplane.routing.config import PolicyConfig
from controlplane.routing.policies import POLICIES
from controlplane.sim.fair_replay import (
    batch_share_for_trace,
    fair_replay,
    parse_modes,
    parse_weights,
)
from controlplane.sim.fleet import FleetConfig
from controlplane.sim.replay import ReplayReport, replay
from controlplane.tenancy.work import WorkMode
from controlplane.traces.model import Trace

out = Console(width=None if sys.stdout.isatty() else 200)
ALL_POLICIES = ",".join(POLICIES)


def print_report(report: ReplayReport, console: Console = out) -> None:
    table = Table(title=f"replay of {report.trace_name}", show_lines=False)
    cols = [
        ("policy", "left"),
        ("requests", "right"),
        ("TTFT p50/p90/p99 s", "right"),
        ("TPOT p50/p99 ms", "right"),
        ("E2E p50/p99 s", "right"),
        ("prefix hit", "right"),
        ("of ceiling", "right"),
        ("goodput req/s", "right"),
        ("out tok/s", "right"),
        ("imbalance", "right"),
        ("preempt", "right"),
    ]
    for name, justify in cols:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    ceiling = report.pooled_prefix_hit_rate
    for name, s in report.summaries().items():
        table.add_row(
            name,
            f"{int(s['completed'])}/{int(s['requests'])}",
            f"{s['ttft_p50_s']:.2f} / {s['ttft_p90_s']:.2f} / {s['ttft_p99_s']:.2f}",
            f"{s['tpot_p50_s'] * 1e3:.0f} / {s['tpot_p99_s'] * 1e3:.0f}",
            f"{s['e2e_p50_s']:.1f} / {s['e2e_p99_s']:.1f}",
            f"{s['prefix_hit_rate']:.1%}",
            f"{s['prefix_hit_rate'] / ceiling:.0%}" if ceiling else "-",
            f"{s['goodput_rps']:.2f}",
            f"{s['output_tokens_per_s']:.0f}",
            f"{s['load_imbalance']:.2f}",
            f"{int(s['preemptions'])}",
        )
    console.print(table)
    cfg = report.config
    console.print(
        f"pooled-cache hit-rate ceiling (one replica with the fleet's {cfg.replicas} x "
        f"{cfg.profile.num_gpu_blocks} blocks): [bold]{ceiling:.1%}[/]; "
        f"SLO TTFT <= {report.slo_ttft_s}s, TPOT <= {report.slo_tpot_s * 1e3:.0f}ms; "
        f"replay wall time {report.wall_s:.1f}s{' (compiled simulator)' if _compiled() else ''}"
    )


def _compiled() -> bool:
    from controlplane.sim import fleet
    from controlplane.sim.native import is_compiled

    return is_compiled(fleet)


def print_fairness(report: ReplayReport, console: Console = out) -> None:
    """Per run and tenant: work share (roofline units) against the weight, latency p99s."""
    table = Table(title=f"tenant fairness on {report.trace_name}")
    cols = (
        "run",
        "tenant / class",
        "weight",
        "work share (target)",
        "TTFT p50/p99 s",
        "TPOT p50/p99 ms",
        "router queue p99 s",
        "completed",
    )
    for i, name in enumerate(cols):
        table.add_column(name, justify="left" if i < 2 else "right")
    for run, f in report.fairness.items():
        first = True
        for label, d, weight in [
            *((t, d, f"{d['weight']:g}") for t, d in f.tenants.items()),
            *((f"[dim]class {c}[/]", d, "") for c, d in f.classes.items()),
        ]:
            share = f"{d['work_share']:.1%} ({d['target_share']:.0%})" if "work_share" in d else ""
            table.add_row(
                run if first else "",
                label,
                weight,
                share,
                f"{d['ttft_p50_s']:.2f} / {d['ttft_p99_s']:.2f}",
                f"{d['tpot_p50_s'] * 1e3:.0f} / {d['tpot_p99_s'] * 1e3:.0f}",
                f"{d['queue_p99_s']:.2f}",
                f"{int(d['completed'])}/{int(d['requests'])}",
            )
            first = False
        span = sum(hi - lo for lo, hi in f.windows_s)
        table.add_row(
            "",
            f"[bold]Jain {f.jain:.3f}[/]",
            "",
            f"over {span:.0f}s ({f.window_kind})",
            "",
            "",
            "",
            "",
            end_section=True,
        )
    console.print(table)
    console.print(
        "work share: GPU work in roofline units (GPU-seconds at the reference decode batch) "
        "done while every tenant was backlogged (contended) or over the arrival span"
    )


@app.command("replay")
def replay_cmd(
    trace: Annotated[
        str, typer.Option(help="Trace: path, 'mooncake', 'azure-code', or gen:<name>?k=v")
    ] = "mooncake",
    replicas: Annotated[
        int | None,
        typer.Option(min=1, help="Replicas in the fleet [default: 8, or --router-config's]."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Model key (see `controlplane roofline models`) [default: llama-3.1-8b, or "
            "--router-config's first replica's]."
        ),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(
            help="GPU key: h100, h200, a100, l40s, cpu [default: h100, or --router-config's]."
        ),
    ] = None,
    tp: Annotated[
        int | None,
        typer.Option(min=1, help="Tensor parallel degree [default: 1, or --router-config's]."),
    ] = None,
    router_config: Annotated[
        Path | None,
        typer.Option(
            help="Replay what a router configuration deploys: its policy or A/B arms (one "
            "row per arm, and the split), books, fair queue and tenants' weights and classes; "
            "its replicas set the fleet unless --replicas/--gpu/--model/--tp say otherwise."
        ),
    ] = None,
    each_arm: Annotated[
        bool,
        typer.Option(
            "--each-arm", help="With --router-config: also replay each arm alone on the trace."
        ),
    ] = False,
    policies: Annotated[str, typer.Option(help="Comma-separated routing policies.")] = ALL_POLICIES,
    rate_scale: Annotated[
        float, typer.Option(help="Divide inter-arrival times by this factor.")
    ] = 1.0,
    routers: Annotated[
        int, typer.Option(min=1, help="Router instances sharing one prefix index.")
    ] = 1,
    no_reservations: Annotated[
        bool, typer.Option("--no-reservations", help="Routers ignore their own in-flight requests.")
    ] = False,
    no_speculative: Annotated[
        bool, typer.Option("--no-speculative", help="No speculative index entries at routing time.")
    ] = False,
    eviction_notice_delay: Annotated[
        float, typer.Option(help="Extra delay (s) before BlockRemoved events reach the index.")
    ] = 0.0,
    kv_event_delay: Annotated[
        float, typer.Option(help="Delay (s) before any KV event reaches the index.")
    ] = 0.0,
    scrape_interval: Annotated[
        float, typer.Option(help="Seconds between metrics scrapes (0: always fresh).")
    ] = 0.5,
    slo_ttft: Annotated[float, typer.Option(help="TTFT SLO in seconds, for goodput.")] = 2.0,
    slo_tpot: Annotated[float, typer.Option(help="TPOT SLO in seconds, for goodput.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed for generated traces.")] = 0,
    block_size: Annotated[int, typer.Option(help="Engine block size (0: vLLM's default).")] = 0,
    window: Annotated[str, typer.Option(help="Only requests arriving in START:END seconds.")] = "",
    densest: Annotated[
        int, typer.Option(help="Only the densest run of this many requests (a burst).")
    ] = 0,
    max_requests: Annotated[int, typer.Option(help="Only the first N requests.")] = 0,
    oracle_output: Annotated[
        bool, typer.Option("--oracle-output", help="predicted_finish knows true output lengths.")
    ] = False,
    fairness: Annotated[
        str,
        typer.Option(
            help="Queue requests in the router per tenant and dispatch them by this ordering "
            "(comma-separated to compare): request, vtc, vtc-roofline. Empty: route at arrival."
        ),
    ] = "",
    tenant_weights: Annotated[
        str, typer.Option(help="Tenant weights for --fairness, e.g. A=1,B=3 (default 1 each).")
    ] = "",
    batch_kv_share: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Share of each replica's KV the batch class may hold (1: no cap).",
        ),
    ] = 1.0,
    interactive_tpot_target: Annotated[
        float,
        typer.Option(
            help="Size --batch-kv-share from this interactive TPOT target (s) with the roofline."
        ),
    ] = 0.0,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the results as JSON.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write latency CDFs and per-replica load as PNG.")
    ] = None,
    native: Annotated[
        bool,
        typer.Option(
            "--native",
            help="Run on the simulator compiled with mypyc (2-2.5x faster, same results bit for "
            "bit; built once into $XDG_CACHE_HOME/controlplane/native; needs a C compiler).",
        ),
    ] = False,
) -> None:
    """Replay a trace through a simulated fleet once per policy and compare them side by side."""
    if native:
        from controlplane.cli.common import rerun_compiled
        from controlplane.sim.native import cache_dir

        # -P: no current directory on sys.path, where a source checkout would shadow the tree
        code = "from controlplane.cli import main; main()"
        rerun_compiled(cache_dir(), ["-P", "-c", code], out)
    if router_config is not None:
        from controlplane.cli.replay_config import replay_router_config

        replay_router_config(
            router_config,
            trace=trace,
            fleet=(replicas, gpu, model, tp, block_size),
            trace_options={
                "rate_scale": rate_scale,
                "window_spec": window,
                "densest": densest,
                "max_requests": max_requests,
                "seed": seed,
            },
            slo=(slo_ttft, slo_tpot),
            each_arm=each_arm,
            json_path=json_path,
            plot=plot,
        )
        return
    replicas, gpu, model, tp = replicas or 8, gpu or "h100", model or "llama-3.1-8b", tp or 1
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise ConfigError("--policies is empty")
    modes = parse_modes(fairness)
    if modes and len(names) > 1:
        if policies != ALL_POLICIES:
            raise ConfigError("--fairness compares orderings under one routing policy")
        names = ["least_loaded"]
    prof = build_profile(gpu, model, tp, block_size)
    tr = build_trace(
        trace,
        rate_scale=rate_scale,
        window_spec=window,
        densest=densest,
        max_requests=max_requests,
        seed=seed,
    )
    config = FleetConfig(
        profile=prof,
        replicas=replicas,
        routers=routers,
        policy=PolicyConfig(reservations=not no_reservations, speculative=not no_speculative),
        eviction_notice_delay_s=eviction_notice_delay,
        kv_event_delay_s=kv_event_delay,
        scrape_interval_s=scrape_interval,
        oracle_output=oracle_output,
    )
    out.print(
        f"[bold]{tr.name}[/]: {len(tr)} requests over {tr.duration_s:.0f}s; "
        f"{replicas} x {prof.label} ({prof.num_gpu_blocks} blocks of {prof.resolved_block_size})"
    )
    with progress_runs(len(tr)) as (start, advance):
        if modes:
            share = batch_kv_share
            if interactive_tpot_target > 0:
                share, _ = batch_share_for_trace(tr, config, tpot_target_s=interactive_tpot_target)
                out.print(f"batch KV share sized for TPOT {interactive_tpot_target}s: {share:.1%}")
            report = replay_fair(tr, config, modes, names[0], tenant_weights, share, start, advance)
        else:
            report = replay(
                tr,
                config,
                names,
                slo_ttft_s=slo_ttft,
                slo_tpot_s=slo_tpot,
                on_policy_start=start,
                progress=advance,
            )
    write_report(report, json_path, plot)


def write_report(report: ReplayReport, json_path: Path | None, plot: Path | None) -> None:
    """Print the tables; write the JSON and the plot when asked."""
    print_report(report)
    if report.fairness:
        print_fairness(report)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.to_json(), indent=2))
        out.print(f"wrote {json_path}")
    if plot is not None:
        from controlplane.sim.plots import plot_replay

        plot_replay(report, plot)
        out.print(f"wrote {plot}")


@contextlib.contextmanager
def progress_runs(
    total: int,
) -> Iterator[tuple[Callable[[str], None], Callable[[int], None]]]:
    """A progress bar per run of `total` requests: `start(name)` opens the next run's bar,
    `advance(done)` moves it."""
    bar = Progress(
        TextColumn("{task.description:<20}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=True,
    )
    with bar:
        current: list[TaskID] = []

        def start(name: str) -> None:
            current[:] = [bar.add_task(name, total=total)]

        def advance(done: int) -> None:
            bar.update(current[0], completed=done)

        yield start, advance


def replay_fair(
    trace: Trace,
    config: FleetConfig,
    modes: list[WorkMode],
    policy: str,
    weights: str,
    share: float,
    start: Callable[[str], None],
    advance: Callable[[int], None],
) -> ReplayReport:
    return fair_replay(
        trace,
        config,
        modes,
        policy=policy,
        weights=parse_weights(weights),
        batch_kv_share=share,
        on_start=start,
        progress=advance,
    )
