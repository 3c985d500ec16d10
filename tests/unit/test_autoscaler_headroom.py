"""The headroom policy: loading replicas count, no flapping, bounds and rate limits, the backlog
term, ski-rental scale-down, reasons and determinism. Contexts are built directly."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaler.capacity import SloCapacity
from autoscaler.forecast import ForecastConfig
from autoscaler.headroom import (
    HeadroomConfig,
    HeadroomPolicy,
    HeadroomState,
    burst_rate,
    headroom_policy,
    staffed,
)
from autoscaler.types import (
    DemandSample,
    FleetCounts,
    ScaleContext,
    ScaleDecision,
    ScaleReason,
    ScalingPolicy,
)
from controlplane.roofline import profile

TICK = 10.0
LOAD = 240.0


@dataclass(frozen=True, slots=True)
class ConstRho:
    """Stand-in for `SloCapacity`: a fixed utilization target."""

    rho: float = 0.8

    ttft_slo_s: float = 2.0

    def utilization_target(
        self, prefill_mean_s: float, prefill_scv: float, replicas: int = 1
    ) -> float:
        return self.rho


def sample(t: float, rate: float, backlog: float = 0.0, interval: float = TICK) -> DemandSample:
    return DemandSample(
        t_s=t,
        interval_s=interval,
        arrivals=10,
        prefill_work_s=0.25 * rate * interval,
        decode_work_s=0.75 * rate * interval,
        backlog_work_s=backlog,
        prefill_mean_s=0.1,
    )


def context(
    s: DemandSample, ready: int, loading: int = 0, lo: int = 1, hi: int = 64, load: float = LOAD
) -> ScaleContext:
    return ScaleContext(s, FleetCounts(ready, loading), load, lo, hi, TICK)


Run = list[tuple[float, ScaleDecision]]


def drive(
    policy: HeadroomPolicy, rates: list[float], start: int, load: float = LOAD
) -> tuple[Run, HeadroomState]:
    """A fleet that applies every target at once (current = the last target)."""
    state, current, out = policy.initial_state(), start, []
    for i, rate in enumerate(rates):
        t = i * TICK
        decision, state = policy.decide(context(sample(t, rate), current, load=load), state, t)
        out.append((t, decision))
        current = decision.target
    return out, state


def changes(run: Run, start: int) -> list[float]:
    """Times at which the target's direction of movement reversed."""
    steps, prev = [], start
    for t, d in run:
        if d.target != prev:
            steps.append((t, 1 if d.target > prev else -1))
        prev = d.target
    return [t for (_, a), (t, b) in itertools.pairwise(steps) if a != b]


def warmed(policy: HeadroomPolicy, rate: float, ready: int, ticks: int = 40) -> HeadroomState:
    state = policy.initial_state()
    for i in range(ticks):
        _, state = policy.decide(context(sample(i * TICK, rate), ready), state, i * TICK)
    return state


# square-root staffing on (the default is off) so the tests' figures exercise that term too
BETA = 0.5
POLICY = HeadroomPolicy(HeadroomConfig(ConstRho(0.8), beta=BETA))
_CONFORMS: ScalingPolicy[HeadroomState] = POLICY  # mypy checks the protocol


def test_policy_name_and_initial_state() -> None:
    assert POLICY.name == "headroom"
    assert POLICY.initial_state() == HeadroomState()


# -- loading replicas are supply ------------------------------------------------------------------
def test_steady_rate_three_needs_five() -> None:
    assert staffed(3.0, 0.0, 0.8, 2.33, 0.5) == pytest.approx((3.0 + 0.5 * 3.0**0.5) / 0.8)
    state = warmed(POLICY, 3.0, 5)
    d, _ = POLICY.decide(context(sample(400.0, 3.0), 5), state, 400.0)
    assert (d.target, d.reason) == (5, ScaleReason.HOLD)


