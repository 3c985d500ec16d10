"""The hindsight bound (autoscaler.oracle): the schedule optimiser against brute force, and the
segment replays on a tiny trace."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaler.capacity import SloCapacity
from autoscaler.hosts.sim import AutoscaleConfig
from autoscaler.oracle import (
    OracleResult,
    SegmentCurve,
    frontier,
    optimal_schedule,
    oracle,
    rate_levels,
    rate_only,
    schedule_cost,
)
from controlplane.roofline import profile
from controlplane.sim.fleet import FleetConfig
from controlplane.traces.model import Trace, TraceRequest

SEG, LOAD, TP = 60.0, 240.0, 2


def curve(first: int, *late: int, requests: int = 100) -> SegmentCurve:
    return SegmentCurve(0.0, requests, 1.0, first, tuple(late))


@pytest.mark.parametrize(
    ("schedule", "hours"),
    [
        ((3,), 3 * SEG * TP / 3600),
        ((3, 3, 3), 9 * SEG * TP / 3600),
        # one replica added pays its load time; removing one is free
        ((3, 4, 3), (10 * SEG + LOAD) * TP / 3600),
        ((5, 2, 4), (11 * SEG + 2 * LOAD) * TP / 3600),
    ],
)
def test_schedule_cost(schedule: tuple[int, ...], hours: float) -> None:
    assert schedule_cost(schedule, SEG, LOAD, TP) == pytest.approx(hours)


@pytest.mark.parametrize(
    ("n", "late"),
    [(1, 100), (2, 100), (3, 7), (4, 2), (5, 0), (9, 0)],
)
def test_late_at_outside_the_tried_sizes(n: int, late: int) -> None:
    c = curve(3, 7, 2, 0)
    assert c.late_at(n) == late
    assert c.zero_late == 5


@pytest.mark.parametrize(
    ("lam", "schedule"),
    [
        # late requests are free: the smallest fleet everywhere
        (0.0, (1, 1, 1)),
        # late requests are dear: every segment at its zero-late size or more; the first
        # segment's fleet is there already, and holding 4 for three segments (720 s) is cheaper
        # than 3, 2 then loading two (540 s + 480 s)
        (10.0, (4, 4, 4)),
    ],
)
def test_optimal_schedule_extremes(lam: float, schedule: tuple[int, ...]) -> None:
    curves = [curve(2, 9, 0), curve(1, 9, 0), curve(3, 9, 0)]
    assert optimal_schedule(curves, lam, SEG, LOAD, TP).schedule == schedule


def test_a_short_dip_is_not_worth_a_reload() -> None:
    # the middle segment needs one replica less; shedding it saves one segment but the
    # replica must be loaded again for the third (LOAD > SEG): the optimum holds 3 throughout
    curves = [curve(3, 0), curve(2, 0), curve(3, 0)]
    point = optimal_schedule(curves, 10.0, SEG, LOAD, TP)
    assert point.schedule == (3, 3, 3)
    assert point.late == 0


curves_st = st.lists(
    st.builds(
        lambda first, drops: SegmentCurve(
            0.0,
            20,
            1.0,
            first,
            tuple(itertools.accumulate([sum(drops)] + [-d for d in drops])),
        ),
        st.integers(1, 3),
        st.lists(st.integers(0, 6), min_size=0, max_size=3),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(curves_st, st.sampled_from([0.0, 1e-3, 0.01, 0.1, 10.0]))
def test_optimal_schedule_matches_brute_force(curves: list[SegmentCurve], lam: float) -> None:
    lo = min(c.first for c in curves)
    hi = max(c.zero_late for c in curves)
    point = optimal_schedule(curves, lam, SEG, LOAD, TP)

    def objective(s: tuple[int, ...]) -> float:
        late = sum(c.late_at(n) for c, n in zip(curves, s, strict=True))
        return schedule_cost(s, SEG, LOAD, TP) + lam * late

    best = min(objective(s) for s in itertools.product(range(lo, hi + 1), repeat=len(curves)))
    assert objective(point.schedule) == pytest.approx(best)
    assert point.late == sum(c.late_at(n) for c, n in zip(curves, point.schedule, strict=True))
    assert point.gpu_hours == pytest.approx(schedule_cost(point.schedule, SEG, LOAD, TP))


@settings(max_examples=30, deadline=None)
@given(curves_st)
def test_frontier_trades_gpu_hours_for_late_requests(curves: list[SegmentCurve]) -> None:
    points = frontier(curves, SEG, LOAD, TP)
    assert points
    # cheapest first; a dearer point is never also later
    for a, b in itertools.pairwise(points):
        assert a.gpu_hours <= b.gpu_hours
        assert b.late <= a.late
    # the dearest point serves every segment at its zero-late size or more
    assert points[-1].late == 0


def rated(rate: float, zero_late: int) -> SegmentCurve:
    """A segment at work rate `rate` whose smallest zero-late size is `zero_late`."""
    return SegmentCurve(0.0, 50, rate, zero_late - 1, (5, 0))


@pytest.mark.parametrize(
    ("segments", "window", "schedule"),
    [
        # the level is monotone and so is the need: the envelope is the need itself
        ([(1.0, 3), (2.0, 4), (3.0, 5)], 0, (3, 4, 5)),
        # a lucky segment at level 2 needed 6: every segment at level 2 or more holds 6
        ([(1.0, 3), (2.0, 6), (2.5, 4), (2.0, 4), (1.0, 3)], 0, (3, 6, 6, 6, 3)),
        # equal levels share their envelope whatever their order
        ([(2.0, 4), (1.0, 2), (2.0, 5)], 0, (5, 2, 5)),
        # averaged over one segment either side the levels are 1.5, 2, 2.5: the envelope is
        # the running maximum of the need in that order
        ([(1.0, 5), (2.0, 3), (3.0, 4)], 1, (5, 5, 5)),
    ],
)
def test_rate_only_holds_what_equal_demand_needed(
    segments: list[tuple[float, int]], window: int, schedule: tuple[int, ...]
) -> None:
    # ten-minute segments: stepping up is cheaper than holding the peak early
    curves = [rated(r, n) for r, n in segments]
    point = rate_only(curves, window, 600.0, LOAD, TP)
    assert point.schedule == schedule
    assert point.late == 0


@pytest.mark.parametrize(
    ("tolerance", "schedule", "late"), [(0, (5, 5), 0), (1, (4, 4), 1), (3, (3, 3), 5)]
)
def test_rate_only_tolerance_accepts_late_requests_per_segment(
    tolerance: int, schedule: tuple[int, ...], late: int
) -> None:
    # two segments at one level; sizes 3, 4, 5 leave 3, 1, 0 and 2, 0, 0 late
    curves = [SegmentCurve(0.0, 9, 1.0, 3, (3, 1, 0)), SegmentCurve(60.0, 9, 1.0, 3, (2, 0))]
    point = rate_only(curves, 0, SEG, LOAD, TP, tolerance=tolerance)
    assert (point.schedule, point.late) == (schedule, late)


def test_rate_levels_average_the_neighbours() -> None:
    curves = [rated(r, 1) for r in (1.0, 2.0, 6.0)]
    assert rate_levels(curves, 0) == [1.0, 2.0, 6.0]
    assert rate_levels(curves, 1) == [1.5, 3.0, 4.0]


@settings(max_examples=40, deadline=None)
@given(curves_st, st.integers(0, 2))
def test_rate_only_costs_at_least_hindsight(curves: list[SegmentCurve], window: int) -> None:
    curves = [
        SegmentCurve(c.start_s, c.requests, float(i % 3), c.first, c.late)
        for i, c in enumerate(curves)
    ]
    point = rate_only(curves, window, SEG, LOAD, TP)
    best = optimal_schedule(curves, 1e6, SEG, LOAD, TP)
    assert point.late == 0
    assert all(c.late_at(n) == 0 for c, n in zip(curves, point.schedule, strict=True))
    assert point.gpu_hours >= best.gpu_hours - 1e-9


def test_segment_replays_on_a_tiny_trace() -> None:
    # 2 minutes: a light first minute, then a second minute at ten times the rate
    reqs = [
        TraceRequest(arrival_s=i * 0.5, prompt_tokens=4000, output_tokens=20) for i in range(120)
    ]
    reqs += [
        TraceRequest(arrival_s=60.0 + i * 0.05, prompt_tokens=4000, output_tokens=20)
        for i in range(1200)
    ]
    trace = Trace("tiny", tuple(reqs)).sorted()
    prof = profile("h100", "llama-3.1-8b")
    auto = AutoscaleConfig(load_time_s=30.0, ttft_slo_s=0.5, max_replicas=8)
    cap = SloCapacity.build(prof, auto.ttft_slo_s, auto.tpot_slo_s)
    res = oracle(trace, FleetConfig(profile=prof), auto, cap, segment_s=60.0, warmup_s=30.0)
    assert [c.requests for c in res.curves] == [120, 1200]
    first, second = res.curves
    # every curve ends at its first size with no late request, and the busier minute needs more
    assert first.late[-1] == 0 and second.late[-1] == 0
    assert second.zero_late > first.zero_late
    assert res.points[-1].late == 0
    cheapest = res.cheapest(0)
    assert cheapest is not None
    assert cheapest.schedule == (first.zero_late, second.zero_late)
    again = OracleResult.from_json(res.trace, res.to_json())
    assert again.curves == res.curves and again.points == res.points
