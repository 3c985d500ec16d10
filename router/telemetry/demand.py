"""The router's demand signal for the autoscaler, as Prometheus series summable across routers.

One `DemandMeter` (autoscaler/demand.py) per served model, fed from the request's life in the
router:

    admitted (quota passed, before the fair queue)   arrived: work priced with SloCapacity
    routed (its replica chosen)                      dispatched to that replica
    first token                                      started (left the backlog) + TTFT
    any end (done, error, disconnect, rejected)      finished (idempotent)

The live router cannot see when a replica begins a prefill, so its backlog is "accepted and no
first token yet": the router's queue, the replicas' waiting queues and the prefills in progress.
The part already routed waits at (or runs on) its replica, which alone can serve it: it is also
exported per replica (a reroute, the replica never accepted it, moves it). The Serve
ingress learns a request's replica only with its first chunk (router/serve/ingress.py `adopt`):
there the per-replica part stays empty.

Exported (the standalone autoscaler sums these over every router replica and differentiates the
counters over its tick):

    cp_demand_work_seconds_total{model,kind}         prefill / decode work that arrived
    cp_demand_prefill_work_squared_seconds_total{model}   sum of squared prefill work (for SCV)
    cp_demand_arrivals_total{model}
    cp_backlog_work_seconds{model}, cp_backlog_requests{model}, cp_in_flight_requests{model}
    cp_backlog_dispatched_work_seconds{model,replica}     the backlog work already routed to
                                                          `replica` (series only for replicas
                                                          holding some: removed at zero)
    cp_demand_prefill_peak_work_seconds{model,window_s}   sub-tick bursts: the most prefill
    cp_demand_prefill_peak_requests{model,window_s}       work (and its requests) within any
                                                          window_s seconds, over the windows
                                                          ending in the last window_s seconds
                                                          (`DemandMeter.recent_peaks`, read at
                                                          scrape time: every scraper sees it)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric

from autoscaler.capacity import SloCapacity
from autoscaler.demand import PEAK_REQUESTS, PEAK_WORK, DemandMeter, sum_peaks
from autoscaler.hosts.ray_serve import DemandTotals
from controlplane.roofline.profile import profile
from router.config import RouterSettings

if TYPE_CHECKING:
    from router.scope import Outcome, RequestScope


def demand_capacity(settings: RouterSettings) -> SloCapacity:
    """SloCapacity of the configured (or the first replica's) GPU, model and TP."""
    d = settings.demand
    first = settings.replicas[0] if settings.replicas else None
    gpu = d.gpu or (first.gpu if first else "h100")
    model = d.model or (first.model if first else "llama-3.1-8b")
    tp = d.tp or (first.tp if first else 1)
    return SloCapacity.build(profile(gpu, model, tp=tp), d.ttft_slo_s, d.tpot_slo_s)


class RouterDemand:
    def __init__(
        self,
        settings: RouterSettings,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = settings.demand.enabled
        self.capacity = demand_capacity(settings)
        self.clock = clock
        self.meters: dict[str, DemandMeter] = {}
        # the same signal summed over models, as a Serve replica reports it (`stats`)
        self.totals = DemandTotals()
        self._model_of: dict[str, str] = {}
        r = registry
        self.work = Counter(
            "cp_demand_work_seconds",
            "Work that arrived, in replica-seconds at the SLO, by kind (prefill, decode).",
            ["model", "kind"],
            registry=r,
        )
        self.work_sq = Counter(
            "cp_demand_prefill_work_squared_seconds",
            "Sum of the squared prefill work of arrivals (variability of prefill service).",
            ["model"],
            registry=r,
        )
        self.arrivals = Counter(
            "cp_demand_arrivals", "Requests admitted (quota passed).", ["model"], registry=r
        )
        self.backlog_work = Gauge(
            "cp_backlog_work_seconds",
            "Work of admitted requests without a first token yet (replica-seconds at the SLO).",
            ["model"],
            registry=r,
        )
        self.backlog_requests = Gauge(
            "cp_backlog_requests",
            "Admitted requests without a first token yet.",
            ["model"],
            registry=r,
        )
        self.in_flight = Gauge(
            "cp_in_flight_requests", "Admitted requests not finished.", ["model"], registry=r
        )
        r.register(self)

    # -- the sub-tick peaks and the per-replica backlog, computed when scraped --------------------
    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        work = GaugeMetricFamily(
            PEAK_WORK,
            "Most prefill work (replica-seconds at the SLO) that arrived within window_s "
            "seconds, over the windows ending in the last window_s seconds.",
            labels=["model", "window_s"],
        )
        reqs = GaugeMetricFamily(
            PEAK_REQUESTS,
            "Requests in the window of cp_demand_prefill_peak_work_seconds.",
            labels=["model", "window_s"],
        )
        # a series only for the replicas holding some: read from the meters when scraped, so
        # the request path does not walk the replicas and no series is left behind at zero
        dispatched = GaugeMetricFamily(
            "cp_backlog_dispatched_work_seconds",
            "Work of admitted requests without a first token yet that were routed to the "
            "replica (replica-seconds at the SLO).",
            labels=["model", "replica"],
        )
        return work, reqs, dispatched

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        work, reqs, dispatched = self._families()
        now = self.clock()
        for model, meter in sorted(self.meters.items()):
            for w, peak, n in meter.recent_peaks(now):
                window = f"{w:g}"
                work.add_metric([model, window], peak)
                reqs.add_metric([model, window], float(n))
            for replica, backlog in sorted(meter.backlog_by_replica.items()):
                dispatched.add_metric([model, replica], backlog)
        yield work
        yield reqs
        yield dispatched

    def _meter(self, model: str) -> DemandMeter:
        meter = self.meters.get(model)
        if meter is None:
            meter = self.meters[model] = DemandMeter(self.capacity, start_s=self.clock())
        return meter

    def _gauges(self, model: str, meter: DemandMeter) -> None:
        self.backlog_work.labels(model).set(meter.backlog_work_s)
        self.backlog_requests.labels(model).set(meter.backlog_requests)
        self.in_flight.labels(model).set(meter.in_flight)

    def arrived(self, request_id: str, model: str, prompt_tokens: int, predicted: int) -> None:
        if not self.enabled or request_id in self._model_of:
            return
        meter = self._meter(model)
        prefill, decode = meter.arrived(request_id, prompt_tokens, predicted, self.clock())
        self._model_of[request_id] = model
        self.work.labels(model, "prefill").inc(prefill)
        self.work.labels(model, "decode").inc(decode)
        self.work_sq.labels(model).inc(prefill * prefill)
        self.arrivals.labels(model).inc()
        self.totals.arrived(prefill, decode)
        self._gauges(model, meter)

    def dispatched(self, request_id: str, replica_id: str) -> None:
        model = self._model_of.get(request_id)
        if model is None:
            return
        self.meters[model].dispatched(request_id, replica_id, self.clock())

    def first_token(self, request_id: str) -> None:
        model = self._model_of.get(request_id)
        if model is None:
            return
        meter = self.meters[model]
        meter.first_token(request_id, self.clock())
        self._gauges(model, meter)

    def stats(self) -> dict[str, float]:
        """Every model's demand as one `DemandTotals.stats()` (the counters and gauges above,
        summed over models): what an ingress replica on Ray Serve returns from
        `record_autoscaling_stats` (autoscaler/hosts/ray_ingress.py)."""
        meters = self.meters.values()
        self.totals.set_load(
            backlog_requests=sum(m.backlog_requests for m in meters),
            backlog_work_s=sum(m.backlog_work_s for m in meters),
            in_flight=sum(m.in_flight for m in meters),
            peaks=self._peaks_over_models(),
        )
        return self.totals.stats()

    def _peaks_over_models(self) -> tuple[tuple[float, float, int], ...]:
        """Every model's `recent_peaks` now, added up per window."""
        now = self.clock()
        return sum_peaks(m.recent_peaks(now) for m in self.meters.values())

    # -- the request scope's hooks (router/scope.py) ----------------------------------------------
    def on_admitted(self, scope: RequestScope) -> None:
        req = scope.request
        if req is not None:
            predicted = req.predicted_output_tokens
            self.arrived(scope.request_id, scope.model, req.prompt_tokens, predicted)

    def on_routed(self, scope: RequestScope) -> None:
        if scope.routed is not None:
            self.dispatched(scope.request_id, scope.routed.replica_id)

    def on_first_token(self, scope: RequestScope) -> None:
        self.first_token(scope.request_id)

    def on_tokens(self, scope: RequestScope, n: int) -> None:
        return None

    def on_end(self, scope: RequestScope, outcome: Outcome) -> None:
        self.finished(scope.request_id)

    def finished(self, request_id: str) -> None:
        model = self._model_of.pop(request_id, None)
        if model is None:
            return
        meter = self.meters[model]
        meter.finished(request_id, self.clock())
        self._gauges(model, meter)


__all__ = ["RouterDemand", "demand_capacity"]