@pytest.mark.parametrize(
    ("ready", "loading", "target", "reason"),
    [
        (2, 3, 5, ScaleReason.LOADING_COVERS),
        (0, 5, 5, ScaleReason.LOADING_COVERS),
        (4, 1, 5, ScaleReason.LOADING_COVERS),
        (2, 0, 5, ScaleReason.FORECAST_UP),  # the same need without loading replicas orders 3
        (2, 2, 5, ScaleReason.FORECAST_UP),
    ],
)
def test_loading_replicas_count_as_capacity_arriving(
    ready: int, loading: int, target: int, reason: ScaleReason
) -> None:
    state = warmed(POLICY, 3.0, 5)
    d, _ = POLICY.decide(context(sample(400.0, 3.0), ready, loading), state, 400.0)
    assert (d.target, d.reason) == (target, reason)


# -- no flapping ----------------------------------------------------------------------------------
EAGER = ForecastConfig(alpha=0.6, beta=0.1, shift_confirm_s=20.0, season_s=0.0)
SAWTOOTH = [2.0 + 6.0 * ((i * TICK) % 120.0) / 120.0 for i in range(360)]  # period 120 s


@pytest.mark.parametrize("hysteresis", [150.0, 300.0, 900.0])
def test_sawtooth_gives_at_most_one_direction_change_per_hysteresis_window(
    hysteresis: float,
) -> None:
    # a policy made to flap (20 s loads, no re-use horizon, no reload cost, an eager forecaster)
    def eager(h: float) -> HeadroomPolicy:
        return HeadroomPolicy(
            HeadroomConfig(
                ConstRho(0.8),
                reuse_horizon_s=0.0,
                reload_cost_s=0.0,
                hysteresis_s=h,
                max_step_down=8,
                warmup_s=0.0,
                forecast=EAGER,
            )
        )

    flips = changes(drive(eager(0.0), SAWTOOTH, 10, load=20.0)[0], 10)
    assert any(b - a < hysteresis for a, b in itertools.pairwise(flips))  # it flaps
    run, _ = drive(eager(hysteresis), SAWTOOTH, 10, load=20.0)
    flips = changes(run, 10)
    assert len(flips) >= 2
    assert all(b - a >= hysteresis for a, b in itertools.pairwise(flips))


def test_default_policy_settles_under_a_sawtooth_and_never_flaps() -> None:
    # the warm-up overshoots (no way down while warming up); once the horizon residuals exist
    # the surplus is shed step by step, and the sawtooth's teeth never bring it back up: the
    # recent need's peak (re-use horizon) and the deadband keep every tooth's replicas
    run, _ = drive(POLICY, SAWTOOTH, 10)
    flips = changes(run, 10)
    assert all(b - a >= POLICY.config.hysteresis_s for a, b in itertools.pairwise(flips))
    targets = [d.target for t, d in run if t >= 1200.0]
    assert all(b <= a for a, b in itertools.pairwise(targets))
    assert min(targets) >= 8  # the teeth's peaks (8 replicas of work) stay covered


# -- bounds and rate limits -----------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    rates=st.lists(st.floats(0.0, 200.0), min_size=1, max_size=12),
    backlog=st.floats(0.0, 5000.0),
    ready=st.integers(0, 80),
    loading=st.integers(0, 20),
    lo=st.integers(0, 10),
    span=st.integers(0, 40),
    up=st.integers(1, 10),
    down=st.integers(1, 10),
    rho=st.floats(0.05, 1.0),
)
def test_bounds_and_rate_limits_hold_for_any_sample_and_fleet(
    rates: list[float],
    backlog: float,
    ready: int,
    loading: int,
    lo: int,
    span: int,
    up: int,
    down: int,
    rho: float,
) -> None:
    policy = HeadroomPolicy(
        HeadroomConfig(ConstRho(rho), beta=BETA, max_step_up=up, max_step_down=down)
    )
    hi = lo + span
    state = policy.initial_state()
    for i, rate in enumerate(rates):
        t = i * TICK
        ctx = ScaleContext(
            sample(t, rate, backlog), FleetCounts(ready, loading), LOAD, lo, hi, TICK
        )
        d, state = policy.decide(ctx, state, t)
        assert isinstance(d.reason, ScaleReason)
        assert lo <= d.target <= hi
        current = ready + loading
        if lo <= current <= hi:
            assert -down <= d.target - current <= up
        else:  # the bounds win over the rate limits
            assert -max(down, current - hi) <= d.target - current <= max(up, lo - current)
        ready, loading = d.target, 0


