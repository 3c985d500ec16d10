"""`EventIndexer`: follow many replicas' KV events into one prefix index.

One `ReplicaSubscriber` (ZMQ, seq tracking, replay) and one `EventIngestor` (engine → project
hashes) per `ReplicaSource`, sharing one ZMQ context and one index. The caller owns the index
(and closes it after `close()`). `status()` gives one row per replica for a status display or a
metrics exporter (controlplane/kvevents/metrics.py). Every batch handed to the index is one
INTERNAL span `cp.kvevents.batch` (replica, seq, event count, replayed) of the tracer
`controlplane.kvevents`.

Incarnations: a source without one starts at `initial_incarnation()` (default: wall-clock
milliseconds, so a restarted indexer never writes under an older incarnation than the one it
left in a shared index); a replica restart moves to `max(previous + 1, initial_incarnation())`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq.asyncio
from opentelemetry.trace import TracerProvider

from controlplane.kvevents.config import ReplicaSource
from controlplane.kvevents.ingest import DEFAULT_MAX_MAPPED_BLOCKS, EventIngestor
from controlplane.kvevents.subscriber import (
    DEFAULT_REPLAY_BACKOFF_S,
    DEFAULT_REPLAY_TIMEOUT_S,
    TRACER_NAME,
    ReplicaSubscriber,
)
from controlplane.prefix.protocol import AsyncPrefixIndex, PrefixIndex
from controlplane.tracing import tracer_of


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    replica_id: str
    state: str
    trusted: bool
    applied_seq: int
    batches: int
    replayed: int
    gaps: int
    lost: int
    restarts: int
    mapped_blocks: int
    skipped_unknown_parent: int
    incarnation: int
    # Unix time of the last applied batch (0.0: none yet)
    last_batch_at: float = 0.0


class EventIndexer:
    def __init__(
        self,
        sources: Sequence[ReplicaSource],
        index: PrefixIndex | AsyncPrefixIndex,
        *,
        secret: bytes = b"",
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        replay_backoff_s: float = DEFAULT_REPLAY_BACKOFF_S,
        max_mapped_blocks: int = DEFAULT_MAX_MAPPED_BLOCKS,
        initial_incarnation: Callable[[], int] = wall_clock_ms,
        context: zmq.asyncio.Context | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """`tracer_provider`: where the per-batch spans go (default: the global provider)."""
        tracer = tracer_of(TRACER_NAME, tracer_provider)
        self._ctx = context or zmq.asyncio.Context()
        self._own_ctx = context is None
        self.ingestors: dict[str, EventIngestor] = {}
        self.subscribers: dict[str, ReplicaSubscriber] = {}

        def next_incarnation(previous: int) -> int:
            return max(previous + 1, initial_incarnation())

        for src in sources:
            ing = EventIngestor(
                src.replica_id,
                index,
                model=src.model,
                block_size=src.block_size,
                secret=secret,
                incarnation=(initial_incarnation() if src.incarnation is None else src.incarnation),
                next_incarnation=next_incarnation,
                max_mapped_blocks=max_mapped_blocks,
            )
            self.ingestors[src.replica_id] = ing
            self.subscribers[src.replica_id] = ReplicaSubscriber(
                src.replica_id,
                src.events,
                ing,
                replay_endpoint=src.replay,
                topic=src.topic,
                context=self._ctx,
                replay_timeout_s=replay_timeout_s,
                replay_backoff_s=replay_backoff_s,
                tracer=tracer,
            )

    def start(self) -> None:
        for sub in self.subscribers.values():
            sub.start()

    async def close(self) -> None:
        for sub in self.subscribers.values():
            await sub.close()
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> EventIndexer:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def status(self) -> list[ReplicaStatus]:
        rows = []
        for rid, sub in self.subscribers.items():
            ing = self.ingestors[rid]
            st = sub.stats
            rows.append(
                ReplicaStatus(
                    replica_id=rid,
                    state=str(sub.state),
                    trusted=sub.trusted,
                    applied_seq=sub.applied_seq,
                    batches=st.batches_applied,
                    replayed=st.batches_replayed,
                    gaps=st.gaps,
                    lost=st.lost,
                    restarts=st.restarts,
                    mapped_blocks=ing.mapped_blocks,
                    skipped_unknown_parent=ing.stats.skipped_unknown_parent,
                    incarnation=ing.incarnation,
                    last_batch_at=sub.last_applied_at,
                )
            )
        return rows
