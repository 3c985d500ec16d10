"""Reads what one router process knows into `StatusInputs`, then `build_status` (pure) on them.

    feed = StatusFeed(runtime)        built with the runtime (`runtime.status`)
    feed.snapshot() -> FleetStatus    on the router's event loop, O(replicas + tenants + ring)

Sources: fleet rows (`LiveFleet.status()`), the demand meters and the SLO-priced work counter
(`cp_demand_work_seconds_total`, turned into a rate by `RateWindow`), the fair queue's books
(work charged, requests in flight and waiting, per tenant) with the configured tenants, the
decision ring, and every callable in `runtime.status_sources` (an autoscaler attached to the
process appends `ScaleLog.entries`, router/status/scale_log.py). Each router worker process
answers for itself: its own decisions, queue and demand.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from router.status.model import (
    DemandFigures,
    FleetStatus,
    ScaleEntry,
    StatusInputs,
    TenantInput,
    build_status,
)
from router.status.rate import RateWindow

if TYPE_CHECKING:
    from router.runtime import RouterRuntime

# something the process attached that reports scaling decisions (newest last or any order)
StatusSource = Callable[[], Sequence[ScaleEntry]]

WORK_COUNTER = "cp_demand_work_seconds_total"


class StatusFeed:
    def __init__(
        self,
        runtime: RouterRuntime,
        *,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.rt = runtime
        self.rate = RateWindow(window_s)
        self.clock = clock
        self.wall = wall

    def _work_total(self) -> float:
        registry = self.rt.metrics.registry
        total = 0.0
        for model in list(self.rt.demand.meters):
            for kind in ("prefill", "decode"):
                value = registry.get_sample_value(WORK_COUNTER, {"model": model, "kind": kind})
                total += value or 0.0
        return total

    def demand(self, now: float) -> DemandFigures:
        d = self.rt.demand
        meters = list(d.meters.values())
        measured = self.rate.observe(now, self._work_total()) if d.enabled else None
        return DemandFigures(
            in_flight=sum(m.in_flight for m in meters),
            backlog_requests=sum(m.backlog_requests for m in meters),
            backlog_work_s=sum(m.backlog_work_s for m in meters),
            queued=self.rt.fairq.queued,
            rate_replicas=measured[0] if measured else None,
            window_s=measured[1] if measured else 0.0,
            metered=d.enabled,
        )

    def tenants(self) -> list[TenantInput]:
        core = self.rt.fairq.core
        in_flight = Counter(f.entry.tenant for f in core.inflight.values())
        known = {t.tenant_id: t for t in self.rt.tenancy.tenants()}
        ids = sorted(set(known) | set(core.charged) | set(in_flight))
        out = []
        for tid in ids:
            t = known.get(tid)
            out.append(
                TenantInput(
                    id=tid,
                    weight=t.weight if t else core.weights.get(tid, 1.0),
                    priority=str(t.priority if t else core.classes.get(tid, "interactive")),
                    charged_work=core.charged.get(tid, 0.0),
                    in_flight=in_flight[tid],
                    queued=len(core.fifos.get(tid, ())),
                )
            )
        return out

    def snapshot(self) -> FleetStatus:
        rt = self.rt
        now = self.clock()
        scaling = [entry for source in rt.status_sources for entry in source()]
        return build_status(
            StatusInputs(
                at_s=self.wall(),
                model=rt.settings.served_model,
                uptime_s=max(0.0, now - rt.started_s),
                replicas=rt.fleet.status(),
                demand=self.demand(now),
                tenants=self.tenants(),
                decisions=rt.decisions.entries(),
                autoscaler=scaling,
                degraded=rt.degraded_reasons(),
            )
        )


__all__ = ["StatusFeed", "StatusSource"]
