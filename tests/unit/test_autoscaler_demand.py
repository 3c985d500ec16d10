"""DemandMeter: arrival work and backlog kept apart, exact time-averages, nothing leaks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoscaler.capacity import SloCapacity
from autoscaler.demand import DemandMeter, sum_peaks
from controlplane.roofline.profile import profile

CAP = SloCapacity.build(profile("h100", "llama-3.1-8b"), 2.0, 0.1)


def flat(peaks: tuple[tuple[float, float, int], ...]) -> list[float]:
    """(window, work, requests) triples as one list, for pytest.approx."""
    return [float(x) for p in peaks for x in p]


def test_arrivals_are_priced_and_backlog_is_separate() -> None:
    m = DemandMeter(CAP)
    m.arrived("a", 1000, 100, 1.0)
    m.arrived("b", 3000, 10, 2.0)
    m.started("a", 2.5)
    s = m.sample(10.0)
    assert s.interval_s == 10.0 and s.arrivals == 2
    assert s.prefill_work_s == pytest.approx(CAP.prefill_work(1000) + CAP.prefill_work(3000))
    assert s.decode_work_s == pytest.approx(CAP.decode_work(100, 1000) + CAP.decode_work(10, 3000))
    assert s.rate == pytest.approx((s.prefill_work_s + s.decode_work_s) / 10.0)
    assert s.backlog_requests == 1
    assert s.backlog_work_s == pytest.approx(CAP.request_work(3000, 10))
    assert s.in_flight == 2
    # a: in flight 1..10 (9 s), b: 2..10 (8 s) over a 10 s interval
    assert s.in_flight_avg == pytest.approx(1.7)
    # the next interval has no arrivals but keeps the backlog and the in-flight requests
    s2 = m.sample(20.0)
    assert (s2.arrivals, s2.prefill_work_s, s2.backlog_requests) == (0, 0.0, 1)
    assert s2.in_flight_avg == pytest.approx(2.0)


def test_ttft_p99_and_prefill_variability() -> None:
    m = DemandMeter(CAP)
    for i in range(10):
        m.arrived(f"r{i}", 500, 50, 0.0)
        m.first_token(f"r{i}", 0.1 * (i + 1))
    s = m.sample(5.0)
    assert s.backlog_requests == 0
    assert s.ttft_p99_s == pytest.approx(0.991, abs=1e-3)
    assert s.prefill_scv == pytest.approx(0.0, abs=1e-9)
    m.arrived("short", 100, 1, 5.0)
    m.arrived("long", 8000, 1, 5.0)
    s = m.sample(6.0)
    assert s.prefill_scv > 0.5
    assert m.sample(7.0).ttft_p99_s == -1.0


def test_events_for_unknown_or_repeated_requests_are_ignored() -> None:
    m = DemandMeter(CAP)
    m.started("ghost", 0.0)
    m.first_token("ghost", 0.0)
    m.finished("ghost", 0.0)
    m.arrived("x", 100, 10, 0.0)
    m.arrived("x", 100, 10, 0.0)
    m.started("x", 1.0)
    m.started("x", 1.0)
    s = m.sample(2.0)
    assert (s.arrivals, s.backlog_requests, s.in_flight) == (1, 0, 1)


events = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "dispatch", "start", "first", "finish"]), st.integers(0, 7)
    ),
    max_size=60,
)


@given(events)
def test_nothing_leaks_once_every_request_finishes(ops: list[tuple[str, int]]) -> None:
    m = DemandMeter(CAP)
    t = 0.0
    for op, k in ops:
        t += 0.5
        rid = f"r{k}"
        if op == "arrive":
            m.arrived(rid, 200 + 100 * k, 20, t)
        elif op == "dispatch":
            m.dispatched(rid, f"replica-{k % 3}", t)
        elif op == "start":
            m.started(rid, t)
        elif op == "first":
            m.first_token(rid, t)
        else:
            m.finished(rid, t)
        assert 0 <= m.backlog_requests <= m.in_flight
        assert m.backlog_work_s >= 0
        pinned = m.backlog_by_replica
        assert all(w > 0 for w in pinned.values())
        assert sum(pinned.values()) <= m.backlog_work_s + 1e-9
    for k in range(8):
        m.finished(f"r{k}", t + 1)
    s = m.sample(t + 2)
    assert (s.in_flight, s.backlog_requests, s.backlog_work_s) == (0, 0, 0.0)
    assert (s.backlog_by_replica, m.backlog_by_replica) == ((), {})


def test_dispatched_backlog_is_kept_per_replica_until_it_starts() -> None:
    m = DemandMeter(CAP)
    w = CAP.request_work(2000, 50)
    for i in range(3):
        m.arrived(f"a{i}", 2000, 50, 0.0)
    m.arrived("held", 2000, 50, 0.0)  # still at the router's queue
    m.dispatched("a0", "r1", 0.1)
    m.dispatched("a1", "r1", 0.1)
    m.dispatched("a2", "r2", 0.1)
    m.dispatched("a2", "r1", 0.2)  # a reroute moves it ...
    m.dispatched("a2", "r2", 0.3)  # ... and back
    m.dispatched("a2", "r2", 0.3)  # the same replica again changes nothing
    m.dispatched("unknown", "r1", 0.2)
    s = m.sample(1.0)
    assert s.backlog_work_s == pytest.approx(4 * w)
    assert s.backlog_by_replica == pytest.approx((2 * w, w))
    m.started("a0", 1.5)
    m.dispatched("a0", "r2", 1.6)  # already started: no longer backlog anywhere
    m.finished("a2", 2.0)  # ended without starting (cancelled): leaves r2's queue
    assert m.backlog_by_replica == pytest.approx({"r1": w})
    m.first_token("a1", 2.5)
    assert m.sample(3.0).backlog_by_replica == ()
    assert m.backlog_work_s == pytest.approx(w)  # "held" never left the router


def test_a_spike_cut_by_a_tick_boundary_is_seen_whole_on_the_sliding_window() -> None:
    m = DemandMeter(CAP, peak_windows=(5.0,))
    work = CAP.prefill_work(2000)
    # ten requests 4.6 .. 5.4 s: the 5-s tick boundary cuts the spike in two
    for i in range(10):
        m.arrived(f"r{i}", 2000, 10, 4.6 + 0.08 * i if i < 5 else 5.0 + 0.08 * (i - 4))
        if i == 4:
            first = m.sample(5.0)
    second = m.sample(10.0)
    assert flat(first.prefill_peaks) == pytest.approx(flat(((5.0, 5 * work, 5),)))
    assert first.prefill_work_s == pytest.approx(5 * work)
    # the second tick holds five of them, its window reaches back to the other five
    assert second.prefill_work_s == pytest.approx(5 * work)
    assert flat(second.prefill_peaks) == pytest.approx(flat(((5.0, 10 * work, 10),)))
    # a quiet interval reports no peak; one arrival long after: only itself
    assert m.sample(15.0).prefill_peaks == ()
    m.arrived("late", 2000, 10, 30.0)
    assert flat(m.sample(30.0).prefill_peaks) == pytest.approx(flat(((5.0, work, 1),)))


@pytest.mark.parametrize(
    ("gaps", "window", "expected_n"),
    [
        ([0.125] * 20, 1.0, 8),  # a window (t - 1, t] holds 8 of them
        ([0.125] * 20, 5.0, 20),
        ([2.0] * 5, 1.0, 1),
        ([0.5, 0.5, 3.0, 0.125, 0.125], 1.0, 3),
    ],
)
def test_peak_window_counts_the_densest_run(
    gaps: list[float], window: float, expected_n: int
) -> None:
    m = DemandMeter(CAP, peak_windows=(window,))
    t = 0.0
    for i, g in enumerate(gaps):
        t += g
        m.arrived(f"r{i}", 1000, 10, t)
    ((w, work, n),) = m.sample(t + 1.0).prefill_peaks
    assert (w, n) == (window, expected_n)
    assert work == pytest.approx(expected_n * CAP.prefill_work(1000))


def test_recent_peaks_hold_for_one_window_whoever_reads_them() -> None:
    m = DemandMeter(CAP, peak_windows=(5.0, 10.0))
    work = CAP.prefill_work(1000)
    for i in range(4):
        m.arrived(f"a{i}", 1000, 10, 1.0 + 0.25 * i)
    at6 = m.recent_peaks(6.0)
    assert flat(at6) == pytest.approx(flat(((5.0, 4 * work, 4), (10.0, 4 * work, 4))))
    assert m.recent_peaks(6.0) == at6  # reading changes nothing
    m.sample(6.0)
    assert m.recent_peaks(6.0) == at6  # nor does a sample
    m.arrived("b", 1000, 10, 8.0)
    # 5-s windows ending after 4 s: only b's; 10-s ones: the one ending at 8 s holds all five
    at9 = m.recent_peaks(9.0)
    assert flat(at9) == pytest.approx(flat(((5.0, work, 1), (10.0, 5 * work, 5))))
    assert flat(m.recent_peaks(30.0)) == pytest.approx(flat(((5.0, 0.0, 0), (10.0, 0.0, 0))))


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        ([], []),
        ([[(5.0, 1.0, 2)], [(5.0, 0.5, 1)]], [5.0, 1.5, 3]),
        ([[(5.0, 1.0, 2), (10.0, 2.0, 3)], [(5.0, 0.5, 1)]], [5.0, 1.5, 3]),  # 10 s: one part
        ([[(10.0, 0.0, 0), (5.0, 1.0, 1)]], [5.0, 1.0, 1, 10.0, 0.0, 0]),  # sorted, zeros kept
    ],
)
def test_sum_peaks_adds_the_windows_every_part_reports(
    parts: list[list[tuple[float, float, int]]], expected: list[float]
) -> None:
    assert flat(sum_peaks(parts)) == pytest.approx(expected)
