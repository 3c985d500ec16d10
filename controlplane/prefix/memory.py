"""In-memory `PrefixIndex` for one process (the simulator, a single router).

Confirmed entries: one `set` of hashes per replica, updated in bulk from KV events. A lookup walks
the query chain per replica with `itertools.takewhile(set.__contains__, ...)`, which runs at C speed
and stops at the first miss, so the cost is the matched length, not the prompt length.

Speculative entries: whole chains with an expiry time from the injected clock, kept by
`SpeculativeChains` (speculative.py) as a radix tree per replica: a lookup walks it down once, a
binary search per edge (chained hashes make "held" monotone along the query).

A replica's match is the first block held by neither kind:

    k = longest speculative common prefix
    matched   = k + walk(confirmed, from block k)
    confirmed = walk(confirmed, from block 0)

Known simplification: vLLM can hold two copies of one block (computed concurrently by two
requests); a set forgets the hash when the first copy is evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice, takewhile

from controlplane.prefix.speculative import SpeculativeChains
from controlplane.types import PrefixMatch


class InMemoryPrefixIndex:
    """Process-local index; `clock` returns seconds (simulation time or monotonic)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._confirmed: dict[str, set[int]] = {}
        self._speculative = SpeculativeChains()
        self.stored_total = 0
        self.removed_total = 0

    # -- writes ----------------------------------------------------------------------------------
    def record_stored(self, replica_id: str, hashes: Sequence[int]) -> None:
        self._confirmed.setdefault(replica_id, set()).update(hashes)
        self.stored_total += len(hashes)

    def record_removed(self, replica_id: str, hashes: Sequence[int]) -> None:
        held = self._confirmed.get(replica_id)
        if held is not None:
            held.difference_update(hashes)
        self.removed_total += len(hashes)

    def clear(self, replica_id: str) -> None:
        self._confirmed.pop(replica_id, None)
        self._speculative.forget(replica_id)

    def speculate(self, replica_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        if not hashes or ttl_s <= 0:
            return
        now = self._clock()
        self._speculative.add(replica_id, hashes, now + ttl_s, now)

    def retract(self, replica_id: str, hashes: Sequence[int], grace_s: float) -> None:
        if not hashes:
            return
        now = self._clock()
        self._speculative.shorten(replica_id, hashes, now + grace_s, now)

    @property
    def speculative_entries(self) -> int:
        """Speculative chains held (expired ones until a write or lookup prunes them)."""
        return self._speculative.held()

    @property
    def live_speculative_entries(self) -> int:
        """Speculative chains a lookup would still count."""
        self._speculative.prune(self._clock())
        return self._speculative.held()

    # -- reads -----------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int], candidates: Sequence[str]) -> dict[str, PrefixMatch]:
        return self._lookup(hashes, candidates, self._holds, self._walk)

    def _lookup(
        self,
        hashes: Sequence[int],
        candidates: Sequence[str],
        holds: Callable[[str, int], bool],
        walk: Callable[[str, Sequence[int], int], int],
    ) -> dict[str, PrefixMatch]:
        """The lookup over confirmed blocks read through `holds(replica, first hash)` and
        `walk(replica, hashes, start)` (leading blocks of `hashes[start:]` held), and this
        index's speculative chains."""
        out: dict[str, PrefixMatch] = {}
        if not hashes:
            return out
        first = hashes[0]
        speculative = self._speculative
        speculative.prune(self._clock())
        for rid in candidates:
            held = holds(rid, first)
            spec = speculative.longest_prefix(rid, hashes)
            if not held and not spec:
                continue  # neither kind holds the first block: no match
            confirmed = walk(rid, hashes, 0) if held else 0
            matched = confirmed
            if spec > confirmed:
                matched = spec + walk(rid, hashes, spec)
            if matched:
                out[rid] = PrefixMatch(rid, matched, confirmed)
        return out

    def holdings(self, replica_id: str, hashes: Sequence[int]) -> tuple[list[bool], int]:
        """Block by block: is each block of `hashes` confirmed on the replica; and how many
        leading blocks a live speculative chain covers. What an index that searches instead of
        walking (the Redis one) is checked against."""
        held = self._confirmed.get(replica_id, set())
        self._speculative.prune(self._clock())
        spec = self._speculative.longest_prefix(replica_id, hashes)
        return [h in held for h in hashes], spec

    def _holds(self, replica_id: str, h: int) -> bool:
        held = self._confirmed.get(replica_id)
        return held is not None and h in held

    def _walk(self, replica_id: str, hashes: Sequence[int], start: int) -> int:
        """Leading blocks of `hashes[start:]` confirmed on the replica (first miss ends it)."""
        held = self._confirmed.get(replica_id)
        if not held:
            return 0
        tail = hashes if start == 0 else islice(hashes, start, None)
        return sum(1 for _ in takewhile(held.__contains__, tail))

    def held_blocks(self, replica_id: str) -> int:
        return len(self._confirmed.get(replica_id, ()))
