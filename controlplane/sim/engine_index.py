"""A prefix index that reads the simulated engines' block pools instead of their KV events.

With no event delivery delay, an index built from KV events holds exactly the blocks each
engine has cached once the engines are synced (the fleet syncs them before every lookup), so the
simulator can skip generating and applying millions of events and ask the pools directly. The
speculative side (routing-time entries, retraction) is the in-memory index's, unchanged.

Engines fast-forward decode runs; the fleet syncs one before it is walked, and only when the
walk could tell: the replica holds the query's first block (a run's allocations may have evicted
part of the prefix), or the run caches blocks other requests share (session content).

One difference, in the index's favour: an engine can hold two copies of a block (computed
concurrently by two requests); a set of hashes fed by events forgets the hash when the first copy
is evicted, the pool still finds the second. The fleet uses this index only when both event delays
are zero; any delay needs the event-fed index to model staleness.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.sim.block_pool import BlockPool


class EngineBackedIndex(InMemoryPrefixIndex):
    """`before_walk(replica_id, first_hash)` lets the fleet bring that engine up to date."""

    def __init__(
        self,
        clock: Callable[[], float],
        pools: Mapping[str, BlockPool],
        before_walk: Callable[[str, int], None],
    ) -> None:
        super().__init__(clock)
        self._pools = pools
        self._before_walk = before_walk

    def _holds(self, replica_id: str, h: int) -> bool:
        pool = self._pools.get(replica_id)
        if pool is None:
            return False
        self._before_walk(replica_id, h)  # a decode run may have filled this block by now
        return pool.cached_block(h) is not None

    def _walk(self, replica_id: str, hashes: Sequence[int], start: int) -> int:
        pool = self._pools.get(replica_id)
        if pool is None or not hashes:
            return 0
        self._before_walk(replica_id, hashes[start] if start < len(hashes) else hashes[-1])
        tail = hashes if start == 0 else hashes[start:]
        return len(pool.longest_cached_prefix(tail, len(tail)))

    def record_stored(self, replica_id: str, hashes: Sequence[int]) -> None:
        return None

    def record_removed(self, replica_id: str, hashes: Sequence[int]) -> None:
        return None

    def clear(self, replica_id: str) -> None:
        self._speculative.pop(replica_id, None)
