"""RedisPrefixIndex answers like InMemoryPrefixIndex for random operation sequences.

"Like" is `index_check.check_lookup`: the same answer wherever a replica's blocks along the query
form a prefix, a valid boundary at or beyond the first gap where they do not (the Redis lookup
searches the held run instead of walking it).

Both run on one fake clock (the Redis index takes it instead of Redis TIME), so speculative expiry
is compared exactly. Replica restarts are modelled as a new incarnation in Redis and `clear` in
memory; late writes of an old incarnation must change nothing.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from index_check import check_lookup
from redis_server import RedisServer

from controlplane.hashing import BlockHasher, scope_key
from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.prefix.redis_index import RedisPrefixIndex

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

HASHER = BlockHasher(1, key=scope_key("model-test"))
# a small tree of chains: A and B share 3 blocks, C shares nothing
TOKENS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25])
CHAINS = [HASHER.hash_blocks(t) for t in TOKENS]
REPLICAS = ("r0", "r1")
_prefixes = itertools.count()


@dataclass(frozen=True)
class Op:
    kind: str  # store | remove | spec | clear | restart | stale | tick | lookup
    replica: str = "r0"
    chain: int = 0
    lo: int = 0
    hi: int = 0
    ms: int = 0


replica = st.sampled_from(REPLICAS)
chain_id = st.integers(0, len(CHAINS) - 1)
span = st.tuples(st.integers(0, 8), st.integers(0, 8)).map(sorted)
# patterns random sequences rarely hit: a confirmed run that resumes where speculation ends, and
# a late write of an old incarnation after the new one wrote
BRIDGE = [Op("store", "r0", 0, 0, 2), Op("store", "r0", 0, 4, 8), Op("spec", "r0", 0, 0, 4, 1500)]
LATE = [
    Op("store", "r1", 1, 0, 6),
    Op("restart", "r1"),
    Op("store", "r1", 1, 0, 2),
    Op("stale", "r1", 1, 0, 6),
    Op("remove", "r1", 1, 1, 2),
    Op("stale", "r1", 0, 0, 3),
]
OPS = st.one_of(
    st.builds(lambda r, c, s: Op("store", r, c, s[0], s[1]), replica, chain_id, span),
    st.builds(lambda r, c, s: Op("remove", r, c, s[0], s[1]), replica, chain_id, span),
    # speculation covers a chain from its root, as the router writes it; TTLs end between ticks
    st.builds(
        lambda r, c, k, ms: Op("spec", r, c, 0, k, ms),
        replica,
        chain_id,
        st.integers(1, 8),
        st.sampled_from([1500, 2500, 4500]),
    ),
    st.builds(lambda r: Op("clear", r), replica),
    st.builds(lambda r: Op("restart", r), replica),
    st.builds(lambda r, c, s: Op("stale", r, c, s[0], s[1]), replica, chain_id, span),
    st.builds(lambda ms: Op("tick", ms=ms), st.sampled_from([1000, 2000, 3000])),
    st.builds(lambda c, k: Op("lookup", chain=c, hi=k), chain_id, st.integers(1, 8)),
)


async def run_ops(url: str, ops: Sequence[Op]) -> None:
    clock_ms = [1_700_000_000_000]
    memory = InMemoryPrefixIndex(clock=lambda: clock_ms[0] / 1000)
    index = RedisPrefixIndex(
        url,
        key_prefix=f"m{next(_prefixes)}",
        entry_ttl_s=3600,
        lookup_budget_s=2.0,
        clock_override_ms=lambda: clock_ms[0],
    )
    inc = dict.fromkeys(REPLICAS, 1)
    try:
        for op in [*ops, *(Op("lookup", chain=c, hi=8) for c in range(len(CHAINS)))]:
            hashes = CHAINS[op.chain][op.lo : op.hi]
            r = op.replica
            if op.kind == "store":
                await index.record_stored(r, inc[r], hashes)
                memory.record_stored(r, hashes)
            elif op.kind == "remove":
                await index.record_removed(r, inc[r], hashes)
                memory.record_removed(r, hashes)
            elif op.kind == "spec":
                await index.speculate(r, inc[r], hashes, op.ms / 1000)
                memory.speculate(r, hashes, op.ms / 1000)
            elif op.kind == "clear":
                await index.clear(r)
                memory.clear(r)
            elif op.kind == "restart":
                inc[r] += 1
                memory.clear(r)
            elif op.kind == "stale":
                await index.record_stored(r, inc[r] - 1, hashes)
            elif op.kind == "tick":
                assert await index.flush()
                clock_ms[0] += op.ms
            else:
                assert await index.flush()
                query = CHAINS[op.chain][: op.hi]
                got = await index.lookup(query, [(r, inc[r]) for r in REPLICAS])
                assert got is not None, op
                check_lookup(got, memory, query, REPLICAS)
        assert index.unknown == 0 and index.writes_failed == 0 and index.writes_dropped == 0
    finally:
        await index.aclose()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(OPS, max_size=40))
@example(ops=BRIDGE)
@example(ops=[*BRIDGE, Op("tick", ms=2000)])
@example(ops=LATE)
def test_redis_index_matches_in_memory(redis_server: RedisServer, ops: list[Op]) -> None:
    asyncio.run(run_ops(redis_server.url, ops))


def test_model_checker_catches_a_difference(redis_server: RedisServer) -> None:
    """The comparison is not vacuous: a write the memory side misses is noticed."""

    async def diverge() -> None:
        index = RedisPrefixIndex(redis_server.url, key_prefix="diverge", lookup_budget_s=2.0)
        memory = InMemoryPrefixIndex(clock=lambda: 0.0)
        try:
            await index.record_stored("r0", 1, CHAINS[0])
            assert await index.flush()
            got = await index.lookup(CHAINS[0], [("r0", 1)])
            assert got is not None
            with pytest.raises(AssertionError):
                check_lookup(got, memory, CHAINS[0], ["r0"])
        finally:
            await index.aclose()

    asyncio.run(diverge())


LONG = HASHER.hash_blocks(list(range(3000)))


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    held=st.lists(
        st.tuples(
            st.integers(0, 2400),  # confirmed run
            st.integers(0, 2400),  # speculative run from the root (0 = none)
            st.lists(st.integers(0, 2399), max_size=3),  # removed blocks (gaps), often none
        ),
        min_size=1,
        max_size=4,
    ),
    n=st.integers(1, 2400),
)
@example(held=[(2400, 0, []), (1200, 1600, []), (256, 0, []), (0, 0, [])], n=2000)
@example(held=[(1000, 0, [500]), (40, 900, [10, 600])], n=1000)
def test_long_chains_search_agrees_with_the_walk(
    redis_server: RedisServer, held: list[tuple[int, int, list[int]]], n: int
) -> None:
    """Chains of up to 2,400 blocks: the searched answer equals the walk when the holdings are a
    prefix, and is a valid boundary when the index holds gaps."""

    async def run() -> None:
        memory = InMemoryPrefixIndex(clock=lambda: 1_700_000_000.0)
        index = RedisPrefixIndex(
            redis_server.url,
            key_prefix=f"m{next(_prefixes)}",
            lookup_budget_s=2.0,
            clock_override_ms=lambda: 1_700_000_000_000,
        )
        replicas = [f"r{i}" for i in range(len(held))]
        try:
            for rid, (conf, spec, gaps) in zip(replicas, held, strict=True):
                gone = [LONG[g] for g in gaps]
                await index.record_stored(rid, 1, LONG[:conf])
                await index.record_removed(rid, 1, gone)
                await index.speculate(rid, 1, LONG[:spec], 30.0)
                memory.record_stored(rid, LONG[:conf])
                memory.record_removed(rid, gone)
                memory.speculate(rid, LONG[:spec], 30.0)
            assert await index.flush()
            got = await index.lookup(LONG[:n], [(r, 1) for r in replicas])
            assert got is not None
            check_lookup(got, memory, LONG[:n], replicas)
        finally:
            await index.aclose()

    asyncio.run(run())