# -- backlog --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("backlog", "ready"), [(0.0, 5), (100.0, 5), (500.0, 5), (1000.0, 5)])
def test_backlog_term_adds_what_the_ready_fleet_cannot_drain(backlog: float, ready: int) -> None:
    policy = HeadroomPolicy(
        HeadroomConfig(ConstRho(0.8), beta=BETA, drain_time_s=100.0, max_step_up=64)
    )
    state = warmed(policy, 3.0, ready)
    d, _ = policy.decide(context(sample(400.0, 3.0, backlog), ready), state, 400.0)
    f = d.figures()
    base = max(f["need_rate"], f["need_burst"])
    spare = max(0.0, ready - base)
    assert f["need_backlog"] == pytest.approx(max(0.0, backlog - spare * 100.0) / 100.0)
    assert d.target == max(ready, math.ceil(base + f["need_backlog"] - 1e-9))
    grows = f["need_backlog"] > 0 and d.target > ready
    assert d.reason == (ScaleReason.BACKLOG_DRAIN if grows else ScaleReason.HOLD)


# (backlog at the router, per-replica dispatched backlog, ready, need_backlog with D = 100 s
# and a need of 3 / 0.8 = 3.75 replicas): a replica's own queue keeps it busy for at most all of
# D, whatever its length; the router's queue drains on any replica
@pytest.mark.parametrize(
    ("queued", "pinned", "ready", "expected"),
    [
        (0.0, (), 4, 0.0),
        (0.0, (5000.0,), 4, 1.0 - 0.25),  # a step's pile on one replica: one replica, not 50
        (0.0, (5000.0, 5000.0), 4, 2.0 - 0.25),
        (0.0, (50.0, 50.0), 4, 1.0 - 0.25),  # short queues: b / D each, as at the router
        (500.0, (5000.0,), 4, 5.0 + 1.0 - 0.25),
        (500.0, (), 4, 5.0 - 0.25),
        (0.0, (5000.0,), 10, 0.0),  # six spare replicas absorb it
    ],
)
def test_dispatched_backlog_occupies_only_the_replica_holding_it(
    queued: float, pinned: tuple[float, ...], ready: int, expected: float
) -> None:
    policy = HeadroomPolicy(HeadroomConfig(ConstRho(0.8), drain_time_s=100.0, max_step_up=64))
    state = warmed(policy, 3.0, ready)
    s = replace(
        sample(400.0, 3.0, queued + sum(pinned)), backlog_by_replica=tuple(sorted(pinned))[::-1]
    )
    d, _ = policy.decide(context(s, ready), state, 400.0)
    f = d.figures()
    assert max(f["need_rate"], f["need_burst"]) == pytest.approx(3.75)
    assert f["need_backlog"] == pytest.approx(expected)
    assert f["backlog_pinned_replicas"] == pytest.approx(sum(min(1.0, b / 100.0) for b in pinned))


def test_a_backlog_the_ready_spare_drains_orders_nothing() -> None:
    policy = HeadroomPolicy(HeadroomConfig(ConstRho(0.8), beta=BETA, drain_time_s=100.0))
    state = warmed(policy, 3.0, 20)
    d, _ = policy.decide(context(sample(400.0, 3.0, 500.0), 20), state, 400.0)
    assert d.figures()["need_backlog"] == 0.0  # 15 spare replicas drain 500 s of work in 100 s


# -- ski-rental scale-down ------------------------------------------------------------------------
def test_a_brief_dip_does_not_scale_down() -> None:
    rates = [8.0] * 60 + [1.0] * 6 + [8.0] * 100
    run, _ = drive(POLICY, rates, 12)
    targets = [d.target for t, d in run if t >= 300.0]
    assert min(targets) >= 12
    assert all(d.reason != ScaleReason.SCALE_DOWN for _, d in run)


