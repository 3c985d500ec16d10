"""The paged KV block pool with prefix caching, as vLLM v1's `BlockPool` behaves.

- Block 0 is the null block and is never handed out, so `num_blocks - 1` blocks are usable.
- Free blocks sit in one LRU queue. Initially it holds every block in id order; freed blocks are
  appended at the tail; allocation pops from the head. Never-used ("fresh") blocks therefore always
  precede recycled ones; we keep them as an id range instead of materialising millions of entries.
- A block whose hash is set is *cached*: a later request with the same chained hash can reuse it.
  Cached blocks stay cached while free (ref count 0) until allocation pops them, which evicts them
  (one `BlockRemoved`). Reusing a free cached block ("touch") pulls it out of the free queue.
- Two blocks may carry the same hash (two requests computed the same block concurrently); lookups
  return the earliest inserted one still cached, as vLLM's `BlockHashToBlockMap` does.
- Requests free their blocks tail first (the caller passes them reversed), so a request's last
  blocks are evicted before its first ones.

Speed. A replay moves millions of blocks, so the hot paths are single tight loops over local
variables (measured faster than chains of `map` passes, and than compiling them with mypyc). The
free queue is a list with a head index and lazy deletion: `_qpos[b]` is the position of block b's
live queue entry (-1 when b is not free); taking a block out of the middle just clears
`_qpos[b]`, and the head skips entries whose position no longer matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from controlplane.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_COMPACT_AT = 1 << 16


class BlockPool:
    """Fixed pool of `num_blocks` KV blocks (including the null block)."""

    __slots__ = (
        "_cached",
        "_dups",
        "_fresh_next",
        "_hash",
        "_nfree",
        "_q",
        "_qh",
        "_qpos",
        "_ref",
        "block_size",
        "enable_caching",
        "events",
        "events_enabled",
        "num_blocks",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        events_enabled: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events_enabled = events_enabled
        self.events: list[KVEvent] = []
        # per-block state for blocks handed out at least once (index = block id)
        self._ref: list[int] = [1]  # the null block is permanently held
        self._hash: list[int | None] = [None]
        self._qpos: list[int] = [-1]
        self._fresh_next = 1
        # recycled free blocks in LRU order from `_qh` on, with stale entries skipped lazily
        self._q: list[int] = []
        self._qh = 0
        self._nfree = 0
        # hash -> earliest block holding it; later duplicates in insertion order
        self._cached: dict[int, int] = {}
        self._dups: dict[int, list[int]] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocatable now (never-used plus free, including cached-but-unreferenced)."""
        return self.num_blocks - self._fresh_next + self._nfree

    @property
    def usage(self) -> float:
        """vLLM's `get_usage`: the fraction of usable blocks referenced by a request."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    @property
    def num_cached(self) -> int:
        return len(self._cached) + sum(len(v) for v in self._dups.values())

    def ref_count(self, block: int) -> int:
        return self._ref[block] if block < len(self._ref) else 0

    def block_hash(self, block: int) -> int | None:
        return self._hash[block] if block < len(self._hash) else None

    def is_free(self, block: int) -> bool:
        return block >= self._fresh_next or self._qpos[block] >= 0

    def free_queue(self) -> list[int]:
        """Recycled free blocks in eviction order (for tests; fresh blocks come before these)."""
        q, qpos = self._q, self._qpos
        return [b for i, b in enumerate(q[self._qh :], self._qh) if qpos[b] == i]

    def longest_cached_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks holding the leading `hashes`, stopping at the first miss or `max_blocks`."""
        if not self.enable_caching or max_blocks <= 0 or not hashes:
            return []
        get = self._cached.get
        if get(hashes[0]) is None:
            return []
        limit = min(max_blocks, len(hashes))
        found = list(map(get, hashes[:limit]))
        if None in found:
            del found[found.index(None) :]
        return found  # type: ignore[return-value]

    def evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are free now (reusing them takes them out of the free queue)."""
        return list(map(self._ref.__getitem__, blocks)).count(0)

    # -- mutations -------------------------------------------------------------------------------
    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        ref, qpos = self._ref, self._qpos
        taken = 0
        for b in blocks:
            r = ref[b]
            if not r:
                qpos[b] = -1
                taken += 1
            ref[b] = r + 1
        self._nfree -= taken

    def allocate(self, n: int) -> list[int]:
        """Pop `n` blocks from the head of the free queue, evicting cached ones."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        start = self._fresh_next
        fresh = min(n, self.num_blocks - start)
        out = list(range(start, start + fresh))
        if fresh:
            self._fresh_next = start + fresh
            self._ref.extend(repeat(1, fresh))
            self._hash.extend(repeat(None, fresh))
            self._qpos.extend(repeat(-1, fresh))
        rest = n - fresh
        if not rest:
            return out
        q, qpos, ref, hashes = self._q, self._qpos, self._ref, self._hash
        cached = self._cached
        no_dups = not self._dups
        evicted: list[int] = []
        head = self._qh
        append = out.append
        while rest:
            b = q[head]
            if qpos[b] == head:
                qpos[b] = -1
                ref[b] = 1
                h = hashes[b]
                if h is not None:
                    hashes[b] = None
                    if no_dups:
                        del cached[h]
                    else:
                        self._drop_copy(b, h)
                        no_dups = not self._dups
                    evicted.append(h)
                append(b)
                rest -= 1
            head += 1
        self._qh = head
        self._nfree -= n - fresh
        if evicted and self.events_enabled:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.extend(evicted)
            else:
                self.events.append(BlockRemoved(evicted))
        if head > _COMPACT_AT and head > len(q) // 2:
            self._compact()
        return out

    def cache(self, blocks: Sequence[int], hashes: Sequence[int], parent: int | None) -> None:
        """Mark newly full blocks as cached under their chained hashes (one `BlockStored`)."""
        if not self.enable_caching or not blocks:
            return
        block_hash = self._hash
        cached = self._cached
        setdefault = cached.setdefault
        for b, h in zip(blocks, hashes, strict=True):
            block_hash[b] = h
            if setdefault(h, b) != b:
                self._dups.setdefault(h, []).append(b)
        if self.events_enabled:
            self.events.append(BlockStored(list(hashes), parent, self.block_size))

    def free(self, blocks_tail_first: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced ones join the free queue's tail."""
        ref, qpos, q = self._ref, self._qpos, self._q
        freed = 0
        for b in blocks_tail_first:
            r = ref[b] - 1
            ref[b] = r
            if not r:
                qpos[b] = len(q)
                q.append(b)
                freed += 1
        self._nfree += freed

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use, as vLLM requires)."""
        if self.num_free != self.num_blocks - 1:
            return False
        self._hash = [None] * len(self._hash)
        self._cached.clear()
        self._dups.clear()
        if self.events_enabled:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    # -- internals -------------------------------------------------------------------------------
    def _compact(self) -> None:
        """Drop the consumed head and stale entries of the free queue; renumber positions."""
        q, qpos, head = self._q, self._qpos, self._qh
        live = [b for i, b in enumerate(q[head:], head) if qpos[b] == i]
        for i, b in enumerate(live):
            qpos[b] = i
        self._q = live
        self._qh = 0

    def _drop_copy(self, block: int, h: int) -> None:
        """Forget that `block` holds `h`; the earliest remaining copy stays findable."""
        cached, dups = self._cached, self._dups
        if cached.get(h) == block:
            later = dups.get(h)
            if later:
                cached[h] = later.pop(0)
                if not later:
                    del dups[h]
            else:
                del cached[h]
        else:
            later = dups[h]
            later.remove(block)
            if not later:
                del dups[h]
