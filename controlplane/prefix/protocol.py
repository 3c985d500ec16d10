"""The `PrefixIndex` protocol: which replica holds which KV blocks.

Keys are chained block hashes (block size = the engine's), so an equal hash at position i means
an equal prefix up to block i. Entries are either *confirmed* (a KV event said the replica stored
the block) or *speculative* (a router sent a request there and expects the replica to compute the
blocks; these expire after a TTL unless events confirm them). A lookup returns, per candidate
replica, how many leading blocks of the query it holds: the first block held by neither kind ends
the match, as vLLM's own lookup stops at the first miss. (The Redis index finds that block by a
search that takes a replica's held blocks along one chain to be a prefix, as they are in vLLM;
where the index holds a gap it answers some boundary at or after it: see `redis_lua.LOOKUP`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from controlplane.types import PrefixMatch


class PrefixIndex(Protocol):
    def lookup(self, hashes: Sequence[int], candidates: Sequence[str]) -> dict[str, PrefixMatch]:
        """Leading blocks of `hashes` held by each candidate (absent = no match)."""
        ...

    def record_stored(self, replica_id: str, hashes: Sequence[int]) -> None:
        """A KV event: the replica stored these blocks."""
        ...

    def record_removed(self, replica_id: str, hashes: Sequence[int]) -> None:
        """A KV event: the replica evicted these blocks."""
        ...

    def clear(self, replica_id: str) -> None:
        """Forget everything about a replica (AllBlocksCleared, restart, removal)."""
        ...

    def speculate(self, replica_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        """Routing-time entry: the replica is about to compute this chain."""
        ...

    def retract(self, replica_id: str, hashes: Sequence[int], grace_s: float) -> None:
        """The chain has been computed (first token): let KV events speak for it after
        `grace_s`, so a speculative claim never outlives an eviction."""
        ...


class AsyncPrefixIndex(Protocol):
    """The same contract for a shared, remote index (Redis) used by many router processes.

    Entries are tied to a replica *incarnation*: a restarted replica is a new incarnation, and
    nothing recorded for an older one may match. `lookup` returns None when the index cannot
    answer within its time budget ("unknown"); callers then route on load alone.
    """

    async def lookup(
        self, hashes: Sequence[int], candidates: Sequence[tuple[str, int]]
    ) -> dict[str, PrefixMatch] | None:
        """Per (replica, incarnation) candidate, the leading blocks it holds; None = unknown."""
        ...

    async def record_stored(
        self, replica_id: str, incarnation: int, hashes: Sequence[int]
    ) -> None: ...

    async def record_removed(
        self, replica_id: str, incarnation: int, hashes: Sequence[int]
    ) -> None: ...

    async def clear(self, replica_id: str) -> None:
        """Forget every entry of the replica (all incarnations)."""
        ...

    async def speculate(
        self, replica_id: str, incarnation: int, hashes: Sequence[int], ttl_s: float
    ) -> None: ...

    async def aclose(self) -> None: ...