def test_a_sustained_drop_scales_down_after_the_break_even_time() -> None:
    rates = [8.0] * 60 + [1.0] * 200
    run, _ = drive(POLICY, rates, 12)
    downs = [(t, d) for t, d in run if d.reason == ScaleReason.SCALE_DOWN]
    assert downs and run[-1][1].target < 12
    first_t, _first = next((t, d) for t, d in run if d.target < 12)
    assert first_t >= 600.0 + LOAD  # the surplus had to last the reload cost / idle cost
    assert any(d.reason == ScaleReason.DOWN_NOT_WORTH_IT for t, d in run if t < first_t)
    figures = downs[0][1].figures()
    assert figures["surplus_s"] >= figures["break_even_s"] == LOAD
    assert run[-1][1].target == staffed_target(1.0)


def staffed_target(rate: float) -> int:
    return -int(-staffed(rate, 0.0, 0.8, 2.33, 0.5) // 1)


def test_a_shorter_reload_sheds_sooner() -> None:
    fast = HeadroomPolicy(HeadroomConfig(ConstRho(0.8), beta=BETA, reload_cost_s=60.0))
    rates = [8.0] * 60 + [1.0] * 100
    first = {
        name: next(t for t, d in drive(p, rates, 12)[0] if d.target < 12)
        for name, p in (("default", POLICY), ("fast", fast))
    }
    assert first["fast"] < first["default"]


# -- no data, warm-up, reasons, determinism -------------------------------------------------------
@pytest.mark.parametrize(
    "s", [sample(400.0, 3.0, interval=0.0), sample(300.0, 3.0)], ids=["no-interval", "stale"]
)
def test_missing_or_stale_samples_hold_and_leave_the_forecaster_alone(s: DemandSample) -> None:
    state = warmed(POLICY, 3.0, 5)
    d, nxt = POLICY.decide(context(s, 7), state, 400.0)
    assert (d.target, d.reason) == (7, ScaleReason.NO_DATA)
    assert nxt.forecast == state.forecast


def test_warming_up_never_goes_down_but_may_go_up() -> None:
    state = POLICY.initial_state()
    d, state = POLICY.decide(context(sample(0.0, 1.0), 20), state, 0.0)
    assert (d.target, d.reason) == (20, ScaleReason.WARMING_UP)
    d, _ = POLICY.decide(context(sample(10.0, 6.0), 2), state, 10.0)
    assert d.target > 2 and d.reason == ScaleReason.WARMING_UP


def test_detail_carries_the_figures() -> None:
    state = warmed(POLICY, 3.0, 5)
    d, _ = POLICY.decide(context(sample(400.0, 3.0, 50.0), 5), state, 400.0)
    figures = d.figures()
    for key in ("rate", "level", "trend", "forecast_peak", "sigma_h", "rho_target", "need_rate"):
        assert key in figures
    assert figures["rate"] == pytest.approx(3.0)
    assert figures["rho_target"] == pytest.approx(0.8)
    assert figures["forecast_peak"] >= figures["level"]


def test_rho_comes_from_the_slo_capacity() -> None:
    capacity = SloCapacity.build(profile("h100", "llama-3.1-8b"), ttft_slo_s=2.0, tpot_slo_s=0.05)
    policy = HeadroomPolicy(HeadroomConfig(capacity))
    s = DemandSample(400.0, TICK, 10, 1.0, 20.0, prefill_mean_s=0.1, prefill_scv=2.0)
    d, _ = policy.decide(context(s, 5), policy.initial_state(), 400.0)
    rho = d.figures()["rho_target"]
    # pooled over the fleet size the need implies: one of M/G/c's figures, at least M/G/1's
    pooled = [capacity.utilization_target(0.1, 2.0, c) for c in range(1, 65)]
    assert rho >= capacity.utilization_target(0.1, 2.0)
    assert any(rho == pytest.approx(p) for p in pooled)


@settings(max_examples=30, deadline=None)
@given(rates=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=40), start=st.integers(0, 30))
def test_decide_is_deterministic(rates: list[float], start: int) -> None:
    a, sa = drive(POLICY, rates, start)
    b, sb = drive(POLICY, rates, start)
    assert a == b
    assert sa == sb
    assert all(isinstance(d.reason, ScaleReason) for _, d in a)


