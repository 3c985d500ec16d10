"""The headroom policy: plan on the lead time, staff to the SLO utilization, shed by ski-rental.

Every decision (`decide(ctx, state, now)`, pure; units: replicas of work at the SLO):

1. NO_DATA: `interval_s <= 0` or the sample is older than `stale_ticks` ticks: hold (bounds
   still apply) and leave the forecaster untouched.
2. Feed the forecaster (`autoscaler.forecast`) with the rate `r = prefill + decode work / s`,
   its horizon set to the lead time `L = load_time_s + tick_s`. A surge (an excursion at least
   `max(surge_min_ratio, surge_burst_mult x F_q)` times the level, i.e. beyond any burst the
   fleet carries) becomes the new level after the forecaster's `surge_confirm_s` (30 s) instead
   of its 300-s shift confirmation.
3. Utilization target `rho* = capacity.utilization_target(E[prefill], C2)` (the last seen
   prefill moments when the interval had no arrivals; defaults before any).
4. Need, rate, bursts and backlog kept apart (anchors §4):
       R          = peak(L)                             the level's forecast peak, [now, now + L]
       need_rate  = (R + sqrt(beta^2 R + (z sigma_L)^2)) / rho*(n)
       need_burst = (1 - phi) R + F_q * tick / (tick + b) * max(phi R, f) + z sigma_L
       need_back  = sum_i min(1, b_i / D) + Q / D - spare_ready   (>= 0; D = drain_time_s, or L)
       up         = ceil(max(need_rate, need_burst) + need_back + spare)
   - `spare_ready = ready - max(need_rate, need_burst)`: what the ready fleet drains by itself
     within D; only the rest of the backlog buys replicas.
   - The backlog `Q` still at the router drains on any replica. The backlog `b_i` a router
     already dispatched to replica i (`DemandSample.backlog_by_replica`) waits in i's own
     queue: new replicas cannot take it, it only keeps i busy, for at most all of D. After a
     step, the queue that piled up on the one ready replica is that replica's for an hour;
     pricing it as `b / D` replicas ordered 2.1x the demand for no earlier recovery
     (docs/autoscaling.md, load step).
   - `sigma_L` is the forecaster's own error at horizon L, scored against the level (not the
     noisy sample), upside only (the RMS of its under-forecasts, so a positive bias counts and a
     missed drop does not); `beta sqrt(R)` is optional square-root staffing, combined with
     `z sigma_L` in quadrature. Its default is 0: the M/G/c target `rho*(n)` already prices
     the Poisson arrivals' queueing, and staffing for it again cost the synthetic trace 11-14%
     over the rate-only bound (docs/autoscaling.md).
   - `rho*(n)` is the SLO-compatible utilization of `n` pooled replicas (M/G/c with the measured
     prefill moments, `SloCapacity.utilization_target`), with `n` the fleet size the need
     itself implies (a few fixed-point steps from the current size).
   - Bursts shorter than the lead time cannot be scaled for; they are carried as headroom.
     `F_q` is the `burst_quantile` of this tick's prefill rate (its sharpest sliding window
     of one tick, `burst_rate`, so a spike cut by a tick boundary counts whole) over its
     recent mean (EW, `burst_memory_s / 6`), weighted by prefill work (so it is a quantile
     over the requests that meet the fleet) and remembered over `burst_memory_s` in a
     log-binned histogram. Only
     the prefill share `phi` of the work is bursty at the TTFT time scale (decode work is
     spread over the outputs' lifetimes), and a tick's burst may outrun the fleet as long as
     its backlog drains within the TTFT waiting budget `b = ttft_slo - E[prefill]`. Below
     `f = burst_floor` replicas of prefill, bursts are measured against `f` and carried as
     replicas, not as a multiple of the level: at a few requests a minute the level is noise,
     and a 30x ratio to it, times the next forecast wobble, orders tens of replicas.
5. Target. Loading replicas are capacity arriving: everything is compared with
   `current = ready + loading`.
   - warming up (less than `warmup_s` of history): `max(current, up)`, never down (WARMING_UP);
   - `up > current`: `up` (FORECAST_UP, or BACKLOG_DRAIN when the rate alone fits `current`);
   - `ready < up <= current` with replicas loading: hold (LOADING_COVERS);
   - otherwise scale-down by ski-rental: `keep` = the larger of the same need with the forecast
     peak over the look-ahead `L + reuse_horizon_s` and the largest need of the last
     `reuse_horizon_s` (a replica the forecast or the recent past wants back within a load
     time plus the re-use horizon is kept). If `keep < current` the surplus timer runs; an idle
     replica costs 1 replica-second per second and removing it costs `reload_cost_s` (default
     `load_time_s x 1 replica`) when it is needed again, so the surplus is shed only once it has
     lasted the break-even time `reload_cost_s / 1` (the deterministic 2-competitive
     ski-rental rule): SCALE_DOWN to `keep + floor(down_margin keep)` (a deadband, so the
     wobble of the need does not bring it straight back), else DOWN_NOT_WORTH_IT. Any tick
     without surplus resets it.
6. Limits, in order: clip to `[min_replicas, max_replicas]` (AT_MIN / AT_MAX); hysteresis (a
   step against the last step's direction within `hysteresis_s` of the last direction change
   is refused: at most one change per window, RATE_LIMITED); `max_step_up` / `max_step_down`
   per decision (RATE_LIMITED); the bounds win over the rate limits when `current` lies outside
   them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

from autoscaler.bursts import add_burst, burst_quantile, empty_bursts
from autoscaler.forecast import (
    ForecastConfig,
    ForecastState,
    bias_at_horizon,
    current_level,
    observe,
    peak,
    sigma_at_horizon,
    upside_sigma_at_horizon,
)
from autoscaler.types import DemandSample, ScaleContext, ScaleDecision, ScaleReason

_EPS = 1e-9


class UtilizationModel(Protocol):
    """What the policy needs from `autoscaler.capacity.SloCapacity`."""

    @property
    def ttft_slo_s(self) -> float: ...

    def utilization_target(
        self, prefill_mean_s: float, prefill_scv: float, replicas: int = 1
    ) -> float: ...


@dataclass(frozen=True, slots=True)
class HeadroomConfig:
    capacity: UtilizationModel
    z: float = 3.5  # 1% probability that demand at the horizon exceeds the forecast + z sigma
    beta: float = 0.0  # square-root staffing on top of rho* (which prices Poisson queueing)
    spare: int = 0  # N+1 reserve (see the report: a failure within L is rarer than 1%)
    drain_time_s: float | None = None  # None: the lead time
    max_step_up: int = 8
    max_step_down: int = 1  # consolidate one replica at a time
    reload_cost_s: float | None = None  # GPU-seconds; None: load_time_s x 1 replica
    reuse_horizon_s: float = 300.0
    # a scale-down stops this fraction above `keep` (a deadband: the need wobbles by a replica
    # or two as sigma and the burst factor move, and shedding to the edge would flap)
    down_margin: float = 0.05
    hysteresis_s: float = 300.0
    warmup_s: float = 60.0
    stale_ticks: float = 3.0
    peak_steps: int = 16
    default_prefill_mean_s: float = 0.1
    default_prefill_scv: float = 1.0
    # bursts shorter than the lead time: the work-weighted `burst_quantile` of the tick rate
    # (its sharpest one-tick window, `burst_rate`) over the forecast level, remembered over
    # `burst_memory_s`. 0.999 was set when the tick's own total was measured, which halves a
    # spike cut by a tick boundary; on the sliding window 0.995 keeps every Azure draw >= 99%
    # (docs/autoscaling.md)
    burst_quantile: float = 0.995
    # replicas of prefill work below which bursts are remembered and carried in absolute
    # terms (a burst of 3 replicas at a level of 0.1 is 3 replicas, not 30x the level: at light
    # traffic the level is a few requests a minute and a ratio to it is noise)
    burst_floor: float = 1.0
    surge_min_ratio: float = 3.0
    surge_burst_mult: float = 1.5
    burst_memory_s: float = 3600.0
    # the level the fleet follows is slow (time constant ~330 s, shifts confirmed after 300 s):
    # swings shorter than the lead time cannot be followed, so they belong to the burst
    # factor, not to the level
    forecast: ForecastConfig = field(
        default_factory=lambda: ForecastConfig(
            horizon_target="level", alpha=0.03, shift_confirm_s=300.0
        )
    )


@dataclass(frozen=True, slots=True)
class HeadroomState:
    forecast: ForecastState = field(default_factory=ForecastState)
    last_dir: int = 0  # direction of the last step: +1, -1, 0 (none yet)
    last_step_s: float = -math.inf
    last_change_s: float = -math.inf  # when the direction last changed
    last_target: int = -1
    history: int = 0  # samples folded into the forecaster
    surplus_since_s: float | None = None
    prefill_mean_s: float = 0.0  # last seen prefill moments (0: none yet)
    prefill_scv: float = 1.0
    burst_w: tuple[float, ...] = ()  # prefill-work-weighted histogram of prefill burst ratios
    # burst_quantile(burst_w, cfg.burst_quantile), kept with burst_w (1.0: that of no bursts)
    burst_q: float = 1.0
    # ticks awaiting judgement: (t, prefill rate, prefill work, its recent mean then)
    burst_pending: tuple[tuple[float, float, float, float], ...] = ()
    # EW means of the arrived prefill and total work rates (their ratio: the prefill share)
    prefill_ew: float = 0.0
    work_ew: float = 0.0
    # the need's recent peaks: (bucket start, max need) over the last reuse_horizon_s
    recent_need: tuple[tuple[float, int], ...] = ()


def staffed(rate: float, sigma: float, rho: float, z: float, beta: float) -> float:
    """Replicas for a forecast `rate` with error `sigma`: `(R + sqrt(b^2 R + (z s)^2)) / rho`."""
    r = max(0.0, rate)
    return (r + math.sqrt(beta * beta * r + (z * sigma) ** 2)) / rho


def burst_rate(sample: DemandSample, tick_s: float, budget_s: float) -> float:
    """The tick's prefill rate as the burst memory records it: the larger of the interval's
    mean rate and its sharpest window of one tick (the sample's shortest `prefill_peaks`
    window at least `tick_s` long), so a spike counts whole whichever way the tick boundaries
    cut it. A window of `W` work from `n` requests drains within the waiting budget `b` on
    `min(n, W / (w + b))` replicas (a request runs on one replica), the rate
    `min(n, W / (w + b)) * (w + b) / w`. Without peaks (a host that cannot see arrivals):
    the mean rate."""
    if sample.interval_s <= 0:
        return 0.0
    rate = sample.prefill_work_s / sample.interval_s
    fits = [p for p in sample.prefill_peaks if p[0] >= tick_s - 1e-6]
    if fits:
        w, work, n = min(fits)
        rate = max(rate, min(float(n), work / (w + budget_s)) * (w + budget_s) / w)
    return rate


def _window_max(
    buckets: tuple[tuple[float, int], ...], now: float, value: int, window_s: float
) -> tuple[tuple[float, int], ...]:
    """Add `value` at `now` to per-bucket maxima (10 buckets per window); drop old buckets."""
    width = max(1e-9, window_s / 10.0)
    kept = [(t, n) for t, n in buckets if now - t < window_s]
    if kept and now - kept[-1][0] < width:
        kept[-1] = (kept[-1][0], max(kept[-1][1], value))
    else:
        kept.append((now, value))
    return tuple(kept)


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


class HeadroomPolicy:
    """Lead-time headroom autoscaler (see the module docstring)."""

    name = "headroom"

    def __init__(self, config: HeadroomConfig) -> None:
        self.config = config

    def initial_state(self) -> HeadroomState:
        return HeadroomState()

    def decide(
        self, ctx: ScaleContext, state: HeadroomState, now: float
    ) -> tuple[ScaleDecision, HeadroomState]:
        cfg = self.config
        s, fleet = ctx.sample, ctx.fleet
        current = fleet.current
        lead = ctx.load_time_s + ctx.tick_s
        base = (
            ("ready", float(fleet.ready)),
            ("loading", float(fleet.loading)),
            ("current", float(current)),
            ("lead_time_s", lead),
        )
        if s.interval_s <= 0 or now - s.t_s > cfg.stale_ticks * max(ctx.tick_s, s.interval_s):
            detail = (*base, ("sample_age_s", now - s.t_s))
            return self._finish(ctx, state, now, current, ScaleReason.NO_DATA, detail, state)

        # an excursion far beyond the bursts the fleet already carries (surge_burst_mult x the
        # burst factor, at least surge_min_ratio x the level) is a new level once it has lasted
        # surge_confirm_s, not a burst to wait out for shift_confirm_s
        # (the burst factor before this tick: state.burst_q is exactly the quantile of
        # state.burst_w, computed when that histogram was stored; this tick's decay is applied
        # to it later, in _bursts, so no reliance on a quantile's scale invariance, which float
        # rounding would only approximate)
        fcfg = replace(
            cfg.forecast,
            horizon_s=lead,
            surge_ratio=max(cfg.surge_min_ratio, cfg.surge_burst_mult * state.burst_q),
            surge_floor=cfg.burst_floor,
        )
        share = state.prefill_ew / state.work_ew if state.work_ew > 0 else -1.0
        prefill_rate = s.prefill_work_s / s.interval_s
        # the prefill share of the work: a ratio of EW means (memory burst_memory_s / 6)
        gap = max(0.0, s.t_s - state.forecast.t_s) if state.forecast.n else cfg.burst_memory_s
        w = 1.0 - math.exp(-gap / (cfg.burst_memory_s / 6.0))
        p_ew = state.prefill_ew + w * (prefill_rate - state.prefill_ew)
        t_ew = state.work_ew + w * (s.rate - state.work_ew)
        phi = p_ew / t_ew if t_ew > 0 else 1.0
        fst = observe(fcfg, state.forecast, s.t_s, s.rate)
        pm, scv = state.prefill_mean_s, state.prefill_scv
        if s.arrivals > 0 and s.prefill_mean_s > 0:
            pm, scv = s.prefill_mean_s, s.prefill_scv
        pm_, scv_ = (pm, scv) if pm > 0 else (cfg.default_prefill_mean_s, cfg.default_prefill_scv)
        # the TTFT waiting budget: how long a burst's backlog may take to drain
        budget = max(0.0, cfg.capacity.ttft_slo_s - pm_)
        spike = burst_rate(s, ctx.tick_s, budget)
        burst_w, pending = self._bursts(fcfg, state, fst, s.t_s, spike, s.prefill_work_s, share)
        sigma = upside_sigma_at_horizon(fcfg, fst)
        pk = peak(fcfg, fst, lead, cfg.peak_steps)
        level = current_level(fcfg, fst)
        pk_keep = peak(fcfg, fst, lead + cfg.reuse_horizon_s, cfg.peak_steps)
        burst = burst_quantile(burst_w, cfg.burst_quantile)
        need_rate, rho = self._rate_need(pk, sigma, pm_, scv_, current)
        # a tick's burst may outrun the fleet as long as its backlog drains within the TTFT
        # waiting budget b: capacity >= burst rate * tick / (tick + b)
        absorb = ctx.tick_s / (ctx.tick_s + budget)
        # TTFT waits on prefill: only the prefill part of the level is bursty at this scale;
        # decode work is spread over the outputs' lifetimes
        # below `burst_floor` replicas of prefill the burst memory is absolute (see _bursts)
        floor = cfg.burst_floor

        def with_bursts(rate: float) -> float:
            return (1.0 - phi) * rate + burst * absorb * max(phi * rate, floor)

        surge = with_bursts(pk) / pk if pk > 0 else 1.0
        need_burst = with_bursts(pk) + cfg.z * sigma
        # the backlog the ready replicas cannot drain with their spare capacity within the
        # drain time is what extra replicas are for (those ordered now arrive after L anyway)
        drain = cfg.drain_time_s or lead
        spare_ready = max(0.0, fleet.ready - max(need_rate, need_burst))
        pinned = sum(min(1.0, b / drain) for b in s.backlog_by_replica)
        queued = max(0.0, s.backlog_work_s - sum(s.backlog_by_replica))
        need_back = max(0.0, pinned + queued / drain - spare_ready)
        up = _ceil(max(need_rate, need_burst) + need_back + cfg.spare)
        keep_rate, _ = self._rate_need(pk_keep, sigma, pm_, scv_, current)
        keep_burst = with_bursts(pk_keep) + cfg.z * sigma
        # what to keep: the need at the forecast peak over the look-ahead, and the largest need
        # of the last re-use horizon: demand that came and went within it is expected back, and
        # a replica shed now could not return in time
        recent = _window_max(state.recent_need, now, up, cfg.reuse_horizon_s)
        keep = max(
            up,
            _ceil(max(keep_rate, keep_burst) + need_back + cfg.spare),
            max((n for _, n in recent), default=0),
        )
        keep = min(ctx.max_replicas, max(ctx.min_replicas, keep))
        break_even = (ctx.load_time_s if cfg.reload_cost_s is None else cfg.reload_cost_s) / 1.0
        warming = fst.n < 2 or fst.t_s - fst.t_first_s < cfg.warmup_s

        surplus: float | None = None
        if warming:
            desired, reason = max(current, up), ScaleReason.WARMING_UP
        elif up > current:
            rate_only = _ceil(max(need_rate, need_burst) + cfg.spare) > current
            desired = up
            reason = ScaleReason.FORECAST_UP if rate_only else ScaleReason.BACKLOG_DRAIN
        elif fleet.loading > 0 and up > fleet.ready:
            desired, reason = current, ScaleReason.LOADING_COVERS
        elif keep >= current:
            desired, reason = current, ScaleReason.HOLD
            if keep == ctx.min_replicas and up < keep:
                reason = ScaleReason.AT_MIN
        else:
            surplus = now if state.surplus_since_s is None else state.surplus_since_s
            if now - surplus >= break_even:
                desired = min(current, keep + math.floor(keep * cfg.down_margin))
                reason = ScaleReason.SCALE_DOWN if desired < current else ScaleReason.HOLD
            else:
                desired, reason = current, ScaleReason.DOWN_NOT_WORTH_IT

        figures: tuple[tuple[str, float], ...] = (
            *base,
            ("rate", s.rate),
            ("level", level),
            ("need_recent_peak", float(max((n for _, n in recent), default=0))),
            ("trend", fst.trend),
            ("forecast_peak", pk),
            ("forecast_peak_keep", pk_keep),
            ("sigma_h", sigma),
            ("sigma_h_sym", sigma_at_horizon(fcfg, fst)),
            ("bias_h", bias_at_horizon(fcfg, fst)),
            ("rho_target", rho),
            ("need_rate", need_rate),
            ("burst_factor", burst),
            ("prefill_share", phi),
            ("surge", surge),
            ("need_burst", need_burst),
            ("backlog_pinned_replicas", pinned),
            ("need_backlog", need_back),
            ("need", float(up)),
            ("keep", float(keep)),
            ("surplus_s", 0.0 if surplus is None else now - surplus),
            ("break_even_s", break_even),
        )
        new = replace(
            state,
            forecast=fst,
            history=state.history + 1,
            surplus_since_s=surplus,
            prefill_mean_s=pm,
            prefill_scv=scv,
            burst_w=burst_w,
            burst_q=burst,
            burst_pending=pending,
            prefill_ew=p_ew,
            work_ew=t_ew,
            recent_need=recent,
        )
        return self._finish(ctx, state, now, desired, reason, figures, new)

    def _rate_need(
        self, rate: float, sigma: float, prefill_mean: float, scv: float, current: int
    ) -> tuple[float, float]:
        """Replicas for the forecast `rate` at the pooled utilization target of the fleet size
        it implies (a few fixed-point steps from the current size)."""
        cfg = self.config
        n = max(1, current)
        need, rho = 0.0, 1.0
        for _ in range(4):
            rho = min(1.0, max(0.05, cfg.capacity.utilization_target(prefill_mean, scv, n)))
            need = staffed(rate, sigma, rho, cfg.z, cfg.beta)
            nxt = max(1, _ceil(need))
            if nxt == n:
                break
            n = nxt
        return need, rho

    def _bursts(
        self,
        fcfg: ForecastConfig,
        state: HeadroomState,
        fst: ForecastState,
        t: float,
        rate: float,
        work: float,
        share: float,
    ) -> tuple[tuple[float, ...], tuple[tuple[float, float, float, float], ...]]:
        """Decay the burst memory to `t`; judge the ticks older than the forecaster's
        level-shift confirmation time with that hindsight: a tick's prefill rate over the largest
        of its recent mean then (EW, memory burst_memory_s / 6), the level now (times the
        prefill share) and `burst_floor` (below it the memory is absolute). A burst is still
        a burst; the first minutes of a sustained step are part of the new level, not a burst
        to carry for an hour. Weighted by prefill work (the quantile is over the requests that
        meet the fleet)."""
        cfg = self.config
        weights = state.burst_w or empty_bursts()
        if state.forecast.n:
            decay = math.exp(-max(0.0, t - state.forecast.t_s) / cfg.burst_memory_s)
            weights = tuple(w * decay for w in weights)
        pending = state.burst_pending
        if work > 0 and state.prefill_ew > 0:
            pending = (*pending, (t, rate, work, state.prefill_ew))
        level_now = current_level(fcfg, fst) * max(0.0, share)
        keep = []
        for t0, r, w, mean in pending:
            if t - t0 >= fcfg.shift_confirm_s:
                weights = add_burst(weights, r / max(mean, level_now, cfg.burst_floor), w, 1.0)
            else:
                keep.append((t0, r, w, mean))
        return weights, tuple(keep)

    def _finish(
        self,
        ctx: ScaleContext,
        old: HeadroomState,
        now: float,
        desired: int,
        reason: ScaleReason,
        detail: tuple[tuple[str, float], ...],
        new: HeadroomState,
    ) -> tuple[ScaleDecision, HeadroomState]:
        """Apply the bounds, the hysteresis and the step limits; record the direction."""
        cfg = self.config
        current = ctx.fleet.current
        lo, hi = ctx.min_replicas, max(ctx.min_replicas, ctx.max_replicas)
        bounded = min(hi, max(lo, desired))
        if bounded != desired:
            reason = ScaleReason.AT_MAX if desired > hi else ScaleReason.AT_MIN
        step = bounded - current
        direction = (step > 0) - (step < 0)
        blocked = (
            direction != 0
            and old.last_dir not in (0, direction)
            and now - old.last_change_s < cfg.hysteresis_s
        )
        if blocked:
            step, reason = 0, ScaleReason.RATE_LIMITED
        limited = max(-cfg.max_step_down, min(cfg.max_step_up, step))
        if limited != step:
            reason = ScaleReason.RATE_LIMITED
        target = current + limited
        if not lo <= target <= hi:
            reason = ScaleReason.AT_MAX if target > hi else ScaleReason.AT_MIN
            target = min(hi, max(lo, target))
        step = target - current
        direction = (step > 0) - (step < 0)
        if direction != 0:
            changed = old.last_dir not in (0, direction)
            new = replace(
                new,
                last_dir=direction,
                last_step_s=now,
                last_change_s=now if changed else old.last_change_s,
            )
        detail = (*detail, ("hysteresis_blocked", float(blocked)), ("target", float(target)))
        return ScaleDecision(target, reason, detail), replace(new, last_target=target)


def headroom_policy(
    gpu: str = "h100",
    model: str = "llama-3.1-8b",
    tp: int = 1,
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
    **overrides: float,
) -> HeadroomPolicy:
    """A factory from plain values (a config file's `policy_params`): the capacity at the SLO
    of a roofline profile, and numeric `HeadroomConfig` fields as overrides."""
    from autoscaler.capacity import SloCapacity
    from controlplane.roofline import profile

    capacity = SloCapacity.build(profile(gpu, model, tp=tp), ttft_slo_s, tpot_slo_s)
    config = replace(HeadroomConfig(capacity), **overrides)  # type: ignore[arg-type]
    return HeadroomPolicy(config)


__all__ = [
    "HeadroomConfig",
    "HeadroomPolicy",
    "HeadroomState",
    "UtilizationModel",
    "burst_rate",
    "headroom_policy",
    "staffed",
]
