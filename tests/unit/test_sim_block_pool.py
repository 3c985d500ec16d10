"""BlockPool: vLLM v1's free queue, prefix cache index and KV events, against a reference model."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sim_builders import FlatEvent, PoolGuard, check_pool, flatten_events, make_pool, pool_state

from controlplane.sim.block_pool import MAX_ID, BlockPool
from controlplane.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


@pytest.fixture
def guard() -> Iterator[PoolGuard]:
    with PoolGuard() as g:
        yield g


# -- a literal reference model of vLLM's BlockPool ---------------------------------------------


class ModelPool:
    """vLLM's BlockPool written naively: every free block, fresh or not, sits in one queue;
    freed blocks with a hash join its tail, those without one its head."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [1] + [0] * (num_blocks - 1)
        self.hash: list[int | None] = [None] * num_blocks
        self.queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        # hash -> blocks holding it, in insertion order (vLLM's BlockHashToBlockMap)
        self.index: dict[int, list[int]] = {}
        self.events: list[FlatEvent] = []

    @property
    def num_free(self) -> int:
        return len(self.queue)

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        out: list[int] = []
        for h in hashes[:max_blocks]:
            copies = self.index.get(h)
            if not copies:
                break
            out.append(copies[0])
        return out

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.queue[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.queue)
        out = []
        for _ in range(n):
            b, _ = self.queue.popitem(last=False)
            assert self.ref[b] == 0, "handed out a referenced block"
            h = self.hash[b]
            if h is not None:
                self.index[h].remove(b)
                if not self.index[h]:
                    del self.index[h]
                self.hash[b] = None
                self.events.append(("removed", (h,), None))
            self.ref[b] = 1
            out.append(b)
        return out

    def cache(self, blocks: Sequence[int], hashes: Sequence[int], parent: int | None) -> None:
        if not blocks:
            return
        for b, h in zip(blocks, hashes, strict=True):
            assert self.hash[b] is None
            self.hash[b] = h
            self.index.setdefault(h, []).append(b)
        self.events.append(("stored", tuple(hashes), parent))

    def free(self, blocks_tail_first: Sequence[int]) -> None:
        head: list[int] = []
        for b in blocks_tail_first:
            self.ref[b] -= 1
            assert self.ref[b] >= 0, "double free"
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    head.append(b)  # reused first, in the order given
                else:
                    self.queue[b] = None
        for b in reversed(head):
            self.queue[b] = None
            self.queue.move_to_end(b, last=False)

    def reset(self) -> bool:
        if len(self.queue) != self.num_blocks - 1:
            return False
        self.hash = [None] * self.num_blocks
        self.index.clear()
        self.events.append(("cleared", (), None))
        return True


# -- basic behaviour -------------------------------------------------------------------------


def test_null_block_and_initial_state(guard: PoolGuard) -> None:
    pool = make_pool(6)
    guard.watch(pool)
    assert pool.num_free == 5
    assert pool.usage == 0.0
    assert pool.ref_count(0) == 1
    assert not pool.is_free(0)
    assert pool.free_queue() == []  # fresh blocks are kept as a range, not queued
    got = pool.allocate(5)
    assert isinstance(got, np.ndarray) and got.dtype == np.int64
    assert got.tolist() == [1, 2, 3, 4, 5]
    assert 0 not in got
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate_few(1)
    pool.free(got[::-1])


def test_needs_two_blocks() -> None:
    with pytest.raises(ValueError):
        BlockPool(1, 4)


@pytest.mark.parametrize(
    ("num_blocks", "held", "usage"),
    [(5, 0, 0.0), (5, 1, 0.25), (5, 2, 0.5), (5, 4, 1.0), (11, 5, 0.5), (2, 1, 1.0)],
)
def test_usage_counts_referenced_blocks(num_blocks: int, held: int, usage: float) -> None:
    pool = make_pool(num_blocks)
    blocks = pool.allocate(held)
    assert pool.usage == pytest.approx(usage)
    # a cached but unreferenced block is free: it does not count as used
    pool.cache(blocks, list(range(100, 100 + held)), None)
    pool.free(blocks[::-1])
    assert pool.usage == 0.0
    assert pool.num_cached == held


