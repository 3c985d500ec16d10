"""`/metrics` of the standalone KV-event indexer (`controlplane indexer --metrics-port N`).

The indexer has no HTTP server of its own, so this one is prometheus_client's (a WSGI server in
a daemon thread) over a registry of its own. Its series are the router's (one definition each):
`cp_kv_events_*{replica}` from controlplane/kvevents/metrics.py and, with a Redis index,
`cp_redis_breaker_open{store="prefix_index"}` / `cp_redis_breaker_opens_total` from
controlplane/store/metrics.py. `update(rows)` runs on the indexer's status tick, so a scrape
sees figures at most one status interval old.
"""

from __future__ import annotations

from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from controlplane.kvevents.metrics import KvEventMetrics
from controlplane.kvevents.service import ReplicaStatus
from controlplane.prefix.protocol import AsyncPrefixIndex, PrefixIndex
from controlplane.prefix.redis_index import RedisPrefixIndex
from controlplane.store.metrics import BreakerMetrics


class IndexerMetrics:
    def __init__(self, index: PrefixIndex | AsyncPrefixIndex) -> None:
        self.registry = CollectorRegistry()
        self.kv_events = KvEventMetrics(self.registry)
        self.breakers = BreakerMetrics(self.registry)
        self.index = index
        self._server: tuple[WSGIServer, Thread] | None = None

    def update(self, rows: list[ReplicaStatus]) -> None:
        self.kv_events.sync(rows)
        if isinstance(self.index, RedisPrefixIndex):
            self.breakers.sync("prefix_index", self.index.breaker)

    def serve(self, host: str, port: int) -> int:
        """Start serving /metrics; the bound port (`port` 0: a free one)."""
        self._server = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server[0].server_port)

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(timeout=5.0)
            self._server = None


__all__ = ["IndexerMetrics"]
