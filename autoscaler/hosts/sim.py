"""The fleet simulator under an autoscaling policy: the host `controlplane autoscale backtest` runs.

Every `tick_s` (default 5 s: finer than Ray's 10 s metric push and HPA's 15 s sync, which those
policies enforce themselves; coarser than KPA's 2 s decider, whose 6 s panic window then spans
one to two samples) the host:

1. measures: a `DemandSample` from the same router-side `DemandMeter` the live router feeds
   (`arrived` at routing time with the router's predicted output, `started` when a replica
   first schedules the request, `first_token`, `finished`), with
   `gpu_util = sum over ready replicas of busy seconds in the tick / (ready * tick_s)`: the
   fraction of the tick their engines were running steps, the duty cycle DCGM reports as GPU
   utilization;
2. counts the fleet: ready, loading (with the seconds until each is due), draining;
3. asks the policy: `decide(ScaleContext(...), state, now)` (the target is clipped to
   `[min_replicas, max_replicas]` again, whatever the policy said);
4. actuates towards the target: up -> replicas start loading now and serve `load_time_s` later;
   down -> loading replicas are cancelled first (newest first, they are furthest from serving),
   then ready ones drain, least loaded (running + waiting) first. A draining replica takes no
   new requests and leaves once it has finished everything it holds, so no request is lost.

No request is lost to an empty fleet either: the fleet starts with `initial_replicas` ready,
`min_replicas >= 1`, and a scale-down never drains more ready replicas than the target leaves,
so at least one replica is always ready (FleetSim would reject an arrival with no ready replica
as `no_ready_replica`; the figures would count it as a miss).

Figures (`AutoscaleRun`): SLO attainment = requests completed with TTFT <= the TTFT SLO / all
requests (TPOT attainment likewise with TPOT, single-token outputs pass); GPU-hours = sum over
replicas of (left - joined) * TP / 3600 with load time included and replicas still up charged
to the end of the run (the last arrival or finish); scale events = ticks whose target differed
from the fleet's current size (ready + loading); direction changes = sign flips between
consecutive scale events.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from autoscaler.capacity import SloCapacity
from autoscaler.demand import DemandMeter
from autoscaler.types import FleetCounts, ScaleContext, ScalingPolicy
from controlplane.errors import ConfigError
from controlplane.routing.policies import make_policy
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.ids import Ids
from controlplane.sim.results import FleetResult, RequestRecord
from controlplane.traces.model import Trace
from controlplane.types import Phase


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    load_time_s: float = 240.0
    tick_s: float = 5.0
    min_replicas: int = 1
    max_replicas: int = 64
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    routing_policy: str = "least_loaded"

    def __post_init__(self) -> None:
        if self.min_replicas < 1 or self.max_replicas < self.min_replicas:
            raise ConfigError("autoscaling needs 1 <= min_replicas <= max_replicas")
        if self.tick_s <= 0 or self.load_time_s < 0:
            raise ConfigError("tick_s must be positive and load_time_s non-negative")


@dataclass(frozen=True, slots=True)
class TickPoint:
    t_s: float
    ready: int
    loading: int
    draining: int
    target: int
    reason: str
    demand_rate: float
    in_flight: int
    backlog: int
    gpu_util: float

    @property
    def ordered(self) -> int:
        return self.ready + self.loading


@dataclass(slots=True)
class AutoscaleRun:
    policy: str
    result: FleetResult
    config: AutoscaleConfig
    tp: int
    initial_replicas: int
    timeline: list[TickPoint] = field(default_factory=list)

    @property
    def end_s(self) -> float:
        recs = self.result.records
        return max((max(r.arrival_s, r.finish_s) for r in recs), default=0.0)

    def gpu_hours(self) -> float:
        end = self.end_s
        total = 0.0
        for s in self.result.replicas:
            left = s.left_s if 0 <= s.left_s <= end else end
            total += max(0.0, left - s.joined_s)
        return total * self.tp / 3600.0

    def late(self, since_s: float = -math.inf) -> int:
        """Requests arrived at `since_s` or later (simulator clock) that missed the TTFT SLO
        (or never completed)."""
        slo = self.config.ttft_slo_s
        return sum(
            1
            for r in self.result.records
            if r.arrival_s >= since_s and not (r.completed and r.ttft_s <= slo)
        )

    def peak_ordered(self) -> int:
        """The most replicas ordered (ready + loading) at any tick."""
        return max((p.ordered for p in self.timeline), default=0)

    def slo_attainment(self) -> float:
        recs = self.result.records
        return 1.0 - self.late() / len(recs) if recs else 0.0

    def tpot_attainment(self) -> float:
        recs = self.result.records
        slo = self.config.tpot_slo_s
        ok = sum(1 for r in recs if r.completed and (r.output_tokens <= 1 or r.tpot_s <= slo))
        return ok / len(recs) if recs else 0.0

    def scale_changes(self) -> list[int]:
        """Signed size of each applied change of the target (target - current size)."""
        return [p.target - p.ordered for p in self.timeline if p.target != p.ordered]

    def direction_changes(self) -> int:
        signs = [1 if d > 0 else -1 for d in self.scale_changes()]
        return sum(1 for a, b in itertools.pairwise(signs) if a != b)

    def to_json(self, *, timeline: bool = True) -> dict[str, object]:
        recs = self.result.records
        done = [r for r in recs if r.completed]
        ttft = np.array([r.ttft_s for r in done]) if done else np.zeros(1)
        doc: dict[str, object] = {
            "slo_attainment": self.slo_attainment(),
            "gpu_hours": self.gpu_hours(),
            "scale_events": len(self.scale_changes()),
            "direction_changes": self.direction_changes(),
            "tpot_attainment": self.tpot_attainment(),
            "requests": len(recs),
            "completed": len(done),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "initial_replicas": self.initial_replicas,
            "peak_ordered": self.peak_ordered(),
            "wall_seconds": self.result.wall_s,
        }
        if timeline:
            doc["timeline"] = {
                "t_s": [p.t_s for p in self.timeline],
                "ready": [p.ready for p in self.timeline],
                "ordered": [p.ordered for p in self.timeline],
                "target": [p.target for p in self.timeline],
            }
        return doc


class _Host:
    """Ticks the policy over a running FleetSim (see the module docstring)."""

    def __init__(
        self,
        sim: FleetSim,
        meter: DemandMeter,
        policy: ScalingPolicy[Any],
        config: AutoscaleConfig,
        timeline: list[TickPoint],
        state: Any = None,
    ) -> None:
        self.sim, self.meter, self.policy, self.config = sim, meter, policy, config
        self.state: Any = policy.initial_state() if state is None else state
        self.timeline = timeline
        self._busy: dict[str, float] = {}

    def tick(self, now: float) -> None:
        sim, cfg = self.sim, self.config
        reps = [r for r in sim.replicas if r.phase is not Phase.DEAD]
        ready = [r for r in reps if r.phase is Phase.READY]
        loading = [r for r in reps if r.phase is Phase.LOADING]
        draining = sum(1 for r in reps if r.phase is Phase.DRAINING)
        busy = 0.0
        for r in ready:
            b = sim.busy_time(r.rid, now)
            busy += b - self._busy.get(r.rid, 0.0)
            self._busy[r.rid] = b
        util = min(1.0, busy / (len(ready) * cfg.tick_s)) if ready else 0.0
        sample = self.meter.sample(now, gpu_util=util)
        counts = FleetCounts(
            ready=len(ready),
            loading=len(loading),
            draining=draining,
            loading_eta_s=tuple(max(0.0, r.ready_eta_s - now) for r in loading),
        )
        ctx = ScaleContext(
            sample, counts, cfg.load_time_s, cfg.min_replicas, cfg.max_replicas, cfg.tick_s
        )
        decision, self.state = self.policy.decide(ctx, self.state, now)
        target = min(cfg.max_replicas, max(cfg.min_replicas, decision.target))
        self.timeline.append(
            TickPoint(
                now,
                len(ready),
                len(loading),
                draining,
                target,
                str(decision.reason),
                sample.rate,
                sample.in_flight,
                sample.backlog_requests,
                util,
            )
        )
        current = len(ready) + len(loading)
        for _ in range(target - current):
            sim.join(now, cfg.load_time_s)
        excess = max(0, current - target)  # a negative slice bound would cancel loading ones
        for r in sorted(loading, key=lambda r: r.joined_s, reverse=True)[:excess]:
            sim.leave(r.rid, now)
        excess -= min(excess, len(loading))
        if excess > 0:
            by_load = sorted(ready, key=lambda r: r.engine.num_running + r.engine.num_waiting)
            for r in by_load[:excess]:
                sim.leave(r.rid, now)


def run_autoscaled(
    trace: Trace,
    fleet: FleetConfig,
    policy: ScalingPolicy[Any],
    config: AutoscaleConfig,
    *,
    initial_replicas: int,
    capacity: SloCapacity | None = None,
    block_ids: Sequence[Ids] | None = None,
    id_floor: int = 0,
    progress: Callable[[int], None] | None = None,
    initial_state: Any = None,
) -> AutoscaleRun:
    """Replay `trace` on a fleet of `initial_replicas` that `policy` resizes every tick
    (starting from `initial_state`, e.g. a state warmed on the previous day; None: fresh)."""
    n0 = min(config.max_replicas, max(config.min_replicas, initial_replicas))
    cap = capacity or SloCapacity.build(fleet.profile, config.ttft_slo_s, config.tpot_slo_s)
    sim = FleetSim(
        replace(fleet, replicas=n0), functools.partial(make_policy, config.routing_policy)
    )
    meter = DemandMeter(cap, peak_windows=(config.tick_s,))
    run = AutoscaleRun(
        policy.name, FleetResult([], [], 0.0, 0.0, 0.0), config, fleet.profile.tp, n0
    )
    host = _Host(sim, meter, policy, config, run.timeline, initial_state)
    sim.observer = meter
    sim.tick_s = config.tick_s
    sim.on_tick = host.tick
    run.result = sim.run(trace, block_ids=block_ids, id_floor=id_floor, progress=progress)
    return run


def ttft_p99_windows(
    records: Sequence[RequestRecord], window_s: float = 60.0
) -> tuple[list[float], list[float]]:
    """Per `window_s` window of arrival time: its middle and the p99 TTFT of its requests
    (requests that never got a first token count as infinitely late)."""
    if not records:
        return [], []
    t0 = min(r.arrival_s for r in records)
    bins: dict[int, list[float]] = {}
    for r in records:
        ttft = r.ttft_s if r.completed else float("inf")
        bins.setdefault(int((r.arrival_s - t0) // window_s), []).append(ttft)
    mids, p99 = [], []
    for k in sorted(bins):
        mids.append(t0 + (k + 0.5) * window_s)
        p99.append(float(np.percentile(np.array(bins[k]), 99, method="higher")))
    return mids, p99


__all__ = ["AutoscaleConfig", "AutoscaleRun", "TickPoint", "run_autoscaled", "ttft_p99_windows"]
