"""The controller's demand math: router expositions -> counter deltas -> one `DemandSample`.

Counters are summed over routers; a counter that went down restarted from 0 (its new value is the
increase); a tick with an unreachable router is NO_DATA and moves no baseline, so the next delta
spans both intervals; the first tick only sets baselines. Load times come from the fleet.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from autoscaler.controller import (
    DemandAccumulator,
    RouterReading,
    counter_delta,
    load_policy,
    parse_router_metrics,
)
from autoscaler.hosts import FleetObservation, LoadTimes
from controlplane.errors import ConfigError


def reading(arrivals: float, prefill: float, decode: float, backlog: float = 0.0,
            in_flight: float = 0.0) -> RouterReading:  # fmt: skip
    return RouterReading(
        {"arrivals": arrivals, "prefill": prefill, "decode": decode},
        {"cp_backlog_work_seconds": backlog, "cp_backlog_requests": 0.0,
         "cp_in_flight_requests": in_flight},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("prev", "cur", "delta"), [(0.0, 0.0, 0.0), (5.0, 7.5, 2.5), (10.0, 3.0, 3.0), (4.0, 4.0, 0.0)]
)
def test_counter_delta(prev: float, cur: float, delta: float) -> None:
    assert counter_delta(prev, cur) == delta


@dataclass(frozen=True)
class Case:
    name: str
    # per tick: (time, {router: reading or None})
    ticks: list[tuple[float, dict[str, RouterReading | None]]]
    # expected of the last sample: interval, arrivals, prefill, decode, backlog, in_flight
    expected: tuple[float, int, float, float, float, int]


A0, B0 = reading(10, 1.0, 4.0), reading(20, 2.0, 8.0)
CASES = [
    Case("first tick: baselines only", [(0.0, {"a": A0})], (0.0, 0, 0.0, 0.0, 0.0, 0)),
    Case(
        "two routers summed",
        [
            (0.0, {"a": A0, "b": B0}),
            (10.0, {"a": reading(15, 1.5, 6.0, 2.0, 3), "b": reading(25, 2.5, 9.0, 1.0, 4)}),
        ],
        (10.0, 10, 1.0, 3.0, 3.0, 7),
    ),
    Case(
        "a router restarted: its counters count from 0",
        [
            (0.0, {"a": A0, "b": B0}),
            (10.0, {"a": reading(15, 1.5, 6.0), "b": reading(3, 0.5, 1.0)}),
        ],
        (10.0, 8, 1.0, 3.0, 0.0, 0),
    ),
    Case(
        "a router unreachable: NO_DATA",
        [(0.0, {"a": A0, "b": B0}), (10.0, {"a": reading(15, 1.5, 6.0), "b": None})],
        (0.0, 0, 0.0, 0.0, 0.0, 0),
    ),
    Case(
        "back after an outage: the delta spans both intervals",
        [
            (0.0, {"a": A0, "b": B0}),
            (10.0, {"a": reading(15, 1.5, 6.0), "b": None}),
            (20.0, {"a": reading(20, 2.0, 8.0), "b": reading(30, 3.0, 12.0)}),
        ],
        (20.0, 20, 2.0, 8.0, 0.0, 0),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_demand_accumulator(case: Case) -> None:
    acc = DemandAccumulator()
    for now, readings in case.ticks:
        sample = acc.update(now, readings)
    s = sample
    got = (s.interval_s, s.arrivals, s.prefill_work_s, s.decode_work_s, s.backlog_work_s,
           s.in_flight)  # fmt: skip
    assert got == pytest.approx(case.expected)
    if s.interval_s > 0:
        assert s.rate == pytest.approx((s.prefill_work_s + s.decode_work_s) / s.interval_s)


EXPOSITION = """\
# TYPE cp_demand_work_seconds counter
cp_demand_work_seconds_total{model="a",kind="prefill"} 1.5
cp_demand_work_seconds_total{model="a",kind="decode"} 4.0
cp_demand_work_seconds_total{model="b",kind="decode"} 100.0
# TYPE cp_demand_arrivals counter
cp_demand_arrivals_total{model="a"} 7
cp_demand_arrivals_total{model="b"} 70
cp_backlog_work_seconds{model="a"} 0.5
cp_backlog_requests{model="a"} 2
cp_in_flight_requests{model="a"} 5
cp_in_flight_requests{model="b"} 50
cp_demand_prefill_peak_work_seconds{model="a",window_s="5"} 0.75
cp_demand_prefill_peak_requests{model="a",window_s="5"} 3
cp_demand_prefill_peak_work_seconds{model="b",window_s="5"} 2.0
cp_demand_prefill_peak_requests{model="b",window_s="5"} 1
cp_backlog_dispatched_work_seconds{model="a",replica="r1"} 0.25
cp_backlog_dispatched_work_seconds{model="a",replica="r2"} 0.125
cp_backlog_dispatched_work_seconds{model="b",replica="r1"} 3.0
unrelated_total 3
"""


@pytest.mark.parametrize(
    ("model", "counters", "in_flight", "peaks", "dispatched"),
    [("a", {"arrivals": 7, "prefill": 1.5, "decode": 4.0}, 5, {5.0: (0.75, 3.0)},
      {"r1": 0.25, "r2": 0.125}),
     ("", {"arrivals": 77, "prefill": 1.5, "decode": 104.0}, 55, {5.0: (2.75, 4.0)},
      {"r1": 3.25, "r2": 0.125}),
     ("c", {"arrivals": 0, "prefill": 0.0, "decode": 0.0}, 0, {}, {})],
)  # fmt: skip
def test_parse_router_metrics(
    model: str,
    counters: dict[str, float],
    in_flight: int,
    peaks: dict[float, tuple[float, float]],
    dispatched: dict[str, float],
) -> None:
    r = parse_router_metrics(EXPOSITION, model)
    assert dict(r.counters) == counters
    assert r.gauges["cp_in_flight_requests"] == in_flight
    assert dict(r.peaks) == peaks
    assert dict(r.dispatched) == dispatched


def test_routers_dispatched_backlog_adds_up_per_replica() -> None:
    def with_dispatched(n: float, backlog: float, dispatched: dict[str, float]) -> RouterReading:
        base = reading(n, n / 10, n / 5, backlog)
        return RouterReading(base.counters, base.gauges, dispatched=dispatched)

    acc = DemandAccumulator()
    acc.update(0.0, {"a": with_dispatched(10, 0.0, {}), "b": with_dispatched(20, 0.0, {})})
    # both routers sent work to r1; a series at zero is no replica holding any
    s = acc.update(
        5.0,
        {
            "a": with_dispatched(15, 6.0, {"r1": 2.0, "r2": 3.0}),
            "b": with_dispatched(25, 4.0, {"r1": 1.5, "r3": 0.0}),
        },
    )
    assert s.backlog_work_s == 10.0
    assert s.backlog_by_replica == (3.5, 3.0)
    # nothing dispatched anywhere: the whole backlog waits at the routers
    s = acc.update(10.0, {"a": with_dispatched(15, 1.0, {}), "b": with_dispatched(25, 0.0, {})})
    assert s.backlog_by_replica == ()


def test_routers_peaks_add_up_per_window_both_report() -> None:
    def with_peaks(n: float, peaks: dict[float, tuple[float, float]]) -> RouterReading:
        base = reading(n, n / 10, n / 5)
        return RouterReading(base.counters, base.gauges, peaks)

    acc = DemandAccumulator()
    acc.update(0.0, {"a": with_peaks(10, {}), "b": with_peaks(20, {})})
    s = acc.update(
        5.0,
        {
            "a": with_peaks(15, {5.0: (1.0, 3.0), 10.0: (1.5, 4.0)}),
            "b": with_peaks(25, {5.0: (0.5, 2.0)}),  # an older router: no 10-s window
        },
    )
    assert s.prefill_peaks == ((5.0, 1.5, 5),)
    # no arrivals anywhere within a window: nothing to report
    s = acc.update(10.0, {"a": with_peaks(15, {5.0: (0.0, 0.0)}), "b": with_peaks(25, {})})
    assert s.prefill_peaks == ()


def test_load_times_from_the_fleet() -> None:
    lt = LoadTimes(default_s=100.0)
    assert lt.estimate_s == 100.0
    lt = lt.ordered(10.0, 1, 3)  # 1 -> 3 at t=10
    counts = FleetObservation(spec=3, ready=1).counts(lt, 20.0)
    assert (counts.ready, counts.loading, counts.loading_eta_s) == (1, 2, (90.0, 90.0))
    lt = lt.ordered(30.0, 3, 4).observed(40.0, 3)  # 3 ready at 40: one sample of 30 s
    assert (lt.estimate_s, lt.orders) == (30.0, ((30.0, 4),))
    lt = lt.ordered(45.0, 4, 2)  # scaled down before the 4th came: the order is cancelled
    assert lt.orders == ()
    draining = FleetObservation(spec=2, ready=3).counts(lt, 50.0)
    assert (draining.ready, draining.loading, draining.draining) == (2, 0, 1)


@pytest.mark.parametrize("name", ["nope", "no.such.module:Policy", "autoscaler.types:Nope"])
def test_load_policy_refuses(name: str) -> None:
    with pytest.raises(ConfigError):
        load_policy(name, {})


def test_headroom_is_built_from_plain_config_values() -> None:
    from autoscaler.controller import load_policy
    from autoscaler.headroom import HeadroomPolicy

    policy = load_policy("headroom", {"model": "llama-3.1-70b", "tp": 4, "ttft_slo_s": 3.0})
    assert isinstance(policy, HeadroomPolicy) and policy.name == "headroom"
