"""KV-event wire format: golden bytes (reference §2.5) both ways, tolerant decoding, round trips."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.kvevents.wire import (
    KVEventDecodeError,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

TS = 1700000000.5
H0 = 8866452693264111234
TOKENS = tuple(range(1, 17))

STORED = WireBlockStored(
    block_hashes=[H0],
    parent_block_hash=None,
    token_ids=TOKENS,
    block_size=16,
    medium="GPU",
    group_idx=0,
)
REMOVED = WireBlockRemoved(block_hashes=[H0], medium="GPU", group_idx=0)
LEGACY_REMOVED = WireBlockRemoved(block_hashes=[H0], medium="GPU", group_idx=None)
CLEARED = WireAllBlocksCleared()

GOLDEN_MAP: dict[str, tuple[str, WireEvent]] = {
    "stored": (
        "93cb41d954fc4020000091de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368"
        "657391cf7b0bf7bf7fd01682b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc"
        "00100102030405060708090a0b0c0d0e0f10aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d65"
        "6469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780000",
        STORED,
    ),
    "removed": (
        "93cb41d954fc402000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865"
        "7391cf7b0bf7bf7fd01682a66d656469756da3475055a967726f75705f6964780000",
        REMOVED,
    ),
    "cleared": (
        "93cb41d954fc402000009181a474797065b0416c6c426c6f636b73436c656172656400",
        CLEARED,
    ),
}
GOLDEN_LEGACY: dict[str, tuple[str, WireEvent]] = {
    "stored": (
        "93cb41d954fc40200000919cab426c6f636b53746f72656491cf7b0bf7bf7fd01682c0dc001001020304"
        "05060708090a0b0c0d0e0f1010c0a3475055c0c000c0c000",
        STORED,
    ),
    "removed": (
        "93cb41d954fc402000009194ac426c6f636b52656d6f76656491cf7b0bf7bf7fd01682a3475055c000",
        LEGACY_REMOVED,
    ),
    "cleared": ("93cb41d954fc402000009191b0416c6c426c6f636b73436c656172656400", CLEARED),
}


def _batch(ev: WireEvent) -> WireBatch:
    return WireBatch(ts=TS, events=[ev], data_parallel_rank=0)


@pytest.mark.parametrize("name", sorted(GOLDEN_MAP))
def test_map_golden_bytes_decode_and_encode(name: str) -> None:
    hex_, ev = GOLDEN_MAP[name]
    payload = bytes.fromhex(hex_)
    assert decode_batch(payload) == _batch(ev)
    assert encode_batch(_batch(ev)) == payload


@pytest.mark.parametrize("name", sorted(GOLDEN_LEGACY))
def test_legacy_golden_bytes_decode_and_encode(name: str) -> None:
    hex_, ev = GOLDEN_LEGACY[name]
    payload = bytes.fromhex(hex_)
    assert decode_batch(payload) == _batch(ev)
    assert encode_batch(_batch(ev), legacy=True) == payload


def test_golden_sizes_match_the_reference() -> None:
    assert len(bytes.fromhex(GOLDEN_MAP["stored"][0])) == 157
    assert len(bytes.fromhex(GOLDEN_MAP["removed"][0])) == 76
    assert len(bytes.fromhex(GOLDEN_MAP["cleared"][0])) == 35
    assert len(bytes.fromhex(GOLDEN_LEGACY["stored"][0])) == 66


def test_decoded_stored_fields() -> None:
    ev = decode_batch(bytes.fromhex(GOLDEN_MAP["stored"][0])).events[0]
    assert isinstance(ev, WireBlockStored)
    assert ev.block_hashes == (H0,)
    assert ev.parent_block_hash is None
    assert ev.token_ids == TOKENS
    assert (ev.block_size, ev.lora_id, ev.medium, ev.lora_name) == (16, None, "GPU", None)
    assert (ev.extra_keys, ev.group_idx) == (None, 0)


enc = msgspec.msgpack.encode


def test_hashes_signed_and_bytes_are_normalised() -> None:
    digest = bytes(24) + H0.to_bytes(8, "big")
    negative = H0 - (1 << 64) if H0 >= 1 << 63 else -5
    payload = enc(
        [
            TS,
            [
                ["BlockStored", [digest, negative], digest, [1, 2], 1, None],
                {"type": "BlockRemoved", "block_hashes": [-1], "medium": None},
            ],
            0,
        ]
    )
    stored, removed = decode_batch(payload).events
    assert isinstance(stored, WireBlockStored)
    assert stored.block_hashes == (H0, negative & ((1 << 64) - 1))
    assert stored.parent_block_hash == H0
    assert isinstance(removed, WireBlockRemoved)
    assert removed.block_hashes == ((1 << 64) - 1,)


def test_short_legacy_events_fill_missing_trailing_fields_with_none() -> None:
    payload = enc([TS, [["BlockStored", [7], 3, [1, 2, 3, 4], 4, 0], ["BlockRemoved", [7]]]])
    batch = decode_batch(payload)
    stored, removed = batch.events
    assert batch.data_parallel_rank is None  # two-element batch: predates the field
    assert stored == WireBlockStored([7], 3, [1, 2, 3, 4], 4, lora_id=0, medium=None)
    assert removed == WireBlockRemoved([7], medium=None)


def test_map_events_ignore_unknown_keys_and_unknown_events_are_counted() -> None:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [5, 6],
        "block_size": 2,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": "ad",
        "future_field": {"x": 1},
        "extra_keys": [[["lora", "ad", "/p"]]],
    }
    payload = enc({"ts": TS, "events": [ev, {"type": "BlockTeleported"}, ["Nope", 1]]})
    batch = decode_batch(payload)
    assert batch.unknown_events == 2
    (stored,) = batch.events
    assert isinstance(stored, WireBlockStored)
    assert (stored.medium, stored.lora_name) == ("CPU", "ad")
    assert stored.extra_keys == ((("lora", "ad", "/p"),),)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used in msgpack
        enc({"no": "events"}),
        enc([TS]),
        enc([TS, "not a list", 0]),
        enc([TS, [{"type": "BlockStored", "block_hashes": [1]}], 0]),
        enc([TS, [["BlockRemoved", ["not a hash"]]], 0]),
        enc(["yesterday", [], 0]),
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_seq_frames() -> None:
    assert encode_seq(0) == bytes(8)
    assert decode_seq(encode_seq(2**64 - 2)) == 2**64 - 2
    with pytest.raises(KVEventDecodeError):
        decode_seq(b"\x00")


# -- round trips -----------------------------------------------------------------------------

u64 = st.integers(min_value=0, max_value=2**64 - 1)
small = st.integers(min_value=0, max_value=2**31)
opt_str = st.none() | st.text(max_size=8)
opt_int = st.none() | small
extra_entry = st.none() | st.tuples(st.just("lora"), st.text(max_size=4), st.text(max_size=4))


@st.composite
def stored_events(draw: st.DrawFn, legacy: bool) -> WireBlockStored:
    n = draw(st.integers(min_value=0, max_value=4))
    bs = draw(st.integers(min_value=1, max_value=4))
    extra = draw(st.none() | st.lists(extra_entry, min_size=n, max_size=n))
    tail: dict[str, Any] = {}
    if not legacy:
        tail = {
            "locality": draw(opt_str),
            "ownership": draw(opt_str),
            "session_id": draw(opt_str),
            "lookahead_token_ids": draw(st.none() | st.lists(st.lists(small, max_size=3))),
        }
    return WireBlockStored(
        block_hashes=draw(st.lists(u64, min_size=n, max_size=n)),
        parent_block_hash=draw(st.none() | u64),
        token_ids=draw(st.lists(small, min_size=n * bs, max_size=n * bs)),
        block_size=bs,
        lora_id=draw(opt_int),
        medium=draw(st.sampled_from([None, "GPU", "CPU", "STORAGE"])),
        lora_name=draw(opt_str),
        extra_keys=extra,
        group_idx=draw(opt_int),
        kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full_attention", "mamba"])),
        kv_cache_spec_sliding_window=draw(opt_int),
        **tail,
    )


@st.composite
def removed_events(draw: st.DrawFn, legacy: bool) -> WireBlockRemoved:
    return WireBlockRemoved(
        block_hashes=draw(st.lists(u64, max_size=3)),
        medium=draw(st.none() | st.sampled_from(["GPU", "CPU"])),
        group_idx=draw(opt_int),
        locality=None if legacy else draw(opt_str),
        ownership=None if legacy else draw(opt_str),
    )


def batches(legacy: bool) -> st.SearchStrategy[WireBatch]:
    event = st.one_of(
        stored_events(legacy), removed_events(legacy), st.just(WireAllBlocksCleared())
    )
    return st.builds(
        WireBatch,
        ts=st.floats(allow_nan=False, allow_infinity=False),
        events=st.lists(event, max_size=5),
        data_parallel_rank=opt_int,
    )


@given(batches(legacy=False))
def test_map_round_trip(batch: WireBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch


@given(batches(legacy=True))
def test_legacy_round_trip(batch: WireBatch) -> None:
    payload = encode_batch(batch, legacy=True)
    assert decode_batch(payload) == batch
    # every legacy event is a positional array with the full field set
    for ev in msgspec.msgpack.decode(payload)[1]:
        assert len(ev) in (1, 4, 12)
