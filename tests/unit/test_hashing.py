"""Block hashing: vLLM's test vectors (reference §1.7) and the project's keyed chain."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.hashing import (
    BlockHasher,
    normalize_event_hash,
    scope_key,
    vllm_block_digests,
    vllm_block_hashes,
    vllm_none_hash,
)

B0, B1 = list(range(1, 17)), list(range(17, 33))


@pytest.mark.parametrize(
    ("algo", "seed", "none_hash", "b0", "b1"),
    [
        (
            "sha256_cbor",
            "vllm-none-hash",
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
            8866452693264111234,
            807986237951177663,
        ),
        (
            "sha256_cbor",
            "0",
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
            3236607068019569386,
            2758186210834249151,
        ),
        (
            "sha256",
            "vllm-none-hash",
            "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
            1403909460543360175,
            1643945449041937783,
        ),
        (
            "sha256",
            "0",
            "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
            7536218907325174565,
            9048537298590080561,
        ),
    ],
)
def test_vllm_vectors_block_16(algo: str, seed: str, none_hash: str, b0: int, b1: int) -> None:
    assert vllm_none_hash(seed, algo).hex() == none_hash  # type: ignore[arg-type]
    assert vllm_block_hashes(B0 + B1, 16, algo=algo, seed=seed) == [b0, b1]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("algo", "seed", "b0", "b1"),
    [
        ("sha256", "0", 12802785450610620322, 4678177864115437763),
        ("sha256", "vllm-none-hash", 11290800355336220572, 11189021207153552290),
        ("sha256_cbor", "0", 16884408276749910423, 11994141271686408032),
        ("sha256_cbor", "vllm-none-hash", 12204319907483556814, 4209074748214054702),
    ],
)
def test_vllm_vectors_block_32(algo: str, seed: str, b0: int, b1: int) -> None:
    tokens = list(range(1, 65))
    assert vllm_block_hashes(tokens, 32, algo=algo, seed=seed) == [b0, b1]  # type: ignore[arg-type]


def test_vllm_captured_from_a_live_cpu_replica() -> None:
    tokens = [
        368,
        365,
        360,
        361,
        354,
        351,
        281,
        350,
        349,
        352,
        344,
        280,
        345,
        356,
        259,
        353,
        280,
        357,
        366,
        348,
        363,
        355,
        347,
        364,
        358,
        359,
        346,
        362,
        281,
        365,
        360,
        361,
    ]
    assert vllm_block_hashes(tokens, 32, algo="sha256", seed="0") == [2213736797078725205]


def test_vllm_large_ids_and_extra_keys() -> None:
    big = [
        151644,
        872,
        198,
        9064,
        374,
        279,
        6722,
        315,
        5616,
        30,
        151645,
        198,
        151644,
        77091,
        198,
        151667,
    ]
    [d] = vllm_block_digests(big, 16, algo="sha256_cbor")
    assert d.hex() == "a3da5751f73e1ba159753d0b02ef8ecc524830c3051f50c8c910c6b15f1388cf"
    lora = vllm_block_digests(B0, 16, algo="sha256_cbor", lora=("my-lora", "/adapters/my-lora"))
    assert lora[0].hex() == "8039a07ef34ebf0f24f3017de91b2267d9fb43eac6cd7e2ef37f8c8e125c3f3e"
    salt = vllm_block_digests(B0, 16, algo="sha256_cbor", cache_salt="s3cr3t")
    assert salt[0].hex() == "b48b943e12a1bc55b0d43ada3fb904d825ba84163ccac4080e9c04c674044e34"
    both = vllm_block_digests(
        B0, 16, algo="sha256_cbor", lora=("my-lora", "/adapters/my-lora"), cache_salt="s3cr3t"
    )
    assert both[0].hex() == "3242c33749574f2813e619350d19eadd8a5fccf3fd89c96a2e1926550163a7d1"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(5, 5), (-1, 2**64 - 1), (bytes(24) + (7).to_bytes(8, "big"), 7)],
)
def test_event_hash_normalization(raw: int | bytes, expected: int) -> None:
    assert normalize_event_hash(raw) == expected


@given(st.lists(st.integers(0, 2**20), min_size=0, max_size=200), st.integers(1, 64))
def test_project_hash_chains_and_only_hashes_full_blocks(tokens: list[int], bs: int) -> None:
    h = BlockHasher(bs, scope_key("m"))
    full = h.hash_blocks(tokens)
    assert len(full) == len(tokens) // bs
    # a prefix's hashes are a prefix of the hashes; continuing from a parent is the same chain
    k = len(full) // 2
    assert h.hash_blocks(tokens[: k * bs]) == full[:k]
    if k:
        assert h.hash_blocks(tokens[k * bs :], parent=full[k - 1]) == full[k:]


def test_project_hash_is_scoped() -> None:
    tokens = list(range(64))
    a = BlockHasher(16, scope_key("m", salt="tenant-a")).hash_blocks(tokens)
    b = BlockHasher(16, scope_key("m", salt="tenant-b")).hash_blocks(tokens)
    c = BlockHasher(16, scope_key("m", adapter="lora-1", salt="tenant-a")).hash_blocks(tokens)
    assert not set(a) & set(b) and not set(a) & set(c)
    assert BlockHasher(16, scope_key("m", salt="tenant-a")).hash_blocks(tokens) == a
