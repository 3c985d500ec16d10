"""The loop of the standalone hosts: scrape the routers, ask the policy, actuate, export.

Every `tick_s`:

1. Scrape every router's `/metrics` (concurrently) and read one model's demand: the counters
   `cp_demand_work_seconds_total{kind="prefill"|"decode"}`, `cp_demand_arrivals_total`, and the
   gauges `cp_backlog_work_seconds`, `cp_backlog_requests`, `cp_in_flight_requests`, each summed
   over the routers (and over models when no model is configured), and the backlog already
   routed to each replica, `cp_backlog_dispatched_work_seconds{replica}`, summed per replica
   over the routers (several routers send to the same replica): the sample's
   `backlog_by_replica`, descending.
2. Turn the counters into the interval's amounts: per router, `delta = cur - prev`, or `cur` when
   the counter went down (the router restarted and counts from 0 again). Baselines move only on
   a tick where *every* router answered, so every delta spans the same interval. A tick where a
   router is unreachable (or the very first tick, which only sets baselines) yields a NO_DATA
   sample (`interval_s == 0`): the host holds the current target without consulting the policy.
3. Read the fleet from the actuator (`spec`, `ready`), update the measured load time
   (`autoscaler.hosts.LoadTimes`) and build `ScaleContext`.
4. `policy.decide(ctx, state, now)` with the injected clock; actuate a changed target; export
   `cp_autoscaler_decisions_total{policy,reason}`, `cp_autoscaler_target_replicas{model}`,
   `cp_autoscaler_{ready,loading,min,max}_replicas{model}`,
   `cp_autoscaler_forecast_<figure>{model}` (from `decision.detail`), log one JSON line and end
   one INTERNAL span `cp.autoscaler.decide` (tracer `controlplane.autoscaler`) whose attributes
   carry the reason, target, fleet and figures.

Errors never stop the loop: a failed scrape is NO_DATA, a failed fleet read or actuation is
logged and counted (`cp_autoscaler_errors_total{stage}`) and the next tick tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from autoscaler.demand import PEAK_REQUESTS, PEAK_WORK, backlog_by_replica, sum_peaks
from autoscaler.hosts import FleetObservation, LoadTimes
from autoscaler.router_urls import RouterUrls
from autoscaler.types import DemandSample, ScaleContext, ScaleDecision, ScaleReason, ScalingPolicy
from controlplane.errors import ConfigError
from controlplane.tracing import tracer_of

log = logging.getLogger("controlplane.autoscaler")

WORK = "cp_demand_work_seconds_total"
ARRIVALS = "cp_demand_arrivals_total"
GAUGES = ("cp_backlog_work_seconds", "cp_backlog_requests", "cp_in_flight_requests")
DISPATCHED = "cp_backlog_dispatched_work_seconds"
COUNTERS = ("arrivals", "prefill", "decode")
POLICIES = {"headroom": "autoscaler.headroom:headroom_policy"}
TRACER_NAME = "controlplane.autoscaler"
DECIDE_SPAN = "cp.autoscaler.decide"


class AutoscalerSettings(BaseSettings):
    """The controller's settings: `CP_AUTOSCALER_*` environment variables, then explicit values."""

    model_config = SettingsConfigDict(env_prefix="CP_AUTOSCALER_", extra="ignore")

    routers: list[str] = Field(
        default_factory=list,
        description="Base URLs of the router replicas (their /metrics and admin API); an entry "
        "dns+http://name:port is every address the name resolves to, re-resolved each tick "
        "(a headless Service of a router Deployment).",
    )
    model: str = Field(default="", description="Served model to scale ('' = sum every model).")
    policy: str = Field(
        default="headroom", description="Policy name (headroom) or import path `module:factory`."
    )
    policy_params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the policy factory."
    )
    tick_s: float = Field(
        default=5.0,
        gt=0,
        description="Seconds between two decisions (the burst memory is measured at this scale).",
    )
    load_time_s: float = Field(
        default=240.0, gt=0, description="Replica start-to-ready time until one is measured."
    )
    min_replicas: int = Field(default=1, ge=0, description="Lower bound of the target.")
    max_replicas: int = Field(default=64, ge=1, description="Upper bound of the target.")
    scrape_timeout_s: float = Field(default=3.0, gt=0, description="Timeout of one /metrics GET.")


def load_policy(name: str, params: Mapping[str, Any]) -> ScalingPolicy[Any]:
    """A policy by registered name or `module:attr` import path, built with `params`."""
    path = POLICIES.get(name, name)
    module, _, attr = path.partition(":")
    if not attr:
        raise ConfigError(f"unknown policy {name!r}: use one of {sorted(POLICIES)} or module:attr")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import policy {path!r}: {exc}") from None
    policy: ScalingPolicy[Any] = factory(**params)
    return policy


