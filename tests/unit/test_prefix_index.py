"""InMemoryPrefixIndex: confirmed walks, speculative chains with an injected clock, their union."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.types import PrefixMatch


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def chained(tokens: Sequence[int]) -> tuple[int, ...]:
    """Chained hashes: block j's hash depends on every token up to block j."""
    return tuple(hash(tuple(tokens[: j + 1])) for j in range(len(tokens)))


Q = chained(list(range(10)))  # the query chain, 10 blocks
OTHER = chained([100, *range(1, 10)])  # differs from Q at block 0, so everywhere


def index(clock: Clock | None = None) -> InMemoryPrefixIndex:
    return InMemoryPrefixIndex(clock or Clock())


@pytest.mark.parametrize(
    ("stored", "expect"),
    [
        (Q, 10),
        (Q[:4], 4),
        (Q[:3] + Q[4:], 3),  # the walk stops at the first miss
        (Q[1:], 0),  # block 0 missing: nothing, whatever follows
        (OTHER, 0),
        ((), 0),
    ],
    ids=["all", "prefix", "gap_at_3", "missing_first", "other_chain", "nothing"],
)
def test_confirmed_walk_stops_at_first_miss(stored: tuple[int, ...], expect: int) -> None:
    idx = index()
    idx.record_stored("r0", stored)
    got = idx.lookup(Q, ["r0", "r1"])
    if expect:
        assert got == {"r0": PrefixMatch("r0", expect, expect)}
        assert not got["r0"].speculative
    else:
        assert got == {}  # replicas without a match are absent


def test_lookup_only_reports_candidates_and_empty_queries() -> None:
    idx = index()
    idx.record_stored("r0", Q)
    idx.record_stored("r1", Q[:2])
    assert set(idx.lookup(Q, ["r1", "r2"])) == {"r1"}
    assert idx.lookup((), ["r0", "r1"]) == {}
    assert idx.lookup(Q, []) == {}


def test_record_removed_cuts_the_walk_and_counts() -> None:
    idx = index()
    idx.record_stored("r0", Q)
    idx.record_removed("r0", [Q[5]])
    assert idx.lookup(Q, ["r0"])["r0"].matched_blocks == 5
    idx.record_removed("r0", [Q[0]])
    assert idx.lookup(Q, ["r0"]) == {}
    idx.record_removed("never-stored", [1, 2])  # harmless
    assert (idx.stored_total, idx.removed_total) == (10, 4)
    assert idx.held_blocks("r0") == 8


def test_speculative_entries_expire_by_the_injected_clock() -> None:
    clock = Clock(100.0)
    idx = index(clock)
    idx.speculate("r0", Q[:6], ttl_s=5.0)
    assert idx.lookup(Q, ["r0"]) == {"r0": PrefixMatch("r0", 6, 0)}
    clock.t = 104.999
    assert idx.lookup(Q, ["r0"])["r0"].matched_blocks == 6
    clock.t = 105.0  # expires_at is exclusive
    assert idx.lookup(Q, ["r0"]) == {}
    clock.t = 0.0  # an expired entry was pruned; it does not come back
    assert idx.lookup(Q, ["r0"]) == {}


@pytest.mark.parametrize("ttl", [0.0, -1.0])
def test_speculate_ignores_empty_chains_and_non_positive_ttls(ttl: float) -> None:
    idx = index()
    idx.speculate("r0", Q, ttl_s=ttl)
    idx.speculate("r0", (), ttl_s=10.0)
    assert idx.lookup(Q, ["r0"]) == {}


def test_longest_live_speculative_chain_wins() -> None:
    clock = Clock()
    idx = index(clock)
    idx.speculate("r0", Q[:3], ttl_s=10.0)
    idx.speculate("r0", Q[:7] + OTHER[7:], ttl_s=2.0)  # agrees with Q on 7 blocks
    idx.speculate("r0", OTHER, ttl_s=10.0)  # another first block, another key
    assert idx.lookup(Q, ["r0"])["r0"].matched_blocks == 7
    clock.t = 3.0
    assert idx.lookup(Q, ["r0"])["r0"].matched_blocks == 3
    assert idx.lookup(OTHER, ["r0"])["r0"].matched_blocks == 10


@pytest.mark.parametrize(
    ("spec", "confirmed", "matched", "confirmed_blocks"),
    [
        # speculative covers [0, 4), confirmed continues after it
        (Q[:4], Q[4:8], 8, 0),
        # confirmed covers [0, 2) and [4, 10); speculative bridges the gap
        (Q[:4], Q[:2] + Q[4:], 10, 2),
        # speculative inside confirmed: confirmed decides
        (Q[:3], Q[:6], 6, 6),
        # speculative longer than confirmed, nothing confirmed after it
        (Q[:7], Q[:2], 7, 2),
        # confirmed after a gap the speculative chain does not reach is not used
        (Q[:3], Q[5:], 3, 0),
    ],
    ids=["spec_then_confirmed", "spec_bridges_gap", "spec_inside", "spec_longer", "gap_after_spec"],
)
def test_speculative_and_confirmed_union(
    spec: tuple[int, ...], confirmed: tuple[int, ...], matched: int, confirmed_blocks: int
) -> None:
    idx = index()
    idx.record_stored("r0", confirmed)
    idx.speculate("r0", spec, ttl_s=30.0)
    assert idx.lookup(Q, ["r0"]) == {"r0": PrefixMatch("r0", matched, confirmed_blocks)}


