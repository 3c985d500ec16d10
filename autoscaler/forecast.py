"""Short-horizon demand forecaster that measures its own error at the load-time horizon.

A pure function over a frozen state: `observe(cfg, state, t_s, value)` folds one demand sample
(replicas of work, at irregular tick times) into a new `ForecastState`; `forecast`, `peak` and
`sigma_at_horizon` read it. One `observe` at time `t` after the previous one at `t - dt`:

1. Prediction. `f = level + trend * g(dt) + s(t)`, where `g(h) = tau (1 - exp(-h / tau))` is
   the damped trend's reach over `h` seconds (`tau = trend_damping_s`; `g(h) = h` when 0) and
   `s(t)` the seasonal index, interpolated between bin centres (0 until seasonality is on).
2. Robust input (bursts shorter than the horizon must not drag the level). With
   `e = value - f` and `band = clip_k * max(sigma_1, clip_floor_frac * |f|, clip_floor_abs)`:
   inside the band the input is the value; outside it is winsorised to `f +- band`, unless the
   same-sign excursion has lasted `shift_confirm_s` (90 s, longer than the <= 80 s bursts of
   the Azure code trace): then it is a level shift, the level is re-seeded at the mean of the
   excursion's values, the trend reset to 0, and the value is taken as is. A 60 s spike moves
   the level by at most `alpha * band` per tick; a real step is followed after 90 s. An
   excursion whose mean is `surge_ratio` times the forecast or more (or 1 / `surge_ratio` of
   it or less) is confirmed after `surge_confirm_s` already (off by default). At a confirmed
   shift the horizon forecasts still pending are dropped: they were made for the old level, and
   a step is a new level, not a forecast error to carry in sigma.
3. Holt update with factors scaled to the gap, `a = 1 - (1 - alpha)^(dt / tick_s)` (same for
   beta): `level' = a (x - s(t)) + (1 - a)(level + trend g(dt))`,
   `trend' = b (level' - level) / dt + (1 - b) trend`.
4. Seasonality (period `season_s`, `season_bins` bins; daily by default, configurable so a
   compressed "day" can be tested). During the first full period the inputs are only summed per
   bin; once `t - t_first >= season_s` the indices become `bin mean - mean of bin means`, the
   level is re-based to `level - s(t)` (the forecast does not jump) and the trend reset. Then
   each input moves the two bins around `t` by `gamma` per period (`1 - (1-gamma)^(dt/bin)`).
5. Errors. One-step: `sigma_1^2` is an EW mean of `(x - f)^2` (memory `sigma_tau_s`; winsorised
   residuals, so a burst grows it by a bounded factor per tick). At the horizon `H`: every
   `H / ring_size` seconds the point forecast `forecast(H)` is pushed on a ring of at most
   `ring_size` entries `(made, due, forecast)`; at the first observation at or after `due` the
   residual `x - forecast` updates an EW mean (`bias`) and variance (weight `max(1/n, 1 /
   horizon_memory)`), and the mean of `max(residual, 0)^2`; entries resolved more than `H/2`
   late are dropped. `sigma_at_horizon` is that std once `min_horizon_residuals` exist, else
   the random-walk fallback `sigma_1 * sqrt(max(1, H / tick))` with `tick` the mean observed
   gap (conservative: with stationary noise the measured sigma saturates well below it).
   `upside_sigma_at_horizon` = `sqrt(2 mean(max(residual, 0)^2))` (same fallback) counts only
   under-forecasts: what a safety stock is for; a missed drop must not inflate it.

Non-increasing timestamps are ignored (the state is returned unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from controlplane.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ForecastConfig:
    tick_s: float = 10.0  # the gap `alpha` and `beta` are quoted for
    alpha: float = 0.15  # level smoothing per tick (time constant ~60 s)
    beta: float = 0.02  # trend smoothing per tick (~500 s: a slope, not a wiggle)
    trend_damping_s: float = 1800.0  # g(250 s) = 233 s; 0 = undamped
    season_s: float = 86400.0  # 0 disables seasonality
    season_bins: int = 48
    gamma: float = 0.2  # weight of the newest period in a seasonal bin
    horizon_s: float = 250.0  # the horizon whose error is tracked (load time + tick)
    clip_k: float = 3.0
    clip_floor_frac: float = 0.05
    clip_floor_abs: float = 0.05
    shift_confirm_s: float = 90.0
    # a far larger excursion is confirmed sooner: its values' mean at least `surge_ratio` times
    # the forecast (or at most 1 / surge_ratio of it) for `surge_confirm_s`; inf = never
    surge_ratio: float = math.inf
    surge_confirm_s: float = 30.0
    # an upward surge is measured against at least this level (below it, a ratio to the level
    # is noise: a 40-s spike at a few requests a minute is not a new level)
    surge_floor: float = 0.0
    sigma_tau_s: float = 600.0
    # what a horizon forecast is scored against: "value" (the raw sample) or "level" (the
    # smoothed level + season at the due time: the error of forecasting the level, without
    # the sample noise; for a user that covers bursts with a separate term)
    horizon_target: Literal["value", "level"] = "value"
    ring_size: int = 16
    horizon_memory: int = 64
    min_horizon_residuals: int = 8

    def __post_init__(self) -> None:
        if self.horizon_target not in ("value", "level"):
            raise ConfigError(
                f"horizon_target must be 'value' or 'level', not {self.horizon_target!r}"
            )


@dataclass(frozen=True, slots=True)
class ForecastState:
    n: int = 0
    t_first_s: float = 0.0
    t_s: float = 0.0
    level: float = 0.0
    trend: float = 0.0  # replicas per second
    var1: float = 0.0  # EW mean square of one-step residuals
    dt_mean: float = 0.0
    # the current out-of-band excursion: sign, duration, sum and count of its values
    run_sign: int = 0
    run_s: float = 0.0
    run_sum: float = 0.0
    run_n: int = 0
    seasonal: tuple[float, ...] = ()  # empty until one full period has been seen
    season_sum: tuple[float, ...] = ()
    season_cnt: tuple[int, ...] = ()
    pending: tuple[tuple[float, float, float], ...] = ()  # (made, due, forecast)
    h_n: int = 0
    h_mean: float = 0.0
    h_var: float = 0.0
    h_up2: float = 0.0  # EW mean of max(residual, 0)^2: the under-forecast side

    @property
    def sigma_1(self) -> float:
        return math.sqrt(self.var1)


def _reach(cfg: ForecastConfig, h: float) -> float:
    tau = cfg.trend_damping_s
    return h if tau <= 0 else tau * (1.0 - math.exp(-h / tau))


def _bins(cfg: ForecastConfig, t: float) -> tuple[int, int, float]:
    """The two bins whose centres bracket `t`, and the weight of the second."""
    x = (t % cfg.season_s) / cfg.season_s * cfg.season_bins - 0.5
    b0 = math.floor(x)
    w = x - b0
    return b0 % cfg.season_bins, (b0 + 1) % cfg.season_bins, w


def _season(cfg: ForecastConfig, state: ForecastState, t: float) -> float:
    if not state.seasonal:
        return 0.0
    b0, b1, w = _bins(cfg, t)
    return state.seasonal[b0] * (1.0 - w) + state.seasonal[b1] * w


def _surging(cfg: ForecastConfig, mean: float, base: float) -> bool:
    """An excursion whose mean is `surge_ratio` times the forecast level or more (or less)."""
    if math.isinf(cfg.surge_ratio):
        return False
    base = max(base, cfg.clip_floor_abs)
    up = mean >= cfg.surge_ratio * max(base, cfg.surge_floor)
    return up or mean * cfg.surge_ratio <= base


def _factor(per_tick: float, dt: float, tick: float) -> float:
    if per_tick >= 1.0:
        return 1.0
    return 1.0 - math.exp(math.log1p(-per_tick) * dt / tick)


def forecast(cfg: ForecastConfig, state: ForecastState, horizon_s: float) -> float:
    """Point forecast of the demand `horizon_s` after the last observation (never negative)."""
    t = state.t_s + horizon_s
    return max(0.0, state.level + state.trend * _reach(cfg, horizon_s) + _season(cfg, state, t))


def current_level(cfg: ForecastConfig, state: ForecastState) -> float:
    """The smoothed demand now (level plus the current seasonal index)."""
    return forecast(cfg, state, 0.0)


def peak(cfg: ForecastConfig, state: ForecastState, horizon_s: float, steps: int = 16) -> float:
    """Max of the forecast path at `steps + 1` points over `[now, now + horizon_s]`."""
    k = max(1, steps)
    path = (forecast(cfg, state, horizon_s * i / k) for i in range(k + 1))
    return max(current_level(cfg, state), *path)


def sigma_at_horizon(cfg: ForecastConfig, state: ForecastState) -> float:
    """Std of the forecast error at `cfg.horizon_s` (see the module docstring for the rule)."""
    if state.h_n >= cfg.min_horizon_residuals:
        return math.sqrt(state.h_var)
    tick = state.dt_mean if state.dt_mean > 0 else cfg.tick_s
    # scored against the level: the one-step noise reaches it through the smoothing only
    smooth = 1.0 if cfg.horizon_target == "value" else math.sqrt(cfg.alpha / (2.0 - cfg.alpha))
    return state.sigma_1 * smooth * math.sqrt(max(1.0, cfg.horizon_s / tick))


def upside_sigma_at_horizon(cfg: ForecastConfig, state: ForecastState) -> float:
    """`sqrt(2 E[max(residual, 0)^2])`: the std of a symmetric error with the same upper
    semi-deviation about zero. It counts under-forecasts (and a positive bias) only, so a missed
    drop in demand does not inflate the safety stock; same fallback as `sigma_at_horizon`."""
    if state.h_n >= cfg.min_horizon_residuals:
        return math.sqrt(2.0 * state.h_up2)
    return sigma_at_horizon(cfg, state)


def bias_at_horizon(cfg: ForecastConfig, state: ForecastState) -> float:
    """EW mean of `actual - forecast` at the horizon (0 until enough residuals exist)."""
    return state.h_mean if state.h_n >= cfg.min_horizon_residuals else 0.0


def _first(cfg: ForecastConfig, t: float, value: float) -> ForecastState:
    on = cfg.season_s > 0 and cfg.season_bins > 0
    sums = tuple(0.0 for _ in range(cfg.season_bins)) if on else ()
    cnts = tuple(0 for _ in range(cfg.season_bins)) if on else ()
    state = ForecastState(n=1, t_first_s=t, t_s=t, level=value, season_sum=sums, season_cnt=cnts)
    return _accumulate(cfg, state, t, value)


def _accumulate(cfg: ForecastConfig, state: ForecastState, t: float, x: float) -> ForecastState:
    """First period: sum the input into its bin; enable the indices once the period is full."""
    if not state.season_sum:
        return state
    b = int((t % cfg.season_s) / cfg.season_s * cfg.season_bins) % cfg.season_bins
    sums = tuple(v + x if i == b else v for i, v in enumerate(state.season_sum))
    cnts = tuple(c + 1 if i == b else c for i, c in enumerate(state.season_cnt))
    if t - state.t_first_s < cfg.season_s:
        return replace(state, season_sum=sums, season_cnt=cnts)
    means = [s / c if c else math.nan for s, c in zip(sums, cnts, strict=True)]
    seen = [m for m in means if not math.isnan(m)]
    centre = sum(seen) / len(seen)
    seasonal = tuple(0.0 if math.isnan(m) else m - centre for m in means)
    on = replace(state, seasonal=seasonal, season_sum=(), season_cnt=(), trend=0.0)
    return replace(on, level=state.level - _season(cfg, on, t))


def _reseason(
    cfg: ForecastConfig, state: ForecastState, t: float, err: float, dt: float
) -> ForecastState:
    b0, b1, w = _bins(cfg, t)
    g = _factor(cfg.gamma, dt, cfg.season_s / cfg.season_bins)
    s = list(state.seasonal)
    s[b0] += g * (1.0 - w) * err
    s[b1] += g * w * err
    return replace(state, seasonal=tuple(s))


def _track_horizon(cfg: ForecastConfig, state: ForecastState, t: float, x: float) -> ForecastState:
    n, mean, var, up2 = state.h_n, state.h_mean, state.h_var, state.h_up2
    keep: list[tuple[float, float, float]] = []
    for made, due, f in state.pending:
        if due > t:
            keep.append((made, due, f))
        elif t - due <= cfg.horizon_s / 2:
            n += 1
            lam = max(1.0 / n, 1.0 / cfg.horizon_memory)
            d = (x - f) - mean
            mean += lam * d
            var = (1.0 - lam) * (var + lam * d * d)
            up2 += lam * (max(0.0, x - f) ** 2 - up2)
    spacing = cfg.horizon_s / max(1, cfg.ring_size)
    if not keep or t - keep[-1][0] >= spacing:
        keep.append((t, t + cfg.horizon_s, forecast(cfg, state, cfg.horizon_s)))
    ring = tuple(keep[-max(1, cfg.ring_size) :])
    return replace(state, pending=ring, h_n=n, h_mean=mean, h_var=var, h_up2=up2)


def observe(cfg: ForecastConfig, state: ForecastState, t_s: float, value: float) -> ForecastState:
    """Fold the demand `value` (replicas) measured at `t_s` into a new state."""
    value = max(0.0, value)
    if state.n == 0:
        return _track_horizon(cfg, _first(cfg, t_s, value), t_s, value)
    dt = t_s - state.t_s
    if dt <= 0:
        return state
    s_t = _season(cfg, state, t_s)
    f = state.level + state.trend * _reach(cfg, dt) + s_t
    e = value - f
    band = cfg.clip_k * max(state.sigma_1, cfg.clip_floor_frac * abs(f), cfg.clip_floor_abs)
    level0, trend0 = state.level, state.trend
    run_sign, run_s, run_sum, run_n = 0, 0.0, 0.0, 0
    x = value
    if abs(e) > band:
        sign = 1 if e > 0 else -1
        same = sign == state.run_sign
        run_sign, run_s = sign, (state.run_s if same else 0.0) + dt
        run_sum, run_n = (
            (state.run_sum if same else 0.0) + value - s_t,
            (state.run_n if same else 0) + 1,
        )
        if run_s >= cfg.shift_confirm_s or (
            run_s >= cfg.surge_confirm_s and _surging(cfg, run_sum / run_n, f - s_t)
        ):
            level0, trend0 = run_sum / run_n, 0.0
            f = level0 + s_t
            run_sign, run_s, run_sum, run_n = 0, 0.0, 0.0, 0
            # the forecasts still pending were made for the old level: a step is a new level,
            # not a forecast error to carry in the horizon error for an hour
            state = replace(state, pending=())
        else:
            x = f + sign * band
    a = _factor(cfg.alpha, dt, cfg.tick_s)
    b = _factor(cfg.beta, dt, cfg.tick_s)
    level = a * (x - s_t) + (1.0 - a) * (level0 + trend0 * _reach(cfg, dt))
    trend = b * (level - level0) / dt + (1.0 - b) * trend0
    lam = max(1.0 / state.n, 1.0 - math.exp(-dt / cfg.sigma_tau_s))
    n = state.n + 1
    new = replace(
        state,
        n=n,
        t_s=t_s,
        level=level,
        trend=trend,
        var1=(1.0 - lam) * state.var1 + lam * (x - f) ** 2,
        dt_mean=dt if state.n == 1 else state.dt_mean + (dt - state.dt_mean) / min(n - 1, 32),
        run_sign=run_sign,
        run_s=run_s,
        run_sum=run_sum,
        run_n=run_n,
    )
    if new.seasonal:
        new = _reseason(cfg, new, t_s, x - level - s_t, dt)
    else:
        new = _accumulate(cfg, new, t_s, x)
    target = x if cfg.horizon_target == "value" else current_level(cfg, new)
    return _track_horizon(cfg, new, t_s, target)


__all__ = [
    "ForecastConfig",
    "ForecastState",
    "bias_at_horizon",
    "current_level",
    "forecast",
    "observe",
    "peak",
    "sigma_at_horizon",
    "upside_sigma_at_horizon",
]
