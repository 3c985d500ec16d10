"""Our policies as Ray Serve custom autoscaling policies (Ray 2.60).

    from autoscaler.hosts.ray_serve import autoscaling_config
    Engine.options(autoscaling_config=autoscaling_config("headroom", 1, 8, tick_s=10.0))

`autoscaling_config` builds the deployment's `AutoscalingConfig` dict: `policy.policy_function`
is `ServeAutoscaler` (a class: Ray instantiates it once with `policy_kwargs` and calls it with an
`AutoscalingContext` every control-loop step), and the delays and factors Ray still applies
around a custom policy are neutralised (`upscale_delay_s = downscale_delay_s =
downscale_to_zero_delay_s = 0`, `upscaling_factor = downscaling_factor = 1`): the policy's own
hysteresis is the only one. Ray still clips the target to min/max replicas.

Each call, `ServeAutoscaler`:

1. Reads the fleet: `spec` = Ray's target (`target_num_replicas`, replicas ordered), `ready` =
   running replicas (`current_num_replicas`); loading = spec - ready. A rise of the target is an
   order; the time until the running count reaches it is a load-time sample
   (`autoscaler.hosts.LoadTimes`; `load_time_s` until one is measured).
2. Between decisions (less than `tick_s` since the last one) returns the last target.
3. At a decision, builds the `DemandSample` of the interval since the last decision:
   - `metrics` demand (the replicas report `DemandTotals.stats()` from
     `record_autoscaling_stats`): per replica, the latest value of each counter minus the value
     at the last decision (a lower value: the counter restarted; a replica first seen after the
     first decision: its whole count); gauges summed over replicas. The first decision only
     sets the baselines (NO_DATA). Each replica's `cp_backlog_work_seconds` waits at that
     replica (the handle already gave it the requests), so it is also the sample's
     `backlog_by_replica` (positive, descending).
   - `ongoing` demand (nothing reported): Ray's `total_num_requests` L and
     `total_queued_requests` Q (window averages) with a per-request work estimate: arrivals
     `λ = (L - Q) / request_latency_s` (Little), arrived work `λ·interval·(prefill + decode work
     per request)`, backlog `Q` requests of the same work. Ray's queued requests wait at the
     handle, where any replica can take them: `backlog_by_replica` stays empty.
   - `auto` (default): `metrics` once any replica reports `cp_demand_arrivals_total`, else
     `ongoing`.
   - `ingress`: the `metrics` rule over the counters the INGRESS deployment's replicas report
     (`ingress_deployment`, same application), read from the controller's demand board
     (`autoscaler/hosts/ray_ingress.py`); none posted within `ingress_stale_s`: NO_DATA. An
     ingress replica's backlog is not at one engine replica, and it learns a request's engine
     replica only with its first chunk (router/serve/ingress.py `adopt`), when the request has
     left the backlog: `backlog_by_replica` stays empty.
4. NO_DATA holds Ray's target; otherwise `policy.decide(ctx, state, now)` with `now` =
   `ctx.current_time`. The policy's state and ours live in Ray's `policy_state` (one key).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from autoscaler.controller import counter_delta, load_policy
from autoscaler.demand import (
    PEAK_REQUESTS,
    PEAK_WINDOWS_S,
    PEAK_WORK,
    backlog_by_replica,
    sum_peaks,
)
from autoscaler.hosts import FleetObservation, LoadTimes
from autoscaler.hosts.ray_ingress import board
from autoscaler.types import DemandSample, ScaleContext, ScaleDecision, ScaleReason, ScalingPolicy
from controlplane.errors import ConfigError

# a child of Serve's logger: the decisions land in the controller's log (serve/controller_*.log)
log = logging.getLogger("ray.serve.controlplane.autoscaler")

ARRIVALS = "cp_demand_arrivals_total"
PREFILL = "cp_demand_prefill_work_seconds_total"
DECODE = "cp_demand_decode_work_seconds_total"
BACKLOG_WORK = "cp_backlog_work_seconds"
BACKLOG_REQUESTS = "cp_backlog_requests"
IN_FLIGHT = "cp_in_flight_requests"
COUNTERS = (ARRIVALS, PREFILL, DECODE)
GAUGES = (BACKLOG_WORK, BACKLOG_REQUESTS, IN_FLIGHT)


def peak_key(name: str, window_s: float) -> str:
    """The stats key of one sub-tick peak gauge (`DemandMeter.recent_peaks`): name:window."""
    return f"{name}:{window_s:g}"


PEAK_GAUGES = tuple(peak_key(n, w) for w in PEAK_WINDOWS_S for n in (PEAK_WORK, PEAK_REQUESTS))
STATE_KEY = "cp_autoscaler"
ADAPTER = "autoscaler.hosts.ray_serve:ServeAutoscaler"
# AutoscalingConfig fields passed through as given (the delays and factors are ours to set)
RAY_FIELDS = frozenset(
    {"initial_replicas", "look_back_period_s", "metrics_interval_s", "aggregation_function",
     "target_ongoing_requests"}
)  # fmt: skip


class RayPolicyConfig(BaseSettings):
    """The adapter's settings: `policy_kwargs`, over `CP_AUTOSCALER_RAY_*` environment variables
    of the Serve controller's process."""

    model_config = SettingsConfigDict(env_prefix="CP_AUTOSCALER_RAY_", extra="forbid")

    policy: str = Field(default="headroom", description="Policy name or `module:factory`.")
    policy_params: dict[str, Any] = Field(default_factory=dict, description="Its kwargs.")
    tick_s: float = Field(default=10.0, gt=0, description="Seconds between two decisions.")
    load_time_s: float = Field(
        default=120.0, gt=0, description="Replica start-to-ready time until one is measured."
    )
    demand: Literal["auto", "metrics", "ongoing", "ingress"] = Field(
        default="auto",
        description="Replicas' reported demand, Ray's ongoing requests, auto, or the ingress "
        "deployment's reported demand.",
    )
    ingress_deployment: str = Field(
        default="ingress", description="ingress demand: the deployment whose replicas report it."
    )
    ingress_stale_s: float = Field(
        default=30.0, gt=0, description="ingress demand: older than this, it is no data."
    )
    prefill_work_per_request_s: float = Field(
        default=0.05, ge=0, description="ongoing demand: prefill work of one request (replica-s)."
    )
    decode_work_per_request_s: float = Field(
        default=0.2, ge=0, description="ongoing demand: decode work of one request (replica-s)."
    )
    request_latency_s: float = Field(
        default=5.0, gt=0, description="ongoing demand: mean time a request runs on a replica."
    )


