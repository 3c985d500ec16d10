"""Kubernetes HPA (autoscaling/v2) on GPU utilization, with the default scaling behaviour.

The metric is DCGM's `DCGM_FI_DEV_GPU_UTIL` averaged over the ready pods: the fraction of the
interval a kernel was running (a duty cycle; the simulator reports `busy / (ready * interval)`).
Target 80% (`target_utilization`): the usual choice in GPU HPA examples and the level above which
a web service's latency would suffer. It is not a capacity signal for vLLM: a replica with any
request in flight runs back-to-back steps, so its duty cycle sits near 100% at almost any load
(anchors.md 3.6), and more load shows up as queueing, not as utilization.

Every `sync_s` (15 s; ticks in between hold):

    R = ready, U = loading (not yet ready), current = the target the HPA last set (R + U)
    ratio = util / target
    |ratio - 1| <= tolerance (0.1)                -> recommendation = current
    ratio > 1 and U > 0: unready pods count 0 usage: ratio = util * R / (target * (R + U));
                         if that is <= 1 + tolerance the recommendation is current
    ratio < 1 and U > 0: unready pods count 100% of target:
                         ratio = (util * R + target * U) / (target * (R + U))
    recommendation = ceil(ratio * (R + U))      (R when nothing loads)

Behaviour (the autoscaling/v2 defaults): scale-up stabilization 0 s, policies {4 pods, 100%}
per 15 s, the larger wins: `up_limit = max(current + 4, 2 * current)`; scale-down stabilization
300 s: the applied value is the max of the recommendations of the last 300 s (the window starts
with the size found at the first decision, as the controller seeds it); scale-down policy
100% per 15 s (no limit). Then clip to [min, max].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.types import ScaleContext, ScaleDecision, ScaleReason


@dataclass(frozen=True, slots=True)
class HpaConfig:
    target_utilization: float = 0.8
    tolerance: float = 0.1
    sync_s: float = 15.0
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0


@dataclass(frozen=True, slots=True)
class HpaState:
    target: int = -1
    last_sync_s: float = -math.inf
    # (time, recommendation) over the longest stabilization window
    recommendations: tuple[tuple[float, int], ...] = ()


class HpaGpuUtilPolicy:
    """HPA with a GPU-utilization resource target."""

    name = "hpa_gpu_util"

    def __init__(self, config: HpaConfig | None = None) -> None:
        self.config = config or HpaConfig()

    def initial_state(self) -> HpaState:
        return HpaState()

    def recommend(self, util: float, ready: int, loading: int, current: int) -> tuple[int, float]:
        """The replica calculator's recommendation and the usage ratio it came from."""
        cfg = self.config
        ratio = util / cfg.target_utilization
        if ready <= 0 or abs(ratio - 1.0) <= cfg.tolerance:
            return current, ratio
        pods = ready + loading
        if loading and ratio > 1.0:
            ratio = util * ready / (cfg.target_utilization * pods)
            if ratio <= 1.0 + cfg.tolerance:
                return current, ratio
        elif loading:
            ratio = (util * ready + cfg.target_utilization * loading) / (
                cfg.target_utilization * pods
            )
            if ratio >= 1.0 - cfg.tolerance:
                return current, ratio
        return math.ceil(ratio * pods - 1e-9), ratio

    def decide(
        self, ctx: ScaleContext, state: HpaState, now: float
    ) -> tuple[ScaleDecision, HpaState]:
        cfg = self.config
        current = state.target if state.target >= 0 else ctx.fleet.current
        current = min(ctx.max_replicas, max(ctx.min_replicas, current))  # bounds apply at once
        if now - state.last_sync_s < cfg.sync_s - 1e-9:
            return ScaleDecision(current, ScaleReason.HOLD), HpaState(
                current, state.last_sync_s, state.recommendations
            )
        f = ctx.fleet
        rec, ratio = self.recommend(ctx.sample.gpu_util, f.ready, f.loading, current)
        keep = max(cfg.scale_up_stabilization_s, cfg.scale_down_stabilization_s)
        # like the controller, the first reconcile seeds the window with the current size
        seed = ((now, current),) if state.target < 0 else ()
        kept = tuple(r for r in state.recommendations if r[0] > now - keep)
        recs = (*seed, *kept, (now, rec))
        up_window = [r for t, r in recs if t > now - cfg.scale_up_stabilization_s] or [rec]
        down_window = [r for t, r in recs if t > now - cfg.scale_down_stabilization_s] or [rec]
        # stabilization: scale up to the lowest, down to the highest recommendation in the window
        desired = current
        if rec > current:
            desired = max(current, min(up_window))
        elif rec < current:
            desired = min(current, max(down_window))
        up_limit = max(
            current + cfg.scale_up_pods, math.ceil(current * (1 + cfg.scale_up_percent / 100))
        )
        reason = ScaleReason.HOLD
        if desired > current:
            reason = ScaleReason.THRESHOLD_UP
            if desired > up_limit:
                desired, reason = up_limit, ScaleReason.RATE_LIMITED
        elif desired < current:
            reason = ScaleReason.THRESHOLD_DOWN
        elif rec < current:
            reason = ScaleReason.DELAY_PENDING  # held by the scale-down stabilization window
        target = min(ctx.max_replicas, max(ctx.min_replicas, desired))
        if target != desired:
            reason = ScaleReason.AT_MAX if target < desired else ScaleReason.AT_MIN
        detail = (
            ("gpu_util", ctx.sample.gpu_util),
            ("ratio", ratio),
            ("recommendation", float(rec)),
        )
        return ScaleDecision(target, reason, detail), HpaState(target, now, recs)


__all__ = ["HpaConfig", "HpaGpuUtilPolicy", "HpaState"]
