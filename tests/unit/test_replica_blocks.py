"""vLLM block hashes interned as the engine's dense ids, and engine events translated back."""

from __future__ import annotations

import pytest

from controlplane.errors import CapacityError
from controlplane.hashing import vllm_block_hashes
from controlplane.kvevents.wire import WireAllBlocksCleared, WireBlockRemoved, WireBlockStored
from controlplane.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from controlplane.sim_replica.blocks import BlockHashTable

B = 32


def table(seed: str = "0", algo: str = "sha256", limit: int = 1 << 20) -> BlockHashTable:
    return BlockHashTable(B, algo=algo, seed=seed, id_limit=limit)  # type: ignore[arg-type]


def test_equal_prefixes_share_ids_and_ids_are_dense() -> None:
    t = table()
    a = t.acquire(list(range(1, 3 * B + 5)))  # 3 full blocks; the partial one is not hashed
    b = t.acquire([*range(1, 2 * B + 1), *range(900, 900 + B)])
    assert a == [0, 1, 2]
    assert b[:2] == a[:2] and b[2] == 3
    assert len(t) == 4


def test_hashes_are_vllm_reference_vectors() -> None:
    """vllm-interfaces.md §1.7, B = 32: tokens 1..64."""
    tokens = list(range(1, 65))
    for algo, seed, expected in [
        ("sha256", "0", [12802785450610620322, 4678177864115437763]),
        ("sha256", "vllm-none-hash", [11290800355336220572, 11189021207153552290]),
        ("sha256_cbor", "0", [16884408276749910423, 11994141271686408032]),
        ("sha256_cbor", "vllm-none-hash", [12204319907483556814, 4209074748214054702]),
    ]:
        t = table(seed, algo)
        ids = t.acquire(tokens)
        assert [t.event_hash(i) for i in ids] == expected


def test_translate_fills_parent_and_tokens() -> None:
    t = table()
    tokens = list(range(5, 5 + 3 * B))
    ids = t.acquire(tokens)
    hashes = vllm_block_hashes(tokens, B, seed="0")
    out = t.translate(
        [BlockStored(ids[:2], None, B), BlockStored(ids[2:], ids[1], B), BlockRemoved([ids[0]])]
    )
    first, second, removed = out
    assert isinstance(first, WireBlockStored) and isinstance(second, WireBlockStored)
    assert first.block_hashes == tuple(hashes[:2]) and first.parent_block_hash is None
    assert first.token_ids == tuple(tokens[: 2 * B])
    assert first.extra_keys == (None, None) and first.group_idx == 0
    assert first.kv_cache_spec_kind == "full_attention" and first.medium == "GPU"
    assert second.parent_block_hash == hashes[1] and second.token_ids == tuple(tokens[2 * B :])
    assert removed == WireBlockRemoved([hashes[0]], group_idx=0)


def test_engine_removals_are_split_one_hash_per_event() -> None:
    t = table()
    ids = t.acquire(list(range(2 * B)))
    t.translate([BlockStored(ids, None, B)])
    out = t.translate([BlockRemoved(list(ids))])
    assert [len(ev.block_hashes) for ev in out if isinstance(ev, WireBlockRemoved)] == [1, 1]


def test_ids_are_recycled_when_no_request_and_no_block_holds_them() -> None:
    t = table()
    tokens = list(range(2 * B))
    ids = t.acquire(tokens)
    t.translate([BlockStored(ids[:1], None, B)])  # only block 0 got cached
    t.release(ids)
    assert len(t) == 1, "block 1 was never cached: forgotten with its last request"
    t.translate([BlockRemoved([ids[0]])])
    assert len(t) == 0
    again = t.acquire(list(range(500, 500 + 2 * B)))
    assert sorted(again) == sorted(ids), "freed ids are reused"


def test_all_blocks_cleared_forgets_unreferenced_ids() -> None:
    t = table()
    held = t.acquire(list(range(B)))
    gone = t.acquire(list(range(100, 100 + B)))
    t.translate([BlockStored(held, None, B), BlockStored(gone, None, B)])
    t.release(gone)
    out = t.translate([AllBlocksCleared()])
    assert out == [WireAllBlocksCleared()]
    assert len(t) == 1  # the held one stays while its request lives


def test_duplicate_copies_are_counted() -> None:
    t = table()
    ids = t.acquire(list(range(B)))
    t.translate([BlockStored(ids, None, B), BlockStored(ids, None, B)])
    t.release(ids)
    t.translate([BlockRemoved(ids)])
    assert len(t) == 1, "one copy is still cached"
    t.translate([BlockRemoved(ids)])
    assert len(t) == 0


def test_id_limit() -> None:
    t = table(limit=3)
    t.acquire(list(range(2 * B)))
    with pytest.raises(CapacityError):
        t.acquire(list(range(1000, 1000 + 2 * B)))
    assert len(t) == 2, "a refused request keeps no references"
