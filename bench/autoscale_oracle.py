"""The hindsight bound of the autoscaling backtest: the cheapest fleet schedule that knows the
trace (autoscaler.oracle), against the policies' figures.

For each backtest trace (the same fleet, SLO and load time as `controlplane autoscale backtest`)
it replays every `--segment` seconds of the trace on fixed fleets until none of its requests is
late, then solves for the GPU-hours / late-requests frontier. It prints, per trace, the cheapest
hindsight schedule within several late budgets (none; each policy's own count when
`--backtest out/bench/autoscale.json` exists) beside the policies' GPU-hours, and the cheapest
zero-late schedule of a planner that knows each segment's demand rate (averaged over a load
time) but not its luck (`autoscaler.oracle.rate_only`), and writes
out/bench/autoscale_oracle.json and out/bench/autoscale_oracle.png (frontier and policies).

Takes about 15 min on two cores (one process per trace; segment lengths in SEGMENT_S).
`--rate-only-seeds 1,2` (the default) then solves the rate-only planner's none-late schedule
for other draws of the traces whose segments allow it (shorter than a load time) and, like the
first seed's, merges each into out/bench/autoscale.json as
`seeds.SEED.TRACE.rate_only_gpu_hours`.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from common import console, merge_json, out_dir, print_table, save_figure, write_json

from autoscaler.backtest import DEFAULT_TRACES, BacktestConfig
from autoscaler.backtest_traces import backtest_trace
from autoscaler.capacity import SloCapacity
from autoscaler.oracle import OraclePoint, OracleResult, oracle, rate_only
from controlplane.sim.fleet import FleetConfig

# one-minute segments where a segment's sweep is short; the Azure trace's bursts send each sweep
# to ~46 replicas, so its segments are five minutes (about 8 min of replays either way)
SEGMENT_S = {"synthetic-diurnal-tenants": 60.0, "azure-code-diurnal": 300.0}


def run_trace(name: str, segment_s: float, warmup_s: float, seed: int = 0) -> OracleResult:
    cfg = BacktestConfig()
    auto, prof = cfg.autoscale, cfg.profile()
    cap = SloCapacity.build(prof, auto.ttft_slo_s, auto.tpot_slo_s)
    trace = backtest_trace(name, seed=seed)

    def progress(done: int, total: int) -> None:
        if done % 10 == 0 or done == total:
            console.print(f"[dim]{name}: segment {done}/{total}[/dim]")

    return oracle(
        trace,
        FleetConfig(profile=prof),
        auto,
        cap,
        segment_s=segment_s,
        warmup_s=warmup_s,
        progress=progress,
    )


def rate_window(res: OracleResult) -> int:
    """The rate-only planner's window, in segments either side: its rate is averaged over
    about one load time."""
    return round(res.load_time_s / res.segment_s / 2)


def rated_point(res: OracleResult, tolerance: int = 0) -> OraclePoint | None:
    """The rate-only planner's cheapest schedule with at most `tolerance` late requests in any
    segment; None unless the segments are shorter than a load time (a longer segment's own
    rate holds its bursts, which are the luck)."""
    if res.segment_s >= res.load_time_s:
        return None
    return rate_only(
        res.curves, rate_window(res), res.segment_s, res.load_time_s, res.tp, tolerance=tolerance
    )


def policy_figures(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per trace, per policy: (late requests, GPU-hours) from a backtest JSON, if present."""
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    out: dict[str, dict[str, dict[str, float]]] = {}
    for trace, tb in doc.get("traces", {}).items():
        n = tb.get("requests", 0)
        out[trace] = {
            name: {
                "late": round((1.0 - p["slo_attainment"]) * n),
                "gpu_hours": p["gpu_hours"],
                "slo_attainment": p["slo_attainment"],
            }
            for name, p in tb.get("policies", {}).items()
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", action="append", help="backtest trace (repeatable)")
    ap.add_argument(
        "--segment", type=float, help="segment length, seconds (default: per trace, SEGMENT_S)"
    )
    ap.add_argument("--warmup", type=float, default=120.0, help="replayed before each segment")
    ap.add_argument("--seed", type=int, default=0, help="the traces' seed (default 0)")
    ap.add_argument(
        "--rate-only-seeds",
        default="1,2",
        help="other seeds whose rate-only none-late GPU-hours to solve (comma-separated; '' none)",
    )
    ap.add_argument("--backtest", type=Path, default=out_dir() / "autoscale.json")
    ap.add_argument(
        "--from-json", type=Path, help="re-report an earlier run's JSON instead of replaying"
    )
    args = ap.parse_args()
    traces = args.trace or list(DEFAULT_TRACES)
    if args.from_json is not None:
        old = json.loads(args.from_json.read_text())["traces"]
        results = {t: OracleResult.from_json(t, old[t]) for t in traces if t in old}
    else:
        with ProcessPoolExecutor(max_workers=min(2, len(traces))) as pool:
            futures = {
                t: pool.submit(
                    run_trace, t, args.segment or SEGMENT_S.get(t, 60.0), args.warmup, args.seed
                )
                for t in traces
            }
            results = {t: f.result() for t, f in futures.items()}
    policies = policy_figures(args.backtest)
    doc: dict[str, object] = {"traces": {}}
    rated_points: dict[str, OraclePoint] = {}
    for name, res in results.items():
        figs = policies.get(name, {})
        # (row label, late budget, the policy whose count it is)
        budgets: list[tuple[str, int, dict[str, float] | None]] = [("none late", 0, None)]
        budgets += [(f"{p}'s late", int(f["late"]), f) for p, f in figs.items()]
        rows = []
        for label, budget, pol in budgets:
            best = res.cheapest(budget)
            if best is None:
                continue
            rows.append(
                [
                    label,
                    budget,
                    best.late,
                    best.gpu_hours,
                    max(best.schedule, default=0),
                    pol["gpu_hours"] if pol else "",
                ]
            )
        # the planner that knows the rate but not the luck: none late, and at most one late
        # request in any segment
        rated_runs = {tol: point for tol in (0, 1) if (point := rated_point(res, tol)) is not None}
        if 0 in rated_runs:
            rated_points[name] = rated_runs[0]
        for tol, point in rated_runs.items():
            label = "rate known, not luck: " + ("none late" if tol == 0 else "<= 1 per segment")
            rows.append(
                [label, "", point.late, point.gpu_hours, max(point.schedule, default=0), ""]
            )
        print_table(
            f"{name}: hindsight schedule ({res.segment_s:.0f}-s segments, {res.requests:,} "
            f"requests, load time {res.load_time_s:.0f} s)",
            ["late budget", "budget", "hindsight late", "hindsight GPU-h", "peak", "policy GPU-h"],
            rows,
        )
        entry = res.to_json()
        entry["policies"] = figs
        entry["rate_only"] = [
            {
                "window_segments": rate_window(res),
                "tolerance_per_segment": tol,
                "gpu_hours": point.gpu_hours,
                "late": point.late,
                "schedule": list(point.schedule),
            }
            for tol, point in rated_runs.items()
        ]
        doc["traces"][name] = entry  # type: ignore[index]
    write_json("autoscale_oracle.json", doc)
    plot(results, policies, rated_points, out_dir() / "autoscale_oracle.png")
    rated = {args.seed: {t: p.gpu_hours for t, p in rated_points.items()}}
    more = [int(x) for x in args.rate_only_seeds.split(",") if x.strip()]
    rated.update(rate_only_seeds(traces, more, args.warmup))
    merge_json(
        "autoscale.json",
        {
            "seeds": {
                str(seed): {t: {"rate_only_gpu_hours": g} for t, g in per.items()}
                for seed, per in rated.items()
            }
        },
    )


def _rate_only_one(trace: str, seed: int, warmup_s: float) -> float | None:
    """The rate-only planner's none-late GPU-hours on one draw of a trace (None: its segments
    are not shorter than a load time, so the rate holds the bursts)."""
    segment = SEGMENT_S.get(trace, 60.0)
    point = rated_point(run_trace(trace, segment, warmup_s, seed))
    return None if point is None else point.gpu_hours


def rate_only_seeds(
    traces: list[str], seeds: list[int], warmup_s: float
) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    load_s = BacktestConfig().autoscale.load_time_s
    jobs = [(t, s) for s in seeds for t in traces if SEGMENT_S.get(t, 60.0) < load_s]
    if not jobs:
        return out
    with ProcessPoolExecutor(max_workers=min(2, len(jobs))) as pool:
        futures = {(t, s): pool.submit(_rate_only_one, t, s, warmup_s) for t, s in jobs}
        for (t, s), fut in futures.items():
            g = fut.result()
            if g is not None:
                out.setdefault(s, {})[t] = g
                console.print(f"seed {s} {t}: rate-only none-late {g:.1f} GPU-hours")
    return out


def plot(
    results: dict[str, OracleResult],
    policies: dict[str, dict[str, dict[str, float]]],
    rated: dict[str, OraclePoint],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items(), strict=True):
        n = max(1, res.requests)
        pts = [(p.gpu_hours, 100.0 * (1 - p.late / n)) for p in res.points]
        ax.step([g for g, _ in pts], [a for _, a in pts], where="post", label="hindsight bound")
        xs = [g for g, a in pts if a >= 97.0]
        if name in rated:
            r = rated[name]
            ax.scatter(
                [r.gpu_hours],
                [100.0 * (1 - r.late / n)],
                marker="*",
                s=120,
                c="black",
                label="rate known, luck not (none late)",
                zorder=4,
            )
            xs.append(r.gpu_hours)
        for pol, f in policies.get(name, {}).items():
            ax.scatter([f["gpu_hours"]], [100.0 * f["slo_attainment"]], label=pol, zorder=3)
            xs.append(f["gpu_hours"])
        static = policies.get(name, {}).get("static_peak")
        if static is not None:
            ax.axvline(0.8 * static["gpu_hours"], ls="--", c="grey", label="80% of static peak")
        if xs:
            ax.set_xlim(0.9 * min(xs), 1.1 * max(xs))
        ax.set_xscale("log")
        lo, hi = ax.get_xlim()
        nice: tuple[int, ...] = (20, 30, 40, 50, 60, 70, 80, 90, 100, 120, 150, 200, 250)
        if hi > 2.5 * lo:  # a wide range: fewer labels
            nice = (10, 20, 30, 50, 100, 200, 300)
        ax.set_xticks([t for t in nice if lo <= t <= hi])
        ax.xaxis.set_major_formatter(FormatStrFormatter("%.0f"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        # three times the late share of the better of headroom and static peak, at least 0.1%
        figs = policies.get(name, {})
        best = max(
            (100.0 * figs[p]["slo_attainment"] for p in ("headroom", "static_peak") if p in figs),
            default=99.0,
        )
        low = 100.0 - 3.0 * max(100.0 - best, 1.0 / 30.0)
        ax.set_ylim(low, 100.0 + (100.0 - low) / 50.0)
        ax.set_xlabel("GPU-hours")
        ax.set_ylabel("TTFT SLO attainment, %")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
