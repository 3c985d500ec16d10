"""The replay plot: latency CDFs per policy and per-replica load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from controlplane.sim.replay import ReplayReport
from controlplane.sim.results import RequestRecord


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.plot(xs, ys, label=label, linewidth=1.4)


def plot_replay(report: ReplayReport, path: Path) -> Path:
    """Four panels: TTFT, TPOT and E2E CDFs (log time axis), and busy time per replica."""
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    panels: tuple[tuple[Any, str, Callable[[RequestRecord], float], float | None], ...] = (
        (axes[0][0], "TTFT (s)", lambda r: r.ttft_s, report.slo_ttft_s),
        (axes[0][1], "TPOT (s)", lambda r: r.tpot_s, report.slo_tpot_s),
        (axes[1][0], "end-to-end latency (s)", lambda r: r.e2e_s, None),
    )
    for ax, title, metric, slo in panels:
        for name, res in report.results.items():
            done = [r for r in res.completed() if title[:4] != "TPOT" or r.output_tokens > 1]
            _cdf(ax, [max(1e-4, metric(r)) for r in done], name)
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        if slo is not None:
            ax.axvline(slo, color="black", linestyle="--", linewidth=0.8, label="SLO")
        ax.legend(fontsize=7, loc="lower right")
    ax = axes[1][1]
    names = list(report.results)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        stats = report.results[name].replicas
        ax.bar(
            np.arange(len(stats)) + i * width,
            [s.busy_s for s in stats],
            width=width,
            label=name,
        )
    ax.set_xlabel("replica")
    ax.set_ylabel("busy time (s)")
    ax.set_title("per-replica load")
    ax.legend(fontsize=7, loc="lower center", ncol=4, framealpha=0.9)
    cfg = report.config
    fig.suptitle(
        f"{report.trace_name}: {cfg.replicas} x {cfg.profile.label}, "
        f"{cfg.routers} router(s); pooled-cache hit ceiling "
        f"{report.pooled_prefix_hit_rate:.1%}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
