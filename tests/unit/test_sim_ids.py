"""dense_block_ids: a trace's chained block hashes as small dense ids for the block pool."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.errors import TraceError
from controlplane.sim.block_pool import MAX_ID
from controlplane.sim.ids import DIRECT_LIMIT, dense_block_ids
from controlplane.traces import load_trace, multi_turn, shared_prefix
from controlplane.traces.model import Trace, TraceRequest


def trace_of(*requests: TraceRequest) -> Trace:
    return Trace("t", tuple(requests))


def req(ids: tuple[int, ...], prompt: int, *, block: int = 64, id_tokens: int = -1) -> TraceRequest:
    return TraceRequest(
        arrival_s=0.0,
        prompt_tokens=prompt,
        output_tokens=8,
        content_ids=ids,
        id_block_tokens=block,
        id_tokens=id_tokens,
    )


def check_shapes(trace: Trace, block_size: int, dense: list[np.ndarray], floor: int) -> None:
    """One int64 array per request, as long as its engine block hashes; every id below floor."""
    assert len(dense) == len(trace)
    for r, ids in zip(trace.requests, dense, strict=True):
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int64
        assert len(ids) == len(r.engine_block_hashes(block_size))
        if len(ids):
            assert ids.min() >= 0 and ids.max() < floor
    assert floor <= MAX_ID


def check_relabeling(trace: Trace, block_size: int, dense: list[np.ndarray], floor: int) -> None:
    """`np.unique` relabeling: hash -> its rank among the trace's distinct hashes."""
    raw = [r.engine_block_hashes(block_size) for r in trace.requests]
    rank = {h: i for i, h in enumerate(sorted({h for hs in raw for h in hs}))}
    assert floor == len(rank)
    for hs, ids in zip(raw, dense, strict=True):
        assert ids.tolist() == [rank[h] for h in hs]


# -- small ids are kept ------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 64])
def test_mooncake_ids_are_kept(block_size: int) -> None:
    trace = load_trace("mooncake-fixture")
    dense, floor = dense_block_ids(trace, block_size)
    check_shapes(trace, block_size, dense, floor)
    top = -1
    for r, ids in zip(trace.requests, dense, strict=True):
        hashes = r.engine_block_hashes(block_size)
        assert ids.tolist() == hashes  # identity: no relabeling below DIRECT_LIMIT
        top = max([top, *hashes])
    assert 0 <= top < floor < DIRECT_LIMIT


def test_small_ids_identity_with_partial_and_missing_content() -> None:
    trace = trace_of(
        req((3, 4, 5), 150),  # 2 whole 64-token ids, the third partial
        req((3, 4), 200),  # ids describe 128 of 200 tokens
        req((), 100),  # nothing shared
        req((3, 9), 40, id_tokens=120),  # session content reaching into the output
        req((7,), 10),  # shorter than one engine block
    )
    dense, floor = dense_block_ids(trace, 16)
    check_shapes(trace, 16, dense, floor)
    assert [ids.tolist() for ids in dense] == [r.engine_block_hashes(16) for r in trace.requests]
    assert dense[0].tolist() == [12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert dense[2].tolist() == [] and dense[4].tolist() == []
    assert floor > 9 * 4 + 3


# -- large ids are relabeled -------------------------------------------------------------------


@pytest.mark.parametrize(
    "trace",
    [
        shared_prefix(groups=4, users=3, prefix=600, question=150, output=40, rate=20.0, seed=7),
        multi_turn(sessions=6, turns=3, first=500, message=150, output=60, rate=5.0, seed=3),
    ],
    ids=["shared_prefix", "multi_turn"],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_generator_ids_are_relabeled_with_np_unique(trace: Trace, block_size: int) -> None:
    raw_top = max(h for r in trace.requests for h in r.engine_block_hashes(block_size))
    assert raw_top >= DIRECT_LIMIT  # generators namespace their ids in the high bits
    dense, floor = dense_block_ids(trace, block_size)
    check_shapes(trace, block_size, dense, floor)
    check_relabeling(trace, block_size, dense, floor)


def test_one_large_id_relabels_the_whole_trace() -> None:
    big = 1 << 40
    trace = trace_of(req((1, 2), 128), req((big, big + 1), 128), req((1, 2), 100), req((), 64))
    dense, floor = dense_block_ids(trace, 32)
    check_shapes(trace, 32, dense, floor)
    check_relabeling(trace, 32, dense, floor)
    # hashes 2, 3, 4, 5 (ids 1, 2 at 2 engine blocks each), then 2^41 .. 2^41 + 3
    assert [ids.tolist() for ids in dense] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2], []]
    assert floor == 8


def test_empty_trace() -> None:
    dense, floor = dense_block_ids(trace_of(), 16)
    assert dense == []
    assert floor >= 0


def test_block_size_must_divide_the_id_blocks() -> None:
    with pytest.raises(TraceError):
        dense_block_ids(trace_of(req((1, 2), 128, block=64)), 48)


def test_id_blocks_of_more_than_4096_engine_blocks() -> None:
    trace = trace_of(req((3, 5, 7), 20_000, block=8192))
    dense, floor = dense_block_ids(trace, 1)
    assert dense[0].tolist() == trace.requests[0].engine_block_hashes(1)
    assert floor > max(dense[0].tolist())


# -- random traces -----------------------------------------------------------------------------


@st.composite
def traces(draw: st.DrawFn) -> tuple[Trace, int]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    per = draw(st.sampled_from([1, 2, 4, 32]))
    large = draw(st.booleans())
    id_values = (
        st.integers(min_value=0, max_value=50)
        if not large
        # generator ids are namespace << 32 | counter with 16-bit namespaces
        else st.sampled_from([0, 7, 1 << 30, (1 << 40) + 3, (1 << 47) + 5, (1 << 56) + 1])
    )
    requests = []
    for _ in range(draw(st.integers(min_value=0, max_value=6))):
        ids = tuple(draw(st.lists(id_values, max_size=5)))
        prompt = draw(st.integers(min_value=1, max_value=6 * per * block_size))
        id_tokens = draw(st.sampled_from([-1, prompt + draw(st.integers(0, 3 * block_size))]))
        requests.append(req(ids, prompt, block=per * block_size, id_tokens=id_tokens))
    return trace_of(*requests), block_size


@settings(max_examples=300, deadline=None)
@given(traces())
def test_dense_ids_are_an_order_preserving_relabeling(work: tuple[Trace, int]) -> None:
    trace, block_size = work
    dense, floor = dense_block_ids(trace, block_size)
    check_shapes(trace, block_size, dense, floor)
    raw = [r.engine_block_hashes(block_size) for r in trace.requests]
    top = max((h for hs in raw for h in hs), default=-1)
    if top < DIRECT_LIMIT:
        assert [ids.tolist() for ids in dense] == raw
    else:
        check_relabeling(trace, block_size, dense, floor)
    # equal hashes <-> equal ids, in order, within and across requests
    pairs = {
        (h, int(i))
        for hs, ids in zip(raw, dense, strict=True)
        for h, i in zip(hs, ids, strict=True)
    }
    assert len({h for h, _ in pairs}) == len({i for _, i in pairs}) == len(pairs)
    assert sorted(pairs) == sorted(pairs, key=lambda p: p[1])
