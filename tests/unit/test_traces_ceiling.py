"""Prefix-reuse ceilings: hand-computed values, invariants, and the LRU model's orderings."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.errors import ConfigError
from controlplane.traces import (
    infinite_cache_ceiling,
    load_trace,
    lru_ceiling,
    multi_turn,
    naive_infinite_cache_ceiling,
    parse_mooncake,
    shared_prefix,
)
from controlplane.traces.model import Trace, TraceRequest


def tiny() -> Trace:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 4]},
        {"timestamp": 2, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    ]
    return parse_mooncake([json.dumps(r) for r in rows])


@pytest.mark.parametrize(
    ("block", "hit_tokens"),
    [
        # r1: nothing cached. r2: ids 1,2 = 2 x 512 (id 4 new). r3: capped at (1024-1)//512 = 1
        (512, 0 + 1024 + 512),
        # at 16: r2 hits ids 1,2 = 64 blocks; r3 capped at 1023 // 16 = 63 blocks
        (16, 0 + 64 * 16 + 63 * 16),
        (64, 0 + 16 * 64 + 15 * 64),
    ],
)
def test_hand_computed_three_requests(block: int, hit_tokens: int) -> None:
    ceiling = infinite_cache_ceiling(tiny(), block)
    assert ceiling.prompt_tokens == 1100 + 1536 + 1024
    assert ceiling.hit_tokens == hit_tokens
    assert ceiling.hit_rate == pytest.approx(hit_tokens / 3660)
    assert ceiling == naive_infinite_cache_ceiling(tiny(), block)


def test_partial_last_block_is_shared_at_engine_granularity() -> None:
    # request 1 describes 600 tokens (ids a, b), b partial: 88 of its tokens in full 16-blocks
    reqs = (
        TraceRequest(0.0, 600, 1, content_ids=(1, 2)),
        TraceRequest(1.0, 700, 1, content_ids=(1, 2)),
    )
    ceiling = infinite_cache_ceiling(Trace("p", reqs), 16)
    assert ceiling.hit_tokens == 600 // 16 * 16


def test_no_shared_ids_means_zero() -> None:
    trace = load_trace("gen:bursty?duration=30")
    assert infinite_cache_ceiling(trace, 16).hit_rate == 0.0
    assert infinite_cache_ceiling(load_trace("azure-code-fixture"), 16).hit_tokens == 0


def test_generated_blocks_count_for_the_next_turn() -> None:
    trace = multi_turn(sessions=10, turns=4, seed=3)
    with_output = infinite_cache_ceiling(trace, 16)
    assert with_output == naive_infinite_cache_ceiling(trace, 16)
    assert with_output.hit_rate > 0.6


def test_shared_prefix_ceiling() -> None:
    # one request per prompt: all but the first of each group hit the 5952 shareable tokens
    trace = shared_prefix(groups=10, users=5, prefix=6000, question=1200, seed=1)
    ceiling = infinite_cache_ceiling(trace, 16)
    assert ceiling.hit_tokens == 10 * 4 * 5952
    assert ceiling.prompt_tokens == 50 * 7200


def test_fixture_fast_equals_naive() -> None:
    trace = load_trace("mooncake-fixture")
    for block in (16, 64, 512):
        fast = infinite_cache_ceiling(trace, block)
        assert fast == naive_infinite_cache_ceiling(trace, block)
        assert 0.0 < fast.hit_rate < 1.0


def test_block_size_must_divide() -> None:
    with pytest.raises(ConfigError):
        infinite_cache_ceiling(tiny(), 48)


@st.composite
def random_traces(draw: st.DrawFn) -> Trace:
    g = draw(st.sampled_from([64, 128]))
    n = draw(st.integers(1, 12))
    reqs = []
    for i in range(n):
        prompt = draw(st.integers(1, 6 * g))
        out = draw(st.integers(1, 3 * g))
        nids = -(-prompt // g)
        # chained ids from a ternary tree: the child of id x on branch b is 3x + b + 1
        branches = draw(st.lists(st.integers(0, 2), min_size=nids, max_size=nids))
        ids: list[int] = []
        for b in branches:
            ids.append((ids[-1] * 3 + b + 1) if ids else b + 1)
        described = draw(st.sampled_from([-1, prompt]))
        reqs.append(
            TraceRequest(float(i), prompt, out, tuple(ids), id_block_tokens=g, id_tokens=described)
        )
    return Trace("h", tuple(reqs))


@settings(max_examples=80, deadline=None)
@given(trace=random_traces(), block=st.sampled_from([16, 32, 64]))
def test_ceiling_matches_reference_and_is_a_fraction(trace: Trace, block: int) -> None:
    fast = infinite_cache_ceiling(trace, block)
    assert fast == naive_infinite_cache_ceiling(trace, block)
    assert 0.0 <= fast.hit_rate <= 1.0
    assert 0.0 <= fast.block_hit_rate <= 1.0


@settings(max_examples=80, deadline=None)
@given(
    k=st.integers(0, 6),
    extra_a=st.integers(0, 5),
    extra_b=st.integers(0, 5),
    tail_a=st.integers(0, 511),
    tail_b=st.integers(0, 511),
    block=st.sampled_from([16, 32, 64, 128, 256, 512]),
)
def test_sharing_k_ids_shares_k_times_per_engine_blocks(
    k: int, extra_a: int, extra_b: int, tail_a: int, tail_b: int, block: int
) -> None:
    g = 512
    common = tuple(range(100, 100 + k))
    ids_a = common + tuple(range(1000, 1000 + extra_a))
    ids_b = common + tuple(range(2000, 2000 + extra_b))
    tokens_a = max(1, (len(ids_a) - 1) * g + tail_a if ids_a else tail_a)
    tokens_b = max(1, (len(ids_b) - 1) * g + tail_b if ids_b else tail_b)
    a = TraceRequest(0.0, tokens_a, 1, ids_a, id_block_tokens=g)
    b = TraceRequest(0.0, tokens_b, 1, ids_b, id_block_tokens=g)
    ha, hb = a.engine_block_hashes(block), b.engine_block_hashes(block)
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    bound = min(k * g // block, len(ha), len(hb))
    assert shared == bound
    assert not set(ha[bound:]) & set(hb[bound:])


def test_lru_orderings_on_fixture() -> None:
    trace = load_trace("mooncake-fixture")
    cap = 400_000
    infinite = infinite_cache_ceiling(trace, 512).block_hit_rate
    one = lru_ceiling(trace, cap).hit_rate
    pooled = lru_ceiling(trace, 8 * cap).hit_rate
    rr = lru_ceiling(trace, cap, replicas=8, routing="round-robin").hit_rate
    aff = lru_ceiling(trace, cap, replicas=8, routing="affinity").hit_rate
    assert rr <= one <= pooled
    assert one < aff <= pooled + 0.02
    assert pooled <= infinite + 0.05
    engine = lru_ceiling(trace, cap, replicas=8, routing="affinity", block_size=16)
    assert 0.0 < engine.hit_rate < 1.0


def test_lru_reproduces_numbers_md_on_real_file() -> None:
    from controlplane.settings import Settings

    path = Settings().mooncake_trace
    if not path.is_file():
        pytest.skip(f"{path} not present")
    trace = load_trace(str(path))
    assert infinite_cache_ceiling(trace, 512).hit_rate == pytest.approx(0.6504, abs=1e-3)
    rows = [
        (400_000, 1, "round-robin", 0.070),
        (3_200_000, 1, "round-robin", 0.319),
        (400_000, 8, "round-robin", 0.051),
        (400_000, 8, "affinity", 0.298),
    ]
    for cap, replicas, routing, expected in rows:
        got = lru_ceiling(trace, cap, replicas=replicas, routing=routing)  # type: ignore[arg-type]
        assert got.hit_rate == pytest.approx(expected, abs=0.002)
