"""Static provisioning for the peak: a fixed replica count chosen before the run, with hindsight.

Rule (`static_peak_replicas`): price every request of the trace with `SloCapacity` (prefill of
the whole prompt + decode of its true output, replica-seconds at the SLO), take the peak over
sliding `window_s` (60 s, stepped every `step_s` = 10 s) of the arrived work per second, and
divide by the utilization target `rho*` of the whole trace's prefill mix:

    N = ceil(max_t work[t, t + 60 s) / 60 s / rho*(E[prefill], SCV[prefill]))

It is what an operator who knew the trace would provision to ride the worst minute at the SLO's
utilization; it never changes (`ScaleReason.STATIC`). Loading: the fleet starts with N ready.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autoscaler.capacity import SloCapacity
from autoscaler.types import ScaleContext, ScaleDecision, ScaleReason


@dataclass(frozen=True, slots=True)
class StaticPeakConfig:
    replicas: int = 1
    # the figures the count came from (for the report)
    peak_rate: float = 0.0
    utilization: float = 1.0


class StaticPeakPolicy:
    """Always answers the configured replica count."""

    name = "static_peak"

    def __init__(self, config: StaticPeakConfig | None = None) -> None:
        self.config = config or StaticPeakConfig()

    def initial_state(self) -> None:
        return None

    def decide(self, ctx: ScaleContext, state: None, now: float) -> tuple[ScaleDecision, None]:
        cfg = self.config
        target = min(ctx.max_replicas, max(ctx.min_replicas, cfg.replicas))
        detail = (("peak_rate", cfg.peak_rate), ("utilization", cfg.utilization))
        return ScaleDecision(target, ScaleReason.STATIC, detail), None


def peak_rate(
    arrivals: Sequence[float], work: Sequence[float], window_s: float = 60.0, step_s: float = 10.0
) -> float:
    """Max over windows `[k * step, k * step + window)` of the work arriving in it, per second."""
    if not arrivals:
        return 0.0
    t0 = min(arrivals)
    bins = int((max(arrivals) - t0) // step_s) + 1
    per_bin = [0.0] * bins
    for t, w in zip(arrivals, work, strict=True):
        per_bin[int((t - t0) // step_s)] += w
    span = max(1, round(window_s / step_s))
    best = running = sum(per_bin[:span])
    for k in range(span, bins):
        running += per_bin[k] - per_bin[k - span]
        best = max(best, running)
    return best / window_s


def static_peak_replicas(
    prompts: Sequence[int],
    outputs: Sequence[int],
    arrivals: Sequence[float],
    capacity: SloCapacity,
    window_s: float = 60.0,
) -> StaticPeakConfig:
    """The count `StaticPeakPolicy` holds for this workload (see the module docstring)."""
    prefill = [capacity.prefill_work(p) for p in prompts]
    work = [
        pw + capacity.decode_work(max(1, o), p)
        for pw, p, o in zip(prefill, prompts, outputs, strict=True)
    ]
    n = len(prefill)
    mean = sum(prefill) / n if n else 0.0
    scv = 1.0
    if n > 1 and mean > 0:
        scv = max(0.0, sum(x * x for x in prefill) / n - mean * mean) / (mean * mean)
    rho = capacity.utilization_target(mean, scv)
    rate = peak_rate(arrivals, work, window_s)
    return StaticPeakConfig(max(1, math.ceil(rate / rho - 1e-9)), rate, rho)


__all__ = ["StaticPeakConfig", "StaticPeakPolicy", "peak_rate", "static_peak_replicas"]