def test_retract_shortens_only_the_retracted_chain_and_never_extends() -> None:
    clock = Clock()
    idx = index(clock)
    idx.speculate("r0", Q[:6], ttl_s=30.0)
    idx.speculate("r0", Q[:3], ttl_s=30.0)
    idx.speculate("r1", Q[:6], ttl_s=30.0)
    clock.t = 2.0
    idx.retract("r0", Q[:6], grace_s=1.0)  # first token: KV events take over after 1 s
    clock.t = 2.5
    assert idx.lookup(Q, ["r0"])["r0"].matched_blocks == 6
    clock.t = 3.0
    assert idx.lookup(Q, ["r0", "r1"]) == {
        "r0": PrefixMatch("r0", 3, 0),  # the shorter chain keeps its own TTL
        "r1": PrefixMatch("r1", 6, 0),  # other replicas untouched
    }
    idx.speculate("r2", Q[:4], ttl_s=1.0)
    idx.retract("r2", Q[:4], grace_s=10.0)  # a grace longer than the TTL does not extend it
    clock.t = 4.0
    assert "r2" not in idx.lookup(Q, ["r2"])
    idx.retract("nobody", Q, grace_s=1.0)
    idx.retract("r1", (), grace_s=1.0)


def test_clear_forgets_confirmed_and_speculative() -> None:
    idx = index()
    idx.record_stored("r0", Q)
    idx.speculate("r0", Q, ttl_s=30.0)
    idx.record_stored("r1", Q[:2])
    idx.clear("r0")
    assert idx.lookup(Q, ["r0", "r1"]) == {"r1": PrefixMatch("r1", 2, 2)}
    assert idx.held_blocks("r0") == 0
    idx.clear("unknown")  # harmless


def test_replicas_are_independent() -> None:
    idx = index()
    idx.record_stored("r0", Q[:5])
    idx.speculate("r1", Q[:8], ttl_s=1.0)
    assert idx.lookup(Q, ["r0", "r1"]) == {
        "r0": PrefixMatch("r0", 5, 5),
        "r1": PrefixMatch("r1", 8, 0),
    }


# -- Hypothesis: against a brute-force definition -------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    query_len=st.integers(0, 24),
    chain_len=st.integers(0, 24),
    agree=st.integers(0, 24),
)
def test_common_prefix_of_chains(query_len: int, chain_len: int, agree: int) -> None:
    """One speculative chain: its common prefix with the query, found by binary search."""
    tokens = list(range(query_len))
    other = tokens[: min(agree, chain_len)] + [10_000 + j for j in range(max(0, chain_len - agree))]
    q, c = chained(tokens), chained(other[:chain_len])
    brute = 0
    while brute < min(len(q), len(c)) and q[brute] == c[brute]:
        brute += 1
    idx = index()
    idx.speculate("r0", c, ttl_s=1.0)
    assert idx.holdings("r0", q) == ([False] * len(q), brute)


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[tuple[int, ...], set[int], list[tuple[tuple[int, ...], float]], float]:
    n = draw(st.integers(1, 20))
    tokens = list(range(n))
    query = chained(tokens)
    confirmed = {query[j] for j in range(n) if draw(st.booleans())}
    specs: list[tuple[tuple[int, ...], float]] = []
    for s in range(draw(st.integers(0, 4))):
        keep = draw(st.integers(0, n))
        tail = draw(st.integers(0, 5))
        chain = chained(tokens[:keep] + [50_000 + 100 * s + j for j in range(tail)])
        if chain:
            specs.append((chain, draw(st.floats(0.5, 20.0))))
    now = draw(st.floats(0.0, 25.0))
    return query, confirmed, specs, now


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios())
def test_lookup_is_the_first_block_held_by_neither_kind(
    scenario: tuple[tuple[int, ...], set[int], list[tuple[tuple[int, ...], float]], float],
) -> None:
    query, confirmed, specs, now = scenario
    clock = Clock(0.0)
    idx = index(clock)
    idx.record_stored("r0", sorted(confirmed))
    for chain, ttl in specs:
        idx.speculate("r0", chain, ttl)
    clock.t = now
    spec = max(
        (_brute_common(query, chain) for chain, ttl in specs if ttl > now),
        default=0,
    )
    walk = 0
    while walk < len(query) and query[walk] in confirmed:
        walk += 1
    j = 0
    while j < len(query) and (j < spec or query[j] in confirmed):
        j += 1
    got = idx.lookup(query, ["r0"])
    if j == 0:
        assert got == {}
    else:
        assert got == {"r0": PrefixMatch("r0", j, walk)}


def _brute_common(a: Sequence[int], b: Sequence[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_expired_speculative_chains_are_dropped_without_lookups() -> None:
    """Memory stays bounded by one TTL of traffic even for prefixes nobody asks for again."""
    from controlplane.prefix.memory import InMemoryPrefixIndex

    now = [0.0]
    index = InMemoryPrefixIndex(clock=lambda: now[0])
    for i in range(1000):
        now[0] = float(i)
        index.speculate("r0", tuple(range(i * 10, i * 10 + 10)), ttl_s=5.0)
    assert index.speculative_entries <= 6