# -- demand ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RouterReading:
    """One router's demand metrics: cumulative counters and current gauges."""

    counters: Mapping[str, float]  # arrivals, prefill, decode
    gauges: Mapping[str, float]  # the GAUGES names
    # window_s -> (most prefill work within window_s, its requests), summed over models
    peaks: Mapping[float, tuple[float, float]] = field(default_factory=dict)
    # replica -> backlog work this router already sent to it, summed over models
    dispatched: Mapping[str, float] = field(default_factory=dict)


def parse_router_metrics(text: str, model: str = "") -> RouterReading:
    """The demand metrics of one router's exposition (`model` '' = every model)."""
    counters = dict.fromkeys(COUNTERS, 0.0)
    gauges = dict.fromkeys(GAUGES, 0.0)
    peaks: dict[float, tuple[float, float]] = {}
    dispatched: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if model and s.labels.get("model", model) != model:
                continue
            if s.name == ARRIVALS:
                counters["arrivals"] += s.value
            elif s.name == WORK and s.labels.get("kind") in ("prefill", "decode"):
                counters[s.labels["kind"]] += s.value
            elif s.name in gauges:
                gauges[s.name] += s.value
            elif s.name == DISPATCHED and "replica" in s.labels:
                replica = s.labels["replica"]
                dispatched[replica] = dispatched.get(replica, 0.0) + s.value
            elif s.name in (PEAK_WORK, PEAK_REQUESTS) and "window_s" in s.labels:
                w = float(s.labels["window_s"])
                work, n = peaks.get(w, (0.0, 0.0))
                if s.name == PEAK_WORK:
                    peaks[w] = (work + s.value, n)
                else:
                    peaks[w] = (work, n + s.value)
    return RouterReading(counters, gauges, peaks, dispatched)


def counter_delta(prev: float, cur: float) -> float:
    """Increase of a counter between two readings; a decrease means it restarted from 0."""
    return cur - prev if cur >= prev else cur


@dataclass
class DemandAccumulator:
    """Counter readings of several routers -> one `DemandSample` per interval."""

    baselines: dict[str, Mapping[str, float]] = field(default_factory=dict)
    last_t: float | None = None
    last_in_flight: float = 0.0

    def update(self, now: float, readings: Mapping[str, RouterReading | None]) -> DemandSample:
        if not readings or any(r is None for r in readings.values()):
            return DemandSample(t_s=self.last_t if self.last_t is not None else now, interval_s=0.0)
        ok = {url: r for url, r in readings.items() if r is not None}
        sums = dict.fromkeys(COUNTERS, 0.0)
        for url, r in ok.items():
            prev = self.baselines.get(url)
            for k in COUNTERS:
                sums[k] += counter_delta(prev[k], r.counters[k]) if prev is not None else 0.0
        gauges = {g: sum(r.gauges[g] for r in ok.values()) for g in GAUGES}
        first = self.last_t is None
        interval = 0.0 if self.last_t is None else max(0.0, now - self.last_t)
        in_flight = gauges["cp_in_flight_requests"]
        avg = (self.last_in_flight + in_flight) / 2
        self.baselines = {url: r.counters for url, r in ok.items()}
        self.last_t, self.last_in_flight = now, in_flight
        if first:
            return DemandSample(t_s=now, interval_s=0.0)
        arrivals = round(sums["arrivals"])
        # routers' peaks add up; a window some router does not report is left out
        peaks = sum_peaks([(w, work, n) for w, (work, n) in r.peaks.items()] for r in ok.values())
        return DemandSample(
            t_s=now,
            interval_s=interval,
            arrivals=arrivals,
            prefill_work_s=sums["prefill"],
            decode_work_s=sums["decode"],
            backlog_requests=round(gauges["cp_backlog_requests"]),
            backlog_work_s=gauges["cp_backlog_work_seconds"],
            backlog_by_replica=backlog_by_replica(r.dispatched for r in ok.values()),
            in_flight=round(in_flight),
            in_flight_avg=avg,
            prefill_mean_s=sums["prefill"] / arrivals if arrivals else 0.0,
            prefill_peaks=tuple(p for p in peaks if p[2] > 0),
        )