@pytest.mark.parametrize(
    ("rate", "current", "lo", "hi", "target", "reason"),
    [
        (8.0, 6, 1, 8, 8, ScaleReason.AT_MAX),  # needs 12
        (8.0, 8, 1, 8, 8, ScaleReason.AT_MAX),
        (1.0, 6, 6, 64, 6, ScaleReason.AT_MIN),  # needs 2
        (8.0, 2, 1, 64, 10, ScaleReason.RATE_LIMITED),  # +8 per decision
    ],
)
def test_bounds_and_rate_limits_are_named_in_the_reason(
    rate: float, current: int, lo: int, hi: int, target: int, reason: ScaleReason
) -> None:
    state = warmed(POLICY, rate, 12)
    ctx = context(sample(400.0, rate), current, lo=lo, hi=hi)
    d, _ = POLICY.decide(ctx, state, 400.0)
    assert (d.target, d.reason) == (target, reason)


def test_factory_from_plain_values() -> None:
    policy = headroom_policy("h100", "llama-3.1-8b", ttft_slo_s=2.0, z=1.64, max_step_up=4)
    assert isinstance(policy.config.capacity, SloCapacity)
    assert (policy.config.z, policy.config.max_step_up) == (1.64, 4)
    with pytest.raises(TypeError):
        headroom_policy(no_such_field=1.0)


# -- bursts shorter than the lead time ------------------------------------------------------------
def _run_split(ticks: list[tuple[float, float]]) -> ScaleDecision:
    """Drive the default policy with (prefill, decode) work rates per tick; the last decision."""
    state, current, last = POLICY.initial_state(), 4, None
    for i, (p, d) in enumerate(ticks):
        t = i * TICK
        s = DemandSample(t, TICK, 10, p * TICK, d * TICK, prefill_mean_s=0.1, prefill_scv=1.0)
        last, state = POLICY.decide(context(s, current), state, t)
        current = last.target
    assert last is not None
    return last


@pytest.mark.parametrize(("prefill", "decode"), [(1.0, 0.0), (0.5, 0.5)])
def test_prefill_bursts_shorter_than_the_lead_time_buy_headroom(
    prefill: float, decode: float
) -> None:
    mean = 4.0
    smooth = [(mean * prefill, mean * decode)] * 400
    # the same mean, its prefill arriving in one tick out of eight
    bursty = [((8 * mean * prefill if i % 8 == 0 else 0.0), mean * decode) for i in range(400)]
    calm, spiky = _run_split(smooth), _run_split(bursty)
    assert spiky.figures()["burst_factor"] > 4 * calm.figures()["burst_factor"]
    assert spiky.target > calm.target
    # only the prefill part is bursty at the TTFT scale: the surge grows with its share
    assert spiky.figures()["prefill_share"] == pytest.approx(prefill, abs=0.02)


def test_decode_wobbles_do_not_count_as_bursts() -> None:
    # after a steady start (a cold forecaster's first samples are its own story)
    bursty_decode = [(1.0, (16.0 if i % 8 == 0 and i >= 100 else 2.0)) for i in range(400)]
    steady = [(1.0, 2.0)] * 400
    a, b = _run_split(bursty_decode), _run_split(steady)
    assert a.figures()["burst_factor"] == pytest.approx(b.figures()["burst_factor"])


# -- a step is a new level ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("surge_min_ratio", "orders_by_s"),
    [
        (3.0, 40.0),  # 30x the level: a surge, followed after 30 s (+ one tick)
        (math.inf, 310.0),  # without the surge rule the level waits for the 300-s confirmation
    ],
)
def test_a_step_far_above_any_burst_is_followed_within_seconds(
    surge_min_ratio: float, orders_by_s: float
) -> None:
    policy = HeadroomPolicy(
        HeadroomConfig(ConstRho(0.8), beta=BETA, surge_min_ratio=surge_min_ratio, max_step_up=64)
    )
    rates = [0.3] * 60 + [9.0] * 60  # the step at 600 s
    run, _ = drive(policy, rates, start=1)
    need = math.ceil(9.0 / 0.8)
    first = next((t for t, d in run if t >= 600.0 and d.target >= need), math.inf)
    assert first - 600.0 <= orders_by_s
    if math.isinf(surge_min_ratio):
        assert first - 600.0 > 40.0
    # and the step does not stay in the forecast error: no more than the rate and burst need
    # plus rounding once it is followed (no backlog here)
    assert max(d.target for _, d in run) <= need + 3


