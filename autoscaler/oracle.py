"""A hindsight bound for autoscaling: the cheapest fleet schedule that knows the whole trace.

No causal policy can beat a planner that knows every arrival in advance, so this bound says how
far a backtest goal is from what any autoscaler could reach on a trace.

Algorithm:

1. Cut the trace into segments of `segment_s`. For each segment `k` and fleet size `n`, replay
   the segment's requests on a fixed fleet of `n` ready replicas, with the `warmup_s` of arrivals
   before it replayed first so the fleet is in its steady state (only the requests that arrive
   inside the segment are counted). `n` goes up from `floor(work rate)` (a fleet below its work
   rate falls behind for good) until no request of the segment misses the TTFT SLO:
   `late[k][n]`, non-increasing in practice; sizes above the last one tried count 0 late, sizes
   below the first count every request late.
2. A schedule `n_1 .. n_K` costs, in GPU-hours,
       tp * (segment_s * sum_k n_k  +  load_time_s * sum_k max(0, n_k - n_{k-1})) / 3600
   every replica added pays its load time (the planner orders it one load time early, which
   only hindsight allows); replicas removed cost nothing; the first segment's fleet is there
   already (as the backtest's warm start is).
3. `frontier` minimises `GPU-hours + lam * late` by dynamic programming over (segment, size)
   for a sweep of `lam`; each optimum is a point (GPU-hours, late requests) of the lower convex
   frontier. `cheapest(late_budget)` is the cheapest frontier point within a budget.

4. `rate_only` answers a narrower question: what zero late requests cost a planner that knows
   the demand rate of every segment in advance (the work rate averaged over `window` segments
   either side) but not which segment brings a coincidence of long requests. It must treat
   segments of equal demand alike, so for none late it holds in segment `k` at least
   `env_k = max(zero-late size of j : level_j <= level_k)`; the DP of step 3 then finds the
   cheapest schedule at or above that envelope (it may hold through dips). The gap between it
   and the hindsight point is the price of the luck no forecast of the rate can see. With a
   `tolerance` of t the envelope is built from each segment's smallest size with at most t late
   requests instead.

What it leaves out, all in the bound's favour: a segment's backlog does not carry into the next
(a schedule that under-serves a segment pays only that segment's late requests), replicas join
and leave exactly at segment edges, and the fleet is the best of every fixed size per segment.
It is a bound in spirit, not a proof: the simulator is not exactly monotone in the fleet size,
and one simplification goes against the bound (a size below the segment's work rate counts every
request late), which matters only for points far below any SLO target.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autoscaler.backtest import static_replay
from autoscaler.capacity import SloCapacity
from autoscaler.hosts.sim import AutoscaleConfig
from controlplane.errors import ConfigError
from controlplane.sim.fleet import FleetConfig
from controlplane.sim.ids import dense_block_ids
from controlplane.traces.model import Trace


@dataclass(frozen=True, slots=True)
class SegmentCurve:
    """Late requests of one segment by fixed fleet size (sizes `first .. first + len - 1`)."""

    start_s: float
    requests: int
    work_rate: float  # arrived work per second, in replicas at the SLO
    first: int
    late: tuple[int, ...]

    def late_at(self, n: int) -> int:
        if n < self.first:
            return self.requests
        i = n - self.first
        return self.late[i] if i < len(self.late) else 0

    @property
    def zero_late(self) -> int:
        """The smallest size tried with no late request."""
        return self.first + len(self.late) - 1


@dataclass(frozen=True, slots=True)
class OraclePoint:
    gpu_hours: float
    late: int
    schedule: tuple[int, ...]


@dataclass(slots=True)
class OracleResult:
    trace: str
    segment_s: float
    load_time_s: float
    tp: int
    requests: int
    curves: list[SegmentCurve] = field(default_factory=list)
    points: list[OraclePoint] = field(default_factory=list)

    def cheapest(self, late_budget: int) -> OraclePoint | None:
        """The cheapest frontier point with at most `late_budget` late requests."""
        ok = [p for p in self.points if p.late <= late_budget]
        return min(ok, key=lambda p: (p.gpu_hours, p.late)) if ok else None

    @classmethod
    def from_json(cls, trace: str, doc: dict[str, Any]) -> OracleResult:
        """Rebuild a result from `to_json`'s document (the frontier is solved again)."""
        curves = [
            SegmentCurve(
                float(c["start_s"]),
                int(c["requests"]),
                float(c["work_rate"]),
                int(c["first"]),
                tuple(int(x) for x in c["late"]),
            )
            for c in doc["segments"]
        ]
        seg, load, tp = float(doc["segment_s"]), float(doc["load_time_s"]), int(doc["tp"])
        result = cls(trace, seg, load, tp, int(doc["requests"]), curves)
        result.points = frontier(curves, seg, load, tp)
        return result

    def to_json(self) -> dict[str, object]:
        return {
            "segment_s": self.segment_s,
            "load_time_s": self.load_time_s,
            "tp": self.tp,
            "requests": self.requests,
            "segments": [
                {"start_s": c.start_s, "requests": c.requests, "work_rate": c.work_rate,
                 "first": c.first, "late": list(c.late)}
                for c in self.curves
            ],
            "frontier": [
                {"gpu_hours": p.gpu_hours, "late": p.late,
                 "slo_attainment": 1.0 - p.late / max(1, self.requests),
                 "schedule": list(p.schedule)}
                for p in self.points
            ],
        }  # fmt: skip


