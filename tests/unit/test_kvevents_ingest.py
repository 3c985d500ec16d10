"""EventIngestor: engine hashes -> project hashes, removals, clears, filters, bounds."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvevents_fakes import AsyncRecordingIndex

from controlplane.hashing import BlockHasher, scope_key, vllm_block_hashes
from controlplane.kvevents.ingest import EventIngestor
from controlplane.kvevents.sink import PurgeReason
from controlplane.kvevents.wire import (
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
)
from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.types import PrefixMatch

BS = 16
MODEL = "m"
A = list(range(100, 164))  # 4 blocks
B = A[:32] + list(range(900, 932))  # shares A's first 2 blocks
EA = vllm_block_hashes(A, BS, seed="0")
EB = vllm_block_hashes(B, BS, seed="0")
PA = BlockHasher(BS, scope_key(MODEL)).hash_blocks(A)
PB = BlockHasher(BS, scope_key(MODEL)).hash_blocks(B)


def stored(
    engine: Sequence[int], parent: int | None, tokens: Sequence[int], **kw: Any
) -> WireBlockStored:
    return WireBlockStored(list(engine), parent, list(tokens), kw.pop("block_size", BS), **kw)


def batch(*events: WireEvent) -> WireBatch:
    return WireBatch(ts=0.0, events=events)


def make(**kw: Any) -> tuple[EventIngestor, InMemoryPrefixIndex]:
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    return EventIngestor("r0", index, model=MODEL, block_size=BS, **kw), index


def matched(index: InMemoryPrefixIndex, hashes: Sequence[int]) -> int:
    m = index.lookup(hashes, ["r0"]).get("r0")
    return 0 if m is None else m.matched_blocks


async def test_root_event_places_the_chain() -> None:
    ing, index = make()
    await ing.apply(batch(stored(EA, None, A)))
    assert matched(index, PA) == 4
    assert [ing.project_hash(e) for e in EA] == PA
    assert ing.stats.stored_blocks == 4 and ing.mapped_blocks == 4


async def test_continuation_extends_the_parents_chain() -> None:
    ing, index = make()
    await ing.apply(batch(stored(EA[:2], None, A[:32])))
    await ing.apply(batch(stored(EA[2:], EA[1], A[32:])))
    assert matched(index, PA) == 4
    # a sibling chain that shares two blocks
    await ing.apply(batch(stored(EB[2:], EB[1], B[32:])))
    assert matched(index, PB) == 4


async def test_unknown_parent_is_counted_and_skipped() -> None:
    ing, index = make()
    await ing.apply(batch(stored(EA[2:], EA[1], A[32:])))
    assert ing.stats.skipped_unknown_parent == 2
    assert index.held_blocks("r0") == 0 and ing.mapped_blocks == 0


async def test_removed_blocks_leave_the_index() -> None:
    ing, index = make()
    await ing.apply(batch(stored(EA, None, A)))
    await ing.apply(batch(WireBlockRemoved([EA[2]]), WireBlockRemoved([12345])))
    assert matched(index, PA) == 2
    assert ing.stats.removed_blocks == 1 and ing.stats.unmapped_removed == 1
    assert ing.project_hash(EA[2]) is None


async def test_all_blocks_cleared_and_purge_forget_everything() -> None:
    ing, index = make()
    await ing.apply(batch(stored(EA, None, A), WireAllBlocksCleared()))
    assert index.held_blocks("r0") == 0 and ing.mapped_blocks == 0
    await ing.apply(batch(stored(EA, None, A)))
    await ing.purge(PurgeReason.GAP)
    assert index.held_blocks("r0") == 0 and ing.mapped_blocks == 0
    assert (ing.stats.clears, ing.stats.purges, ing.stats.lost) == (1, 1, 1)
    # after a purge a continuation cannot be placed
    await ing.apply(batch(stored(EA[2:], EA[1], A[32:])))
    assert ing.stats.skipped_unknown_parent == 2


@pytest.mark.parametrize(
    ("kw", "counter"),
    [
        ({"medium": "CPU"}, "skipped_medium"),
        ({"medium": "STORAGE"}, "skipped_medium"),
        ({"group_idx": 1}, "skipped_group"),
        ({"block_size": 32}, "skipped_mismatch"),
    ],
)
async def test_filtered_events(kw: dict[str, Any], counter: str) -> None:
    ing, index = make()
    tokens = A if kw.get("block_size", BS) == BS else A + A
    await ing.apply(batch(stored(EA, None, tokens, **kw)))
    assert index.held_blocks("r0") == 0
    assert getattr(ing.stats, counter) == 1


async def test_medium_none_and_group_zero_are_routed() -> None:
    ing, index = make()
    await ing.apply(batch(stored(EA, None, A, medium=None, group_idx=0)))
    assert matched(index, PA) == 4
    await ing.apply(batch(WireBlockRemoved([EA[0]], medium="CPU")))
    assert matched(index, PA) == 4  # the CPU tier's removal does not touch the GPU entry


async def test_tokens_not_covering_the_blocks_are_skipped() -> None:
    ing, index = make()
    await ing.apply(batch(stored(EA, None, A[:-1])))
    assert ing.stats.skipped_mismatch == 1 and index.held_blocks("r0") == 0


async def test_block_size_from_events_when_not_configured() -> None:
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    ing = EventIngestor("r0", index, model=MODEL)
    await ing.apply(batch(stored(EA, None, A)))
    assert matched(index, PA) == 4


async def test_adapter_and_cache_salt_pick_the_scope() -> None:
    ing, index = make()
    e = vllm_block_hashes(A, BS, seed="0", lora=("ad", "/p"))
    await ing.apply(batch(stored(e[:2], None, A[:32], lora_name="ad")))
    await ing.apply(batch(stored(e[2:], e[1], A[32:], lora_name="ad")))
    assert matched(index, BlockHasher(BS, scope_key(MODEL, "ad")).hash_blocks(A)) == 4
    assert matched(index, PA) == 0

    s = vllm_block_hashes(A, BS, seed="0", cache_salt="t1")
    extra = [(("cache_salt", "t1"),), None]
    await ing.apply(batch(stored(s[:2], None, A[:32], extra_keys=extra)))
    await ing.apply(batch(stored(s[2:], s[1], A[32:])))  # inherits the parent's scope
    assert matched(index, BlockHasher(BS, scope_key(MODEL, salt="t1")).hash_blocks(A)) == 4


async def test_salt_mapping_and_secret() -> None:
    ing, index = make(secret=b"k", salt_for=lambda s: f"tenant:{s}")
    extra = [(("cache_salt", "x"),)] + [None] * 3
    await ing.apply(batch(stored(EA, None, A, extra_keys=extra)))
    key = scope_key(MODEL, None, "tenant:x", b"k")
    assert matched(index, BlockHasher(BS, key).hash_blocks(A)) == 4


async def test_two_engine_hashes_for_one_project_hash_are_reference_counted() -> None:
    ing, index = make()
    other = [h ^ 1 for h in EA]  # the same tokens under another engine key (another LoRA path)
    await ing.apply(batch(stored(EA, None, A), stored(other, None, A)))
    await ing.apply(batch(WireBlockRemoved([EA[3]])))
    assert matched(index, PA) == 4
    await ing.apply(batch(WireBlockRemoved([other[3]])))
    assert matched(index, PA) == 3


async def test_repeated_store_is_idempotent() -> None:
    ing, index = make()
    await ing.apply(batch(stored(EA, None, A), stored(EA, None, A)))
    assert ing.mapped_blocks == 4
    await ing.apply(batch(WireBlockRemoved([EA[0]])))
    assert matched(index, PA) == 0


async def test_cap_evicts_least_recently_used_and_unindexes_it() -> None:
    ing, index = make(max_mapped_blocks=3)
    await ing.apply(batch(stored(EA, None, A)))
    assert ing.mapped_blocks == 3 and ing.stats.evicted == 1
    assert ing.project_hash(EA[0]) is None
    assert not index.lookup([PA[0]], ["r0"])  # evicted from the index too
    assert matched(index, PA[1:]) == 3


async def test_async_index_gets_incarnations_and_coalesced_writes() -> None:
    index = AsyncRecordingIndex()
    ing = EventIngestor("r0", index, model=MODEL, block_size=BS, incarnation=5)
    await ing.apply(
        batch(
            stored(EA[:2], None, A[:32]),
            stored(EA[2:], EA[1], A[32:]),
            WireBlockRemoved([EA[3]]),
            WireBlockRemoved([EA[2]]),
        )
    )
    assert index.calls == [
        ("stored", "r0", 5, tuple(PA)),
        ("removed", "r0", 5, (PA[3], PA[2])),
    ]
    await ing.purge(PurgeReason.RESTART)
    assert ing.incarnation == 6 and ing.stats.restarts == 1
    await ing.apply(batch(stored(EA, None, A)))
    assert index.calls[-2:] == [("clear", "r0", -1, ()), ("stored", "r0", 6, tuple(PA))]
    assert await index.lookup(PA, [("r0", 6)]) == {"r0": PrefixMatch("r0", 4, 4)}
    assert await index.lookup(PA, [("r0", 5)]) == {}


@settings(max_examples=50, deadline=None)
@given(
    n_blocks=st.integers(min_value=1, max_value=8),
    cuts=st.lists(st.integers(min_value=1, max_value=7), max_size=4),
    seed=st.integers(min_value=0, max_value=1000),
)
async def test_any_split_into_events_gives_the_whole_chain(
    n_blocks: int, cuts: list[int], seed: int
) -> None:
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(n_blocks * BS)]
    engine = vllm_block_hashes(tokens, BS, seed="0")
    bounds = sorted({0, n_blocks, *(c for c in cuts if c < n_blocks)})
    ing, index = make()
    for lo, hi in pairwise(bounds):
        parent = engine[lo - 1] if lo else None
        await ing.apply(batch(stored(engine[lo:hi], parent, tokens[lo * BS : hi * BS])))
    expected = BlockHasher(BS, scope_key(MODEL)).hash_blocks(tokens)
    assert [ing.project_hash(e) for e in engine] == expected
    assert matched(index, expected) == n_blocks
