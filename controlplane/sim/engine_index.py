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

import numpy as np

from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.sim.block_pool import BlockPool, IdsLike
from controlplane.types import PrefixMatch


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

    def lookup(
        self, hashes: Sequence[int], candidates: Sequence[str], ids: IdsLike | None = None
    ) -> dict[str, PrefixMatch]:
        """The in-memory index's lookup, walking the pools; `ids`: `hashes` as an array (the
        caller's, when it has one, saves converting them)."""
        if not hashes:
            return {}
        arr = np.asarray(hashes, dtype=np.int64) if ids is None else ids

        def walk(rid: str, _hashes: Sequence[int], start: int) -> int:
            if start:
                return self._walk_ids(rid, arr, start)
            pool = self._pools[rid]  # `holds` found the first block there, synced
            return len(pool.longest_cached_prefix(arr, len(arr)))

        return self._lookup(hashes, candidates, self._holds_first, walk)

    def _holds_first(self, replica_id: str, first: int) -> bool:
        pool = self._pools.get(replica_id)
        if pool is None:
            return False
        self._before_walk(replica_id, first)  # a decode run may have filled this block by now
        return pool.cached_block(first) is not None

    def _walk_ids(self, replica_id: str, ids: IdsLike, start: int) -> int:
        """Leading blocks of `ids[start:]` the replica's pool holds."""
        pool = self._pools.get(replica_id)
        if pool is None or not len(ids):
            return 0
        self._before_walk(replica_id, int(ids[start] if start < len(ids) else ids[-1]))
        tail = ids[start:]
        return len(pool.longest_cached_prefix(tail, len(tail)))

    def record_stored(self, replica_id: str, hashes: Sequence[int]) -> None:
        return None

    def record_removed(self, replica_id: str, hashes: Sequence[int]) -> None:
        return None

    def clear(self, replica_id: str) -> None:
        self._speculative.forget(replica_id)
