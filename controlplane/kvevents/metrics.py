"""Prometheus series of the KV-event followers, shared by the router and `controlplane indexer`.

Fed from `EventIndexer.status()` rows (cumulative per-replica figures) by `sync(rows)`; a counter
adds the increase since the last call, and a figure that went down (a restarted follower or a
re-created subscriber) is taken whole as the increase, so counters stay monotone.

    cp_kv_events_applied_total{replica}          batches applied to the prefix index
    cp_kv_events_lost_total{replica}             batches lost for good (outside the replay
                                                 buffer, replay failed, no replay endpoint)
    cp_kv_events_gaps_total{replica}             seq gaps seen on the live stream (each one a
                                                 replay request; the lost ones count above)
    cp_kv_events_restarts_total{replica}         replica restarts detected (its entries purged)
    cp_kv_events_last_batch_timestamp_seconds{replica}   Unix time of the last applied batch
                                                 (absent until one is): the index's freshness
    cp_kv_events_trusted{replica}                1 when the follower can vouch for continuity,
                                                 0 after a loss or an index error until a replay
                                                 or an in-sequence batch restores it
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from controlplane.kvevents.service import ReplicaStatus

_COUNTED = ("batches", "lost", "gaps", "restarts")


class KvEventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.applied = Counter(
            "cp_kv_events_applied_total", "KV event batches applied to the prefix index.",
            ("replica",), registry=r,
        )  # fmt: skip
        self.lost = Counter(
            "cp_kv_events_lost_total", "KV event batches lost for good.", ("replica",), registry=r
        )
        self.gaps = Counter(
            "cp_kv_events_gaps_total",
            "Sequence gaps seen on a replica's live KV-event stream (each triggers a replay).",
            ("replica",),
            registry=r,
        )
        self.restarts = Counter(
            "cp_kv_events_restarts_total",
            "Replica restarts detected from its KV events (its index entries are purged).",
            ("replica",),
            registry=r,
        )
        self.last_batch = Gauge(
            "cp_kv_events_last_batch_timestamp_seconds",
            "Unix time of the last KV event batch applied for the replica.",
            ("replica",),
            registry=r,
        )
        self.trusted = Gauge(
            "cp_kv_events_trusted",
            "1 when the replica's KV-event stream is known continuous; 0 after a loss or an "
            "index error, until a replay or an in-sequence batch restores it.",
            ("replica",),
            registry=r,
        )
        self._seen: dict[tuple[str, str], float] = {}

    def _add(self, counter: Counter, replica: str, kind: str, value: float) -> None:
        last = self._seen.get((replica, kind), 0.0)
        delta = value - last if value >= last else value
        child = counter.labels(replica=replica)  # exported from 0, so increase() sees the first
        if delta > 0:
            child.inc(delta)
        self._seen[(replica, kind)] = value

    def sync(self, rows: Iterable[ReplicaStatus]) -> None:
        """Feed the followers' cumulative status rows."""
        for row in rows:
            rid = row.replica_id
            for kind, counter in zip(
                _COUNTED, (self.applied, self.lost, self.gaps, self.restarts), strict=True
            ):
                self._add(counter, rid, kind, float(getattr(row, kind)))
            if row.last_batch_at > 0:
                self.last_batch.labels(replica=rid).set(row.last_batch_at)
            self.trusted.labels(replica=rid).set(1 if row.trusted else 0)

    def forget(self, replica: str) -> None:
        """Drop the gauges of a replica no longer followed (counters stay)."""
        for gauge in (self.last_batch, self.trusted):
            with contextlib.suppress(KeyError):
                gauge.remove(replica)


__all__ = ["KvEventMetrics"]