# -- lookup ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "max_blocks", "expected"),
    [
        ([10, 11, 12], 3, 3),
        ([10, 11, 12], 2, 2),  # capped by max_blocks
        ([10, 11, 12, 13], 9, 3),  # 13 is not cached
        ([10, 99, 12], 3, 1),  # stops at the first miss even though 12 is cached
        ([99, 11, 12], 3, 0),
        ([10, 11, 12], 0, 0),
        ([], 3, 0),
        ([11, 12], 3, 2),  # the pool matches hashes, chaining is the caller's job
    ],
)
def test_lookup_stops_at_first_miss(query: list[int], max_blocks: int, expected: int) -> None:
    pool = make_pool(8)
    blocks = pool.allocate(3)
    pool.cache(blocks, [10, 11, 12], None)
    by_hash = dict(zip([10, 11, 12], blocks, strict=True))
    found = pool.longest_cached_prefix(query, max_blocks)
    assert isinstance(found, np.ndarray) and found.dtype == np.int64
    assert found.tolist() == [by_hash[h] for h in query[:expected]]
    # arrays are accepted as well as lists
    assert pool.longest_cached_prefix(np.array(query, dtype=np.int64), max_blocks).tolist() == (
        found.tolist()
    )


def test_lookup_disabled_without_caching() -> None:
    pool = BlockPool(8, 4, enable_caching=False, events_enabled=True)
    blocks = pool.allocate(2)
    pool.cache(blocks, [1, 2], None)
    assert pool.longest_cached_prefix([1, 2], 2).tolist() == []
    assert pool.num_cached == 0
    assert pool.take_events() == []


