"""Backtest autoscaling policies side by side on the same trace, fleet and SLO.

For each trace (`autoscaler.backtest_traces`) and each policy the simulator host
(`autoscaler.hosts.sim`) replays the whole trace on a fresh fleet of the same replicas
(Llama-3.1-70B, TP2 on H200 by default), with the same load time, tick, bounds and router.
Block ids are computed once per trace and shared.

How each policy is set up (documented choices, the same for every trace):

- `headroom`: `HeadroomPolicy(HeadroomConfig(capacity))` with its defaults, its forecaster's
  season set to the trace's (compressed) day;
- `static_peak`: the smallest fixed fleet that meets the SLO target (`static_target`, 99% of
  requests within the TTFT SLO) on this trace, found with hindsight by replaying it: from the
  rule of `static_peak_replicas` (its module docstring: the peak 60-s work rate over the
  utilization target), up by doubling steps until the target holds, then bisection between
  the last miss and the first hit (`static_search=False` keeps the rule's count). Provisioning
  for the peak means provisioning so that the peak is served; a count that misses the SLO is
  not a peak provisioning. Every count tried is kept in `static_search` (fleet size, attainment);
- `ray_default`: Ray Serve's defaults (target 2 ongoing requests per replica);
- `kpa`: Knative's defaults with the per-replica concurrency target `kpa_target_concurrency`
  (Little's law at the SLO over the trace's mean request, capped by the SLO decode batch);
- `hpa_gpu_util`: HPA defaults on GPU utilization, target 80%.

The headroom policy learns from history (its forecaster's level, trend and error at the
horizon, its burst memory); in production it has been running for days. Its state is warmed on
the two days before, taken to be the same day (`prewarm`): the trace's arrivals, turned into the
demand samples the router would have measured every tick, are folded through `decide` with a
fleet that follows its targets, at times before 0; no request is simulated; its fleet starts at
the size it would have had at midnight (at least the common warm start). The baselines keep
windows of at most ten minutes and start fresh.

Every dynamic policy starts from the same warm fleet: `ceil(mean work rate over the trace's
first load time / rho*)` ready replicas (what the night before would have left running), at
least `min_replicas`.

JSON (`BacktestResult.to_json`):
`{"traces": {TRACE: {"load_time_s", "policies": {NAME: {"slo_attainment", "gpu_hours",
"scale_events", "direction_changes", ...}}, ...}}, ...}`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autoscaler.backtest_traces import BACKTEST_GPU, BACKTEST_MODEL, BACKTEST_TP, backtest_trace
from autoscaler.baselines import (
    HpaGpuUtilPolicy,
    KpaConfig,
    KpaPolicy,
    RayDefaultPolicy,
    StaticPeakConfig,
    StaticPeakPolicy,
    kpa_target_concurrency,
    static_peak_replicas,
)
from autoscaler.capacity import SloCapacity
from autoscaler.demand import DemandMeter
from autoscaler.hosts.sim import AutoscaleConfig, AutoscaleRun, run_autoscaled
from autoscaler.types import DemandSample, FleetCounts, ScaleContext, ScalingPolicy
from controlplane.errors import ConfigError
from controlplane.roofline.profile import EngineProfile, profile
from controlplane.sim.fleet import FleetConfig
from controlplane.sim.ids import dense_block_ids
from controlplane.traces.model import Trace

POLICY_NAMES = ("headroom", "static_peak", "ray_default", "kpa", "hpa_gpu_util")
DEFAULT_TRACES = ("azure-code-diurnal", "synthetic-diurnal-tenants")


@dataclass(frozen=True, slots=True)
class BacktestConfig:
    gpu: str = BACKTEST_GPU
    model: str = BACKTEST_MODEL
    tp: int = BACKTEST_TP
    autoscale: AutoscaleConfig = field(default_factory=lambda: AutoscaleConfig(max_replicas=64))
    # static_peak: the SLO attainment its fixed fleet must reach, and whether to search for it
    static_target: float = 0.99
    static_search: bool = True

    def profile(self) -> EngineProfile:
        return profile(self.gpu, self.model, tp=self.tp)


@dataclass(slots=True)
class TraceBacktest:
    trace: str
    requests: int
    span_s: float
    load_time_s: float
    runs: dict[str, AutoscaleRun] = field(default_factory=dict)
    setup: dict[str, float] = field(default_factory=dict)
    # (window middle s, arrived work per second in replicas), 60-s windows
    demand: tuple[list[float], list[float]] = ([], [])
    # static_peak's search: (fleet size, SLO attainment) of every size replayed
    static_search: list[tuple[int, float]] = field(default_factory=list)

    def to_json(self, *, timeline: bool = True) -> dict[str, object]:
        return {
            "load_time_s": self.load_time_s,
            "requests": self.requests,
            "span_s": self.span_s,
            "setup": self.setup,
            "static_search": [[n, a] for n, a in self.static_search],
            "policies": {n: r.to_json(timeline=timeline) for n, r in self.runs.items()},
        }


@dataclass(slots=True)
class BacktestResult:
    config: BacktestConfig
    traces: dict[str, TraceBacktest] = field(default_factory=dict)
    wall_s: float = 0.0

    def to_json(self, *, timeline: bool = True) -> dict[str, object]:
        """The JSON document; `timeline=False` leaves out the per-tick replica counts."""
        cfg, auto = self.config, self.config.autoscale
        return {
            "traces": {n: tb.to_json(timeline=timeline) for n, tb in self.traces.items()},
            "fleet": {"gpu": cfg.gpu, "model": cfg.model, "tp": cfg.tp},
            "slo": {"ttft_s": auto.ttft_slo_s, "tpot_s": auto.tpot_slo_s},
            "tick_s": auto.tick_s,
            "min_replicas": auto.min_replicas,
            "max_replicas": auto.max_replicas,
            "wall_seconds": self.wall_s,
        }


def _trace_moments(trace: Trace, cap: SloCapacity) -> dict[str, float]:
    reqs = trace.requests
    prefill = [cap.prefill_work(r.prompt_tokens) for r in reqs]
    n = max(1, len(reqs))
    mean_p = sum(prefill) / n
    scv = (sum(x * x for x in prefill) / n - mean_p**2) / mean_p**2 if mean_p > 0 else 1.0
    work = [
        p + cap.decode_work(max(1, r.output_tokens), r.prompt_tokens)
        for p, r in zip(prefill, reqs, strict=True)
    ]
    latency = [
        p + max(0, r.output_tokens - 1) * cap.tpot_slo_s for p, r in zip(prefill, reqs, strict=True)
    ]
    return {
        "rho": cap.utilization_target(mean_p, max(0.0, scv)),
        "mean_work_s": sum(work) / n,
        "mean_slo_latency_s": sum(latency) / n,
    }


def build_policy(
    name: str, trace: Trace, cap: SloCapacity, moments: dict[str, float]
) -> tuple[ScalingPolicy[Any], int | None]:
    """The policy called `name`, and its fixed starting size (None: the common warm start)."""
    if name == "headroom":
        from autoscaler.headroom import HeadroomConfig, HeadroomPolicy

        config = HeadroomConfig(capacity=cap)
        params = trace.meta.get("params", trace.meta.get("diurnal"))
        day = params.get("day_s") if isinstance(params, dict) else None
        if isinstance(day, int | float) and day > 0:  # a compressed day: its season
            config = replace(config, forecast=replace(config.forecast, season_s=float(day)))
        return HeadroomPolicy(config), None
    if name == "static_peak":
        reqs = trace.requests
        static = static_peak_replicas(
            [r.prompt_tokens for r in reqs],
            [r.output_tokens for r in reqs],
            [r.arrival_s for r in reqs],
            cap,
        )
        return StaticPeakPolicy(static), static.replicas
    if name == "ray_default":
        return RayDefaultPolicy(), None
    if name == "kpa":
        target = kpa_target_concurrency(
            moments["rho"], moments["mean_slo_latency_s"], moments["mean_work_s"], cap.decode_batch
        )
        return KpaPolicy(KpaConfig(target_concurrency=target)), None
    if name == "hpa_gpu_util":
        return HpaGpuUtilPolicy(), None
    raise ConfigError(f"unknown autoscaling policy {name!r} (known: {', '.join(POLICY_NAMES)})")


def demand_windows(
    trace: Trace, cap: SloCapacity, window_s: float = 60.0
) -> tuple[list[float], list[float]]:
    """Arrived work (replica-seconds at the SLO) per second, per `window_s` window."""
    if not trace.requests:
        return [], []
    t0 = trace.requests[0].arrival_s
    bins: dict[int, float] = {}
    for r in trace.requests:
        k = int((r.arrival_s - t0) // window_s)
        w = cap.request_work(r.prompt_tokens, max(1, r.output_tokens))
        bins[k] = bins.get(k, 0.0) + w
    last = max(bins)
    return (
        [(k + 0.5) * window_s for k in range(last + 1)],
        [bins.get(k, 0.0) / window_s for k in range(last + 1)],
    )


def arrival_samples(
    trace: Trace, cap: SloCapacity, tick_s: float, offset_s: float
) -> list[DemandSample]:
    """The demand samples a router would measure every `tick_s` from `trace`'s arrivals alone
    (work priced with the actual output; no backlog), timestamped `offset_s` later: the
    arrivals fed through the router's own `DemandMeter`."""
    if not trace.requests:
        return []
    t0 = trace.requests[0].arrival_s
    ticks = max(1, math.ceil((trace.requests[-1].arrival_s - t0) / tick_s))
    meter = DemandMeter(cap, start_s=offset_s, peak_windows=(tick_s,))
    out: list[DemandSample] = []
    for i, r in enumerate(trace.requests):
        k = min(ticks - 1, int((r.arrival_s - t0) // tick_s))
        while len(out) < k:
            out.append(meter.sample(offset_s + (len(out) + 1) * tick_s))
        now = min(offset_s + r.arrival_s - t0, offset_s + (k + 1) * tick_s)
        meter.arrived(str(i), r.prompt_tokens, r.output_tokens, now)
        meter.finished(str(i), now)
    while len(out) < ticks:
        out.append(meter.sample(offset_s + (len(out) + 1) * tick_s))
    return out


def prewarm(
    policy: ScalingPolicy[Any], trace: Trace, cap: SloCapacity, auto: AutoscaleConfig, start: int
) -> Any:
    """`policy`'s state after the day before (see the module docstring)."""
    state = policy.initial_state()
    span = trace.duration_s + auto.tick_s
    current = start
    history = [s for k in (2, 1) for s in arrival_samples(trace, cap, auto.tick_s, -k * span)]
    for sample in history:
        ctx = ScaleContext(
            sample,
            FleetCounts(ready=current),
            auto.load_time_s,
            auto.min_replicas,
            auto.max_replicas,
            auto.tick_s,
        )
        decision, state = policy.decide(ctx, state, sample.t_s)
        current = decision.target
    return state


def backtest_one(
    trace: Trace,
    policies: Sequence[str],
    config: BacktestConfig,
    *,
    on_policy_start: Callable[[str, int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> TraceBacktest:
    """Run every policy over `trace` (see the module docstring)."""
    auto = config.autoscale
    prof = config.profile()
    cap = SloCapacity.build(prof, auto.ttft_slo_s, auto.tpot_slo_s)
    moments = _trace_moments(trace, cap)
    built = {name: build_policy(name, trace, cap, moments) for name in policies}
    t0 = trace.requests[0].arrival_s if trace.requests else 0.0
    head = [r for r in trace.requests if r.arrival_s - t0 < max(auto.load_time_s, 60.0)]
    head_rate = sum(cap.request_work(r.prompt_tokens, max(1, r.output_tokens)) for r in head)
    warm = math.ceil(head_rate / max(auto.load_time_s, 60.0) / moments["rho"] - 1e-9)
    warm = max(auto.min_replicas, warm)
    tb = TraceBacktest(trace.name, len(trace), trace.duration_s, auto.load_time_s)
    tb.setup = {**moments, "warm_start_replicas": float(warm)}
    kpa = built.get("kpa")
    if kpa is not None and isinstance(kpa[0], KpaPolicy):
        tb.setup["kpa_target_concurrency"] = kpa[0].config.target_concurrency
    static = built.get("static_peak")
    if static is not None and static[1] is not None:
        tb.setup["static_peak_replicas"] = float(static[1])
    tb.demand = demand_windows(trace, cap)
    ids, floor = dense_block_ids(trace, prof.resolved_block_size)
    fleet = FleetConfig(profile=prof)
    for name, (policy, fixed) in built.items():
        n0 = warm if fixed is None else fixed
        if name == "static_peak" and fixed is not None and config.static_search:

            def replay(n: int) -> AutoscaleRun:
                if on_policy_start is not None:
                    on_policy_start(f"static_peak ({n})", len(trace))
                return static_replay(trace, fleet, n, auto, cap, (ids, floor), progress)

            run, tried = static_search(replay, fixed, config.static_target, auto.max_replicas)
            tb.runs[name] = run
            tb.setup["static_peak_replicas"] = float(run.initial_replicas)
            tb.setup["static_peak_rule_replicas"] = float(fixed)
            tb.static_search = sorted(tried.items())
            continue
        if on_policy_start is not None:
            on_policy_start(name, len(trace))
        warmed = None
        if name == "headroom":  # it has been running: its state and its own fleet
            warmed = prewarm(policy, trace, cap, auto, n0)
            n0 = max(n0, warmed.last_target)
        tb.runs[name] = run_autoscaled(
            trace,
            fleet,
            policy,
            auto,
            initial_replicas=n0,
            capacity=cap,
            block_ids=ids,
            id_floor=floor,
            progress=progress,
            initial_state=warmed,
        )
    return tb


def static_replay(
    trace: Trace,
    fleet: FleetConfig,
    replicas: int,
    auto: AutoscaleConfig,
    cap: SloCapacity,
    ids: tuple[Sequence[Any], int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> AutoscaleRun:
    """`trace` replayed on a fixed fleet of `replicas` ready replicas (`ids`: the trace's block
    ids and id floor from `dense_block_ids`, computed here when None)."""
    block_ids, floor = ids or dense_block_ids(trace, fleet.profile.resolved_block_size)
    return run_autoscaled(
        trace,
        fleet,
        StaticPeakPolicy(StaticPeakConfig(replicas)),
        auto,
        initial_replicas=replicas,
        capacity=cap,
        block_ids=block_ids,
        id_floor=floor,
        progress=progress,
    )


def static_search(
    replay: Callable[[int], AutoscaleRun], start: int, target: float, most: int
) -> tuple[AutoscaleRun, dict[int, float]]:
    """The smallest fixed fleet in [1, most] whose replay meets `target` (the largest tried if
    none does): doubling steps from `start`, then bisection. Attainment grows with the fleet."""
    runs: dict[int, AutoscaleRun] = {}

    def att(n: int) -> float:
        if n not in runs:
            runs[n] = replay(n)
        return runs[n].slo_attainment()

    n = max(1, min(most, start))
    if att(n) >= target:
        lo, hi, step = 0, n, 1
        while hi - step >= 1 and att(hi - step) >= target:
            hi, step = hi - step, step * 2
        lo = max(lo, hi - step)
    else:
        lo, hi, step = n, most, 1
        while lo + step < most and att(lo + step) < target:
            lo, step = lo + step, step * 2
        hi = min(most, lo + step)
        if att(hi) < target:
            return runs[hi], {k: r.slo_attainment() for k, r in runs.items()}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if att(mid) >= target:
            hi = mid
        else:
            lo = mid
    return runs[hi], {k: r.slo_attainment() for k, r in runs.items()}


def backtest(
    traces: Sequence[str],
    policies: Sequence[str] = POLICY_NAMES,
    config: BacktestConfig | None = None,
    *,
    trace_params: dict[str, dict[str, object]] | None = None,
    on_policy_start: Callable[[str, int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> BacktestResult:
    """Backtest `policies` on each named trace (builders in `autoscaler.backtest_traces`)."""
    cfg = config or BacktestConfig()
    for name in policies:
        if name not in POLICY_NAMES:
            raise ConfigError(f"unknown autoscaling policy {name!r} (known: {POLICY_NAMES})")
    wall0 = time.perf_counter()
    result = BacktestResult(cfg)
    params = trace_params or {}
    for spec in traces:
        trace = backtest_trace(spec, **params.get(spec, {}))
        result.traces[spec] = backtest_one(
            trace, policies, cfg, on_policy_start=on_policy_start, progress=progress
        )
    result.wall_s = time.perf_counter() - wall0
    return result


__all__ = [
    "DEFAULT_TRACES",
    "POLICY_NAMES",
    "BacktestConfig",
    "BacktestResult",
    "TraceBacktest",
    "arrival_samples",
    "backtest",
    "backtest_one",
    "build_policy",
    "demand_windows",
    "prewarm",
    "static_replay",
    "static_search",
]
