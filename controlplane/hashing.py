"""Chained block hashes over token ids: the project's own, and vLLM's exact one as a cross-check.

**The project's hash** keys the prefix index. For a scope (model, adapter, tenant salt) and block
size B, block i of a token sequence hashes to

    h_i = BLAKE2b-64(key = scope_key, data = h_{i-1} (8 bytes, big-endian) || tokens_i (u32 LE))

with h_{-1} = 0. Only full blocks are hashed. Chaining makes equal hashes mean equal prefixes; the
keyed hash makes one scope's hashes meaningless in another, so one tenant's prompts never become
another tenant's cache hits, and nothing in the index can be reversed into text. The scope key is
`SHA-256(secret || model || adapter || salt)`; the result is a 64-bit unsigned int.

**vLLM's hash** (reference 0.33.0, `hash_block_tokens`): `H(x) = SHA-256(serialize(x))`,
serialize = pickle protocol 5 (`sha256`, vLLM's default) or canonical CBOR (`sha256_cbor`);
`NONE_HASH = H(seed)` where the seed is the replica's `PYTHONHASHSEED` string (else
"vllm-none-hash"); `h_i = H((h_{i-1}, tuple(tokens_i), extra_i))`; KV events carry the last 8 bytes
of each digest as an unsigned int. Extra keys: a LoRA `("lora", name, path)` on every block, a
cache salt `("cache_salt", salt)` on block 0 only. The router never depends on reproducing it
(events are mapped to the project's hash by their token ids); it exists to check that the
simulated replica and real vLLM name the same blocks.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Literal

import cbor2
import numpy as np

VllmAlgo = Literal["sha256", "sha256_cbor"]
DEFAULT_VLLM_SEED = "vllm-none-hash"
_ROOT = bytes(8)


def scope_key(model: str, adapter: str | None = None, salt: str = "", secret: bytes = b"") -> bytes:
    """The BLAKE2b key for one (model, adapter, tenant salt) scope."""
    material = b"\x00".join((secret, model.encode(), (adapter or "").encode(), salt.encode()))
    return hashlib.sha256(material).digest()


class BlockHasher:
    """The project's chained block hash for one scope and block size."""

    __slots__ = ("block_size", "key")

    def __init__(self, block_size: int, key: bytes = b"") -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.key = key

    def hash_blocks(self, token_ids: Sequence[int], parent: int = 0) -> list[int]:
        """Hashes of every full block of `token_ids`, continuing the chain from `parent`."""
        bs = self.block_size
        full = len(token_ids) // bs
        if not full:
            return []
        data = np.asarray(token_ids[: full * bs], dtype="<u4").tobytes()
        out: list[int] = []
        prev = parent.to_bytes(8, "big") if parent else _ROOT
        step = bs * 4
        key = self.key
        for i in range(full):
            digest = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=8, key=key)
            prev = digest.digest()
            out.append(int.from_bytes(prev, "big"))
        return out


def _serialize(obj: object, algo: VllmAlgo) -> bytes:
    if algo == "sha256":
        return pickle.dumps(obj, protocol=5)
    return cbor2.dumps(obj, canonical=True)


def vllm_none_hash(seed: str = DEFAULT_VLLM_SEED, algo: VllmAlgo = "sha256") -> bytes:
    return hashlib.sha256(_serialize(seed, algo)).digest()


def vllm_block_digests(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: VllmAlgo = "sha256",
    seed: str = DEFAULT_VLLM_SEED,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """vLLM's full 32-byte chained digests for the full blocks of `token_ids`."""
    parent = vllm_none_hash(seed, algo)
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        extra: list[object] = []
        if lora is not None:
            extra.append(("lora", lora[0], lora[1]))
        if cache_salt is not None and i == 0:
            extra.append(("cache_salt", cache_salt))
        block = tuple(int(t) for t in token_ids[i * block_size : (i + 1) * block_size])
        obj = (parent, block, tuple(extra) if extra else None)
        parent = hashlib.sha256(_serialize(obj, algo)).digest()
        out.append(parent)
    return out


def event_int(digest: bytes) -> int:
    """The form KV events carry by default: the last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def normalize_event_hash(value: int | bytes) -> int:
    """Event hashes arrive as unsigned or signed ints (old releases) or raw digests."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(bytes(value)[-8:], "big")
    return int(value) & 0xFFFFFFFFFFFFFFFF


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: VllmAlgo = "sha256",
    seed: str = DEFAULT_VLLM_SEED,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """vLLM's block hashes in KV-event form (64-bit ints)."""
    digests = vllm_block_digests(
        token_ids, block_size, algo=algo, seed=seed, lora=lora, cache_salt=cache_salt
    )
    return [event_int(d) for d in digests]
