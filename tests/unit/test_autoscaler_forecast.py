"""The short-horizon forecaster: trend and seasonal tracking, robustness to bursts, its own error
at the horizon, the peak, and immutability of its state."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaler.forecast import (
    ForecastConfig,
    ForecastState,
    current_level,
    forecast,
    observe,
    peak,
    sigma_at_horizon,
    upside_sigma_at_horizon,
)
from controlplane.errors import ConfigError

FLAT = ForecastConfig(season_s=0.0)  # no seasonality
TICK = 10.0


def feed(cfg: ForecastConfig, values: list[float], tick: float = TICK) -> ForecastState:
    state = ForecastState()
    for i, v in enumerate(values):
        state = observe(cfg, state, i * tick, v)
    return state


# -- level and trend ------------------------------------------------------------------------------
@pytest.mark.parametrize("slope", [0.002, 0.01, 0.05])
@pytest.mark.parametrize("tick", [5.0, 10.0, 15.0])
def test_linear_ramp_level_and_trend_are_tracked(slope: float, tick: float) -> None:
    n = int(3000 / tick)
    state = feed(FLAT, [1.0 + slope * i * tick for i in range(n)], tick)
    now = (n - 1) * tick
    assert state.trend == pytest.approx(slope, rel=0.05)
    assert current_level(FLAT, state) == pytest.approx(1.0 + slope * now, rel=0.01)
    # the damped trend reaches 233 of the 250 s: within 2% of the truth at the horizon
    assert forecast(FLAT, state, 250.0) == pytest.approx(1.0 + slope * (now + 250.0), rel=0.02)


def test_irregular_ticks_track_the_ramp_too() -> None:
    rng = random.Random(7)
    state, t = ForecastState(), 0.0
    while t < 3000.0:
        state = observe(FLAT, state, t, 2.0 + 0.01 * t)
        t += rng.uniform(3.0, 20.0)
    assert state.trend == pytest.approx(0.01, rel=0.05)


def test_a_sixty_second_spike_does_not_drag_the_level_but_a_shift_is_followed() -> None:
    rng = random.Random(2)
    base = [5.0 + rng.gauss(0.0, 0.2) for _ in range(200)]
    spike = [20.0 if 100 <= i < 106 else v for i, v in enumerate(base)]  # 6 ticks = 60 s
    shift = [v + 5.0 if i >= 100 else v for i, v in enumerate(base)]
    after_spike = feed(FLAT, spike[:107])
    assert after_spike.level < 6.0  # the spike was +15; the level moved less than 1
    assert feed(FLAT, spike).level == pytest.approx(5.0, abs=0.2)
    assert feed(FLAT, shift[:115]).level == pytest.approx(10.0, abs=0.5)


def test_non_increasing_timestamps_are_ignored() -> None:
    state = feed(FLAT, [1.0, 2.0, 3.0])
    assert observe(FLAT, state, 20.0, 100.0) is state
    assert observe(FLAT, state, 5.0, 100.0) is state


# -- seasonality ----------------------------------------------------------------------------------
def test_seasonality_is_picked_up_after_one_compressed_period() -> None:
    period, horizon = 1000.0, 100.0
    rng = random.Random(3)

    def truth(t: float) -> float:
        return 5.0 + 3.0 * math.sin(2.0 * math.pi * t / period)

    errors: dict[float, float] = {}
    for season in (period, 0.0):
        cfg = ForecastConfig(season_s=season, season_bins=20, horizon_s=horizon)
        state, errs = ForecastState(), []
        for i in range(400):
            t = i * TICK
            if i == 99:
                assert state.seasonal == ()  # not before one full period
            if i >= 200:  # the third period: compare the forecast for t + horizon
                errs.append(abs(forecast(cfg, state, horizon) - truth(t - TICK + horizon)))
            state = observe(cfg, state, t, truth(t) + rng.gauss(0.0, 0.1))
        assert len(state.seasonal) == (20 if season else 0)
        errors[season] = sum(errs) / len(errs)
    assert errors[period] < 0.3
    assert errors[0.0] > 1.0  # without the seasonal term the lagging trend misses the turns


# -- error at the horizon -------------------------------------------------------------------------
@pytest.mark.parametrize("noise", [0.1, 0.5, 1.0])
def test_sigma_at_horizon_approximates_the_noise_of_a_constant_series(noise: float) -> None:
    rng = random.Random(11)
    cfg = ForecastConfig(season_s=0.0, horizon_s=250.0)
    state = feed(cfg, [10.0 + rng.gauss(0.0, noise) for _ in range(3000)])
    assert state.h_n >= cfg.min_horizon_residuals
    assert sigma_at_horizon(cfg, state) == pytest.approx(noise, rel=0.25)
    assert upside_sigma_at_horizon(cfg, state) == pytest.approx(noise, rel=0.3)


def test_sigma_falls_back_to_the_random_walk_rule_before_enough_residuals() -> None:
    cfg = ForecastConfig(season_s=0.0, horizon_s=250.0)
    rng = random.Random(5)
    state = feed(cfg, [10.0 + rng.gauss(0.0, 0.5) for _ in range(20)])  # 190 s < horizon
    assert state.h_n < cfg.min_horizon_residuals
    expected = state.sigma_1 * math.sqrt(250.0 / TICK)
    assert sigma_at_horizon(cfg, state) == pytest.approx(expected)
    assert expected > 0


def test_a_missed_drop_does_not_inflate_the_upside_sigma() -> None:
    # a fall from 8 to 1 over 400 s: every tick stays inside the band (no shift), and the
    # forecasts made on the way down over-forecast
    rng = random.Random(9)
    values = [8.0 + rng.gauss(0.0, 0.1) for _ in range(100)]
    values += [max(1.0, 8.0 - 7.0 * i / 40) + rng.gauss(0.0, 0.1) for i in range(60)]
    state = feed(FLAT, values)
    assert sigma_at_horizon(FLAT, state) > 1.0  # the symmetric error saw the miss
    assert upside_sigma_at_horizon(FLAT, state) < 0.5


@pytest.mark.parametrize("step", [5.0, 30.0])
def test_a_step_is_a_new_level_not_a_forecast_error(step: float) -> None:
    # after the shift is confirmed the forecasts made for the old level are void: the upside
    # sigma at the horizon does not carry the step for the next hour
    rng = random.Random(4)
    values = [1.0 + rng.gauss(0.0, 0.05) for _ in range(100)]
    values += [1.0 + step + rng.gauss(0.0, 0.05) for _ in range(100)]
    state = feed(FLAT, values)
    assert current_level(FLAT, state) == pytest.approx(1.0 + step, rel=0.05)
    assert upside_sigma_at_horizon(FLAT, state) < 0.1 * step


@pytest.mark.parametrize(
    ("ratio", "ticks_to_follow"),
    [
        (math.inf, 9),  # no surge rule: the 90-s shift confirmation (9 ticks of 10 s)
        (3.0, 3),  # a 10x excursion is confirmed after surge_confirm_s = 30 s
    ],
)
def test_a_surge_far_above_the_level_is_followed_sooner(ratio: float, ticks_to_follow: int) -> None:
    cfg = dataclasses.replace(FLAT, surge_ratio=ratio)
    base = [2.0] * 50
    for k in range(1, 12):
        state = feed(cfg, base + [20.0] * k)
        if current_level(cfg, state) > 10.0:
            break
    assert k == ticks_to_follow


def test_a_smaller_excursion_waits_for_the_shift_confirmation() -> None:
    cfg = dataclasses.replace(FLAT, surge_ratio=3.0)
    state = feed(cfg, [2.0] * 50 + [5.0] * 6)  # 2.5x for 60 s: a burst, not a surge
    assert current_level(cfg, state) < 3.0


@pytest.mark.parametrize(
    ("floor", "surge"),
    [
        (0.0, True),  # 0.1 -> 2.0 is 20x the level: a surge
        (1.0, False),  # measured against a floor of 1.0 it is 2x: a burst
        (0.5, True),  # 4x a floor of 0.5
    ],
)
def test_an_upward_surge_is_measured_against_the_surge_floor(floor: float, surge: bool) -> None:
    cfg = dataclasses.replace(FLAT, surge_ratio=3.0, surge_floor=floor)
    state = feed(cfg, [0.1] * 50 + [2.0] * 5)  # 50 s above: past surge_confirm_s
    assert (current_level(cfg, state) > 1.0) == surge


@pytest.mark.parametrize("after", [0.05, 0.2, 0.3])
def test_the_surge_floor_leaves_downward_surges_alone(after: float) -> None:
    values = [0.3] * 50 + [after] * 5
    floored = feed(dataclasses.replace(FLAT, surge_ratio=3.0, surge_floor=1.0), values)
    plain = feed(dataclasses.replace(FLAT, surge_ratio=3.0), values)
    assert floored.level == plain.level


# -- peak and immutability ------------------------------------------------------------------------
series = st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(values=series, horizon=st.floats(min_value=0.0, max_value=2000.0), steps=st.integers(1, 40))
def test_peak_is_at_least_the_level_and_every_point_of_the_path(
    values: list[float], horizon: float, steps: int
) -> None:
    cfg = ForecastConfig(season_s=200.0, season_bins=8)
    state = feed(cfg, values)
    top = peak(cfg, state, horizon, steps)
    assert top >= current_level(cfg, state)
    assert top >= forecast(cfg, state, horizon) - 1e-9
    assert all(top >= forecast(cfg, state, horizon * i / steps) - 1e-9 for i in range(steps + 1))
    assert math.isfinite(top)
    assert top >= 0.0


def test_state_is_frozen_and_observe_returns_a_new_state() -> None:
    state = feed(FLAT, [1.0, 2.0, 3.0])
    snapshot = dataclasses.replace(state)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.level = 9.0  # type: ignore[misc]
    nxt = observe(FLAT, state, 100.0, 50.0)
    assert nxt is not state
    assert state == snapshot
    assert all(
        isinstance(getattr(state, f.name), (int, float, tuple)) for f in dataclasses.fields(state)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        FLAT.alpha = 0.5  # type: ignore[misc]


def test_ring_of_pending_forecasts_stays_small() -> None:
    cfg = ForecastConfig(season_s=0.0, horizon_s=2000.0, ring_size=8)
    state = feed(cfg, [1.0] * 500)
    assert 1 <= len(state.pending) <= 8


def test_an_unknown_horizon_target_is_refused() -> None:
    with pytest.raises(ConfigError, match="horizon_target"):
        ForecastConfig(horizon_target="lvl")  # type: ignore[arg-type]