@pytest.mark.parametrize(
    ("prompt_tokens", "usable"),
    [(1, 0), (3, 0), (4, 0), (5, 1), (7, 1), (8, 1), (9, 2), (12, 2), (13, 3), (16, 3), (17, 4)],
)
def test_last_token_rule_caps_hits(prompt_tokens: int, usable: int) -> None:
    """At most (N - 1) // B blocks hit: the last token is recomputed for its logits, so a fully
    cached prompt of a multiple of B tokens recomputes its whole last block."""
    bs = 4
    pool = make_pool(16, bs)
    full = prompt_tokens // bs
    hashes = list(range(500, 500 + full))
    blocks = pool.allocate(full)
    pool.cache(blocks, hashes, None)
    hit = pool.longest_cached_prefix(hashes, (prompt_tokens - 1) // bs)
    assert len(hit) == usable
    assert usable == (prompt_tokens - 1) // bs
    recomputed = prompt_tokens - usable * bs
    assert 1 <= recomputed <= bs
    if prompt_tokens % bs == 0:
        assert recomputed == bs


# -- LRU eviction order ------------------------------------------------------------------------


def test_fresh_blocks_are_used_before_recycled_ones(guard: PoolGuard) -> None:
    pool = make_pool(8)
    guard.watch(pool)
    a = pool.allocate(3)
    pool.cache(a, [1, 2, 3], None)
    pool.free(a[::-1])
    # blocks 4..7 have never been used: they come first even though 1..3 were freed earlier
    b = pool.allocate(4)
    assert b.tolist() == [4, 5, 6, 7]
    assert pool.num_cached == 3
    c = pool.allocate(1)
    assert c.tolist() == [3]  # a's tail block, freed first
    assert pool.longest_cached_prefix([1, 2, 3], 3).tolist() == [1, 2]
    pool.free(c)
    pool.free(b[::-1])


def test_cached_blocks_leave_in_free_order(guard: PoolGuard) -> None:
    pool = make_pool(7)
    guard.watch(pool)
    first = pool.allocate(2)  # [1, 2]
    second = pool.allocate(2)  # [3, 4]
    third = pool.allocate(2)  # [5, 6]
    pool.cache(np.concatenate((first, second, third)), range(10, 16), None)
    pool.free(second[::-1])
    pool.free(third[::-1])
    pool.free(first[::-1])
    assert pool.free_queue() == [4, 3, 6, 5, 2, 1]
    assert pool.allocate(6).tolist() == [4, 3, 6, 5, 2, 1]
    pool.free(list(range(6, 0, -1)))


def test_uncached_blocks_are_reused_first_last_freed_first(guard: PoolGuard) -> None:
    """vLLM's `free_blocks`: blocks without a hash go to the queue's head (LIFO), ahead of
    never-used blocks and of cached ones; cached ones go to the tail (LRU)."""
    pool = make_pool(9)
    guard.watch(pool)
    a = pool.allocate(3)  # [1, 2, 3]: two full cached blocks and a partial one
    pool.cache(a[:2], [10, 11], None)
    b = pool.allocate(2)  # [4, 5]: nothing cached
    pool.free(a[::-1])
    pool.free(b[::-1])
    # head: b's blocks (freed last, tail first), then a's partial block; a's cached ones at the tail
    assert pool.free_queue() == [5, 4, 3, 2, 1]
    # the uncached ones go before the three never-used blocks [6, 7, 8]
    assert pool.allocate(4).tolist() == [5, 4, 3, 6]
    assert pool.allocate(4).tolist() == [7, 8, 2, 1]
    assert flatten_events(pool.take_events())[-2:] == [
        ("removed", (11,), None),
        ("removed", (10,), None),
    ]
    pool.free(list(range(8, 0, -1)))


def test_without_caching_every_freed_block_is_reused_last_in_first_out() -> None:
    pool = BlockPool(6, 4, enable_caching=False)
    a = pool.allocate(2)  # [1, 2]
    b = pool.allocate(2)  # [3, 4]
    pool.free(a[::-1])
    pool.free(b[::-1])
    assert pool.allocate(5).tolist() == [4, 3, 2, 1, 5]
    check_pool(pool)


def test_tail_blocks_of_a_request_are_evicted_first() -> None:
    pool = make_pool(5)
    blocks = pool.allocate(4)
    pool.cache(blocks, [10, 11, 12, 13], None)
    pool.free(blocks[::-1])
    pool.take_events()
    pool.allocate(1)
    # the prefix [10, 11, 12] is still whole: only the last block went
    assert pool.longest_cached_prefix([10, 11, 12, 13], 4).tolist() == blocks[:3].tolist()
    assert flatten_events(pool.take_events()) == [("removed", (13,), None)]
    pool.allocate(2)
    assert pool.longest_cached_prefix([10, 11, 12, 13], 4).tolist() == blocks[:1].tolist()
    assert flatten_events(pool.take_events()) == [
        ("removed", (12,), None),
        ("removed", (11,), None),
    ]


def test_touching_a_free_cached_block_takes_it_out_of_the_queue(guard: PoolGuard) -> None:
    pool = make_pool(5)
    guard.watch(pool)
    blocks = pool.allocate(4)  # [1, 2, 3, 4]
    pool.cache(blocks[:2], [10, 11], None)
    pool.free(blocks[::-1])
    assert pool.free_queue() == [4, 3, 2, 1]
    hit = pool.longest_cached_prefix([10, 11], 2)
    assert hit.tolist() == [1, 2]
    assert pool.evictable_among(hit) == 2
    pool.touch(hit)
    assert pool.free_queue() == [4, 3]
    assert pool.num_free == 2
    assert [pool.ref_count(b) for b in hit] == [1, 1]
    assert pool.evictable_among(hit) == 0
    # touching a block that is already in use only adds a reference
    pool.touch(hit[:1])
    assert pool.ref_count(hit[0]) == 2
    assert pool.num_free == 2
    assert pool.allocate(2).tolist() == [4, 3]
    assert pool.num_cached == 2  # the touched ones survived
    pool.free([4, 3])
    pool.free(hit[::-1])
    pool.free(hit[:1])
    # re-freed blocks go to the tail in the order given
    assert pool.free_queue() == [4, 3, 2, 1]


# -- events ------------------------------------------------------------------------------------


def test_stored_and_removed_events_in_order() -> None:
    pool = make_pool(4, block_size=4)
    a = pool.allocate(2)
    pool.cache(a, [10, 11], None)
    c = pool.allocate(1)
    pool.cache(c, [12], 11)
    events = pool.take_events()
    assert events == [BlockStored([10, 11], None, 4), BlockStored([12], 11, 4)]
    assert pool.take_events() == []
    pool.free(c)
    pool.free(a[::-1])
    # queue: [3, 2, 1]; allocating two evicts 12 then 11, merged into one BlockRemoved
    got = pool.allocate(2)
    assert got.tolist() == [3, 2]
    pool.cache(got, [20, 21], None)
    got2 = pool.allocate(1)
    events = pool.take_events()
    assert events == [
        BlockRemoved([12, 11]),
        BlockStored([20, 21], None, 4),
        BlockRemoved([10]),
    ]
    assert flatten_events(events) == [
        ("removed", (12,), None),
        ("removed", (11,), None),
        ("stored", (20, 21), None),
        ("removed", (10,), None),
    ]
    pool.free(got2)
    pool.free(got[::-1])


def test_no_events_unless_enabled() -> None:
    pool = make_pool(4, events=False)
    a = pool.allocate(3)
    pool.cache(a, [1, 2, 3], None)
    pool.free(a[::-1])
    pool.allocate(3)
    assert pool.take_events() == []


def test_uncached_blocks_evict_silently() -> None:
    pool = make_pool(4)
    a = pool.allocate(3)
    pool.cache(a[:1], [7], None)
    pool.free(a[::-1])
    pool.take_events()
    assert pool.allocate(2).tolist() == [3, 2]  # neither carried a hash
    assert pool.take_events() == []
    assert pool.allocate(1).tolist() == [1]
    assert pool.take_events() == [BlockRemoved([7])]


# -- duplicate hashes --------------------------------------------------------------------------


@pytest.mark.parametrize("evict_first", ["original", "duplicate"])
def test_duplicate_hash_stays_findable_after_either_copy_goes(evict_first: str) -> None:
    """Two requests computed the same block: evicting either copy keeps the other findable."""
    pool = make_pool(3)
    original = pool.allocate(1).tolist()
    duplicate = pool.allocate(1).tolist()
    pool.cache(original, [42], None)
    pool.cache(duplicate, [42], None)
    assert pool.num_cached == 2
    # the earliest inserted copy
    assert pool.longest_cached_prefix([42], 1).tolist() == original
    pool.take_events()
    first, second = (original, duplicate) if evict_first == "original" else (duplicate, original)
    pool.free(first)
    pool.free(second)
    assert pool.free_queue() == first + second
    assert pool.allocate(1).tolist() == first
    assert pool.take_events() == [BlockRemoved([42])]  # one removal per evicted copy, as vLLM
    assert pool.longest_cached_prefix([42], 1).tolist() == second
    assert pool.num_cached == 1
    check_pool(pool, [first])
    assert pool.allocate(1).tolist() == second
    assert pool.take_events() == [BlockRemoved([42])]
    assert pool.longest_cached_prefix([42], 1).tolist() == []
    assert pool.num_cached == 0
    check_pool(pool, [first, second])


def test_three_copies_promote_in_insertion_order() -> None:
    pool = make_pool(5)
    blocks = pool.allocate(4)
    for b in blocks:
        pool.cache([b], [9], None)
    assert pool.num_cached == 4
    assert pool.longest_cached_prefix([9], 1).tolist() == [1]
    pool.free([2])
    assert pool.allocate(1).tolist() == [2]  # evicts the second copy; the first still answers
    assert pool.longest_cached_prefix([9], 1).tolist() == [1]
    pool.free([1])
    assert pool.allocate(1).tolist() == [1]
    assert pool.longest_cached_prefix([9], 1).tolist() == [3]
    check_pool(pool, [[1], [2], [3], [4]])


def test_duplicates_within_one_cache_call() -> None:
    pool = make_pool(4)
    blocks = pool.allocate(3)
    pool.cache(blocks, [5, 5, 6], None)
    assert pool.num_cached == 3
    assert pool.longest_cached_prefix([5, 6], 2).tolist() == [1, 3]
    check_pool(pool, [blocks])


# -- reset -------------------------------------------------------------------------------------


def test_reset_prefix_cache_only_when_nothing_is_in_use(guard: PoolGuard) -> None:
    pool = make_pool(5)
    guard.watch(pool)
    a = pool.allocate(2)
    pool.cache(a, [1, 2], None)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
    assert pool.longest_cached_prefix([1, 2], 2).tolist() == a.tolist()
    pool.free(a[::-1])
    free_before = pool.free_queue()
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.longest_cached_prefix([1, 2], 2).tolist() == []
    assert pool.num_cached == 0
    assert pool.block_hash(int(a[0])) is None
    assert pool.free_queue() == free_before
    assert pool.num_free == 4
    # evicting the cleared blocks emits nothing
    got = pool.allocate(4)
    assert pool.take_events() == []
    pool.free(got[::-1])


def test_reset_ignores_cached_free_blocks() -> None:
    pool = make_pool(3)
    a = pool.allocate(2)
    pool.cache(a, [1, 2], None)
    pool.free(a[::-1])
    pool.touch(pool.longest_cached_prefix([1], 1))
    assert pool.reset_prefix_cache() is False  # a touched block is in use again
    pool.free([1])
    assert pool.reset_prefix_cache() is True


# -- hash ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 12])  # the scalar path (<= 8 blocks) and the batch path
def test_hash_ids_must_be_dense(n: int) -> None:
    pool = make_pool(16)
    blocks = pool.allocate(n)
    with pytest.raises(ValueError):
        pool.cache(blocks, [MAX_ID + i for i in range(n)], None)
    with pytest.raises(ValueError):
        pool.cache(blocks, list(range(n + 1)), None)  # one hash per block
    assert pool.num_cached == 0
    # ids grow the index on demand, well past its initial size
    far = [1_000_000 + i for i in range(n)]
    pool.cache(blocks, far, None)
    assert pool.longest_cached_prefix(far, n).tolist() == blocks.tolist()
    assert pool.longest_cached_prefix([MAX_ID - 1], 1).tolist() == []
    assert pool.cached_block(MAX_ID - 1) is None
    check_pool(pool, [blocks])


@pytest.mark.parametrize(
    "hashes",
    [[1, -2, 3], [1, 2], [1, 2, 3, 4]],
    ids=["negative", "fewer hashes", "more hashes"],
)
def test_bad_hashes_are_rejected_on_the_scalar_path_before_any_change(hashes: list[int]) -> None:
    pool = make_pool(16)
    blocks = pool.allocate(3)
    with pytest.raises(ValueError):
        pool.cache_few(blocks.tolist(), hashes, None)
    assert [pool.block_hash(int(b)) for b in blocks] == [None, None, None]
    assert pool.cached_block(1) is None


def test_negative_hash_ids_are_rejected_on_the_batch_path() -> None:
    pool = make_pool(16)
    blocks = pool.allocate(12)
    with pytest.raises(ValueError):
        pool.cache(blocks, [-1, *range(1, 12)], None)


def test_array_and_list_arguments_are_equivalent() -> None:
    states = []
    for as_array in (False, True):
        pool = make_pool(24)

        def arg(xs: Iterable[int], as_array: bool = as_array) -> list[int] | npt.NDArray[np.int64]:
            return _ids(list(xs), as_array)

        a = pool.allocate(12).tolist()
        b = pool.allocate(3).tolist()
        pool.cache(arg(a), arg(range(100, 112)), None)
        pool.cache(arg(b), arg([100, 101, 7]), None)  # two duplicates of a's first blocks
        pool.free(arg(a[::-1]))
        hit = pool.longest_cached_prefix(arg(range(100, 112)), 11)
        assert hit.tolist() == a[:11]  # the earliest copies
        assert pool.evictable_among(arg(hit.tolist())) == 11
        pool.touch(arg(hit.tolist()))
        pool.free(arg(b[::-1]))
        pool.allocate(10)
        states.append((pool_state(pool), pool.take_events()))
    assert states[0] == states[1]


# -- long churn: lazy deletion, ring compaction and growth ------------------------------------


def test_queue_compaction_keeps_lru_order() -> None:
    """Far more frees than the free-queue ring holds: `_reserve_ring` compacts it in place
    (dropping stale entries left by allocations and touches), never losing LRU order."""
    n = 10
    pool = make_pool(n, events=False)
    model = ModelPool(n, 4)
    ring_size = len(pool._ring)
    rounds = 2 * ring_size // (n - 1) + 50  # n - 1 entries a round: two compactions or more
    compactions = 0
    hashes = 0
    for r in range(rounds):
        tail = pool._tail
        got = pool.allocate(n - 1).tolist()
        assert got == model.allocate(n - 1)
        # cache all but the last (uncached blocks skip the ring), keep one referenced
        # through a touch so the queue has holes
        ids = list(range(hashes, hashes + n - 2))
        pool.cache(got[:-1], ids, None)
        model.cache(got[:-1], ids, None)
        hashes += n - 2
        order = got[::-1] if r % 2 else got
        pool.free(order)
        model.free(order)
        hit = pool.longest_cached_prefix([ids[0]], 1).tolist()
        assert hit == model.lookup([ids[0]], 1)
        pool.touch(hit)
        model.touch(hit)
        pool.free(hit)
        model.free(hit)
        compactions += pool._tail < tail
        assert pool.free_queue() == list(model.queue)
    assert compactions >= 2
    assert len(pool._ring) == ring_size  # a handful of live entries never needs a bigger ring
    check_pool(pool)


def test_ring_grows_for_many_frees() -> None:
    """More recycled free blocks than the ring holds: it grows, keeping LRU order, through
    holes (touched blocks) and evictions, against the reference model."""
    pool = make_pool(2, events=True)
    n = len(pool._ring) + 5_003  # more usable blocks than the initial ring has entries
    pool = make_pool(n, events=True)
    model = ModelPool(n, 4)
    ring_size = len(pool._ring)
    got = pool.allocate(n - 1).tolist()
    assert got == model.allocate(n - 1)
    # cache every block (distinct ids), in a few calls of different sizes
    for lo, hi in ((0, 5), (5, 20_000), (20_000, n - 1)):
        pool.cache(got[lo:hi], list(range(lo, hi)), lo - 1 if lo else None)
        model.cache(got[lo:hi], list(range(lo, hi)), lo - 1 if lo else None)
    # free in interleaved chunks of varied size (tail first within each "request")
    chunks = [got[i : i + s] for i, s in zip(range(0, n - 1, 7_001), (7_001,) * 100, strict=False)]
    for chunk in chunks[1::2] + chunks[::2]:
        pool.free(chunk[::-1])
        model.free(chunk[::-1])
    assert len(pool._ring) > ring_size, "the ring did not grow"
    assert pool.free_queue() == list(model.queue)
    # touch blocks out of the middle of the queue (holes), evict some, free again
    for start in (3, 30_000, 60_000):
        hit = pool.longest_cached_prefix(list(range(start, start + 50)), 50).tolist()
        assert hit == model.lookup(list(range(start, start + 50)), 50)
        pool.touch(hit)
        model.touch(hit)
    evicted = pool.allocate(9_000).tolist()
    assert evicted == model.allocate(9_000)
    pool.free(evicted[::-1])
    model.free(evicted[::-1])
    for start in (3, 30_000, 60_000):
        hit = model.lookup(list(range(start, start + 50)), 50)
        pool.free(hit[::-1])
        model.free(hit[::-1])
    assert pool.free_queue() == list(model.queue)
    assert flatten_events(pool.take_events()) == model.events
    assert pool.allocate(n - 1).tolist() == model.allocate(n - 1)
    check_pool(pool, [list(range(1, n))])


# -- stateful property test against the model -------------------------------------------------

# a small alphabet, so that lookups hit and duplicates happen; pools up to 24 blocks, so that
# batches take the vectorised paths (more than 8 blocks) as well as the scalar ones
ALPHABET = 16
HASHES = st.integers(min_value=0, max_value=ALPHABET - 1)


def _ids(blocks: list[int], as_array: bool) -> list[int] | npt.NDArray[np.int64]:
    return np.array(blocks, dtype=np.int64) if as_array else blocks


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / touch / free / reset sequences, compared with `ModelPool`."""

    pool: BlockPool
    model: ModelPool

    @initialize(num_blocks=st.integers(min_value=2, max_value=24))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, 4, events_enabled=True)
        self.model = ModelPool(num_blocks, 4)
        # owner -> (blocks in order, how many leading ones carry a hash)
        self.owners: dict[int, list[int]] = {}
        self.uncached: dict[int, list[int]] = {}
        self.next_owner = 0

    def _new_owner(self, blocks: list[int], uncached: list[int]) -> None:
        self.owners[self.next_owner] = blocks
        self.uncached[self.next_owner] = uncached
        self.next_owner += 1

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(min_value=0, max_value=self.model.num_free))
        held = {b for blocks in self.owners.values() for b in blocks}
        if n <= 8 and data.draw(st.booleans()):  # the decode path's plain list
            got = self.pool.allocate_few(n)
            assert all(type(b) is int for b in got)
        else:
            out = self.pool.allocate(n)
            assert isinstance(out, np.ndarray) and out.dtype == np.int64
            got = out.tolist()
        assert got == self.model.allocate(n)
        assert len(set(got)) == len(got)
        assert not held & set(got), "a referenced block was handed out again"
        if got:
            self._new_owner(got, list(got))

    @precondition(lambda self: any(self.uncached.values()))
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, u in self.uncached.items() if u)))
        todo = self.uncached[owner]
        k = data.draw(st.integers(min_value=1, max_value=len(todo)))
        blocks, self.uncached[owner] = todo[:k], todo[k:]
        distinct = k <= ALPHABET and data.draw(st.booleans())
        hashes = data.draw(st.lists(HASHES, min_size=k, max_size=k, unique=distinct))
        parent = data.draw(st.none() | HASHES)
        as_array = data.draw(st.booleans())
        self.pool.cache(_ids(blocks, as_array), _ids(hashes, as_array), parent)
        self.model.cache(blocks, hashes, parent)

    @rule(
        query=st.lists(HASHES, max_size=12),
        cap=st.integers(min_value=0, max_value=12),
        as_array=st.booleans(),
    )
    def touch(self, query: list[int], cap: int, as_array: bool) -> None:
        found = self.pool.longest_cached_prefix(_ids(query, as_array), cap)
        assert isinstance(found, np.ndarray) and found.dtype == np.int64
        assert found.tolist() == self.model.lookup(query, cap)
        hit = list(dict.fromkeys(found.tolist()))  # a request never holds one block twice
        evictable = sum(self.model.ref[b] == 0 for b in hit)
        assert self.pool.evictable_among(_ids(hit, as_array)) == evictable
        self.pool.touch(_ids(hit, as_array))
        self.model.touch(hit)
        if hit:
            self._new_owner(hit, [])

    @precondition(lambda self: bool(self.owners))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        blocks = self.owners.pop(owner)
        self.uncached.pop(owner)
        self.pool.free(_ids(blocks[::-1], data.draw(st.booleans())))
        self.model.free(blocks[::-1])

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == self.model.reset()

    @invariant()
    def agrees_with_model(self) -> None:
        pool, model = self.pool, self.model
        assert pool.num_free == model.num_free
        n, recycled = pool.num_blocks, pool.free_queue()
        fresh = list(range(n - (pool.num_free - len(recycled)), n))
        stacked = len(pool._stack)
        assert recycled[:stacked] + fresh + recycled[stacked:] == list(model.queue)
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == model.ref[b]
            assert pool.block_hash(b) == model.hash[b]
        for h in range(ALPHABET + 1):
            assert pool.longest_cached_prefix([h], 1).tolist() == model.lookup([h], 1)
            copies = model.index.get(h)
            assert pool.cached_block(h) == (copies[0] if copies else None)
        assert pool.num_cached == sum(len(v) for v in model.index.values())
        assert flatten_events(pool.take_events()) == model.events
        model.events = []
        check_pool(pool, self.owners.values())

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for blocks in self.owners.values():
            self.pool.free(blocks[::-1])
        self.owners.clear()
        check_pool(self.pool, [])
        assert self.pool.num_free == self.pool.num_blocks - 1, "blocks leaked"


PoolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase
