"""Where a policy runs: what every host shares, whatever it actuates.

A host (the Ray Serve adapter, the standalone controller in front of Kubernetes/KEDA) observes
the fleet as two counts, the replicas *ordered* (`spec`: Ray's target, a Deployment's
`spec.replicas`) and the replicas *serving* (`ready`: Ray's running replicas, `readyReplicas`),
and turns them into `FleetCounts`:

    ready    = min(ready, spec)
    loading  = max(0, spec - ready)        ordered, not serving yet
    draining = max(0, ready - spec)        serving, being removed

Load time is measured on the fleet, not assumed: every increase of `spec` is an *order*
`(t, level)`; when `ready` first reaches `level`, `now - t` is one load-time sample; an order
above a later, lower `spec` is cancelled. The estimate is the median of the last `keep`
samples (the configured value until one was seen). Each loading replica's ETA is the estimate
minus the age of the order that asked for it (0 when overdue).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from autoscaler.types import FleetCounts


@dataclass(frozen=True, slots=True)
class FleetObservation:
    """The fleet as a host reads it: replicas ordered and replicas serving."""

    spec: int
    ready: int

    def counts(self, load_times: LoadTimes, now: float) -> FleetCounts:
        ready = max(0, min(self.ready, self.spec))
        loading = max(0, self.spec - self.ready)
        draining = max(0, self.ready - self.spec)
        return FleetCounts(
            ready=ready,
            loading=loading,
            draining=draining,
            loading_eta_s=load_times.etas(now, ready, loading),
        )


@dataclass(frozen=True, slots=True)
class LoadTimes:
    """Measured start-to-ready times of the fleet (immutable: every update returns a copy)."""

    default_s: float
    # (time ordered, replica level ordered): replicas up to `level` were asked for at that time
    orders: tuple[tuple[float, int], ...] = ()
    samples: tuple[float, ...] = ()
    keep: int = 8

    @property
    def estimate_s(self) -> float:
        """Median of the recent samples; the configured value until one was measured."""
        if not self.samples:
            return self.default_s
        return float(statistics.median(self.samples))

    def ordered(self, now: float, current: int, target: int) -> LoadTimes:
        """`spec` went from `current` to `target`: a new order, or orders cancelled."""
        orders = tuple(o for o in self.orders if o[1] <= target)
        if target > current:
            orders = (*orders, (now, target))
        if orders == self.orders:
            return self
        return LoadTimes(self.default_s, orders, self.samples, self.keep)

    def observed(self, now: float, ready: int) -> LoadTimes:
        """`ready` replicas serve at `now`: the orders it reached become samples."""
        done = [t for t, level in self.orders if ready >= level]
        if not done:
            return self
        samples = (*self.samples, *(max(0.0, now - t) for t in done))[-self.keep :]
        orders = tuple(o for o in self.orders if ready < o[1])
        return LoadTimes(self.default_s, orders, samples, self.keep)

    def etas(self, now: float, ready: int, loading: int) -> tuple[float, ...]:
        """Seconds until each of the `loading` replicas is expected to serve."""
        est = self.estimate_s
        out: list[float] = []
        for k in range(ready + 1, ready + loading + 1):
            ages = [now - t for t, level in self.orders if level >= k]
            out.append(max(0.0, est - max(ages)) if ages else est)
        return tuple(out)


__all__ = ["FleetObservation", "LoadTimes"]
