"""Ray Serve's default autoscaling policy (`ray.serve.autoscaling_policy`, defaults of Ray 2.32+).

Every decision:

    avg      = time-average of the in-flight count (running + queued at the handles) over the
               last `look_back_s` (30 s)
    desired  = avg / target_ongoing_requests                          (2 per replica)
    scaled   = ceil(target + factor * (desired - target))             (factor 1.0)
               a downscale the factor rounds away becomes target - 1 ("stuck downscale")
    scaled   = clip(scaled, min_replicas, max_replicas)

`target` is the deployment's current target (it counts starting replicas, so loading replicas
do not cascade: ray#18925). Delays: a scale-up is applied once `scaled > target` has held
continuously for `upscale_delay_s` (30 s); a scale-down once `scaled < target` has held for
`downscale_delay_s` (600 s); a flip of direction, or a tick where `scaled == target`, restarts
the clock (Ray's decision counter); applying a step restarts it too. With zero replicas and
pending requests the delay is bypassed (cold start).

Known failure this reproduces: backlog counts as demand, so the queue that builds while replicas
load inflates `desired`, and the 600 s delay then holds the surplus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.baselines._window import Point, prune, push, window_average
from autoscaler.types import ScaleContext, ScaleDecision, ScaleReason


@dataclass(frozen=True, slots=True)
class RayDefaultConfig:
    target_ongoing_requests: float = 2.0
    look_back_s: float = 30.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class RayDefaultState:
    # -1 until the first decision: then the target the policy last set
    target: int = -1
    # +1 / -1 while a step in that direction is pending, 0 otherwise; since when
    direction: int = 0
    since_s: float = 0.0
    history: tuple[Point, ...] = ()


class RayDefaultPolicy:
    """Ray Serve's default request-based policy with its up/down delays."""

    name = "ray_default"

    def __init__(self, config: RayDefaultConfig | None = None) -> None:
        self.config = config or RayDefaultConfig()

    def initial_state(self) -> RayDefaultState:
        return RayDefaultState()

    def decide(
        self, ctx: ScaleContext, state: RayDefaultState, now: float
    ) -> tuple[ScaleDecision, RayDefaultState]:
        cfg = self.config
        s = ctx.sample
        history = prune(
            push(state.history, s.t_s, s.interval_s, s.in_flight_avg), now, cfg.look_back_s
        )
        target = state.target if state.target >= 0 else ctx.fleet.current
        target = min(ctx.max_replicas, max(ctx.min_replicas, target))  # bounds apply at once
        avg = window_average(history, now, cfg.look_back_s)
        desired = avg / cfg.target_ongoing_requests
        scaled = _scaled(target, desired, cfg)
        scaled = min(ctx.max_replicas, max(ctx.min_replicas, scaled))
        detail = (("in_flight_avg", avg), ("desired", desired), ("scaled", float(scaled)))
        direction = (scaled > target) - (scaled < target)
        if direction == 0:
            new = RayDefaultState(target, 0, now, history)
            return ScaleDecision(target, ScaleReason.HOLD, detail), new
        since = state.since_s if direction == state.direction else now
        delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
        cold = target == 0 and s.in_flight > 0
        if cold or now - since >= delay:
            reason = ScaleReason.THRESHOLD_UP if direction > 0 else ScaleReason.THRESHOLD_DOWN
            return ScaleDecision(scaled, reason, detail), RayDefaultState(scaled, 0, now, history)
        pending = RayDefaultState(target, direction, since, history)
        waited = (("waited_s", now - since), ("delay_s", delay))
        return ScaleDecision(target, ScaleReason.DELAY_PENDING, detail + waited), pending


def _scaled(target: int, desired: float, cfg: RayDefaultConfig) -> int:
    if target == 0:  # the factor is skipped at zero replicas
        return math.ceil(desired)
    factor = cfg.upscaling_factor if desired > target else cfg.downscaling_factor
    scaled = math.ceil(target + factor * (desired - target))
    if desired < target and scaled >= target and math.ceil(desired) < target:
        scaled = target - 1  # stuck downscale
    return scaled


__all__ = ["RayDefaultConfig", "RayDefaultPolicy", "RayDefaultState"]
