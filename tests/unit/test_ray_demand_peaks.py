"""What `metrics_sample` reads of the replicas' `DemandTotals.stats()` on Ray Serve beyond the
sums: the sub-tick peaks (one gauge per window of the meter's `recent_peaks`, added up over the
replicas, only windows every replica reports, into `prefill_peaks`) and each engine replica's
own backlog (`backlog_by_replica`; an ingress's backlog is at no engine replica)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from autoscaler.hosts import LoadTimes
from autoscaler.hosts.ray_serve import AdapterState, DemandTotals, metrics_sample


@dataclass(frozen=True)
class Point:
    value: float


def raw(**replicas: dict[str, float]) -> dict[str, dict[Any, list[Point]]]:
    names = {n for stats in replicas.values() for n in stats}
    return {n: {rid: [Point(s[n])] for rid, s in replicas.items() if n in s} for n in names}


def totals(
    arrivals: int, peaks: tuple[tuple[float, float, int], ...], backlog_work_s: float = 0.0
) -> dict[str, float]:
    t = DemandTotals()
    t.arrived(0.1 * arrivals, 0.2 * arrivals, arrivals)
    t.set_load(
        backlog_requests=round(backlog_work_s), backlog_work_s=backlog_work_s, in_flight=0,
        peaks=peaks,
    )  # fmt: skip
    return t.stats()


@pytest.mark.parametrize(
    ("a_peaks", "b_peaks", "expected"),
    [
        (((5.0, 1.0, 4), (10.0, 1.5, 6)), ((5.0, 0.5, 1),), ((5.0, 1.5, 5),)),
        (((5.0, 1.0, 4),), (), ()),  # b reports no window (an older replica): none is kept
        (((5.0, 0.0, 0),), ((5.0, 0.0, 0),), ()),  # nothing arrived within any window
    ],
)
def test_replicas_peaks_add_up_per_window(
    a_peaks: tuple[tuple[float, float, int], ...],
    b_peaks: tuple[tuple[float, float, int], ...],
    expected: tuple[tuple[float, float, int], ...],
) -> None:
    first = raw(a=totals(10, ()), b=totals(20, ()))
    st = AdapterState(policy_state=None, load_times=LoadTimes(default_s=60.0))
    _, baselines = metrics_sample(first, st, 0.0)
    st = AdapterState(None, LoadTimes(default_s=60.0), last_tick=0.0, baselines=baselines)
    sample, _ = metrics_sample(raw(a=totals(15, a_peaks), b=totals(25, b_peaks)), st, 5.0)
    assert sample.arrivals == 10
    assert [(w, n) for w, _, n in sample.prefill_peaks] == [(w, n) for w, _, n in expected]
    assert [work for _, work, _ in sample.prefill_peaks] == pytest.approx(
        [work for _, work, _ in expected]
    )


@pytest.mark.parametrize(
    ("at_replicas", "expected"),
    [(True, (3.0, 1.5)), (False, ())],  # engine replicas (metrics); ingress replicas
)
def test_each_engine_replicas_backlog_waits_at_it(
    at_replicas: bool, expected: tuple[float, ...]
) -> None:
    st = AdapterState(None, LoadTimes(default_s=60.0))
    _, baselines = metrics_sample(raw(a=totals(10, ()), b=totals(20, ())), st, 0.0)
    st = AdapterState(None, LoadTimes(default_s=60.0), last_tick=0.0, baselines=baselines)
    now = raw(a=totals(15, (), 1.5), b=totals(25, (), 3.0), c=totals(5, (), 0.0))
    sample, _ = metrics_sample(now, st, 5.0, at_replicas=at_replicas)
    assert sample.backlog_work_s == 4.5
    assert sample.backlog_by_replica == expected