class DemandTotals:
    """A replica's demand as `record_autoscaling_stats` reports it: cumulative counters and
    current gauges. Feed it events (`arrived`, `set_load`) or a `DemandMeter`'s successive
    (disjoint) samples (`add`)."""

    def __init__(self) -> None:
        self.arrivals = 0
        self.prefill_work_s = 0.0
        self.decode_work_s = 0.0
        self.backlog_requests = 0
        self.backlog_work_s = 0.0
        self.in_flight = 0
        self.peaks: tuple[tuple[float, float, int], ...] = ()

    def arrived(self, prefill_work_s: float, decode_work_s: float, n: int = 1) -> None:
        self.arrivals += n
        self.prefill_work_s += prefill_work_s
        self.decode_work_s += decode_work_s

    def set_load(
        self,
        *,
        backlog_requests: int,
        backlog_work_s: float,
        in_flight: int,
        peaks: tuple[tuple[float, float, int], ...] = (),
    ) -> None:
        self.backlog_requests, self.backlog_work_s = backlog_requests, backlog_work_s
        self.in_flight = in_flight
        self.peaks = peaks

    def add(self, sample: DemandSample) -> None:
        self.arrived(sample.prefill_work_s, sample.decode_work_s, sample.arrivals)
        self.set_load(
            backlog_requests=sample.backlog_requests,
            backlog_work_s=sample.backlog_work_s,
            in_flight=sample.in_flight,
        )

    def stats(self) -> dict[str, float]:
        return {
            ARRIVALS: float(self.arrivals), PREFILL: self.prefill_work_s,
            DECODE: self.decode_work_s, BACKLOG_REQUESTS: float(self.backlog_requests),
            BACKLOG_WORK: self.backlog_work_s, IN_FLIGHT: float(self.in_flight),
            **{peak_key(PEAK_WORK, w): work for w, work, _ in self.peaks},
            **{peak_key(PEAK_REQUESTS, w): float(n) for w, _, n in self.peaks},
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class AdapterState:
    """What the adapter keeps in Ray's policy_state between calls."""

    policy_state: Any
    load_times: LoadTimes
    last_tick: float | None = None
    target: int | None = None
    spec: int | None = None
    # replica -> counter values at the last decision; None: no metrics baseline yet
    baselines: dict[str, dict[str, float]] | None = None
    detail: dict[str, float] = field(default_factory=dict)


def _replica_key(rid: Any) -> str:
    return str(getattr(rid, "unique_id", None) or rid)


def _latest(raw: dict[str, dict[Any, Any]], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for rid, series in (raw.get(name) or {}).items():
        if series:
            out[_replica_key(rid)] = float(series[-1].value)
    return out


def metrics_sample(
    raw: dict[str, dict[Any, Any]], st: AdapterState, now: float, *, at_replicas: bool = True
) -> tuple[DemandSample, dict[str, dict[str, float]]]:
    """The interval's demand from the replicas' reported counters; the new baselines.
    `at_replicas`: the reporting replicas serve the requests they meter (the engine's own, not
    the ingress's), so each one's backlog is `backlog_by_replica`."""
    latest = {name: _latest(raw, name) for name in (*COUNTERS, *GAUGES, *PEAK_GAUGES)}
    current = {
        rid: {name: latest[name].get(rid, 0.0) for name in COUNTERS} for rid in latest[ARRIVALS]
    }
    if st.baselines is None or st.last_tick is None:
        return DemandSample(t_s=now, interval_s=0.0), current
    sums = dict.fromkeys(COUNTERS, 0.0)
    for rid, values in current.items():
        prev = st.baselines.get(rid)
        for name in COUNTERS:
            sums[name] += counter_delta(prev[name], values[name]) if prev else values[name]
    gauges = {name: sum(latest[name].values()) for name in GAUGES}
    arrivals = round(sums[ARRIVALS])
    in_flight = gauges[IN_FLIGHT]
    # the replicas' peaks add up; a window some replica does not report is left out
    peaks = sum_peaks(
        [
            (w, latest[peak_key(PEAK_WORK, w)][rid], latest[peak_key(PEAK_REQUESTS, w)].get(rid, 0))
            for w in PEAK_WINDOWS_S
            if rid in latest[peak_key(PEAK_WORK, w)]
        ]
        for rid in current
    )
    return DemandSample(
        t_s=now,
        interval_s=max(0.0, now - st.last_tick),
        arrivals=arrivals,
        prefill_work_s=sums[PREFILL],
        decode_work_s=sums[DECODE],
        backlog_requests=round(gauges[BACKLOG_REQUESTS]),
        backlog_work_s=gauges[BACKLOG_WORK],
        backlog_by_replica=backlog_by_replica([latest[BACKLOG_WORK]]) if at_replicas else (),
        in_flight=round(in_flight),
        in_flight_avg=in_flight,
        prefill_mean_s=sums[PREFILL] / arrivals if arrivals else 0.0,
        prefill_peaks=tuple(p for p in peaks if p[2] > 0),
    ), current


def ongoing_sample(ctx: Any, cfg: RayPolicyConfig, interval_s: float, now: float) -> DemandSample:
    """The interval's demand from Ray's ongoing/queued requests and the per-request estimate."""
    total = float(ctx.total_num_requests or 0.0)
    queued = float(ctx.total_queued_requests or 0.0)
    running = max(0.0, total - queued)
    arrived = running / cfg.request_latency_s * interval_s
    per_request = cfg.prefill_work_per_request_s + cfg.decode_work_per_request_s
    return DemandSample(
        t_s=now,
        interval_s=interval_s,
        arrivals=round(arrived),
        prefill_work_s=arrived * cfg.prefill_work_per_request_s,
        decode_work_s=arrived * cfg.decode_work_per_request_s,
        backlog_requests=round(queued),
        backlog_work_s=queued * per_request,
        in_flight=round(total),
        in_flight_avg=total,
        prefill_mean_s=cfg.prefill_work_per_request_s,
    )


class ServeAutoscaler:
    """`AutoscalingConfig.policy.policy_function`: Ray calls `instance(ctx) -> (target, state)`."""

    def __init__(self, **kwargs: Any) -> None:
        try:
            self.config = RayPolicyConfig(**kwargs)
        except ValidationError as exc:
            raise ConfigError(f"invalid Ray autoscaling policy kwargs:\n{exc}") from None
        self.policy = self.make_policy()

    def make_policy(self) -> ScalingPolicy[Any]:
        return load_policy(self.config.policy, self.config.policy_params)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        cfg = self.config
        now = float(ctx.current_time if ctx.current_time is not None else time.time())
        st: AdapterState | None = ctx.policy_state.get(STATE_KEY)
        if st is None:
            st = AdapterState(self.policy.initial_state(), LoadTimes(cfg.load_time_s))
        spec, running = int(ctx.target_num_replicas), int(ctx.current_num_replicas)
        lt = st.load_times if st.spec is None else st.load_times.ordered(now, st.spec, spec)
        lt = lt.observed(now, running)
        if st.last_tick is not None and now - st.last_tick < cfg.tick_s:
            target = st.target if st.target is not None else spec
            return target, {**ctx.policy_state, STATE_KEY: replace(st, load_times=lt, spec=spec)}

        raw: dict[str, dict[Any, Any]] | None = ctx.raw_metrics or {}
        if cfg.demand == "ingress":
            app = str(ctx.app_name)
            raw = board().read(app, cfg.ingress_deployment, now, cfg.ingress_stale_s)
        baselines = st.baselines
        if raw is None:  # the ingress posted nothing lately: hold, and baseline afresh
            sample, baselines = DemandSample(t_s=now, interval_s=0.0), None
        elif cfg.demand in ("metrics", "ingress") or (cfg.demand == "auto" and ARRIVALS in raw):
            sample, baselines = metrics_sample(raw, st, now, at_replicas=cfg.demand != "ingress")
        else:
            interval = cfg.tick_s if st.last_tick is None else now - st.last_tick
            sample = ongoing_sample(ctx, cfg, interval, now)
        sctx = ScaleContext(
            sample=sample,
            fleet=FleetObservation(spec, running).counts(lt, now),
            load_time_s=lt.estimate_s,
            min_replicas=int(ctx.capacity_adjusted_min_replicas),
            max_replicas=int(ctx.capacity_adjusted_max_replicas),
            tick_s=cfg.tick_s,
        )
        pstate = st.policy_state
        if sample.interval_s <= 0:
            decision = ScaleDecision(spec, ScaleReason.NO_DATA)
        else:
            decision, pstate = self.policy.decide(sctx, pstate, now)
        lt = lt.ordered(now, spec, decision.target)
        log.info(json.dumps({
            "event": "autoscale_decision", "host": "ray_serve", "deployment": ctx.deployment_name,
            "policy": self.policy.name, "target": decision.target, "reason": str(decision.reason),
            "ready": sctx.fleet.ready, "loading": sctx.fleet.loading,
            "load_time_s": round(sctx.load_time_s, 3), "rate": round(sample.rate, 4),
            "backlog_work_s": round(sample.backlog_work_s, 4), **decision.figures(),
        }, sort_keys=True))  # fmt: skip
        new = AdapterState(
            pstate, lt, now, decision.target, decision.target, baselines, decision.figures()
        )
        return decision.target, {**ctx.policy_state, STATE_KEY: new}


def autoscaling_config(
    policy_import_path: str,
    min_replicas: int,
    max_replicas: int,
    *,
    adapter: str | type[ServeAutoscaler] = ADAPTER,
    **kwargs: Any,
) -> dict[str, Any]:
    """A deployment's `autoscaling_config` running `policy_import_path` (a policy name or
    `module:factory`) with Ray's delays at 0 and factors at 1. `kwargs`: the `AutoscalingConfig`
    fields in `RAY_FIELDS` (e.g. `look_back_period_s`, `initial_replicas`), everything else is a
    `RayPolicyConfig` field (e.g. `tick_s`, `load_time_s`, `policy_params`)."""
    if not 0 <= min_replicas <= max_replicas or max_replicas < 1:
        raise ConfigError(f"need 0 <= min_replicas <= max_replicas, 1 <= max_replicas: "
                          f"{min_replicas}, {max_replicas}")  # fmt: skip
    ray_fields = {k: v for k, v in kwargs.items() if k in RAY_FIELDS}
    policy_kwargs = {"policy": policy_import_path, **{
        k: v for k, v in kwargs.items() if k not in RAY_FIELDS}}  # fmt: skip
    try:
        RayPolicyConfig(**policy_kwargs)
        json.dumps(policy_kwargs)
    except (ValidationError, TypeError) as exc:
        raise ConfigError(f"invalid autoscaling policy arguments:\n{exc}") from None
    return {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        **ray_fields,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "downscale_to_zero_delay_s": 0.0,
        "upscaling_factor": 1.0,
        "downscaling_factor": 1.0,
        "policy": {"policy_function": adapter, "policy_kwargs": policy_kwargs},
    }


__all__ = [
    "ADAPTER",
    "AdapterState",
    "DemandTotals",
    "RayPolicyConfig",
    "ServeAutoscaler",
    "autoscaling_config",
    "metrics_sample",
    "ongoing_sample",
]
