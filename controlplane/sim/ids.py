"""Dense block ids for a replay: the trace's chained block hashes, relabeled as small integers.

The simulator only ever compares block hashes for equality, and chaining is a property of the
content they stand for, so any injective relabeling replays identically. Small dense ids let the
block pool index plain arrays. Traces whose ids are already small (Mooncake's `id * (512 / B) + k`
is at most a few million) keep them; others (generators namespace their ids in the high bits)
are relabeled with one `numpy.unique` over every block of the trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.traces.model import Trace, TraceRequest

Ids = npt.NDArray[np.int64]
DIRECT_LIMIT = 1 << 26
_SUB: Ids = np.arange(4096, dtype=np.int64)
_SUB_U: npt.NDArray[np.uint64] = np.arange(4096, dtype=np.uint64)
AnyIds = npt.NDArray[Any]


def dense_block_ids(trace: Trace, block_size: int) -> tuple[list[Ids], int]:
    """Per request, the dense ids of its described blocks; and the first id nobody uses."""
    reqs = trace.requests
    if not reqs:
        return [], 1
    top = 0
    for r in reqs:
        if r.content_ids:
            if r.id_block_tokens % block_size:
                return dense_from_hashes([r.engine_block_hashes(block_size) for r in reqs])
            top = max(top, (max(r.content_ids) + 1) * (r.id_block_tokens // block_size))
    if top >= DIRECT_LIMIT:
        if top > 1 << 64:  # hashes past 64 bits: the generic path says so
            return dense_from_hashes([r.engine_block_hashes(block_size) for r in reqs])
        return _relabel([_engine_hashes(r, block_size, _SUB_U) for r in reqs])
    return [_engine_hashes(r, block_size, _SUB) for r in reqs], max(1, top)


def _engine_hashes(r: TraceRequest, block_size: int, sub: AnyIds) -> AnyIds:
    """`r.engine_block_hashes(block_size)` as an array of `sub`'s dtype (int64, or uint64 for
    ids in the high bits), built without a Python int per block; the caller checked that they
    fit."""
    per = r.id_block_tokens // block_size
    full = min(r.described_tokens // block_size, len(r.content_ids) * per)
    cids = np.asarray(r.content_ids[: -(-full // per)], dtype=sub.dtype)
    if per == 1:
        return cids[:full]
    step = sub[:per] if per <= len(sub) else np.arange(per, dtype=sub.dtype)
    return (cids[:, None] * per + step).ravel()[:full]


def _relabel(raw: list[npt.NDArray[np.uint64]]) -> tuple[list[Ids], int]:
    """`dense_from_hashes` over per-request uint64 arrays."""
    return _dense(np.concatenate(raw), [len(h) for h in raw])


def dense_from_hashes(raw: Sequence[Sequence[int]]) -> tuple[list[Ids], int]:
    lengths = [len(h) for h in raw]
    flat = np.fromiter((x for h in raw for x in h), dtype=np.uint64, count=sum(lengths))
    return _dense(flat, lengths)


def _dense(flat: npt.NDArray[np.uint64], lengths: list[int]) -> tuple[list[Ids], int]:
    """Small hashes as they are, larger ones by rank (`numpy.unique`); split per request."""
    if not len(flat):
        return [np.zeros(0, dtype=np.int64) for _ in lengths], 1
    top = int(flat.max())
    if top < DIRECT_LIMIT:
        dense = flat.astype(np.int64)
        floor = top + 1
    else:
        uniq, inverse = np.unique(flat, return_inverse=True)
        dense = inverse.astype(np.int64)
        floor = len(uniq)
    bounds = np.cumsum([0, *lengths])
    return [dense[bounds[i] : bounds[i + 1]] for i in range(len(lengths))], floor
