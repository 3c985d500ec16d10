"""Probe the headroom policy on one backtest draw, with config overrides and its figures.

A quick loop for changing `autoscaler/headroom.py`: replays headroom alone (no static search,
no baselines) on one trace and seed, with `HeadroomConfig` fields overridden (`--set z=3
--set burst_quantile=0.99`), and prints one JSON line (attainment, late, GPU-hours, peak) and the
minutes with late requests beside the decision's figures then (ready, loading, level, burst
factor, the rate and burst needs). `--dump FILE` writes every decision's figures as JSON.

    PYTHONPATH=. python bench/headroom_probe.py --trace azure-code-diurnal --seed 2
    PYTHONPATH=. python bench/headroom_probe.py --trace azure-code \\
        --trace-params '{"day_s": 7200, "rate_scale": 0.35}' --set burst_floor=0

Judge a change on several draws (`--seed`) of each trace, never on one; the bench that counts
is `autoscale_bench.py` (every policy, every seed).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from autoscaler import backtest as bt
from autoscaler.backtest_traces import BACKTEST_TRACES, backtest_trace
from autoscaler.capacity import SloCapacity
from autoscaler.headroom import HeadroomPolicy
from autoscaler.hosts.sim import AutoscaleConfig
from autoscaler.types import ScaleContext, ScaleDecision, ScalingPolicy
from controlplane.traces.model import Trace

FIGURES = ("ready", "loading", "level", "burst_factor", "need_rate", "need_burst", "sigma_h")


class Recorder(HeadroomPolicy):
    """The headroom policy, keeping every decision's time, target, reason and figures."""

    def __init__(self, base: HeadroomPolicy) -> None:
        super().__init__(base.config)
        self.records: list[tuple[float, int, str, dict[str, float]]] = []

    def decide(self, ctx: ScaleContext, state: Any, now: float) -> tuple[ScaleDecision, Any]:
        decision, new = super().decide(ctx, state, now)
        if now >= 0:  # not the warm-up on the days before
            self.records.append((now, decision.target, str(decision.reason), decision.figures()))
        return decision, new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default="azure-code-diurnal", help="backtest trace or spec")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-params", default="{}", help="JSON keywords of the trace's builder")
    ap.add_argument("--set", action="append", default=[], help="HeadroomConfig field=value")
    ap.add_argument("--dump", type=Path, help="write every decision's figures here (JSON)")
    args = ap.parse_args()
    overrides = {k: float(v) for k, v in (item.split("=", 1) for item in args.set)}
    params: dict[str, object] = json.loads(args.trace_params)
    if args.trace in BACKTEST_TRACES or params:
        params.setdefault("seed", args.seed)
    trace = backtest_trace(args.trace, **params)
    recorders: list[Recorder] = []
    build = bt.build_policy

    def with_overrides(
        name: str, trace: Trace, cap: SloCapacity, moments: dict[str, float]
    ) -> tuple[ScalingPolicy[Any], int | None]:
        policy, fixed = build(name, trace, cap, moments)
        assert isinstance(policy, HeadroomPolicy)
        rec = Recorder(HeadroomPolicy(replace(policy.config, **overrides)))  # type: ignore[arg-type]
        recorders.append(rec)
        return rec, fixed

    bt.build_policy = with_overrides  # backtest_one looks it up at call time
    cfg = bt.BacktestConfig(autoscale=AutoscaleConfig(max_replicas=64), static_search=False)
    t0 = time.perf_counter()
    run = bt.backtest_one(trace, ["headroom"], cfg).runs["headroom"]
    summary = {
        "trace": args.trace,
        "seed": args.seed,
        "set": overrides,
        "requests": len(trace),
        "attainment_pct": round(100 * run.slo_attainment(), 3),
        "late": run.late(),
        "gpu_hours": round(run.gpu_hours(), 2),
        "peak_ordered": run.peak_ordered(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    records = recorders[0].records
    slo = run.config.ttft_slo_s
    late: collections.Counter[int] = collections.Counter()
    total: collections.Counter[int] = collections.Counter()
    for r in run.result.records:
        minute = int(r.arrival_s // 60)
        total[minute] += 1
        late[minute] += not (r.completed and r.ttft_s <= slo)
    by_minute = {int(t // 60): fig for t, _, _, fig in records}
    print("minute late/arrived " + " ".join(FIGURES))
    for minute in sorted(m for m in late if late[m] >= 5):
        fig = by_minute.get(minute, {})
        cells = " ".join(f"{fig.get(k, 0.0):.2f}" for k in FIGURES)
        print(f"{minute} {late[minute]}/{total[minute]} {cells}")
    if args.dump:
        args.dump.write_text(json.dumps(records))


if __name__ == "__main__":
    main()
