"""Knative's Pod Autoscaler (KPA, `knative/serving: pkg/autoscaler/scaling/autoscaler.go`).

Every decision, with `TV = target_concurrency * target_utilization` (per replica) and `ready`
the ready replicas (at least 1):

    stable = time-average of the in-flight count over the stable window (60 s)
    panic  = time-average over the panic window (10% of it: 6 s)
    dspc   = ceil(stable / TV),   dppc = ceil(panic / TV)
    both clamped to [floor(ready / max_scale_down_rate), ceil(max_scale_up_rate * ready)]
    panic starts when dppc / ready >= panic_threshold (2.0) and ends one stable window after the
    last tick over it; while panicking the target is max(dspc, dppc, ready at panic start) and
    never decreases,
    otherwise it is dspc
    target = clip(target, min_replicas, max_replicas)

Concurrency counts every accepted request, queued or running (Knative's activator and
queue-proxy see both). Knative's default target is 100 concurrent requests per pod (web
containers); for an LLM replica the target is a documented choice (`kpa_target_concurrency`):
Little's law at the SLO operating point, `rho* * E[T_slo] / E[w]` requests in flight per replica
(a replica that is `rho*` busy with requests of mean work `E[w]` replica-seconds, each lasting
its SLO latency `E[T_slo]` = prefill + (output - 1) * TPOT SLO), capped by the SLO decode batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.baselines._window import Point, prune, push, window_average
from autoscaler.types import ScaleContext, ScaleDecision, ScaleReason


@dataclass(frozen=True, slots=True)
class KpaConfig:
    target_concurrency: float = 16.0
    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_pct: float = 10.0
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0

    @property
    def panic_window_s(self) -> float:
        return self.stable_window_s * self.panic_window_pct / 100.0


@dataclass(frozen=True, slots=True)
class KpaState:
    history: tuple[Point, ...] = ()
    # -1: not panicking; else the last time the panic threshold was crossed
    panic_since_s: float = -1.0
    last_over_s: float = -1.0
    max_panic_pods: int = 0


def kpa_target_concurrency(
    utilization: float, mean_slo_latency_s: float, mean_work_s: float, decode_batch: int
) -> float:
    """Per-replica concurrency target by Little's law at the SLO (see the module docstring)."""
    if mean_work_s <= 0:
        return float(max(1, decode_batch))
    return max(1.0, min(float(decode_batch), utilization * mean_slo_latency_s / mean_work_s))


class KpaPolicy:
    """Knative KPA with stable/panic windows on request concurrency."""

    name = "kpa"

    def __init__(self, config: KpaConfig | None = None) -> None:
        self.config = config or KpaConfig()

    def initial_state(self) -> KpaState:
        return KpaState()

    def decide(
        self, ctx: ScaleContext, state: KpaState, now: float
    ) -> tuple[ScaleDecision, KpaState]:
        cfg = self.config
        s = ctx.sample
        history = prune(
            push(state.history, s.t_s, s.interval_s, s.in_flight_avg), now, cfg.stable_window_s
        )
        tv = cfg.target_concurrency * cfg.target_utilization
        stable = window_average(history, now, cfg.stable_window_s)
        panic = window_average(history, now, cfg.panic_window_s)
        ready = max(1, ctx.fleet.ready)
        lo = math.floor(ready / cfg.max_scale_down_rate)
        hi = math.ceil(cfg.max_scale_up_rate * ready)
        dspc = min(hi, max(lo, math.ceil(stable / tv)))
        dppc = min(hi, max(lo, math.ceil(panic / tv)))
        over = dppc / ready >= cfg.panic_threshold
        panic_since, last_over = state.panic_since_s, state.last_over_s
        if over:
            last_over = now
            if panic_since < 0:
                panic_since = now
        elif panic_since >= 0 and now - last_over >= cfg.stable_window_s:
            panic_since = -1.0
        detail = (
            ("stable_concurrency", stable),
            ("panic_concurrency", panic),
            ("dspc", float(dspc)),
            ("dppc", float(dppc)),
        )
        if panic_since >= 0:
            # entering panic starts from the ready count; then it only ever grows
            floor = state.max_panic_pods if state.panic_since_s >= 0 else ready
            desired = max(dspc, dppc, floor)
            max_panic = desired
            reason = ScaleReason.PANIC
        else:
            desired = dspc
            max_panic = 0
            current = ctx.fleet.current
            reason = (
                ScaleReason.THRESHOLD_UP
                if desired > current
                else ScaleReason.THRESHOLD_DOWN
                if desired < current
                else ScaleReason.HOLD
            )
        target = min(ctx.max_replicas, max(ctx.min_replicas, desired))
        if target != desired:
            reason = ScaleReason.AT_MAX if target < desired else ScaleReason.AT_MIN
        new = KpaState(history, panic_since, last_over, max_panic)
        return ScaleDecision(target, reason, detail), new


__all__ = ["KpaConfig", "KpaPolicy", "KpaState", "kpa_target_concurrency"]
