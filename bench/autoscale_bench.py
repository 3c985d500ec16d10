"""Autoscaling backtest: headroom against static peak, Ray Serve's default, Knative KPA and the
HPA on GPU utilization, on both backtest traces with a 240 s replica load time.

The same library call as `controlplane autoscale backtest` (autoscaler.backtest): each trace is
a 2-h compressed day (autoscaler.backtest_traces) on Llama-3.1-70B TP2 / H200 replicas; each
policy replays it on a fresh fleet. Prints one table per trace and the goal check per seed
(headroom >= 99% TTFT attainment, dominated by no baseline: none has both fewer late requests
and fewer GPU-hours) and over the seeds (headroom's mean GPU-hours as a share of static peak's:
at most 85% on the Azure trace; the synthetic trace's goal, at most 1.08x the rate-only
planner, needs `autoscale_oracle.py`), and writes out/bench/autoscale.json (the backtest's
JSON) and out/bench/autoscale.png.

By default it replays the 2-h days of `controlplane autoscale backtest` (the headline figures
quoted in docs/autoscaling.md), one trace per process (about 15-20 min on two cores);
`--quick` compresses each day to 1 h; `--trace` and `--policies` replay one trace or some
policies only. `--seeds 0,1,2` (the default) replays each draw of the traces: the top level of
the JSON is the first seed's backtest (its shape unchanged) and `"seeds": {SEED: {TRACE:
{"policies": {...}}}}` holds every seed's figures (`autoscale_oracle.py` adds each seed's
`rate_only_gpu_hours` there, `autoscale_hpa.py` the load-step figures under `"step"`).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from typing import cast

from common import console, out_dir, write_json

from autoscaler.backtest import (
    DEFAULT_TRACES,
    POLICY_NAMES,
    BacktestConfig,
    BacktestResult,
    backtest,
)
from autoscaler.backtest_plot import plot_backtest
from autoscaler.hosts.sim import AutoscaleConfig
from controlplane.cli.autoscale_backtest import print_backtest


def goal(result: BacktestResult) -> dict[str, dict[str, object]]:
    """Per trace, one draw: headroom's attainment, its GPU-hours as a share of static peak's,
    and the baselines that dominate it (fewer late requests, exact counts, and fewer
    GPU-hours)."""
    checks: dict[str, dict[str, object]] = {}
    for name, tb in result.traces.items():
        head, static = tb.runs.get("headroom"), tb.runs.get("static_peak")
        if head is None or static is None:
            continue
        att, hours, late = head.slo_attainment(), head.gpu_hours(), head.late()
        others = {o: (r.late(), r.gpu_hours()) for o, r in tb.runs.items() if o != "headroom"}
        dominated_by = [o for o, (lt, gh) in others.items() if lt < late and gh < hours]
        checks[name] = {
            "attainment": att,
            "gpu_hours": hours,
            "static_gpu_hours": static.gpu_hours(),
            "gpu_hours_vs_static": hours / static.gpu_hours(),
            "meets_slo": att >= 0.99,
            "dominated_by": dominated_by,
        }
    return checks


def mean_vs_static(per_seed: dict[int, dict[str, dict[str, object]]]) -> dict[str, float]:
    """Per trace: headroom's mean GPU-hours over the seeds over static peak's mean."""
    traces = {t for checks in per_seed.values() for t in checks}
    out = {}
    for t in sorted(traces):
        rows = [c[t] for c in per_seed.values() if t in c]
        head = sum(cast(float, r["gpu_hours"]) for r in rows)
        static = sum(cast(float, r["static_gpu_hours"]) for r in rows)
        out[t] = head / static
    return out


def _one(
    trace: str, config: BacktestConfig, quick: bool, seed: int, policies: tuple[str, ...]
) -> BacktestResult:
    """One trace's backtest (in its own process)."""

    def start(name: str, total: int) -> None:
        console.print(f"  {trace}: {name} ({total} requests)")

    params: dict[str, object] = {"seed": seed, **({"day_s": 3600.0} if quick else {})}
    return backtest([trace], policies, config, trace_params={trace: params}, on_policy_start=start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1-h days (default: 2 h)")
    parser.add_argument(
        "--seeds", default="0,1,2", help="the traces' seeds, comma-separated (default 0,1,2)"
    )
    parser.add_argument(
        "--trace", action="append", help="backtest trace (repeatable; default both)"
    )
    parser.add_argument(
        "--policies", default=",".join(POLICY_NAMES), help="comma-separated (default: all)"
    )
    args = parser.parse_args()
    traces = args.trace or list(DEFAULT_TRACES)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    config = BacktestConfig(autoscale=AutoscaleConfig(load_time_s=240.0, max_replicas=64))
    results = {seed: BacktestResult(config) for seed in seeds}
    with ProcessPoolExecutor(max_workers=2) as pool:
        futures = [
            (seed, pool.submit(_one, t, config, args.quick, seed, policies))
            for seed in seeds
            for t in traces
        ]
        for seed, fut in futures:
            part = fut.result()
            results[seed].traces.update(part.traces)
            results[seed].wall_s = max(results[seed].wall_s, part.wall_s)
    per_seed_checks = {seed: goal(res) for seed, res in results.items()}
    for seed, res in results.items():
        console.rule(f"seed {seed}")
        print_backtest(res, console)
        for name, c in per_seed_checks[seed].items():
            console.print(
                f"seed {seed} {name}: headroom {c['attainment']:.2%} (>= 99%: {c['meets_slo']}), "
                f"{c['gpu_hours_vs_static']:.0%} of static peak's GPU-hours, "
                f"dominated by: {c['dominated_by'] or 'none'}"
            )
    result = results[seeds[0]]
    checks = per_seed_checks[seeds[0]]
    for name, share in mean_vs_static(per_seed_checks).items():
        console.print(
            f"{name}: headroom's mean GPU-hours over seeds {args.seeds} = {share:.1%} of static "
            "peak's (Azure goal <= 85%; the synthetic goal is against the rate-only planner: "
            "autoscale_oracle.py)"
        )
    plot_backtest(result, out_dir() / "autoscale.png")
    payload = result.to_json(timeline=False)
    per_seed = {
        str(seed): {
            name: {"policies": tb.to_json(timeline=False)["policies"]}
            for name, tb in res.traces.items()
        }
        for seed, res in results.items()
    }
    doc = {
        **payload,
        "goal": checks,
        "full": not args.quick,
        "seed": seeds[0],
        "seeds": per_seed,
    }
    write_json("autoscale.json", doc)


if __name__ == "__main__":
    main()