def schedule_cost(schedule: Sequence[int], segment_s: float, load_time_s: float, tp: int) -> float:
    """GPU-hours of a schedule (see the module docstring)."""
    held = sum(schedule) * segment_s
    loads = sum(max(0, b - a) for a, b in itertools.pairwise(schedule))
    return tp * (held + loads * load_time_s) / 3600.0


def optimal_schedule(
    curves: Sequence[SegmentCurve], lam: float, segment_s: float, load_time_s: float, tp: int
) -> OraclePoint:
    """Minimise GPU-hours + lam * late over schedules (dynamic programming over sizes)."""
    if not curves:
        return OraclePoint(0.0, 0, ())
    lo = max(1, min(c.first for c in curves))
    hi = max(c.zero_late for c in curves)
    sizes = range(lo, hi + 1)
    hold, load = tp * segment_s / 3600.0, tp * load_time_s / 3600.0
    cost = {n: n * hold + lam * curves[0].late_at(n) for n in sizes}
    back: list[dict[int, int]] = []
    for c in curves[1:]:
        # best predecessor for n: min over m of cost[m] + load * max(0, n - m); sweep upward
        # (m <= n pays the load) and downward (m > n is free) in O(sizes)
        best_up: dict[int, tuple[float, int]] = {}
        run: tuple[float, int] = (math.inf, lo)
        for n in sizes:
            cand = (cost[n] - load * n, n)
            run = min(run, cand)
            best_up[n] = (run[0] + load * n, run[1])
        best_down: dict[int, tuple[float, int]] = {}
        run = (math.inf, hi)
        for n in reversed(sizes):
            run = min(run, (cost[n], n))
            best_down[n] = run
        step: dict[int, int] = {}
        new: dict[int, float] = {}
        for n in sizes:
            prev = min(best_up[n], best_down[n])
            step[n] = prev[1]
            new[n] = prev[0] + n * hold + lam * c.late_at(n)
        back.append(step)
        cost = new
    n = min(sizes, key=lambda k: (cost[k], k))
    schedule = [n]
    for step in reversed(back):
        n = step[n]
        schedule.append(n)
    schedule.reverse()
    late = sum(c.late_at(k) for c, k in zip(curves, schedule, strict=True))
    gpu = schedule_cost(schedule, segment_s, load_time_s, tp)
    return OraclePoint(gpu, late, tuple(schedule))


def frontier(
    curves: Sequence[SegmentCurve], segment_s: float, load_time_s: float, tp: int
) -> list[OraclePoint]:
    """The (GPU-hours, late) frontier for a geometric sweep of lam, cheapest first."""
    points: dict[tuple[int, ...], OraclePoint] = {}
    lam = 1e-7
    while lam < 1e3:
        p = optimal_schedule(curves, lam, segment_s, load_time_s, tp)
        points.setdefault(p.schedule, p)
        lam *= 1.25
    return sorted(points.values(), key=lambda p: (p.gpu_hours, p.late))


