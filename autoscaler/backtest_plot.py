"""The backtest timeline plot: per trace, demand, replicas per policy and TTFT p99 over time.

One column per trace, three rows sharing the time axis (minutes):

1. arrived work per second (replicas of work at the SLO, 60-s windows);
2. replicas ordered (ready + loading, solid) and ready (dotted) per policy, from the host's ticks;
3. TTFT p99 per 60-s window of arrival time per policy (log scale), the TTFT SLO dashed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from autoscaler.backtest import BacktestResult
from autoscaler.hosts.sim import ttft_p99_windows


def plot_backtest(result: BacktestResult, path: Path, window_s: float = 60.0) -> Path:
    names = list(result.traces)
    fig, axes = plt.subplots(
        3, max(1, len(names)), figsize=(7.5 * max(1, len(names)), 10), sharex="col", squeeze=False
    )
    slo = result.config.autoscale.ttft_slo_s
    for col, name in enumerate(names):
        tb = result.traces[name]
        ax_d: Any = axes[0][col]
        ax_r: Any = axes[1][col]
        ax_t: Any = axes[2][col]
        xs, ys = tb.demand
        ax_d.plot([x / 60 for x in xs], ys, color="black", linewidth=1.0)
        ax_d.set_ylabel("arrived work (replicas)")
        ax_d.set_title(f"{name} (load time {tb.load_time_s:.0f} s)")
        for i, (policy, run) in enumerate(tb.runs.items()):
            color = f"C{i}"
            t = [p.t_s / 60 for p in run.timeline]
            ax_r.step(t, [p.ordered for p in run.timeline], where="post", color=color, label=policy)
            ax_r.step(t, [p.ready for p in run.timeline], where="post", color=color, linestyle=":")
            mids, p99 = ttft_p99_windows(run.result.records, window_s)
            capped = [min(v, 1e4) for v in p99]
            ax_t.plot([m / 60 for m in mids], capped, color=color, linewidth=1.0, label=policy)
        ax_r.set_ylabel("replicas (solid ordered, dotted ready)")
        ax_r.legend(fontsize=7, loc="upper left")
        ax_t.axhline(slo, color="black", linestyle="--", linewidth=0.8, label="TTFT SLO")
        ax_t.set_yscale("log")
        ax_t.set_ylabel(f"TTFT p99 per {window_s:.0f}-s window (s)")
        ax_t.set_xlabel("time (min)")
        ax_t.legend(fontsize=7, loc="upper left")
        for ax in (ax_d, ax_r, ax_t):
            ax.grid(True, alpha=0.3)
    cfg = result.config
    fig.suptitle(f"autoscaling backtest: {cfg.model} TP{cfg.tp} on {cfg.gpu}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["plot_backtest"]
