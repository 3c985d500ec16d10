"""The autoscaling baselines reproduce their documented behaviour (anchors.md section 3)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaler.baselines import (
    HpaConfig,
    HpaGpuUtilPolicy,
    KpaConfig,
    KpaPolicy,
    RayDefaultConfig,
    RayDefaultPolicy,
    StaticPeakConfig,
    StaticPeakPolicy,
    kpa_target_concurrency,
    peak_rate,
)
from autoscaler.types import (
    DemandSample,
    FleetCounts,
    ScaleContext,
    ScaleDecision,
    ScaleReason,
    ScalingPolicy,
)

TICK = 5.0


def ctx(
    t: float,
    *,
    in_flight: float = 0.0,
    ready: int = 4,
    loading: int = 0,
    util: float = 0.0,
    lo: int = 1,
    hi: int = 64,
) -> ScaleContext:
    sample = DemandSample(
        t_s=t,
        interval_s=TICK,
        in_flight=round(in_flight),
        in_flight_avg=in_flight,
        gpu_util=util,
    )
    fleet = FleetCounts(ready=ready, loading=loading, loading_eta_s=(60.0,) * loading)
    return ScaleContext(sample, fleet, load_time_s=240.0, min_replicas=lo, max_replicas=hi)


def drive(
    policy: ScalingPolicy[Any], steps: list[dict[str, Any]], *, follow: bool = True
) -> list[ScaleDecision]:
    """Feed one context per tick (t = 5, 10, ...). With `follow`, the fleet is the last target
    (ready), as if every change were ready at once."""
    state = policy.initial_state()
    out: list[ScaleDecision] = []
    ready = steps[0].get("ready", 4)
    for i, kw in enumerate(steps):
        t = TICK * (i + 1)
        kw = {"ready": ready, **kw} if follow else kw
        decision, state = policy.decide(ctx(t, **kw), state, t)
        out.append(decision)
        if follow:
            ready = decision.target
    return out


def first_change(decisions: list[ScaleDecision], start: int) -> tuple[float, int] | None:
    for i, d in enumerate(decisions):
        if d.target != start:
            return TICK * (i + 1), d.target
    return None


# -- Ray Serve default ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_flight", "ticks", "expected"),
    [
        # desired = 20 / 2 = 10 > 4: applied once it has held 30 s (first seen at t=5 -> t=35)
        (20.0, 10, (35.0, 10)),
        # desired = 2 / 2 = 1 < 4: held for the 600 s down delay (first seen at t=5 -> t=605)
        (2.0, 130, (605.0, 1)),
        # desired = 8 / 2 = 4 == 4: never changes
        (8.0, 130, None),
    ],
)
def test_ray_delays(in_flight: float, ticks: int, expected: tuple[float, int] | None) -> None:
    decisions = drive(RayDefaultPolicy(), [{"in_flight": in_flight}] * ticks)
    assert first_change(decisions, 4) == expected
    if expected is not None:
        applied = decisions[int(expected[0] / TICK) - 1]
        assert applied.reason in (ScaleReason.THRESHOLD_UP, ScaleReason.THRESHOLD_DOWN)
        assert decisions[0].reason is ScaleReason.DELAY_PENDING


def test_ray_direction_flip_resets_the_timer() -> None:
    # up for 20 s (4 ticks), one tick below target, then up again: the 30 s restart at the flip
    # (a 5-s look-back so the dip is not averaged away)
    policy = RayDefaultPolicy(RayDefaultConfig(look_back_s=5.0))
    steps = [{"in_flight": 20.0}] * 4 + [{"in_flight": 0.0}] + [{"in_flight": 60.0}] * 12
    decisions = drive(policy, steps)
    assert first_change(decisions, 4) == (60.0, 30)  # up seen again at t=30, applied at t=60
    assert decisions[4].reason is ScaleReason.DELAY_PENDING  # the down step was pending


def test_ray_bounds() -> None:
    decisions = drive(RayDefaultPolicy(), [{"in_flight": 400.0, "hi": 8}] * 10)
    assert max(d.target for d in decisions) == 8


# -- Knative KPA -------------------------------------------------------------------------------


def kpa(target: float = 10.0) -> KpaPolicy:
    return KpaPolicy(KpaConfig(target_concurrency=target))  # TV = 7 per replica


def test_kpa_stable_holds_at_the_target() -> None:
    decisions = drive(kpa(), [{"in_flight": 28.0}] * 30)  # 28 / 7 = 4 replicas
    assert {d.target for d in decisions} == {4}


def test_kpa_panics_and_never_decreases_while_panicking() -> None:
    steps = [{"in_flight": 14.0, "ready": 2}] * 12  # steady at 2 replicas (14 / 7)
    steps += [{"in_flight": 70.0, "ready": 2}] * 2  # a burst: the 6-s panic window fills
    steps += [{"in_flight": 0.0, "ready": 2}] * 40  # silence
    decisions = drive(kpa(), steps, follow=False)
    assert decisions[11].reason is not ScaleReason.PANIC
    assert decisions[12].reason is ScaleReason.PANIC  # 6-s average 60.7: 9 >= 2 x 2 replicas
    burst = decisions[13]
    assert burst.target == 10  # dppc = ceil(70 / 7), above the stable window's average (3)
    # while panicking (one stable window after the last over-threshold tick): never lower
    panic = [d for d in decisions[12:] if d.reason is ScaleReason.PANIC]
    assert len(panic) >= 60 / TICK
    assert [d.target for d in panic] == sorted(d.target for d in panic)
    # once out of panic, scale down is limited to ready / 2 per decision
    after = decisions[12 + len(panic)]
    assert after.reason is not ScaleReason.PANIC
    assert after.target == 1


@pytest.mark.parametrize(("ready", "expected"), [(10, 5), (3, 1), (1, 1)])
def test_kpa_max_scale_down_rate(ready: int, expected: int) -> None:
    decisions = drive(kpa(), [{"in_flight": 0.0, "ready": ready}], follow=False)
    assert decisions[0].target == expected


def test_kpa_target_concurrency_littles_law() -> None:
    # 0.7 busy, requests of 0.1 replica-s lasting 2 s at the SLO: 14 in flight per replica
    assert kpa_target_concurrency(0.7, 2.0, 0.1, 256) == pytest.approx(14.0)
    assert kpa_target_concurrency(0.7, 200.0, 0.1, 256) == 256.0


# -- HPA on GPU utilization ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("util", "ready", "loading", "expected"),
    [
        (0.85, 4, 0, 4),  # ratio 1.06: within the 10% tolerance
        (0.75, 4, 0, 4),  # ratio 0.94: within tolerance
        (0.95, 4, 0, 5),  # ratio 1.19: ceil(4.75)
        (1.00, 8, 0, 10),  # ratio 1.25: ceil(10)
        (1.00, 4, 1, 5),  # the loading pod counts 0: 4 / (0.8 * 5) = 1.0 -> hold
        (1.00, 4, 2, 6),  # 4 / (0.8 * 6) < 1 would be a scale-down, but unready: hold
        (0.40, 8, 0, 8),  # down, but the 300 s stabilization window holds it
    ],
)
def test_hpa_recommendation_and_tolerance(
    util: float, ready: int, loading: int, expected: int
) -> None:
    policy = HpaGpuUtilPolicy()
    decision, _ = policy.decide(
        ctx(15.0, util=util, ready=ready, loading=loading), policy.initial_state(), 15.0
    )
    assert decision.target == expected


def test_hpa_scale_down_stabilization_and_sync() -> None:
    steps = [{"util": 0.8}] * 6 + [{"util": 0.2}] * 100  # busy for 30 s, then idle
    decisions = drive(HpaGpuUtilPolicy(), steps)
    change = first_change(decisions, 4)
    assert change is not None
    # syncs at t = 5, 20, 35, ...: the last recommendation of 4 came at t=20 (util 0.8); the
    # max over the 300-s window drops below 4 at the first sync after t=320, on a sync only
    assert change == (320.0, 1)  # 0.2 / 0.8 * 4 = 1
    assert all(d.reason is ScaleReason.HOLD for d in decisions[1:3])  # between syncs


def test_hpa_scale_up_rate_limit() -> None:
    policy = HpaGpuUtilPolicy(HpaConfig(target_utilization=0.1))
    decision, _ = policy.decide(ctx(15.0, util=1.0, ready=2), policy.initial_state(), 15.0)
    assert decision.target == 6  # recommendation 20, limited to max(2 + 4, 2 * 2)
    assert decision.reason is ScaleReason.RATE_LIMITED


# -- static peak -------------------------------------------------------------------------------


def test_static_is_fixed() -> None:
    policy = StaticPeakPolicy(StaticPeakConfig(replicas=7))
    steps: list[dict[str, Any]] = [
        {"in_flight": x, "util": 1.0, "ready": r} for x, r in [(0, 1), (500, 7), (3, 20)]
    ]
    decisions = drive(policy, steps, follow=False)
    assert [d.target for d in decisions] == [7, 7, 7]
    assert {d.reason for d in decisions} == {ScaleReason.STATIC}


def test_peak_rate_is_the_busiest_window() -> None:
    # 1 replica-second per second for 60 s, then a 30-s burst of 4 per second
    arrivals = [float(t) for t in range(60)] + [60.0 + t / 4 for t in range(120)]
    work = [1.0] * 60 + [1.0] * 120
    assert peak_rate(arrivals, work, window_s=60.0, step_s=10.0) == pytest.approx(150.0 / 60.0)


# -- every baseline: bounds and a reason ---------------------------------------------------------

POLICIES: list[ScalingPolicy[Any]] = [
    RayDefaultPolicy(),
    kpa(),
    HpaGpuUtilPolicy(),
    StaticPeakPolicy(StaticPeakConfig(replicas=5)),
]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 500),
            st.floats(0, 1),
            st.integers(1, 40),
            st.integers(0, 5),
        ),
        min_size=1,
        max_size=60,
    ),
    st.integers(1, 4),
    st.integers(4, 30),
)
def test_targets_stay_in_bounds(
    steps: list[tuple[float, float, int, int]], lo: int, hi: int
) -> None:
    for policy in POLICIES:
        kws = [
            {"in_flight": x, "util": u, "ready": r, "loading": n, "lo": lo, "hi": hi}
            for x, u, r, n in steps
        ]
        for d in drive(policy, kws, follow=False):
            assert lo <= d.target <= hi
            assert isinstance(d.reason, ScaleReason)
