"""Why an HPA on GPU utilization fails a vLLM fleet, in the simulator's own figures.

Scenario (the same as `tests/unit/test_autoscale_sim.py`'s HPA test): Llama-3.1-70B, TP4 on H100,
two ready replicas, a 240 s load time. 1 request/s of 4,000/300-token requests for 11 minutes
(each decodes for seconds, so a replica almost never idles), then 30 requests/s for 15
minutes (longer than the load time, so scaling can help).
Two policies on the same arrivals: `hpa_gpu_util` (Kubernetes HPA defaults on a DCGM-style duty
cycle, target 80%) and `headroom` (demand measured at the router).

Per 60-s window it prints the demand (replicas of work at the SLO), the duty cycle the HPA sees,
each policy's ordered and ready replicas and the TTFT p99 of the window's arrivals; writes
out/bench/autoscale_hpa.json and out/bench/autoscale_hpa.png, and merges per policy
`{"peak_ordered", "peak_demand_replicas", "recovery_s"}` into out/bench/autoscale.json as
`"step"`: the peak of the windows' demand (replicas of work), and the time from the step to the
end of the first window from which every window of the high phase has a TTFT p99 within the SLO
(None: never).
"""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from common import console, merge_json, out_dir, print_table, save_figure, write_json

from autoscaler.baselines import HpaGpuUtilPolicy
from autoscaler.capacity import SloCapacity
from autoscaler.headroom import HeadroomConfig, HeadroomPolicy
from autoscaler.hosts.sim import AutoscaleConfig, AutoscaleRun, run_autoscaled
from controlplane.roofline.profile import profile
from controlplane.sim.fleet import FleetConfig
from controlplane.traces.model import Trace, TraceRequest

STEP_S, HIGH_S, WINDOW_S = 660.0, 900.0, 60.0
PROFILE = profile("h100", "llama-3.1-70b", tp=4)


def _requests(rate: float, span: float, t0: float) -> list[TraceRequest]:
    return [
        TraceRequest(arrival_s=t0 + i / rate, prompt_tokens=4000, output_tokens=300)
        for i in range(int(rate * span))
    ]


def step_trace() -> Trace:
    reqs = _requests(1.0, STEP_S, 0.0) + _requests(30.0, HIGH_S, STEP_S)
    return Trace("load-step", tuple(reqs)).sorted()


def _run(policy: Any, trace: Trace, cap: SloCapacity) -> AutoscaleRun:
    auto = AutoscaleConfig(load_time_s=240.0, tick_s=5.0, max_replicas=64)
    return run_autoscaled(
        trace, FleetConfig(profile=PROFILE), policy, auto, initial_replicas=2, capacity=cap
    )


