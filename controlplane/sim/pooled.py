"""The pooled-cache ceiling: the hit rate of one replica holding the whole fleet's KV.

Requests are replayed in arrival order through a single `BlockPool` with `replicas x` the blocks of
one replica, with vLLM's block semantics (full blocks only, at most (N - 1) // B blocks reused,
LRU eviction, a request's blocks freed tail first) but no concurrency: each request holds its
blocks only while it is processed. While nothing is evicted, no routing policy can beat it on the
same KV budget: any split of the cache across replicas can only lose hits. Under eviction it is a
reference, not a bound: LRU is not the optimal replacement, and a fleet whose routing keeps each
session on one replica can keep more of the sessions' blocks than one LRU of the whole fleet's
size (the routing matrix's saturated conversations reach 101-108% of it). The replay report shows
each policy's hit rate as a fraction of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from controlplane.roofline.profile import EngineProfile
from controlplane.sim.block_pool import BlockPool
from controlplane.sim.ids import Ids, dense_block_ids
from controlplane.traces.model import Trace


def pooled_hit_rate(
    trace: Trace,
    profile: EngineProfile,
    replicas: int,
    block_ids: Sequence[Ids] | None = None,
    *,
    id_floor: int = 0,
    num_blocks: int | None = None,
) -> float:
    """Prompt tokens served from cache / prompt tokens for one pool of `replicas` replicas' KV.

    `block_ids` are the requests' dense block ids (controlplane.sim.ids) and `id_floor` the
    first id none of them uses; both are computed when not given."""
    bs = profile.resolved_block_size
    if block_ids is None:
        block_ids, id_floor = dense_block_ids(trace, bs)
    next_unique = id_floor
    blocks = num_blocks if num_blocks is not None else profile.num_gpu_blocks * replicas
    pool = BlockPool(blocks, bs)
    hit_tokens = prompt_tokens = 0
    max_len = profile.resolved_max_model_len
    for uid, req in enumerate(trace.requests):
        n, m = req.prompt_tokens, max(1, req.output_tokens)
        if n + m > max_len:
            continue
        known = block_ids[uid]
        total_blocks = -(-(n + m - 1) // bs)
        if total_blocks > blocks - 1:
            continue
        hits = pool.longest_cached_prefix(known, (n - 1) // bs)
        pool.touch(hits)
        new = pool.allocate(total_blocks - len(hits))
        full = (n + m - 1) // bs
        unique = max(0, full - len(known))
        hashes = np.concatenate(
            (known[len(hits) : full], np.arange(next_unique, next_unique + unique))
        )
        next_unique += unique
        pool.cache(new[: len(hashes)], hashes, None)
        pool.free(np.concatenate((hits, new))[::-1])
        hit_tokens += len(hits) * bs
        prompt_tokens += n
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0
