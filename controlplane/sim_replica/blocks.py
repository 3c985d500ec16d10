"""vLLM block hashes <-> the simulated engine's dense block ids.

The engine's block pool indexes arrays by hash id, so ids must be small dense non-negative ints.
The replica computes vLLM's exact chained hash (`controlplane.hashing.vllm_block_digests`, the
configured algorithm and seed) for every full block of a request's tokens, prompt and planned
output alike (vLLM hashes generated blocks too), and interns each digest as a dense id: equal
digests (equal prefixes) get equal ids, so the engine's prefix cache hits exactly where vLLM's
would. A request's `cache_salt` is hashed into its block 0 as vLLM does (so salted and unsalted
chains never share a block) and reported, untagged, in block 0's event `extra_keys` (`(salt,)`).

Ids are recycled, which keeps them bounded by what the engine can hold: an id is live while a
request in the engine lists it (`refs`) or a block in the pool is cached under it (`copies`,
counted from the engine's own `BlockStored`/`BlockRemoved` events); when both reach zero the
digest is forgotten and the id reused. `translate` turns the engine's events (dense ids) into
wire events with vLLM's 64-bit hashes, the parent hash and the blocks' token ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane.errors import CapacityError
from controlplane.hashing import VllmAlgo, event_int, vllm_block_digests
from controlplane.kvevents.wire import (
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
)
from controlplane.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# what vLLM 0.33 sets on events of a plain (one full-attention group, no LoRA) model
KV_CACHE_SPEC_KIND = "full_attention"
GROUP_IDX = 0


@dataclass(slots=True)
class _Block:
    digest: bytes
    # the 64-bit form events carry, and the parent's (None for a chain's first block)
    event_hash: int
    parent: int | None
    token_ids: tuple[int, ...]
    # the block's event extra keys (untagged): `(salt,)` on a salted chain's block 0
    extra: tuple[object, ...] | None = None
    # requests in the engine whose known hashes list this id
    refs: int = 0
    # pool blocks cached under this id
    copies: int = 0


class BlockHashTable:
    """Interned vLLM block digests (see the module docstring)."""

    def __init__(self, block_size: int, *, algo: VllmAlgo, seed: str, id_limit: int) -> None:
        self.block_size = block_size
        self.algo: VllmAlgo = algo
        self.seed = seed
        self.id_limit = id_limit
        self._ids: dict[bytes, int] = {}  # digest -> dense id
        self._blocks: list[_Block | None] = []  # dense id -> block
        self._free: list[int] = []

    def __len__(self) -> int:
        """Live ids."""
        return len(self._ids)

    def digests(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        return vllm_block_digests(
            token_ids, self.block_size, algo=self.algo, seed=self.seed, cache_salt=cache_salt
        )

    def acquire(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Dense ids of every full block of `token_ids`, each taking a request reference."""
        bs = self.block_size
        out: list[int] = []
        parent: int | None = None
        try:
            for i, digest in enumerate(self.digests(token_ids, cache_salt)):
                bid = self._ids.get(digest)
                if bid is None:
                    tokens = tuple(int(t) for t in token_ids[i * bs : (i + 1) * bs])
                    extra = (cache_salt,) if cache_salt is not None and i == 0 else None
                    bid = self._new_id(_Block(digest, event_int(digest), parent, tokens, extra))
                    self._ids[digest] = bid
                block = self._blocks[bid]
                assert block is not None
                block.refs += 1
                parent = block.event_hash
                out.append(bid)
        except CapacityError:
            self.release(out)
            raise
        return out

    def release(self, ids: Iterable[int]) -> None:
        """Drop the request references `acquire` took."""
        for bid in ids:
            block = self._get(int(bid))
            block.refs -= 1
            assert block.refs >= 0, f"block id {bid} released more often than acquired"
            self._maybe_forget(int(bid), block)

    def event_hash(self, bid: int) -> int:
        return self._get(bid).event_hash

    def translate(self, events: Sequence[KVEvent]) -> list[WireEvent]:
        """The engine's events as vLLM publishes them; keeps the cached-copy counts."""
        out: list[WireEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                blocks = [self._get(int(b)) for b in ev.block_hashes]
                parent = None
                if ev.parent_block_hash is not None:
                    parent = self._get(int(ev.parent_block_hash)).event_hash
                tokens: list[int] = []
                for block in blocks:
                    block.copies += 1
                    tokens.extend(block.token_ids)
                out.append(
                    WireBlockStored(
                        block_hashes=[b.event_hash for b in blocks],
                        parent_block_hash=parent,
                        token_ids=tokens,
                        block_size=ev.block_size,
                        extra_keys=[b.extra for b in blocks],
                        group_idx=GROUP_IDX,
                        kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
                    )
                )
            elif isinstance(ev, BlockRemoved):
                # vLLM sends one BlockRemoved per evicted block
                for raw in ev.block_hashes:
                    bid = int(raw)
                    block = self._get(bid)
                    out.append(WireBlockRemoved([block.event_hash], group_idx=GROUP_IDX))
                    block.copies -= 1
                    assert block.copies >= 0, f"block id {bid} evicted more often than stored"
                    self._maybe_forget(bid, block)
            elif isinstance(ev, AllBlocksCleared):
                out.append(WireAllBlocksCleared())
                for bid, cleared in enumerate(self._blocks):
                    if cleared is not None:
                        cleared.copies = 0
                        self._maybe_forget(bid, cleared)
        return out

    # -- internals -------------------------------------------------------------------------------
    def _new_id(self, block: _Block) -> int:
        if self._free:
            bid = self._free.pop()
            self._blocks[bid] = block
            return bid
        bid = len(self._blocks)
        if bid >= self.id_limit:
            raise CapacityError(f"more than {self.id_limit} distinct blocks in flight")
        self._blocks.append(block)
        return bid

    def _get(self, bid: int) -> _Block:
        block = self._blocks[bid] if 0 <= bid < len(self._blocks) else None
        if block is None:
            raise KeyError(f"block id {bid} is not interned")
        return block

    def _maybe_forget(self, bid: int, block: _Block) -> None:
        if block.refs == 0 and block.copies == 0:
            del self._ids[block.digest]
            self._blocks[bid] = None
            self._free.append(bid)