def _window(run: AutoscaleRun, end_s: float) -> dict[str, float]:
    pts = [p for p in run.timeline if end_s - WINDOW_S <= p.t_s < end_s]
    ttfts = [
        r.ttft_s if r.completed else np.inf
        for r in run.result.records
        if end_s - WINDOW_S <= r.arrival_s < end_s
    ]
    return {
        "rate": float(np.mean([p.demand_rate for p in pts])) if pts else 0.0,
        "util": float(np.mean([p.gpu_util for p in pts])) if pts else 0.0,
        "ordered": float(max((p.ordered for p in pts), default=0)),
        "ready": float(max((p.ready for p in pts), default=0)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else 0.0,
    }


def recovery_s(ends: Any, windows: list[dict[str, float]], slo_s: float = 2.0) -> float | None:
    """Seconds from the step to the end of the first window after which every window that ends
    within the high phase keeps its TTFT p99 within the SLO."""
    high = [
        (float(e), w) for e, w in zip(ends, windows, strict=True) if STEP_S < e <= STEP_S + HIGH_S
    ]
    for i, (end, _) in enumerate(high):
        if all(w["ttft_p99_s"] <= slo_s for _, w in high[i:]):
            return end - STEP_S
    return None


def main() -> None:
    cap = SloCapacity.build(PROFILE, 2.0, 0.1)
    trace = step_trace()
    console.print(f"load step: {len(trace)} requests on {PROFILE.label}")
    runs = {
        "hpa_gpu_util": _run(HpaGpuUtilPolicy(), trace, cap),
        "headroom": _run(HeadroomPolicy(HeadroomConfig(capacity=cap)), trace, cap),
    }
    ends = np.arange(STEP_S - 120.0, STEP_S + HIGH_S + 300.0, WINDOW_S) + WINDOW_S
    rows, series = [], {name: [_window(r, float(e)) for e in ends] for name, r in runs.items()}
    for i, end in enumerate(ends):
        h, d = series["hpa_gpu_util"][i], series["headroom"][i]
        rows.append(
            (
                f"{end - WINDOW_S - STEP_S:+.0f}",
                f"{h['rate']:.1f}",
                f"{h['util']:.0%}",
                f"{h['ordered']:.0f}/{h['ready']:.0f}",
                f"{h['ttft_p99_s']:.1f}",
                f"{d['ordered']:.0f}/{d['ready']:.0f}",
                f"{d['ttft_p99_s']:.1f}",
            )
        )
    print_table(
        "60-s windows around the load step (t = 0 at the step)",
        [
            "t (s)",
            "demand",
            "GPU util (HPA)",
            "HPA ordered/ready",
            "HPA TTFT p99 (s)",
            "headroom ordered/ready",
            "headroom TTFT p99 (s)",
        ],
        rows,
    )
    peak_demand = max(w["rate"] for w in series["headroom"])
    summary: dict[str, dict[str, Any]] = {
        name: {
            "slo_attainment": r.slo_attainment(),
            "gpu_hours": r.gpu_hours(),
            "peak_ordered": r.peak_ordered(),
            "peak_demand_replicas": peak_demand,
            "recovery_s": recovery_s(ends, series[name]),
        }
        for name, r in runs.items()
    }
    for name, s in summary.items():
        rec = s["recovery_s"]
        console.print(
            f"{name}: TTFT <= 2 s for {s['slo_attainment']:.1%} of requests, "
            f"peak ordered {s['peak_ordered']} ({s['peak_ordered'] / peak_demand:.1f}x the "
            f"peak demand of {peak_demand:.1f}), {s['gpu_hours']:.1f} GPU-hours, TTFT p99 "
            f"back within the SLO {'never' if rec is None else f'{rec:.0f} s after the step'}"
        )
    write_json(
        "autoscale_hpa.json",
        {"windows_end_s": [float(e) for e in ends], "series": series, "summary": summary},
    )
    merge_json(
        "autoscale.json",
        {
            "step": {
                name: {k: s[k] for k in ("peak_ordered", "peak_demand_replicas", "recovery_s")}
                for name, s in summary.items()
            }
        },
    )
    _plot(ends, series)


def _plot(ends: Any, series: dict[str, list[dict[str, float]]]) -> None:
    t = (ends - WINDOW_S / 2 - STEP_S) / 60.0
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)

    def pick(name: str, key: str) -> list[float]:
        return [w[key] for w in series[name]]

    axes[0].plot(t, pick("hpa_gpu_util", "rate"), color="k", label="demand (replicas of work)")
    ax2 = axes[0].twinx()
    ax2.plot(t, [u * 100 for u in pick("hpa_gpu_util", "util")], color="tab:purple", ls="--")
    ax2.set_ylabel("GPU utilization seen by the HPA (%)", color="tab:purple")
    ax2.set_ylim(0, 105)
    axes[0].legend(loc="upper left")
    for name, color in (("hpa_gpu_util", "tab:purple"), ("headroom", "tab:blue")):
        axes[1].step(t, pick(name, "ordered"), where="mid", color=color, label=f"{name} ordered")
        axes[1].step(t, pick(name, "ready"), where="mid", color=color, ls=":")
        axes[2].plot(t, pick(name, "ttft_p99_s"), color=color, label=name)
    axes[1].set_ylabel("replicas (dotted: ready)")
    axes[1].legend(loc="upper left")
    axes[2].axhline(2.0, color="k", ls="--", lw=0.8, label="TTFT SLO")
    axes[2].set_yscale("log")
    axes[2].set_ylabel("TTFT p99 (s)")
    axes[2].set_xlabel("minutes from the load step")
    axes[2].legend(loc="upper left")
    fig.suptitle("HPA on GPU utilization vs headroom on a 30x load step (70B TP4, 240 s load)")
    save_figure(fig, out_dir() / "autoscale_hpa.png", dpi=120)


if __name__ == "__main__":
    main()
