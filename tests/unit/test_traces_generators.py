"""Synthetic generators: determinism, structure of the content ids, arrival processes."""

from __future__ import annotations

import itertools
import random
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.errors import ConfigError
from controlplane.traces import (
    GENERATORS,
    TENANT_PRESETS,
    TenantSpec,
    bursty,
    multi_tenant,
    multi_turn,
    shared_prefix,
)
from controlplane.traces.generators.common import (
    IdAllocator,
    lognormal_int,
    namespace_for,
    renewal_times,
)
from controlplane.traces.model import Trace
from controlplane.types import PriorityClass

SMALL: dict[str, dict[str, object]] = {
    "shared-prefix": {"groups": 3, "users": 2, "prefix": 300, "question": 100, "requests": 9},
    "multi-turn": {"sessions": 4, "turns": 3},
    "tenants": {"duration": 20.0},
    "bursty": {"duration": 30.0},
}


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), kind=st.sampled_from(sorted(SMALL)))
def test_generators_are_deterministic_per_seed(seed: int, kind: str) -> None:
    fn = GENERATORS[kind]
    a = fn(seed=seed, **SMALL[kind])
    b = fn(seed=seed, **SMALL[kind])
    assert a == b
    assert a.meta["params"]["seed"] == seed  # type: ignore[index]
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals)
    assert len({r.request_id for r in a}) == len(a)


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_different_seeds_differ(kind: str) -> None:
    fn = GENERATORS[kind]
    assert fn(seed=1, **SMALL[kind]).requests != fn(seed=2, **SMALL[kind]).requests


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_ids_are_namespaced_and_engine_blocks_divide(kind: str) -> None:
    trace = GENERATORS[kind](seed=3, **SMALL[kind])
    ns = trace.meta["id_namespace"]
    assert isinstance(ns, int)
    for r in trace:
        assert r.id_block_tokens % 64 == 0
        assert all(cid >> 32 == ns for cid in r.content_ids)
        assert len(r.content_ids) == -(-r.described_tokens // r.id_block_tokens)
        for b in (16, 32, 64):
            r.engine_block_hashes(b)  # never raises


def test_shared_prefix_structure() -> None:
    trace = shared_prefix(groups=4, users=3, prefix=6000, question=1200, output=100, seed=5)
    assert len(trace) == 12
    assert trace.meta["shareable_prefix_tokens"] == 5952
    by_group: dict[str, list[tuple[int, ...]]] = defaultdict(list)
    for r in trace:
        assert (r.prompt_tokens, r.output_tokens) == (7200, 100)
        assert r.session_key is not None
        by_group[r.session_key.split("-")[0]].append(r.content_ids)
    assert len(by_group) == 4
    heads = set()
    for members in by_group.values():
        assert len({m[:93] for m in members}) == 1  # 6000 // 64 shared ids
        assert len({m[93] for m in members}) == len(members)  # straddling block differs
        heads.add(members[0][0])
    assert len(heads) == 4


def test_shared_prefix_rounds_repeat_every_prompt() -> None:
    trace = shared_prefix(groups=2, users=2, prefix=128, question=64, requests=10, seed=1)
    counts = Counter(r.content_ids for r in trace)
    assert sorted(counts.values()) == [2, 2, 3, 3]


def test_multi_turn_extends_the_whole_previous_sequence() -> None:
    trace = multi_turn(sessions=5, turns=4, system=100, seed=11, think=3.0)
    sessions: dict[str, list] = defaultdict(list)  # type: ignore[type-arg]
    for r in trace:
        assert r.session_key is not None
        sessions[r.session_key].append(r)
    assert len(sessions) == 5
    for turns in sessions.values():
        assert len(turns) == 4
        for prev, cur in itertools.pairwise(turns):
            assert cur.id_tokens == cur.prompt_tokens + cur.output_tokens
            assert cur.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert cur.arrival_s >= prev.arrival_s + prev.output_tokens * 0.02
            assert cur.content_ids[: len(prev.content_ids)] == prev.content_ids
            # every engine block of the previous prompt + output is shared
            for b in (16, 64):
                ph = prev.engine_block_hashes(b)
                assert cur.engine_block_hashes(b)[: len(ph)] == ph
                assert len(ph) == (prev.prompt_tokens + prev.output_tokens) // b
    firsts = {t[0].content_ids[0] for t in sessions.values()}
    assert len(firsts) == 1  # the 100-token system prompt's first 64-token block is shared


def test_multi_turn_stops_at_max_context() -> None:
    trace = multi_turn(sessions=3, turns=50, first=2000, output=500, max_context=8000, seed=2)
    assert all(r.prompt_tokens + r.output_tokens <= 8000 for r in trace)
    assert len(trace) < 150


def test_tenants_fields_and_rates() -> None:
    trace = multi_tenant(tenants="chat,longdoc,batch", duration=400.0, seed=4)
    by = defaultdict(list)
    for r in trace:
        by[r.tenant].append(r)
    assert set(by) == {"chat", "longdoc", "batch"}
    assert {r.priority for r in by["batch"]} == {PriorityClass.BATCH}
    assert {r.priority for r in by["chat"]} == {PriorityClass.INTERACTIVE}
    chat_mean = sum(r.prompt_tokens for r in by["chat"]) / len(by["chat"])
    doc_mean = sum(r.prompt_tokens for r in by["longdoc"]) / len(by["longdoc"])
    assert 150 < chat_mean < 260
    assert 13_000 < doc_mean < 19_000
    assert 1300 < len(by["chat"]) < 1900  # 4 req/s over 400 s


def test_tenant_streams_are_independent() -> None:
    both = multi_tenant(tenants="chat,batch", duration=50.0, seed=9)
    alone = multi_tenant(tenants="chat", duration=50.0, seed=9)
    lengths = [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in both if r.tenant == "chat"]
    assert lengths == [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in alone]


def test_tenant_shared_prefix_and_custom_specs() -> None:
    spec = TenantSpec("sys", rate=2.0, prompt=100, output=10, shared_prefix=640)
    trace = multi_tenant(tenants=[spec, TENANT_PRESETS["chat"]], duration=10.0, seed=1)
    sys_reqs = [r for r in trace if r.tenant == "sys"]
    assert len({r.content_ids[:10] for r in sys_reqs}) == 1
    assert all(r.prompt_tokens >= 641 for r in sys_reqs)
    with pytest.raises(ConfigError, match="unknown tenant preset"):
        multi_tenant(tenants="chat,nope")
    with pytest.raises(ConfigError, match="distinct"):
        multi_tenant(tenants="chat,chat")


def test_bursty_episodes_raise_the_rate() -> None:
    trace = bursty(rate=2.0, duration=2000.0, multiplier=6.0, seed=3)
    episodes = trace.meta["episodes"]
    assert isinstance(episodes, list) and episodes
    inside = sum(1 for r in trace if any(a <= r.arrival_s < b for a, b in episodes))
    burst_time = sum(b - a for a, b in episodes)
    inside_rate = inside / burst_time
    outside_rate = (len(trace) - inside) / (2000.0 - burst_time)
    assert 1.6 < outside_rate < 2.4
    assert 9.0 < inside_rate < 15.0
    assert all(not set(r.content_ids) & set(q.content_ids) for r, q in itertools.pairwise(trace))


def test_renewal_and_lognormal_moments() -> None:
    rng = random.Random(0)
    for cv in (0.5, 1.0, 2.0):
        times = renewal_times(rng, 10.0, cv=cv, count=20_000)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        mean = sum(gaps) / len(gaps)
        sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
        assert mean == pytest.approx(0.1, rel=0.05)
        assert sd / mean == pytest.approx(cv, rel=0.1)
    draws = [lognormal_int(rng, 1000, 0.5) for _ in range(20_000)]
    assert sum(draws) / len(draws) == pytest.approx(1000, rel=0.03)
    assert lognormal_int(rng, 37.4, 0.0) == 37


def test_id_allocator() -> None:
    alloc = IdAllocator(namespace_for("x", 1))
    a, b = alloc.take(3), alloc.take(2)
    assert len(set(a) | set(b)) == 5
    assert namespace_for("x", 1) == namespace_for("x", 1) != namespace_for("y", 1)
    with pytest.raises(ConfigError):
        IdAllocator(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"groups": 0}, "groups must be positive"),
        ({"rate": -1.0}, "rate must be positive"),
        ({"block": 40}, "multiple of 16"),
        ({"prefix": -5}, "non-negative"),
    ],
)
def test_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        shared_prefix(**kwargs)  # type: ignore[arg-type]