def rate_levels(curves: Sequence[SegmentCurve], window: int) -> list[float]:
    """Each segment's demand level: the mean work rate of the segments within `window` of it."""
    rates = [c.work_rate for c in curves]
    out = []
    for k in range(len(rates)):
        near = rates[max(0, k - window) : k + window + 1]
        out.append(sum(near) / len(near))
    return out


def rate_only(
    curves: Sequence[SegmentCurve],
    window: int,
    segment_s: float,
    load_time_s: float,
    tp: int,
    *,
    tolerance: int = 0,
) -> OraclePoint:
    """The cheapest schedule of a planner that sees each segment's demand level but not its
    luck (step 4 of the module docstring), for no late request; with `tolerance`, for at most
    that many late requests in any one segment."""
    if window < 0 or tolerance < 0:
        raise ConfigError("window and tolerance must be non-negative")
    levels = rate_levels(curves, window)
    needs = [
        next((n for n in range(c.first, c.zero_late) if c.late_at(n) <= tolerance), c.zero_late)
        for c in curves
    ]
    # the running maximum of the need in order of level; segments of equal level share it
    env = [0] * len(curves)
    running = 0
    by_level = sorted(range(len(curves)), key=levels.__getitem__)
    for _, group in itertools.groupby(by_level, key=levels.__getitem__):
        same = list(group)
        running = max(running, *(needs[k] for k in same))
        for k in same:
            env[k] = running
    floors = [replace(c, first=e, late=(0,)) for c, e in zip(curves, env, strict=True)]
    # below its floor a segment counts every request late: a large lam keeps every size above
    point = optimal_schedule(floors, 1e6, segment_s, load_time_s, tp)
    late = sum(c.late_at(n) for c, n in zip(curves, point.schedule, strict=True))
    return replace(point, late=late)


def oracle(
    trace: Trace,
    fleet: FleetConfig,
    auto: AutoscaleConfig,
    capacity: SloCapacity,
    *,
    segment_s: float = 60.0,
    warmup_s: float = 120.0,
    progress: Callable[[int, int], None] | None = None,
) -> OracleResult:
    """The hindsight frontier of `trace`: each segment's late requests by fixed fleet size (step 1
    of the module docstring), then the frontier over schedules."""
    if segment_s <= 0 or warmup_s < 0:
        raise ConfigError("segment_s must be positive and warmup_s non-negative")
    tp = fleet.profile.tp
    result = OracleResult(trace.name, segment_s, auto.load_time_s, tp, len(trace))
    reqs = trace.requests
    if not reqs:
        return result
    t0 = reqs[0].arrival_s
    arrivals = [r.arrival_s for r in reqs]  # sorted: a trace is in arrival order
    count = max(1, math.ceil((reqs[-1].arrival_s - t0) / segment_s + 1e-9))
    for k in range(count):
        a, b = t0 + k * segment_s, t0 + (k + 1) * segment_s
        lo, mid, hi = (bisect.bisect_left(arrivals, x) for x in (a - warmup_s, a, b))
        sub, inside = reqs[lo:hi], reqs[mid:hi]
        work = sum(capacity.request_work(r.prompt_tokens, max(1, r.output_tokens)) for r in inside)
        first = max(1, math.floor(work / segment_s))
        late: list[int] = []
        if inside:
            part = trace.with_requests(sub)
            ids = dense_block_ids(part, fleet.profile.resolved_block_size)
            shift = sub[0].arrival_s  # the simulator's clock starts at the first arrival
            n = first
            while True:
                late.append(static_replay(part, fleet, n, auto, capacity, ids).late(a - shift))
                if late[-1] == 0 or n >= auto.max_replicas:
                    break
                n += 1
        result.curves.append(
            SegmentCurve(a - t0, len(inside), work / segment_s, first, tuple(late))
        )
        if progress is not None:
            progress(k + 1, count)
    result.points = frontier(result.curves, segment_s, auto.load_time_s, tp)
    return result


__all__ = [
    "OraclePoint",
    "OracleResult",
    "SegmentCurve",
    "frontier",
    "optimal_schedule",
    "oracle",
    "rate_levels",
    "rate_only",
    "schedule_cost",
]
