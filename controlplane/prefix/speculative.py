"""Speculative prefix-index entries: chains a replica is about to hold, each with an expiry time.

A router writes one when it routes a request (the replica will compute the prompt's blocks) and
shortens it when the first token shows the KV events have taken over (`retract`); until then,
lookups count the chain as held.

Block hashes are chained: block j's hash depends on every block before it, so two chains agree
on block j only if they agree on every block before it. A replica's live chains form a radix tree
(a trie whose single-child runs are one edge): a node is a prefix some live chain has, its edge
is a slice of one chain's hashes, and it counts the live chains that hold its whole prefix. With
chained hashes one comparison tells whether a query holds a whole edge (its last hash), and a
binary search where along the edge it leaves it, so

    lookup   walk down: at a node, the child keyed by the query's next hash; its whole edge
             matched (one comparison), go on; else the match ends inside it (binary search)
    add      the same walk, counting the chain at each node it passes; where it leaves an edge,
             the edge is split there and the chain's rest becomes a new leaf
    remove   the same walk, uncounting; a node no chain holds any more goes with its subtree

so each costs O(depth x log edge), not O(chain length): when many queued requests share a system
prompt or a document, they all hang below one node. Every chain ends at a node, so removal
walks its chain node by node.

Expiry is by the injected clock: a heap of (expires_at, seq, chain) pops each chain when its
time passes (before every lookup and write), so lookups see exactly the chains with
expires_at > now.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class _Chain:
    __slots__ = ("expires_at", "hashes", "live")

    def __init__(self, expires_at: float, hashes: Sequence[int]) -> None:
        self.expires_at = expires_at
        self.hashes = hashes
        self.live = True  # held by its replica's tree


class _Node:
    """A prefix of `hi` blocks that live chains hold: `key[:hi]`; the edge from its parent is
    `key[parent.hi:hi]`."""

    __slots__ = ("children", "count", "hi", "key")

    def __init__(self, key: Sequence[int], hi: int, count: int) -> None:
        self.key = key
        self.hi = hi
        self.count = count  # live chains holding all of key[:hi]
        self.children: dict[int, _Node] = {}  # by the first hash of the child's edge


def _agree(query: Sequence[int], key: Sequence[int], lo: int, hi: int) -> int:
    """Leading blocks shared by `query` and `key`, given that they share `lo` and that `hi` is
    at most both lengths (chained hashes: the shared part is a prefix, found by binary search)."""
    if query[hi - 1] == key[hi - 1]:
        return hi
    # query[lo - 1] == key[lo - 1]; query[hi - 1] != key[hi - 1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if query[mid - 1] == key[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


def _longest(root: _Node, query: Sequence[int]) -> int:
    n = len(query)
    node, pos = root, 0
    while pos < n:
        child = node.children.get(query[pos])
        if child is None:
            return pos
        hi = child.hi
        if hi > n:
            return _agree(query, child.key, pos + 1, n)
        if query[hi - 1] != child.key[hi - 1]:
            return _agree(query, child.key, pos + 1, hi)
        node, pos = child, hi
    return pos


def _insert(root: _Node, chain: Sequence[int]) -> None:
    n = len(chain)
    node, pos = root, 0
    while pos < n:
        first = chain[pos]
        child = node.children.get(first)
        if child is None:
            node.children[first] = _Node(chain, n, 1)
            return
        hi = child.hi
        shared = _agree(chain, child.key, pos + 1, min(hi, n))
        if shared == hi:
            child.count += 1
            node, pos = child, hi
            continue
        # the chain leaves (or ends inside) the child's edge: split it at `shared`
        mid = _Node(child.key, shared, child.count + 1)
        mid.children[child.key[shared]] = child
        node.children[first] = mid
        if shared < n:
            mid.children[chain[shared]] = _Node(chain, n, 1)
        return


def _delete(root: _Node, chain: Sequence[int]) -> None:
    n = len(chain)
    node, pos = root, 0
    while pos < n:
        first = chain[pos]
        child = node.children[first]
        child.count -= 1
        if not child.count:  # nobody holds it any more, nor anything below it
            del node.children[first]
            return
        node, pos = child, child.hi


class SpeculativeChains:
    """Every replica's speculative chains; callers pass `now` from their injected clock."""

    def __init__(self) -> None:
        # replica -> the root of its tree (hi 0; its count is unused)
        self._trees: dict[str, _Node] = {}
        # replica -> last hash -> chains (what `shorten` finds a chain by)
        self._by_last: dict[str, dict[int, list[_Chain]]] = {}
        self._expiry: list[tuple[float, int, str, _Chain]] = []
        self._seq = 0

    def add(self, replica_id: str, hashes: Sequence[int], expires_at: float, now: float) -> None:
        self.prune(now)
        chain = _Chain(expires_at, hashes)
        root = self._trees.get(replica_id)
        if root is None:
            root = self._trees[replica_id] = _Node((), 0, 0)
        _insert(root, hashes)
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
        self._trees.pop(replica_id, None)
        for same in self._by_last.pop(replica_id, {}).values():
            for chain in same:
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
        root = self._trees.get(replica_id)
        return _longest(root, hashes) if root is not None else 0

    def held(self) -> int:
        """Chains held (expired ones until `prune` drops them)."""
        return sum(len(same) for by_last in self._by_last.values() for same in by_last.values())

    def _remove(self, replica_id: str, chain: _Chain) -> None:
        chain.live = False
        _delete(self._trees[replica_id], chain.hashes)
        last = chain.hashes[-1]
        by_last = self._by_last[replica_id]
        same = by_last[last]
        same.remove(chain)
        if not same:
            del by_last[last]

    def _push(self, replica_id: str, chain: _Chain) -> None:
        self._seq += 1
        heapq.heappush(self._expiry, (chain.expires_at, self._seq, replica_id, chain))
