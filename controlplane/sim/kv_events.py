"""KV cache events as vLLM publishes them (`vllm/distributed/kv_events.py`), without the wire.

The simulated engine emits these after each step, in the order vLLM's block pool would: one
`BlockStored` per `cache_full_blocks` call (the blocks a request filled this step), one
`BlockRemoved` per evicted block (consecutive removals are merged into one event with several
hashes, which consumers treat identically), and `AllBlocksCleared` on a prefix-cache reset.
Hashes are the simulator's integer block ids; the live server maps them to vLLM's wire format.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    # hash of the block before the first stored one; None when the chain starts here
    parent_block_hash: int | None
    block_size: int
    # token ids of the stored blocks when the engine has real tokens (the live server)
    token_ids: list[int] | None = None
    medium: str = "GPU"


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int] = field(default_factory=list)
    medium: str = "GPU"


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
