"""The routing matrix: every policy over four workloads x three loads x seeds x fleet sizes.

Workloads, loads and the knee search are defined in `controlplane.sim.matrix` (Mooncake
synthetic, Azure 2023 code, generated conversations with long answers, generated shared-prefix
groups with Zipf popularity; light = knee / 2, knee, saturated = 1.5 x knee, the knee found per
workload and fleet size with a neutral probe policy). Each cell replays all seven policies on
8 x H100 / Llama-3.1-8B (or 32, with four superposed copies of the workload) at block 16.

    default (make bench)  8 replicas, seed 0, 120 s of arrivals per generated workload
    --full                8 and 32 replicas, seeds 0, 1, 2, 300 s of arrivals

Cells run in parallel processes (`--jobs`, default: every core). Prints the per-cell winners and
the summary (cells where each policy is best or within 2% of the best on goodput and on TTFT
p99); writes out/bench/routing_matrix.json and one heat map per metric
(out/bench/routing_matrix_<metric>.png: each cell's value relative to that cell's best policy).
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from common import NATIVE_HELP, console, out_dir, print_table, run_compiled, save_figure, write_json
from rich.progress import Progress

from controlplane.routing.policies import POLICIES
from controlplane.sim import matrix
from controlplane.sim.matrix import LOADS, WORKLOADS, Cell, find_knee, run_cell, summarize

METRICS = (  # key, title, higher is better
    ("goodput_rps", "goodput at the SLO", True),
    ("ttft_p99_s", "TTFT p99", False),
    ("ttft_p50_s", "TTFT p50", False),
    ("tpot_p99_s", "TPOT p99", False),
    ("hit_of_ceiling", "prefix hits / pooled ceiling", True),
)


def knee_job(name: str, replicas: int, span_s: float) -> tuple[str, int, float]:
    return name, replicas, find_knee(name, replicas, span_s=span_s)


def cell_job(cell: Cell, span_s: float) -> dict[str, object]:
    return run_cell(cell, list(POLICIES), span_s=span_s)


def heat_maps(cells: list[dict[str, object]], folder: Path, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(POLICIES)
    labels = [f"{c['trace']} {c['load']} s{c['seed']} x{c['replicas']}" for c in cells]
    for key, title, higher in METRICS:
        raw = np.full((len(cells), len(names)), np.nan)
        for i, c in enumerate(cells):
            pols = c["policies"]
            assert isinstance(pols, dict)
            for j, n in enumerate(names):
                v = pols[n][key]
                raw[i, j] = np.nan if v is None else v
        best = np.nanmax(raw, axis=1) if higher else np.nanmin(raw, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = raw / best[:, None] if higher else best[:, None] / raw
        fig, ax = plt.subplots(figsize=(1.3 * len(names) + 3, 0.32 * len(cells) + 1.6))
        im = ax.imshow(rel, cmap="RdYlGn", vmin=0.5, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_yticks(range(len(cells)), labels, fontsize=7)
        for i in range(len(cells)):
            for j in range(len(names)):
                if not np.isnan(raw[i, j]):
                    ax.text(j, i, f"{raw[i, j]:.3g}", ha="center", va="center", fontsize=6)
        ax.set_title(f"{title} (colour: relative to the cell's best; 1 = best)")
        fig.colorbar(im, ax=ax, fraction=0.03)
        save_figure(fig, folder / f"{stem}_{key.removesuffix('_s')}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="8 and 32 replicas, seeds 0-2")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--traces", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--knees", type=Path, help="reuse the knees of an earlier matrix JSON")
    parser.add_argument("--seeds", default="", help="seeds (default 0; --full: 0,1,2)")
    parser.add_argument("--replicas", default="", help="fleet sizes (default 8; --full: 8,32)")
    parser.add_argument("--span", type=float, help="seconds of arrivals (default 120; --full: 300)")
    parser.add_argument("--out", default="routing_matrix.json", help="JSON name under out/bench")
    parser.add_argument("--native", action="store_true", help=NATIVE_HELP)
    args = parser.parse_args()
    if args.native:
        run_compiled(__file__)
    span = args.span or (300.0 if args.full else 120.0)
    sizes: tuple[int, ...] = (8, 32) if args.full else (8,)
    if args.replicas:
        sizes = tuple(int(x) for x in args.replicas.split(","))
    seeds: tuple[int, ...] = (0, 1, 2) if args.full else (0,)
    if args.seeds:
        seeds = tuple(int(x) for x in args.seeds.split(","))
    traces = [t for t in args.traces.split(",") if t]
    knees: dict[str, float] = {}
    if args.knees:
        knees = json.loads(args.knees.read_text())["knees"]
    cells_out: list[dict[str, object]] = []
    with ProcessPoolExecutor(args.jobs) as pool, Progress(console=console) as progress:
        todo = [(t, n) for t in traces for n in sizes if f"{t} x{n}" not in knees]
        task = progress.add_task("finding knees", total=len(todo))
        for done in as_completed([pool.submit(knee_job, t, n, span) for t, n in todo]):
            name, n, knee = done.result()
            knees[f"{name} x{n}"] = knee
            progress.console.log(f"knee of {name} on {n} replicas: {knee:.2f}x its base rate")
            progress.advance(task)
        cells = [
            Cell(t, load, seed, n, knees[f"{t} x{n}"] * mult)
            for n in sizes
            for t in traces
            for load, mult in LOADS.items()
            for seed in seeds
        ]
        task = progress.add_task("replaying cells", total=len(cells))
        futures = [pool.submit(cell_job, c, span) for c in cells]
        for fut in as_completed(futures):
            cell = fut.result()
            cells_out.append(cell)
            progress.console.log(
                f"{cell['trace']} {cell['load']} seed {cell['seed']} x{cell['replicas']}: "
                f"{cell['requests']} requests, {cell['wall_s']:.0f} s"
            )
            progress.advance(task)
    order = {(c.trace, c.load, c.seed, c.replicas): i for i, c in enumerate(cells)}
    cells_out.sort(key=lambda c: order[(c["trace"], c["load"], c["seed"], c["replicas"])])  # type: ignore[index]
    summary = summarize(cells_out)
    rows = []
    for c in cells_out:
        pols = c["policies"]
        assert isinstance(pols, dict)
        best_g = max(pols, key=lambda n: pols[n]["goodput_rps"])
        best_t = min(pols, key=lambda n: pols[n]["ttft_p99_s"])
        pf = pols["predicted_finish"]
        rows.append(
            (
                f"{c['trace']} {c['load']} s{c['seed']} x{c['replicas']}",
                f"{best_g} {pols[best_g]['goodput_rps']:.2f}",
                f"{pf['goodput_rps']:.2f}",
                f"{best_t} {pols[best_t]['ttft_p99_s']:.2f}",
                f"{pf['ttft_p99_s']:.2f}",
            )
        )
    print_table(
        "best policy per cell (goodput req/s at the SLO, TTFT p99 s)",
        ["cell", "best goodput", "predicted_finish", "best TTFT p99", "predicted_finish"],
        rows,
    )
    print_table(
        f"cells where each policy is best or within 2% ({len(cells_out)} cells)",
        ["policy", "goodput", "TTFT p99"],
        [
            (n, s["best_or_within_2pct_goodput"], s["best_or_within_2pct_ttft_p99"])
            for n, s in summary.items()
        ],
    )
    heat_maps(cells_out, out_dir(), Path(args.out).stem)
    write_json(
        args.out,
        {
            "cells": cells_out,
            "summary": summary,
            "knees": knees,
            "span_s": span,
            "slo": {"ttft_s": matrix.SLO_TTFT_S, "tpot_s": matrix.SLO_TPOT_S},
        },
    )


if __name__ == "__main__":
    main()