class RouterScraper:
    """GETs every router's /metrics concurrently; an unreachable router reads as None."""

    def __init__(
        self,
        urls: Sequence[str] | RouterUrls,
        model: str,
        client: httpx.AsyncClient,
    ) -> None:
        # `dns+http://name:port` entries: every address of the name, re-resolved each scrape
        self.routers = urls if isinstance(urls, RouterUrls) else RouterUrls(urls)
        self.model = model
        self.client = client

    async def _one(self, url: str) -> RouterReading | None:
        try:
            resp = await self.client.get(f"{url}/metrics")
            resp.raise_for_status()
            return parse_router_metrics(resp.text, self.model)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("router %s: /metrics unavailable: %s", url, exc)
            return None

    async def scrape(self) -> dict[str, RouterReading | None]:
        urls = await self.routers.current()
        results = await asyncio.gather(*(self._one(u) for u in urls))
        return dict(zip(urls, results, strict=True))


# -- actuation ------------------------------------------------------------------------------------
class Actuator(Protocol):
    """Reads the fleet and applies a target (Kubernetes scale, advisory log, KEDA metric)."""

    mode: str

    async def observe(self) -> FleetObservation | None:
        """The fleet now; None when this actuator cannot see it (then the last target is
        assumed ready)."""
        ...

    async def apply(self, target: int, decision: ScaleDecision, fleet: FleetObservation) -> bool:
        """Make `target` the fleet's size (or publish/log it); True when the fleet's `spec` is
        now `target` (what the load-time measurement dates its orders by)."""
        ...


