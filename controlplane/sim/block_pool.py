"""The paged KV block pool with prefix caching, as vLLM v1's `BlockPool` behaves.

- Block 0 is the null block and is never handed out, so `num_blocks - 1` blocks are usable.
- Free blocks sit in one queue; allocation pops from its head. Initially it holds every block in
  id order. A freed block that is cached (has a hash) is appended at the tail, so cached blocks
  leave in LRU order; a freed block without a hash (a request's partial last block, or any block
  when caching is off) is pushed onto the head, so it is reused first (vLLM's `free_blocks`:
  "LIFO reuse of non-cached blocks"). The queue is therefore three parts, head to tail: a stack of
  uncached freed blocks, the never-used ("fresh") blocks, which we keep as an id range instead of
  materialising millions of entries, and the cached freed blocks in LRU order.
- A block whose hash is set is *cached*: a later request with the same chained hash can reuse it.
  Cached blocks stay cached while free (ref count 0) until allocation pops them, which evicts them
  (one `BlockRemoved`). Reusing a free cached block ("touch") pulls it out of the free queue.
- Two blocks may carry the same hash (two requests computed the same block concurrently); lookups
  return the earliest inserted one still cached, as vLLM's `BlockHashToBlockMap` does.
- Requests free their blocks tail first (the caller passes them reversed), so a request's last
  blocks are evicted before its first ones.

Hashes are non-negative integer ids. The simulator relabels content hashes as dense ids (an
injective relabeling keeps equality and chaining, all that lookups use), so the hash -> block map is
a plain array indexed by id that grows on demand.

Speed. A replay moves millions of blocks, so every operation on a batch is a handful of numpy
array operations (per-block cost of a few nanoseconds); single-block calls, the common case
during decode, take a scalar path that indexes memoryviews of the same arrays (a Python int per
access, several times cheaper than a numpy scalar). The free queue is a ring of block ids with
lazy deletion: `_qpos[b]` is the position of block b's live entry (-1 when b is not free);
taking a block out of the middle only clears `_qpos[b]`, and the head skips entries whose
position no longer matches.
Popping takes a plain slice of the ring when no such stale entry lies ahead of the head.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from controlplane.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

Blocks = npt.NDArray[np.int64]
IdsLike = Sequence[int] | npt.NDArray[np.int64]
_EMPTY: Blocks = np.zeros(0, dtype=np.int64)
_SMALL = 8  # batches up to this size take the scalar path


MAX_ID = 1 << 28  # hash ids index an array: keep them dense (controlplane.sim.ids)


def as_ids(values: IdsLike) -> Blocks:
    return values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.int64)


class BlockPool:
    """Fixed pool of `num_blocks` KV blocks (including the null block)."""

    __slots__ = (
        "_cached",
        "_cached_v",
        "_dups",
        "_fresh_next",
        "_hash",
        "_hash_v",
        "_head",
        "_id_top",
        "_nfree",
        "_qpos",
        "_qpos_v",
        "_ref",
        "_ref_v",
        "_ring",
        "_ring_v",
        "_stack",
        "_stale",
        "_tail",
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
        if num_blocks >= 1 << 31:
            raise ValueError("block ids must fit in 31 bits")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events_enabled = events_enabled
        self.events: list[KVEvent] = []
        # per-block state, grown as fresh blocks are handed out (index = block id)
        start = min(num_blocks, 1 << 16)
        self._ref = np.zeros(start, dtype=np.int64)
        self._ref[0] = 1  # the null block is permanently held
        self._hash = np.full(start, -1, dtype=np.int64)
        self._qpos = np.full(start, -1, dtype=np.int64)
        self._fresh_next = 1
        # recycled free blocks in LRU order between _head and _tail, stale entries skipped lazily
        self._ring = np.zeros(1 << 16, dtype=np.int64)
        self._head = 0
        self._tail = 0
        self._nfree = 0  # live entries between _head and _tail
        # (lowest, highest) ring position of each batch of entries `touch` made stale
        self._stale: list[tuple[int, int]] = []
        # uncached freed blocks, reused first: the top (end of the list) is the queue's head
        self._stack: list[int] = []
        # hash id -> earliest block holding it (0: not cached; block 0 is the null block, never
        # cached, so zero-filled memory, which numpy gets lazily from the OS, means "empty");
        # later duplicates by insertion order. The last entry is never written, so a lookup can
        # clip out-of-range ids onto it and read a miss. Block ids fit in 16 bits (most pools) or
        # 31: the narrower the entries, the fewer pages a replay touches
        dtype = np.uint16 if num_blocks <= 1 << 16 else np.int32
        self._cached: npt.NDArray[np.integer] = np.zeros(1 << 16, dtype=dtype)
        # 1 + the largest hash id ever cached: growing `_cached` copies only below it
        self._id_top = 0
        self._dups: dict[int, list[int]] = {}
        self._views()

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocatable now (never-used plus free, including cached-but-unreferenced)."""
        return self.num_blocks - self._fresh_next + self._nfree + len(self._stack)

    @property
    def usage(self) -> float:
        """vLLM's `get_usage`: the fraction of usable blocks referenced by a request."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    @property
    def num_cached(self) -> int:
        return int(np.count_nonzero(self._cached)) + sum(len(v) for v in self._dups.values())

    def ref_count(self, block: int) -> int:
        return self._ref_v[block] if block < self._fresh_next else 0

    def block_hash(self, block: int) -> int | None:
        if block >= self._fresh_next:
            return None
        h = self._hash_v[block]
        return None if h < 0 else h

    def cached_block(self, h: int) -> int | None:
        if h >= len(self._cached):
            return None
        b = self._cached_v[h]
        return b or None

    def is_free(self, block: int) -> bool:
        return block >= self._fresh_next or self._qpos_v[block] != -1

    def free_queue(self) -> list[int]:
        """Recycled free blocks in allocation order (fresh blocks sit between the uncached
        ones, which come first, and the cached ones)."""
        pos = np.arange(self._head, self._tail)
        live = self._ring[self._head : self._tail]
        return self._stack[::-1] + [int(b) for b in live[self._qpos[live] == pos]]

    def longest_cached_prefix(self, hashes: IdsLike, max_blocks: int) -> Blocks:
        """Blocks holding the leading `hashes`, stopping at the first miss or `max_blocks`."""
        n = min(max_blocks, len(hashes))
        if not self.enable_caching or n <= 0:
            return _EMPTY
        cached = self._cached
        first = int(hashes[0])
        if first >= len(cached) or not cached[first]:
            return _EMPTY
        # ids past the end read the last entry, which is never written (0: a miss)
        found = cached.take(as_ids(hashes)[:n], mode="clip")
        k = int(found.argmin())  # the first miss, if any (block ids are positive)
        return (found if found[k] else found[:k]).astype(np.int64)

    def evictable_among(self, blocks: IdsLike) -> int:
        """How many of `blocks` are free now (reusing them takes them out of the free queue)."""
        return int(np.count_nonzero(self._ref[as_ids(blocks)] == 0)) if len(blocks) else 0

    def reserve_ids(self, size: int) -> None:
        """Make room for hash ids below `size` up front (one allocation instead of doublings)."""
        self._grow_ids(size)

    # -- mutations -------------------------------------------------------------------------------
    def touch(self, blocks: IdsLike) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        if not len(blocks):
            return
        blocks = as_ids(blocks)
        refs = self._ref[blocks]
        taken = blocks[refs == 0]
        if len(taken):
            pos = self._qpos[taken]
            self._stale.append((int(pos.min()), int(pos.max())))
            self._qpos[taken] = -1
            self._nfree -= len(taken)
        self._ref[blocks] = refs + 1

    def allocate(self, n: int) -> Blocks:
        """Pop `n` blocks from the head of the free queue, evicting cached ones."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        if n <= _SMALL:
            return np.array(self.allocate_few(n), dtype=np.int64)
        parts: list[Blocks] = []
        stack = self._stack
        if stack:
            k = min(n, len(stack))
            top = np.array(stack[-1 : -k - 1 : -1], dtype=np.int64)
            del stack[-k:]
            self._qpos[top] = -1
            self._ref[top] = 1
            parts.append(top)
            n -= k
        start = self._fresh_next
        fresh = min(n, self.num_blocks - start)
        if fresh:
            self._grow_blocks(start + fresh)
            self._fresh_next = start + fresh
            self._ref[start : start + fresh] = 1
            parts.append(np.arange(start, start + fresh, dtype=np.int64))
        rest = n - fresh
        if rest:
            popped = self._popleft(rest)
            old = self._hash[popped]
            if old.min() >= 0:  # all cached (the usual case)
                self._evict(popped, old)
                self._hash[popped] = -1
            else:
                gone = old >= 0
                if gone.any():
                    self._evict(popped[gone], old[gone])
                    self._hash[popped] = -1
            self._ref[popped] = 1
            parts.append(popped)
        if not parts:
            return _EMPTY
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def cache(self, blocks: IdsLike, hashes: IdsLike, parent: int | None) -> None:
        """Mark newly full blocks as cached under their chained hashes (one `BlockStored`).

        Hashes are dense non-negative ids below `MAX_ID`."""
        if not self.enable_caching or not len(blocks):
            return
        if len(blocks) <= _SMALL:
            small = [int(h) for h in hashes]
            if len(small) != len(blocks):
                raise ValueError("cache: one hash per block")
            self.cache_few([int(b) for b in blocks], small, parent)
            return
        blocks = as_ids(blocks)
        ids = as_ids(hashes)
        if len(ids) != len(blocks):
            raise ValueError("cache: one hash per block")
        # ids usually increase along a chain: then they are distinct, and the ends are the bounds
        increasing = bool((ids[1:] > ids[:-1]).all())
        low, top = (int(ids[0]), int(ids[-1])) if increasing else (int(ids.min()), int(ids.max()))
        if low < 0:
            raise ValueError("hash ids are non-negative")
        if top >= self._id_top:
            self._raise_id_top(top)
        cached = self._cached
        self._hash[blocks] = ids
        current = cached[ids]
        distinct = increasing or len(np.unique(ids)) == len(ids)
        if distinct and not current.any():
            cached[ids] = blocks
        else:
            for b, h in zip(blocks.tolist(), ids.tolist(), strict=True):
                if not cached[h]:
                    cached[h] = b
                else:
                    self._dups.setdefault(h, []).append(b)
        if self.events_enabled:
            self.events.append(BlockStored(ids.tolist(), parent, self.block_size))

    def free(self, blocks_tail_first: IdsLike) -> None:
        """Drop one reference from each block; unreferenced cached ones join the free queue's
        tail in the order given, uncached ones its head (the first given ends up first)."""
        if not len(blocks_tail_first):
            return
        blocks_tail_first = as_ids(blocks_tail_first)
        refs = self._ref[blocks_tail_first] - 1
        self._ref[blocks_tail_first] = refs
        # usually nobody else holds any of them
        freed = blocks_tail_first[refs == 0] if refs.any() else blocks_tail_first
        if not len(freed):
            return
        if self.enable_caching:
            uncached = self._hash[freed] < 0
            nu = int(np.count_nonzero(uncached))
            if nu:
                if uncached[:nu].all():  # the usual case: a request's partial last blocks
                    self._push_head(freed[:nu])
                    freed = freed[nu:]
                else:
                    self._push_head(freed[uncached])
                    freed = freed[~uncached]
        else:
            self._push_head(freed)
            return
        k = len(freed)
        if not k:
            return
        self._reserve_ring(k)
        tail = self._tail
        self._ring[tail : tail + k] = freed
        self._qpos[freed] = np.arange(tail, tail + k)
        self._tail = tail + k
        self._nfree += k

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use, as vLLM requires)."""
        if self.num_free != self.num_blocks - 1:
            return False
        self._hash[:] = -1
        self._cached[: self._id_top] = 0
        self._dups.clear()
        if self.events_enabled:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    # -- internals -------------------------------------------------------------------------------
    def _push_head(self, blocks: Blocks) -> None:
        """Put uncached freed blocks at the head of the free queue, `blocks[0]` first."""
        self._qpos[blocks] = -2  # free, but not in the ring
        self._stack.extend(blocks[::-1].tolist())

    def allocate_few(self, n: int) -> list[int]:
        """`allocate` for a few blocks, as a plain list (the decode path): one at a time with
        scalar array access."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        out: list[int] = []
        stack = self._stack
        qpos, ref = self._qpos_v, self._ref_v
        while stack and n:
            b = stack.pop()
            qpos[b] = -1
            ref[b] = 1
            out.append(b)
            n -= 1
        start = self._fresh_next
        fresh = min(n, self.num_blocks - start)
        if fresh:
            self._grow_blocks(start + fresh)
            self._fresh_next = start + fresh
            self._ref[start : start + fresh] = 1
            out.extend(range(start, start + fresh))
            qpos, ref = self._qpos_v, self._ref_v  # grown: new arrays
        rest = n - fresh
        if not rest:
            return out
        ring, hashes, cached = self._ring_v, self._hash_v, self._cached_v
        head = self._head
        evicted: list[int] = []
        while rest:
            b = ring[head]
            if qpos[b] == head:
                qpos[b] = -1
                h = hashes[b]
                if h >= 0:
                    hashes[b] = -1
                    if h in self._dups:
                        self._drop_copy(b, h)
                    else:
                        cached[h] = 0
                    evicted.append(h)
                ref[b] = 1
                out.append(b)
                rest -= 1
            head += 1
        self._head = head
        self._nfree -= n - fresh
        if evicted and self.events_enabled:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.extend(evicted)
            else:
                self.events.append(BlockRemoved(evicted))
        return out

    def cache_few(self, blocks: list[int], hashes: list[int], parent: int | None) -> None:
        """`cache` for a few blocks given as plain lists (the decode path)."""
        n = len(blocks)
        if len(hashes) != n:
            raise ValueError("cache: one hash per block")
        top = -1
        for h in hashes:
            if h < 0:
                raise ValueError("hash ids are non-negative")
            top = max(top, h)
        if top >= self._id_top:
            self._raise_id_top(top)
        cached, block_hash = self._cached_v, self._hash_v
        for i in range(n):
            b, h = blocks[i], hashes[i]
            block_hash[b] = h
            if not cached[h]:
                cached[h] = b
            else:
                self._dups.setdefault(h, []).append(b)
        if self.events_enabled:
            self.events.append(BlockStored(hashes, parent, self.block_size))

    def _popleft(self, n: int) -> Blocks:
        """The `n` live blocks at the head of the recycled free queue, taken out of it."""
        ring, qpos = self._ring, self._qpos
        head = self._head
        stale = [r for r in self._stale if r[1] >= head]  # ranges the head has not passed
        self._stale = stale
        if all(lo >= head + n for lo, _ in stale):  # no stale entries: the next n are live
            out = ring[head : head + n].copy()
            qpos[out] = -1
            self._head = head + n
            self._nfree -= n
            return out
        parts: list[Blocks] = []
        need = n
        while need:
            window = min(self._tail - head, need + (need >> 3) + 16)
            cand = ring[head : head + window]
            live = np.flatnonzero(qpos[cand] == np.arange(head, head + window))
            if len(live) >= need:
                live = live[:need]
                head += int(live[-1]) + 1
            else:
                head += window
            parts.append(cand[live])
            need -= len(live)
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        qpos[out] = -1
        self._head = head
        self._nfree -= n
        return out

    def _evict(self, blocks: Blocks, hashes: Blocks) -> None:
        """Drop the cache entries of evicted `blocks` that held `hashes`."""
        dups = self._dups
        if dups:
            listed = hashes.tolist()
            special = [i for i, h in enumerate(listed) if h in dups]
            if special:
                for i in special:
                    self._drop_copy(int(blocks[i]), listed[i])
                keep = np.ones(len(listed), dtype=bool)
                keep[special] = False
                self._cached[hashes[keep]] = 0
            else:
                self._cached[hashes] = 0
        else:
            self._cached[hashes] = 0
        if self.events_enabled:
            removed = hashes.tolist()
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.extend(removed)
            else:
                self.events.append(BlockRemoved(removed))

    def _drop_copy(self, block: int, h: int) -> None:
        """Forget that `block` holds `h`; the earliest remaining copy stays findable."""
        cached, dups = self._cached_v, self._dups
        if cached[h] == block:
            later = dups.get(h)
            if later:
                cached[h] = later.pop(0)
                if not later:
                    del dups[h]
            else:
                cached[h] = 0
        else:
            later = dups[h]
            later.remove(block)
            if not later:
                del dups[h]

    def _grow_blocks(self, size: int) -> None:
        cur = len(self._ref)
        if size <= cur:
            return
        new = min(self.num_blocks, max(size, 2 * cur))
        self._ref = np.concatenate((self._ref, np.zeros(new - cur, dtype=np.int64)))
        self._hash = np.concatenate((self._hash, np.full(new - cur, -1, dtype=np.int64)))
        self._qpos = np.concatenate((self._qpos, np.full(new - cur, -1, dtype=np.int64)))
        self._views()

    def _views(self) -> None:
        """Memoryviews of the per-block and per-hash arrays (the same memory), for the scalar
        paths: indexing one reads and writes a Python int, several times faster than a numpy
        scalar. Taken again whenever an array is replaced by a grown one."""
        self._ref_v = self._ref.data
        self._hash_v = self._hash.data
        self._qpos_v = self._qpos.data
        self._ring_v = self._ring.data
        self._cached_v = self._cached.data

    def _raise_id_top(self, top: int) -> None:
        """Hash ids up to `top` may now be cached (`top` >= `_id_top`)."""
        if top >= len(self._cached) - 1:
            self._grow_ids(top + 1)
        self._id_top = top + 1

    def _grow_ids(self, size: int) -> None:
        """Room for hash ids below `size`, plus the never-written last entry."""
        if size > MAX_ID:
            raise ValueError(f"hash id {size - 1} is not dense (limit {MAX_ID}); see sim.ids")
        cur = len(self._cached)
        if size + 1 > cur:
            extra = max(size + 1, cur + cur // 2) - cur
            # zero pages stay lazy until touched
            grown = np.zeros(cur + extra, dtype=self._cached.dtype)
            top = self._id_top  # nothing above it was ever written
            grown[:top] = self._cached[:top]
            self._cached = grown
            self._views()

    def _reserve_ring(self, k: int) -> None:
        if self._tail + k <= len(self._ring):
            return
        head, tail = self._head, self._tail
        live = self._ring[head:tail]
        live = live[self._qpos[live] == np.arange(head, tail)]
        size = max(len(self._ring), 4 * (len(live) + k))
        ring = np.empty(size, dtype=np.int64)  # only [head, tail) is ever read
        ring[: len(live)] = live
        self._qpos[live] = np.arange(len(live))
        self._ring, self._head, self._tail = ring, 0, len(live)
        self._views()
        self._stale = []
