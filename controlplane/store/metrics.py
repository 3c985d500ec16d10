"""Prometheus series of the Redis-backed stores' circuit breakers (controlplane/store/breaker.py).

    cp_redis_breaker_open{store}          1 while the store's breaker is open or half-open (its
                                          calls are refused or probing: Redis is considered
                                          down), 0 while closed
    cp_redis_breaker_opens_total{store}   closed/half-open -> open transitions

`store` names the component: `prefix_index` (router and indexer), `quota` (token quotas),
`fair_queue` (the fair queue shared by several routers). `sync(store, breaker)` is called at
scrape time (the router) or on the status tick (the indexer).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from controlplane.store.breaker import BreakerState, CircuitBreaker


class BreakerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.open = Gauge(
            "cp_redis_breaker_open",
            "1 while the store's Redis circuit breaker is open or half-open (Redis down), "
            "0 while closed; by store (prefix_index, quota, fair_queue).",
            ("store",),
            registry=registry,
        )
        self.opens = Counter(
            "cp_redis_breaker_opens_total",
            "Times the store's Redis circuit breaker opened.",
            ("store",),
            registry=registry,
        )
        self._opens_seen: dict[str, int] = {}

    def sync(self, store: str, breaker: CircuitBreaker) -> None:
        self.open.labels(store).set(0 if breaker.state is BreakerState.CLOSED else 1)
        last = self._opens_seen.get(store, 0)
        delta = breaker.opens - last if breaker.opens >= last else breaker.opens
        child = self.opens.labels(store)  # exported from 0, so increase() sees the first
        if delta > 0:
            child.inc(delta)
        self._opens_seen[store] = breaker.opens


__all__ = ["BreakerMetrics"]
