"""Speculative prefix-index entries: chains a replica is about to hold, each with an expiry time.

A router writes one when it routes a request (the replica will compute the prompt's blocks) and
shortens it when the first token shows the KV events have taken over (`retract`); until then,
lookups count the chain as held.

Block hashes are chained: block j's hash depends on every block before it, so two chains agree
on block j only if they agree on every block before it. A replica's chains are grouped by first
hash (a query can only match its own group), and a group answers "longest live prefix of the
query" in one of two ways, whichever is cheaper for its size:

    few chains (<= COUNT_ABOVE)  scan them; a chain can only beat the best so far if it agrees
                                 on the block right after it, so most cost one comparison, the
                                 rest a binary search of the common prefix
    many chains                  count every hash of the group's chains: "some chain holds the
                                 query's block j" implies it holds blocks 0..j, so the answer is
                                 a binary search over one membership test per step

Many chains share a first hash when many queued requests share a system prompt or document:
then a scan per lookup costs more than counting each chain's blocks once. The counts are two
counters that only grow (`added` on speculation, `gone` on expiry; both one C-level
`Counter.update`), a hash being live while added > gone; once `added` holds twice the hashes of
its last rebuild, both are rebuilt from the live chains, so the rebuilds cost O(1) per new hash.

Expiry is by the injected clock: a heap of (expires_at, seq, chain) pops each chain when its
time passes (before every lookup and write), so lookups see exactly the chains with
expires_at > now.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence

COUNT_ABOVE = 32  # a group with more chains than this counts hashes instead of scanning
REBUILD_MIN = 4096  # hashes counted before the first rebuild of a group's counters


class _Chain:
    __slots__ = ("expires_at", "hashes", "live")

    def __init__(self, expires_at: float, hashes: Sequence[int]) -> None:
        self.expires_at = expires_at
        self.hashes = hashes
        self.live = True  # held by its group


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


class _Group:
    """A replica's live chains with one first hash; counted once there are many."""

    __slots__ = ("added", "chains", "gone", "rebuild_at")

    def __init__(self) -> None:
        self.chains: list[_Chain] = []
        self.added: Counter[int] | None = None  # None: scan mode
        self.gone: Counter[int] = Counter()
        self.rebuild_at = REBUILD_MIN

    def add(self, chain: _Chain) -> None:
        self.chains.append(chain)
        if self.added is not None:
            self.added.update(chain.hashes)
            if len(self.added) > self.rebuild_at:
                self._count()
        elif len(self.chains) > COUNT_ABOVE:
            self._count()

    def remove(self, chain: _Chain) -> None:
        self.chains.remove(chain)
        if self.added is not None:
            self.gone.update(chain.hashes)

    def _count(self) -> None:
        self.added, self.gone = Counter(), Counter()
        for chain in self.chains:
            self.added.update(chain.hashes)
        self.rebuild_at = max(REBUILD_MIN, 2 * len(self.added))

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        added = self.added
        if added is None:
            n, spec = len(hashes), 0
            for chain in self.chains:
                held = chain.hashes
                if spec < n and spec < len(held) and held[spec] == hashes[spec]:
                    spec = _common_prefix(hashes, held)
            return spec
        gone = self.gone
        n = len(hashes)
        if added.get(hashes[n - 1], 0) > gone.get(hashes[n - 1], 0):
            return n
        lo, hi = 0, n - 1  # held: hashes[lo - 1] (or lo == 0); not held: hashes[hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if added.get(hashes[mid - 1], 0) > gone.get(hashes[mid - 1], 0):
                lo = mid
            else:
                hi = mid - 1
        return lo


class SpeculativeChains:
    """Every replica's speculative chains; callers pass `now` from their injected clock."""

    def __init__(self) -> None:
        # replica -> first hash -> its group
        self._groups: dict[str, dict[int, _Group]] = {}
        # replica -> last hash -> chains (what `shorten` finds a chain by)
        self._by_last: dict[str, dict[int, list[_Chain]]] = {}
        self._expiry: list[tuple[float, int, str, _Chain]] = []
        self._seq = 0

    def add(self, replica_id: str, hashes: Sequence[int], expires_at: float, now: float) -> None:
        self.prune(now)
        chain = _Chain(expires_at, hashes)
        groups = self._groups.setdefault(replica_id, {})
        group = groups.get(hashes[0])
        if group is None:
            group = groups[hashes[0]] = _Group()
        group.add(chain)
        self._by_last.setdefault(replica_id, {}).setdefault(hashes[-1], []).append(chain)
        self._push(replica_id, chain)

    def shorten(self, replica_id: str, hashes: Sequence[int], until: float, now: float) -> None:
        """Every chain equal to `hashes` on the replica expires by `until` (never later)."""
        self.prune(now)
        by_last = self._by_last.get(replica_id)
        for chain in by_last.get(hashes[-1], ()) if by_last else ():
            if len(chain.hashes) == len(hashes) and until < chain.expires_at:
                chain.expires_at = until
                self._push(replica_id, chain)

    def forget(self, replica_id: str) -> None:
        groups = self._groups.pop(replica_id, {})
        self._by_last.pop(replica_id, None)
        for group in groups.values():
            for chain in group.chains:
                chain.live = False

    def prune(self, now: float) -> None:
        """Drop the chains whose expiry has passed (expires_at <= now)."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, _, rid, chain = heapq.heappop(heap)
            if chain.live and chain.expires_at <= now:
                self._remove(rid, chain)

    # reads: the caller prunes first (`prune(now)`), once per lookup
    def longest_prefix(self, replica_id: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` a live chain of the replica holds."""
        groups = self._groups.get(replica_id)
        group = groups.get(hashes[0]) if groups and hashes else None
        return group.longest_prefix(hashes) if group is not None else 0

    def held(self) -> int:
        """Chains held (expired ones until `prune` drops them)."""
        return sum(len(g.chains) for groups in self._groups.values() for g in groups.values())

    def _remove(self, replica_id: str, chain: _Chain) -> None:
        chain.live = False
        first, last = chain.hashes[0], chain.hashes[-1]
        groups = self._groups[replica_id]
        group = groups[first]
        group.remove(chain)
        if not group.chains:
            del groups[first]
        by_last = self._by_last[replica_id]
        same = by_last[last]
        same.remove(chain)
        if not same:
            del by_last[last]

    def _push(self, replica_id: str, chain: _Chain) -> None:
        self._seq += 1
        heapq.heappush(self._expiry, (chain.expires_at, self._seq, replica_id, chain))