# -- the burst measure: the sharpest window of one tick -------------------------------------------
@pytest.mark.parametrize(
    ("prefill", "peaks", "expected"),
    [
        (20.0, (), 2.0),  # no peaks: the interval's mean rate
        (20.0, ((5.0, 90.0, 50),), 2.0),  # a window shorter than the tick is not this measure
        (20.0, ((10.0, 40.0, 100), (15.0, 60.0, 100)), 40.0 / 12.0 * 12.0 / 10.0),
        (5.0, ((10.0, 30.0, 2),), 2.0 * 12.0 / 10.0),  # two requests use two replicas at most
        (30.0, ((10.0, 30.0, 1),), 3.0),  # never below the interval's own rate
    ],
)
def test_burst_rate_reads_the_one_tick_window(
    prefill: float, peaks: tuple[tuple[float, float, int], ...], expected: float
) -> None:
    s = DemandSample(10.0, TICK, 10, prefill, 0.0, prefill_peaks=peaks)
    assert burst_rate(s, TICK, 2.0) == pytest.approx(expected)


def test_a_spike_counts_the_same_wherever_the_tick_boundaries_cut_it() -> None:
    """The same spike every 16 ticks, whole in one tick or halved over two: with the sliding
    window the burst factor is the same; the tick totals alone see half of it when cut."""

    def run(cut: bool, peaks: bool) -> float:
        state, current, last = POLICY.initial_state(), 4, None
        for i in range(400):
            t = i * TICK
            spike = i % 16 in ((0, 1) if cut else (0,))
            work = (40.0 if cut else 80.0) if spike else 10.0
            # the meter's window: the first half of a cut spike alone, then all of it
            seen = (40.0 if cut and i % 16 == 0 else 80.0) if spike else 10.0
            window = ((TICK, seen, 40 if spike else 5),) if peaks else ()
            s = DemandSample(t, TICK, 10, work, 0.0, prefill_mean_s=0.1, prefill_peaks=window)
            last, state = POLICY.decide(context(s, current), state, t)
            current = last.target
        assert last is not None
        return last.figures()["burst_factor"]

    assert run(cut=True, peaks=True) == pytest.approx(run(cut=False, peaks=True))
    assert run(cut=True, peaks=False) < run(cut=False, peaks=False)


# -- light traffic: bursts in replicas, not in multiples of a tiny level --------------------------
@pytest.mark.parametrize(("floor", "scales_with_level"), [(1.0, False), (0.0, True)])
def test_below_the_burst_floor_a_remembered_burst_is_carried_in_replicas(
    floor: float, scales_with_level: bool
) -> None:
    """Spikes of 1 replica of prefill every 30 ticks over a level of 0.02, then the level
    rises to 0.3 (still light). Floored, the memory holds the spikes' 1 replica; as a ratio
    to the old mean (about 15x) they now ask for 15x the new level: 4 replicas."""
    policy = HeadroomPolicy(HeadroomConfig(ConstRho(0.8), burst_floor=floor))
    state, current, last = policy.initial_state(), 3, None
    rates = [(1.0 if i % 30 == 0 else 0.02) for i in range(240)] + [0.3] * 30
    for i, p in enumerate(rates):
        t = i * TICK
        s = DemandSample(t, TICK, 5, p * TICK, 0.0, prefill_mean_s=0.1, prefill_scv=1.0)
        last, state = policy.decide(context(s, current), state, t)
        current = last.target
    assert last is not None
    need = last.figures()["need_burst"]
    absorb = TICK / (TICK + 2.0 - 0.1)
    if scales_with_level:
        assert need > 3 * absorb
    else:
        assert need < 1.5 * absorb