class ControllerMetrics:
    """The controller's Prometheus metrics, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "cp_autoscaler_decisions", "Decisions.", ["policy", "reason"], registry=r
        )
        self.target = Gauge("cp_autoscaler_target_replicas", "Target.", ["model"], registry=r)
        self.min_replicas = Gauge(
            "cp_autoscaler_min_replicas", "Lower bound of the target.", ["model"], registry=r
        )
        self.max_replicas = Gauge(
            "cp_autoscaler_max_replicas", "Upper bound of the target.", ["model"], registry=r
        )
        self.ready = Gauge("cp_autoscaler_ready_replicas", "Serving.", ["model"], registry=r)
        self.loading = Gauge("cp_autoscaler_loading_replicas", "Loading.", ["model"], registry=r)
        self.load_time = Gauge(
            "cp_autoscaler_load_time_seconds", "Measured load time.", ["model"], registry=r
        )
        self.demand = Gauge(
            "cp_autoscaler_demand_rate", "Arrived work/s (replicas).", ["model"], registry=r
        )
        self.backlog = Gauge(
            "cp_autoscaler_backlog_work_seconds", "Backlog work.", ["model"], registry=r
        )
        self.errors = Counter("cp_autoscaler_errors", "Failed steps.", ["stage"], registry=r)
        self._figures: dict[str, Gauge] = {}

    def figure(self, name: str) -> Gauge:
        key = re.sub(r"[^a-zA-Z0-9_]", "_", name)
        if key not in self._figures:
            self._figures[key] = Gauge(
                f"cp_autoscaler_forecast_{key}", f"Decision figure {name}.", ["model"],
                registry=self.registry,
            )  # fmt: skip
        return self._figures[key]


@dataclass(frozen=True, slots=True)
class TickResult:
    decision: ScaleDecision
    sample: DemandSample
    fleet: FleetObservation
    applied: bool


class Controller:
    """One model's autoscaling loop (clock injected; `tick()` is one decision)."""

    def __init__(
        self,
        settings: AutoscalerSettings,
        policy: ScalingPolicy[Any],
        actuator: Actuator,
        scraper: RouterScraper,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: ControllerMetrics | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """`tracer_provider`: where the decision spans go (default: the global provider)."""
        self.settings = settings
        self.tracer = tracer_of(TRACER_NAME, tracer_provider)
        self.policy = policy
        self.actuator = actuator
        self.scraper = scraper
        self.clock = clock
        self.metrics = metrics or ControllerMetrics()
        self.state: Any = policy.initial_state()
        self.demand = DemandAccumulator()
        self.load_times = LoadTimes(settings.load_time_s)
        self.last: FleetObservation | None = None
        self.decision: ScaleDecision | None = None
        self.label = settings.model or "all"
        # told of every tick's result (e.g. router/status/scale_log.py when run in the router)
        self.on_tick: list[Callable[[TickResult], None]] = []

    async def _observe(self) -> FleetObservation | None:
        try:
            fleet = await self.actuator.observe()
        except Exception as exc:
            self.metrics.errors.labels("observe").inc()
            log.error("cannot read the fleet (%s): %s", self.actuator.mode, exc)
            return None
        if fleet is None:  # not observable: the last target, assumed ready
            fleet = self.last or FleetObservation(self.settings.min_replicas, 0)
            fleet = FleetObservation(fleet.spec, fleet.spec)
        return fleet

    async def tick(self) -> TickResult | None:
        """One decision; None when the fleet could not be read (nothing decided)."""
        readings = await self.scraper.scrape()
        now = self.clock()
        sample = self.demand.update(now, readings)
        fleet = await self._observe()
        if fleet is None:
            return None
        if self.last is not None:
            self.load_times = self.load_times.ordered(now, self.last.spec, fleet.spec)
        self.load_times = self.load_times.observed(now, fleet.ready)
        self.last = fleet
        s = self.settings
        ctx = ScaleContext(
            sample=sample,
            fleet=fleet.counts(self.load_times, now),
            load_time_s=self.load_times.estimate_s,
            min_replicas=s.min_replicas,
            max_replicas=s.max_replicas,
            tick_s=s.tick_s,
        )
        with self.tracer.start_as_current_span(DECIDE_SPAN) as span:
            if sample.interval_s <= 0:
                decision = ScaleDecision(fleet.spec, ScaleReason.NO_DATA)
            else:
                decision, self.state = self.policy.decide(ctx, self.state, now)
            self.decision = decision
            applied = False
            try:
                applied = await self.actuator.apply(decision.target, decision, fleet)
            except Exception as exc:
                self.metrics.errors.labels("apply").inc()
                log.error(
                    "cannot apply target %d (%s): %s", decision.target, self.actuator.mode, exc
                )
            if applied and decision.target != fleet.spec:
                self.load_times = self.load_times.ordered(now, fleet.spec, decision.target)
                self.last = FleetObservation(decision.target, fleet.ready)
            self._export(ctx, decision)
            span.set_attributes(self._span_attributes(ctx, decision, fleet, applied))
        result = TickResult(decision, sample, fleet, applied)
        for observe in self.on_tick:
            observe(result)
        return result

    def _export(self, ctx: ScaleContext, decision: ScaleDecision) -> None:
        m, lbl = self.metrics, self.label
        m.decisions.labels(self.policy.name, str(decision.reason)).inc()
        m.target.labels(lbl).set(decision.target)
        m.min_replicas.labels(lbl).set(ctx.min_replicas)
        m.max_replicas.labels(lbl).set(ctx.max_replicas)
        m.ready.labels(lbl).set(ctx.fleet.ready)
        m.loading.labels(lbl).set(ctx.fleet.loading)
        m.load_time.labels(lbl).set(ctx.load_time_s)
        m.demand.labels(lbl).set(ctx.sample.rate)
        m.backlog.labels(lbl).set(ctx.sample.backlog_work_s)
        for name, value in decision.detail:
            m.figure(name).labels(lbl).set(value)
        line = {
            "event": "autoscale_decision", "mode": self.actuator.mode, "model": lbl,
            "policy": self.policy.name, "target": decision.target, "reason": str(decision.reason),
            "ready": ctx.fleet.ready, "loading": ctx.fleet.loading,
            "load_time_s": round(ctx.load_time_s, 3), "rate": round(ctx.sample.rate, 4),
            "backlog_work_s": round(ctx.sample.backlog_work_s, 4), **decision.figures(),
        }  # fmt: skip
        log.info(json.dumps(line, sort_keys=True))

    def _span_attributes(
        self, ctx: ScaleContext, decision: ScaleDecision, fleet: FleetObservation, applied: bool
    ) -> dict[str, str | int | float | bool]:
        """The decision span's attributes: its reason and the figures behind it."""
        attributes: dict[str, str | int | float | bool] = {
            "cp.autoscaler.model": self.label,
            "cp.autoscaler.policy": self.policy.name,
            "cp.autoscaler.mode": self.actuator.mode,
            "cp.autoscaler.reason": str(decision.reason),
            "cp.autoscaler.target": decision.target,
            "cp.autoscaler.spec": fleet.spec,
            "cp.autoscaler.ready": ctx.fleet.ready,
            "cp.autoscaler.loading": ctx.fleet.loading,
            "cp.autoscaler.applied": applied,
            "cp.autoscaler.load_time_s": ctx.load_time_s,
            "cp.autoscaler.demand_rate": ctx.sample.rate,
            "cp.autoscaler.backlog_work_s": ctx.sample.backlog_work_s,
        }
        for name, value in decision.detail:
            attributes[f"cp.autoscaler.figure.{name}"] = value
        return attributes

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every `tick_s` until `stop` is set; nothing raised by a tick ends the loop."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:
                self.metrics.errors.labels("tick").inc()
                log.exception("autoscaler tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.settings.tick_s)


__all__ = [
    "Actuator",
    "AutoscalerSettings",
    "Controller",
    "ControllerMetrics",
    "DemandAccumulator",
    "RouterReading",
    "RouterScraper",
    "TickResult",
    "counter_delta",
    "load_policy",
    "parse_router_metrics",
]
