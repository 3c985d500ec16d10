"""In-memory `PrefixIndex` for one process (the simulator, a single router).

Confirmed entries: one `set` of hashes per replica, updated in bulk from KV events. A lookup walks
the query chain per replica with `itertools.takewhile(set.__contains__, ...)`, which runs at C speed
and stops at the first miss, so the cost is the matched length, not the prompt length.

Speculative entries: whole chains, kept per replica and keyed by their first hash, with an expiry
time from the injected clock. Because block hashes are chained, two chains agree on block j only if
they agree on every block before it, so the common prefix of a query and a speculative chain is
found by binary search.

A replica's match is the first block held by neither kind:

    k = longest speculative common prefix
    matched   = k + walk(confirmed, from block k)
    confirmed = walk(confirmed, from block 0)

Known simplification: vLLM can hold two copies of one block (computed concurrently by two
requests); a set forgets the hash when the first copy is evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from itertools import islice, takewhile

from controlplane.types import PrefixMatch


def _common_prefix(query: Sequence[int], chain: Sequence[int]) -> int:
    """Length of the common prefix of two chained-hash sequences (binary search)."""
    hi = min(len(query), len(chain))
    if hi == 0 or query[0] != chain[0]:
        return 0
    if query[hi - 1] == chain[hi - 1]:
        return hi
    lo = 1  # query[:lo] == chain[:lo]; query[hi-1] != chain[hi-1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if query[mid - 1] == chain[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


class InMemoryPrefixIndex:
    """Process-local index; `clock` returns seconds (simulation time or monotonic)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._confirmed: dict[str, set[int]] = {}
        # replica -> first hash -> [(expires_at, chain)]
        self._speculative: dict[str, dict[int, list[tuple[float, Sequence[int]]]]] = {}
        # (expires_at, replica, first hash) per speculation, to prune expired chains in time
        # order so memory stays bounded by one TTL of traffic
        self._expiry: list[tuple[float, str, int]] = []
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
        self._speculative.pop(replica_id, None)

    def speculate(self, replica_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        if not hashes or ttl_s <= 0:
            return
        now = self._clock()
        self._prune(now)
        by_first = self._speculative.setdefault(replica_id, {})
        entries = by_first.setdefault(hashes[0], [])
        entries[:] = [(exp, chain) for exp, chain in entries if exp > now]
        entries.append((now + ttl_s, hashes))
        heapq.heappush(self._expiry, (now + ttl_s, replica_id, hashes[0]))

    def _prune(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, rid, first = heapq.heappop(heap)
            by_first = self._speculative.get(rid)
            entries = by_first.get(first) if by_first else None
            if entries is None or by_first is None:
                continue
            live = [(exp, chain) for exp, chain in entries if exp > now]
            if live:
                by_first[first] = live
            else:
                del by_first[first]

    @property
    def speculative_entries(self) -> int:
        """Speculative chains held (expired ones until they are pruned)."""
        return sum(len(v) for by_first in self._speculative.values() for v in by_first.values())

    @property
    def live_speculative_entries(self) -> int:
        """Speculative chains a lookup would still count."""
        now = self._clock()
        return sum(
            exp > now
            for by_first in self._speculative.values()
            for entries in by_first.values()
            for exp, _ in entries
        )

    def retract(self, replica_id: str, hashes: Sequence[int], grace_s: float) -> None:
        if not hashes:
            return
        by_first = self._speculative.get(replica_id)
        entries = by_first.get(hashes[0]) if by_first else None
        if not entries:
            return
        until = self._clock() + grace_s
        last, n = hashes[-1], len(hashes)
        entries[:] = [
            (min(exp, until) if len(chain) == n and chain[-1] == last else exp, chain)
            for exp, chain in entries
        ]

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
        now = self._clock()
        first = hashes[0]
        speculative = self._speculative
        for rid in candidates:
            by_first_spec = speculative.get(rid)
            held = holds(rid, first)
            if not held and not (by_first_spec and first in by_first_spec):
                continue  # neither kind holds the first block: no match
            confirmed = walk(rid, hashes, 0) if held else 0
            spec = self._speculative_match(by_first_spec, hashes, now)
            matched = confirmed
            if spec > confirmed:
                matched = spec + walk(rid, hashes, spec)
            if matched:
                out[rid] = PrefixMatch(rid, matched, confirmed)
        return out

    @staticmethod
    def _speculative_match(
        by_first: dict[int, list[tuple[float, Sequence[int]]]] | None,
        hashes: Sequence[int],
        now: float,
    ) -> int:
        """Longest common prefix of `hashes` with a live speculative chain of one replica
        (`by_first`: its chains by first hash); drops the expired chains it meets."""
        entries = by_first.get(hashes[0]) if by_first is not None else None
        if not entries:
            return 0
        assert by_first is not None
        # a chain can only beat the best so far if it agrees on the block right after it (the
        # hashes are chained): one comparison rejects most of the chains sharing a system prompt
        n = len(hashes)
        spec = 0
        expired = False
        for exp, chain in entries:
            if exp <= now:
                expired = True
            elif spec < n and spec < len(chain) and chain[spec] == hashes[spec]:
                spec = _common_prefix(hashes, chain)
        if expired:
            live = [(exp, chain) for exp, chain in entries if exp > now]
            if live:
                by_first[hashes[0]] = live
            else:
                del by_first[hashes[0]]
        return spec

    def holdings(self, replica_id: str, hashes: Sequence[int]) -> tuple[list[bool], int]:
        """Block by block: is each block of `hashes` confirmed on the replica; and how many
        leading blocks a live speculative chain covers. What an index that searches instead of
        walking (the Redis one) is checked against."""
        held = self._confirmed.get(replica_id, set())
        by_first = self._speculative.get(replica_id)
        spec = self._speculative_match(by_first, hashes, self._clock()) if hashes else 0
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
