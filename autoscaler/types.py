"""The autoscaler's vocabulary: what a policy sees, what it answers, and why.

Every policy (the headroom policy and the baselines it is compared with) is a pure function

    decide(ctx: ScaleContext, state: S, now: float) -> (ScaleDecision, S)

over frozen values with the clock injected as `now`. The same objects run in the simulator
(`controlplane autoscale backtest`), in the Ray Serve adapter and in the standalone controller.

Units. Work is measured in *replica-seconds at the SLO*: the roofline time one replica spends on a
request when it runs at the decode batch the TPOT SLO allows (`autoscaler.capacity`). A demand
rate of 3.0 means "three replicas fully busy"; backlog is work that arrived and has not started.
Demand is measured at the router, never from GPU utilization; `gpu_util` is only carried for the
HPA baseline, which is there to show why it fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar


class ScaleReason(StrEnum):
    """Why a decision is what it is (a metric label and a span attribute)."""

    HOLD = "hold"  # the target is unchanged
    FORECAST_UP = "forecast_up"  # forecast peak over the load time needs more replicas
    BACKLOG_DRAIN = "backlog_drain"  # the backlog term alone forces the increase
    SCALE_DOWN = "scale_down"  # idle cost over the re-use interval beats the reload cost
    DOWN_NOT_WORTH_IT = "down_not_worth_it"  # fewer would do, but reloading later costs more
    LOADING_COVERS = "loading_covers"  # replicas already loading cover the need
    RATE_LIMITED = "rate_limited"  # the step was clipped by a rate limit
    AT_MIN = "at_min"  # clipped to min_replicas
    AT_MAX = "at_max"  # clipped to max_replicas
    WARMING_UP = "warming_up"  # not enough history yet: hold at the current size or more
    NO_DATA = "no_data"  # the demand sample is missing or stale: hold
    # the baselines
    THRESHOLD_UP = "threshold_up"
    THRESHOLD_DOWN = "threshold_down"
    DELAY_PENDING = "delay_pending"  # a baseline's up/down delay has not elapsed yet
    PANIC = "panic"  # KPA panic mode
    STATIC = "static"


@dataclass(frozen=True, slots=True)
class DemandSample:
    """What the router measured over `[t_s - interval_s, t_s]` (one model)."""

    t_s: float
    interval_s: float
    arrivals: int = 0
    # work (replica-seconds at the SLO) of the requests that arrived in the interval
    prefill_work_s: float = 0.0
    decode_work_s: float = 0.0
    # at t_s: requests accepted and not yet started (router queue + replicas' waiting queues)
    backlog_requests: int = 0
    backlog_work_s: float = 0.0
    # at t_s: the part of that backlog already dispatched to a replica, per replica holding any
    # (descending). Only that replica can serve it (vLLM's waiting queue: a router dispatches on
    # arrival and never moves a request), so replicas ordered now cannot drain it; the rest
    # (`backlog_work_s - sum`) waits at the router, where any replica can take it. Empty: the
    # host does not know, and the whole backlog counts as waiting at the router.
    backlog_by_replica: tuple[float, ...] = ()
    # at t_s: requests accepted and not finished (Ray's "ongoing requests", Knative concurrency)
    in_flight: int = 0
    # time-average over the interval of the same count (what Ray and Knative average)
    in_flight_avg: float = 0.0
    # mean prefill work per request and its squared coefficient of variation, over the interval
    prefill_mean_s: float = 0.0
    prefill_scv: float = 1.0
    # fraction of the interval the ready replicas' GPUs were busy (HPA baseline only)
    gpu_util: float = 0.0
    # observed TTFT p99 of requests whose first token came in the interval (-1: none)
    ttft_p99_s: float = -1.0
    # sub-tick bursts: per window length w (`autoscaler.demand.PEAK_WINDOWS_S`), the most
    # prefill work that arrived within any w seconds ending in the interval, and how many
    # requests brought it: (w, work, requests). Empty when the host cannot see arrivals.
    prefill_peaks: tuple[tuple[float, float, int], ...] = ()

    @property
    def rate(self) -> float:
        """Arrived work per second, in replicas (prefill + decode)."""
        if self.interval_s <= 0:
            return 0.0
        return (self.prefill_work_s + self.decode_work_s) / self.interval_s


@dataclass(frozen=True, slots=True)
class FleetCounts:
    """The fleet as the host sees it when it asks for a decision."""

    ready: int
    loading: int = 0
    draining: int = 0
    # seconds until each loading replica is expected to serve (same length as `loading`)
    loading_eta_s: tuple[float, ...] = ()

    @property
    def current(self) -> int:
        """Replicas ordered and not being removed: what a target is compared with."""
        return self.ready + self.loading


@dataclass(frozen=True, slots=True)
class ScaleContext:
    """Everything a policy may read. `load_time_s` is the fleet's measured start-to-ready time
    (the configured value until a replica has been seen loading)."""

    sample: DemandSample
    fleet: FleetCounts
    load_time_s: float
    min_replicas: int = 1
    max_replicas: int = 64
    # seconds between two decisions of the host
    tick_s: float = 10.0


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    target: int
    reason: ScaleReason
    # the figures the decision came from (forecast peak, sigma, utilization target, ...), for
    # logs, span attributes and the backtest's timeline
    detail: tuple[tuple[str, float], ...] = field(default=())

    def figures(self) -> dict[str, float]:
        return dict(self.detail)


S = TypeVar("S")


class ScalingPolicy(Protocol[S]):
    """A named pure policy with its initial state."""

    name: str

    def initial_state(self) -> S: ...

    def decide(self, ctx: ScaleContext, state: S, now: float) -> tuple[ScaleDecision, S]: ...


__all__ = [
    "DemandSample",
    "FleetCounts",
    "ScaleContext",
    "ScaleDecision",
    "ScaleReason",
    "ScalingPolicy",
]