def _sizes(trace: Trace) -> tuple[int, int]:
    return len(trace), sum(r.prompt_tokens for r in trace)


def test_block_16_shares_the_whole_prefix() -> None:
    trace = shared_prefix(groups=1, users=2, prefix=6000, question=100, block=16, seed=0)
    a, b = trace.requests
    shared = sum(1 for x, y in zip(a.content_ids, b.content_ids, strict=True) if x == y)
    assert shared == 375
    assert _sizes(trace) == (2, 12200)


def test_shared_prefix_zipf_makes_a_few_documents_hot() -> None:
    trace = shared_prefix(groups=20, users=4, prefix=300, question=100, requests=2000, zipf=1.1)
    groups = Counter(r.session_key.split("-")[0] for r in trace if r.session_key)
    ranked = [count for _, count in groups.most_common()]
    assert groups.most_common(1)[0][0] == "g0"  # the first group is the most popular
    assert ranked[0] > 5 * ranked[-1]
    assert sum(ranked[:4]) > sum(ranked) / 2  # a fifth of the documents, most of the requests
    # a repeated (group, user) prompt is the identical request
    by_key = defaultdict(set)
    for r in trace:
        by_key[r.session_key].add(r.content_ids)
    assert all(len(ids) == 1 for ids in by_key.values())


def test_shared_prefix_zipf_zero_is_the_round_walk() -> None:
    kwargs: dict[str, int] = {"groups": 5, "users": 3, "prefix": 300, "question": 100}
    assert shared_prefix(**kwargs, requests=30).requests == (
        shared_prefix(**kwargs, requests=30, zipf=0.0).requests
    )
    with pytest.raises(ConfigError, match="zipf"):
        shared_prefix(**kwargs, zipf=-1.0)
