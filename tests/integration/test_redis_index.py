"""RedisPrefixIndex against a private redis-server: match lengths, speculation, incarnations,
clear, memory bounds, no text stored, one round trip per lookup, the write queue, URL guard, TLS."""

from __future__ import annotations

import asyncio
import re
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import redis
from index_check import check_lookup, without_suspending
from redis_server import RedisServer, available

from controlplane.errors import ConfigError
from controlplane.hashing import BlockHasher, scope_key
from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.prefix.redis_index import ANY_INCARNATION, RedisPrefixIndex
from controlplane.store.urls import check_url
from controlplane.types import PrefixMatch

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

Factory = Callable[..., RedisPrefixIndex]
HASHER = BlockHasher(1, key=scope_key("test-model"))


def chain(tokens: Sequence[int]) -> list[int]:
    """Chained block hashes, one token per block."""
    return HASHER.hash_blocks(list(tokens))


Q = chain(range(10))  # the query, 10 blocks
SHARED = chain([0, 1, 2, 3, 50, 51, 52, 53, 54, 55])  # shares Q's first 4 blocks
OTHER = chain([100, *range(1, 10)])  # differs from Q at block 0, so everywhere
REPLICAS = ("r0", "r1", "r2")
CANDIDATES = [(r, 1) for r in (*REPLICAS, "r9")]


class FakeClock:
    def __init__(self, ms: int = 1_700_000_000_000) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


# (replica, op, hashes); op: stored | spec | removed
Holding = tuple[str, str, Sequence[int]]

# expected (matched, confirmed) per replica; where the index holds a gap along the query, the
# lookup's search may stop at any boundary from the first gap on (index_check), so a case lists
# every answer it accepts
Answer = tuple[int, int] | set[tuple[int, int]]
CASES: dict[str, tuple[list[Holding], dict[str, Answer]]] = {
    "all": ([("r0", "stored", Q)], {"r0": (10, 10)}),
    "prefix": ([("r0", "stored", Q[:4])], {"r0": (4, 4)}),
    "gap_at_3": ([("r0", "stored", Q[:3] + Q[4:])], {"r0": {(3, 3), (10, 10)}}),
    "missing_first": ([("r0", "stored", Q[1:])], {}),
    "other_chain": ([("r0", "stored", OTHER)], {}),
    "shared_prefixes": (
        [("r0", "stored", Q), ("r1", "stored", SHARED), ("r2", "stored", Q[:2])],
        {"r0": (10, 10), "r1": (4, 4), "r2": (2, 2)},
    ),
    "speculative_only": ([("r0", "spec", Q[:6])], {"r0": (6, 0)}),
    "spec_bridges_a_confirmed_gap": (
        [("r0", "stored", Q[:2]), ("r0", "spec", Q[:5]), ("r0", "stored", Q[5:8])],
        {"r0": {(8, 2), (8, 8)}},
    ),
    "confirmed_beyond_spec": (
        [("r0", "stored", Q[:7]), ("r0", "spec", Q[:3])],
        {"r0": (7, 7)},
    ),
    "removal_cuts_the_walk": (
        [("r0", "stored", Q), ("r0", "removed", Q[5:6])],
        {"r0": {(5, 5), (10, 10)}},
    ),
    "removal_keeps_speculation": (
        [("r0", "spec", Q[:6]), ("r0", "stored", Q[:6]), ("r0", "removed", Q[:6])],
        {"r0": (6, 0)},
    ),
    "spec_on_a_sibling_chain": ([("r1", "spec", SHARED)], {"r1": (4, 0)}),
    "mixed": (
        [
            ("r0", "stored", Q[:3]),
            ("r1", "spec", Q),
            ("r1", "stored", Q[:1]),
            ("r2", "stored", OTHER),
            ("r2", "spec", SHARED[:2]),
        ],
        {"r0": (3, 3), "r1": (10, 1), "r2": (2, 0)},
    ),
}


async def apply(index: RedisPrefixIndex, memory: InMemoryPrefixIndex, h: list[Holding]) -> None:
    for rid, op, hashes in h:
        if op == "stored":
            await index.record_stored(rid, 1, hashes)
            memory.record_stored(rid, hashes)
        elif op == "spec":
            await index.speculate(rid, 1, hashes, 30.0)
            memory.speculate(rid, hashes, 30.0)
        else:
            await index.record_removed(rid, 1, hashes)
            memory.record_removed(rid, hashes)
    assert await index.flush()


@pytest.mark.parametrize("case", list(CASES))
async def test_match_lengths(make_index: Factory, case: str) -> None:
    holdings, expect = CASES[case]
    index = make_index()
    memory = InMemoryPrefixIndex(clock=time.monotonic)
    await apply(index, memory, holdings)
    got = await index.lookup(Q, CANDIDATES)
    assert got is not None and set(got) == set(expect)
    for rid, answer in expect.items():
        assert (got[rid].matched_blocks, got[rid].confirmed_blocks) in (
            answer if isinstance(answer, set) else {answer}
        ), rid
    check_lookup(got, memory, Q, [r for r, _ in CANDIDATES])  # in-memory agrees where it must
    assert index.unknown == 0 and index.writes_failed == 0


async def test_empty_queries_and_candidates(make_index: Factory) -> None:
    index = make_index()
    await index.record_stored("r0", 1, Q)
    await index.record_stored("r0", 1, [])
    await index.speculate("r0", 1, Q, 0.0)  # ttl <= 0: ignored
    assert await index.flush()
    assert await index.lookup([], CANDIDATES) == {}
    assert await index.lookup(Q, []) == {}
    assert await index.lookup(Q[:1], [("r0", 1)]) == {"r0": PrefixMatch("r0", 1, 1)}
    # hashes are u64; signed forms (old vLLM events) name the same blocks
    signed = [h - (1 << 64) if h >= 1 << 63 else h for h in Q]
    assert await index.lookup(signed, [("r0", 1)]) == {"r0": PrefixMatch("r0", 10, 10)}


async def test_replica_ids_are_opaque(make_index: Factory) -> None:
    index = make_index()
    odd = ["pod:a b/ü", "10.0.0.7:8000", "r,1", ""]
    for i, rid in enumerate(odd):
        await index.record_stored(rid, 1, Q[: i + 1])
    assert await index.flush()
    got = await index.lookup(Q, [(rid, 1) for rid in [*odd, "nul\0id"]])
    assert got == {rid: PrefixMatch(rid, i + 1, i + 1) for i, rid in enumerate(odd)}


async def test_long_prompt_over_many_replicas(make_index: Factory) -> None:
    """2,000 blocks, 16 candidates, holdings of every length: exact answers in one lookup."""
    index = make_index()
    long_q = chain(range(2000))
    held = {f"r{i}": (2000 * i) // 15 for i in range(16)}
    for rid, n in held.items():
        await index.record_stored(rid, 1, long_q[:n])
    await index.speculate("r3", 1, long_q[:1500], 30.0)
    assert await index.flush(10)
    got = await index.lookup(long_q, [(r, 1) for r in held])
    assert got is not None
    expect = {r: PrefixMatch(r, n, n) for r, n in held.items() if n}
    expect["r3"] = PrefixMatch("r3", 1500, held["r3"])
    assert got == expect


async def test_speculative_entries_expire_in_redis_time(
    make_index: Factory, redis_admin: redis.Redis
) -> None:
    index = make_index()
    await index.speculate("r0", 1, Q[:6], 0.3)
    await index.record_stored("r1", 1, Q[:2])
    assert await index.flush()
    assert await index.lookup(Q, CANDIDATES) == {
        "r0": PrefixMatch("r0", 6, 0),
        "r1": PrefixMatch("r1", 2, 2),
    }
    assert 0 < redis_admin.pttl("t:idx:s:r0") <= 300  # the key dies with its last entry
    await asyncio.sleep(0.45)
    assert await index.lookup(Q, CANDIDATES) == {"r1": PrefixMatch("r1", 2, 2)}
    assert not redis_admin.exists("t:idx:s:r0")


async def test_speculative_expiry_follows_the_clock(make_index: Factory) -> None:
    clock = FakeClock()
    index = make_index(clock_override_ms=clock)
    await index.speculate("r0", 1, Q[:6], 2.0)
    clock.ms += 1000
    await index.speculate("r0", 1, Q[:3], 2.0)  # renews the first three blocks only
    assert await index.flush()
    clock.ms += 999
    assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 6, 0)}
    clock.ms += 1  # expiry is exclusive, as in memory
    assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 3, 0)}
    clock.ms += 1000
    assert await index.lookup(Q, [("r0", 1)]) == {}


async def test_retract_ends_speculation_after_the_grace(make_index: Factory) -> None:
    clock = FakeClock()
    index = make_index(clock_override_ms=clock)
    await index.record_stored("r0", 1, Q[:2])
    await index.speculate("r0", 1, Q[:6], 30.0)
    await index.speculate("r1", 1, Q[:6], 30.0)
    await index.retract("r0", 1, Q[:6], 0.5)  # r0 computed the chain: events speak from now on
    await index.retract("r0", 1, Q[6:9], 0.5)  # blocks never speculated stay absent
    assert await index.flush()
    assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 6, 2)}
    clock.ms += 500
    assert await index.lookup(Q, [("r0", 1), ("r1", 1)]) == {
        "r0": PrefixMatch("r0", 2, 2),  # only what KV events confirmed
        "r1": PrefixMatch("r1", 6, 0),  # another replica's claim is untouched
    }
    await index.speculate("r0", 1, Q[:4], 30.0)  # a later claim is not shortened
    assert await index.flush()
    assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 4, 2)}


async def test_new_incarnation_purges_and_old_writes_are_ignored(
    make_index: Factory, redis_admin: redis.Redis
) -> None:
    index = make_index()
    await index.record_stored("r0", 1, Q)
    await index.speculate("r0", 1, SHARED, 30.0)
    assert await index.flush()
    assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 10, 10)}
    # a restarted replica: its entries do not count before any event of the new incarnation
    assert await index.lookup(Q, [("r0", 2)]) == {}

    await index.record_stored("r0", 2, Q[:3])
    assert await index.flush()
    assert await index.lookup(Q, [("r0", 2)]) == {"r0": PrefixMatch("r0", 3, 3)}
    assert await index.lookup(Q, [("r0", 1)]) == {}
    assert index.incarnations_replaced == 1
    assert redis_admin.scard("t:idx:c:r0") == 3  # the old incarnation's entries are gone
    assert not redis_admin.exists("t:idx:s:r0")

    # late events of the old incarnation are ignored (one count per write, whatever its size)
    await index.record_stored("r0", 1, chain(range(3000)))
    await index.record_removed("r0", 1, Q[:3])
    assert await index.flush()
    assert index.stale_writes == 2
    assert await index.lookup(Q, [("r0", 2)]) == {"r0": PrefixMatch("r0", 3, 3)}


async def test_any_incarnation_follows_the_stored_one(make_index: Factory) -> None:
    """A router that does not follow events looks up and speculates with ANY_INCARNATION."""
    index = make_index()
    any_ = [("r0", ANY_INCARNATION)]
    await index.speculate("r0", ANY_INCARNATION, Q[:5], 30.0)  # nothing stored yet
    assert await index.flush()
    assert await index.lookup(Q, any_) == {"r0": PrefixMatch("r0", 5, 0)}
    # the indexer's first write (a real incarnation) replaces the speculative placeholder
    await index.record_stored("r0", 7, Q[:3])
    assert await index.flush()
    assert await index.lookup(Q, any_) == {"r0": PrefixMatch("r0", 3, 3)}
    await index.speculate("r0", ANY_INCARNATION, Q[:8], 30.0)  # joins incarnation 7
    assert await index.flush()
    assert await index.lookup(Q, any_) == {"r0": PrefixMatch("r0", 8, 3)}
    assert await index.lookup(Q, [("r0", 7)]) == {"r0": PrefixMatch("r0", 8, 3)}
    # a restart (new incarnation): ANY follows it, nothing of the old one matches
    await index.record_stored("r0", 8, Q[:2])
    assert await index.flush()
    assert await index.lookup(Q, any_) == {"r0": PrefixMatch("r0", 2, 2)}
    assert await index.lookup(Q, [("r1", ANY_INCARNATION)]) == {}


@pytest.mark.parametrize(
    "order", [(-5, 0, 3), (0, 1 << 40, (1 << 63) - 1), (-(1 << 63) + 1, -1, 0), (9, 10, 11)]
)
async def test_incarnations_order_numerically(make_index: Factory, order: tuple[int, ...]) -> None:
    index = make_index()
    for inc in order:
        await index.record_stored("r0", inc, Q[: inc % 7 + 1])
    await index.record_stored("r0", order[0], Q)  # the oldest: ignored
    assert await index.flush()
    newest = order[-1]
    n = newest % 7 + 1
    assert await index.lookup(Q, [("r0", newest)]) == {"r0": PrefixMatch("r0", n, n)}
    assert index.stale_writes == 1


async def test_clear_forgets_one_replica(make_index: Factory, redis_admin: redis.Redis) -> None:
    index = make_index()
    await index.record_stored("r0", 1, Q)
    await index.speculate("r0", 1, SHARED, 30.0)
    await index.record_stored("r1", 1, Q[:4])
    await index.clear("r0")
    await index.clear("never-seen")
    assert await index.flush()
    assert await index.lookup(Q, CANDIDATES) == {"r1": PrefixMatch("r1", 4, 4)}
    assert not redis_admin.exists("t:idx:c:r0", "t:idx:t:r0", "t:idx:s:r0")
    await index.record_stored("r0", 1, Q[:2])  # the replica lives on
    assert await index.flush()
    assert (await index.lookup(Q, [("r0", 1)])) == {"r0": PrefixMatch("r0", 2, 2)}


async def test_memory_is_bounded(make_index: Factory, redis_admin: redis.Redis) -> None:
    """Per-replica cap (oldest out first), TTL on every key, expired entries trimmed."""
    clock = FakeClock()
    index = make_index(clock_override_ms=clock, max_entries_per_replica=50, entry_ttl_s=60)
    chains = [chain(range(1000 * k, 1000 * k + 30)) for k in range(4)]
    for c in chains:
        await index.record_stored("r0", 1, c)
        await index.speculate("r1", 1, c, 30.0)
        clock.ms += 1000
    assert await index.flush()
    assert redis_admin.scard("t:idx:c:r0") == 50
    assert redis_admin.zcard("t:idx:t:r0") == 50
    assert redis_admin.zcard("t:idx:s:r1") == 50
    assert index.cap_evictions == 2 * 70
    got = await index.lookup(chains[-1], [("r0", 1), ("r1", 1)])
    assert got == {"r0": PrefixMatch("r0", 30, 30), "r1": PrefixMatch("r1", 30, 0)}
    assert await index.lookup(chains[0], [("r0", 1), ("r1", 1)]) == {}
    keys = list(redis_admin.scan_iter("t:idx:*"))
    assert keys and all(redis_admin.pttl(k) > 0 for k in keys)

    # entries past their TTL are trimmed by the replica's next store
    clock.ms += 61_000
    await index.record_stored("r0", 1, Q)
    assert await index.flush()
    assert redis_admin.scard("t:idx:c:r0") == 10
    assert await index.lookup(chains[-1], [("r0", 1)]) == {}


async def test_routing_to_a_replica_keeps_its_hot_prefix_alive(
    make_index: Factory, redis_admin: redis.Redis
) -> None:
    """vLLM sends no event for a cache hit: a speculative write (a request routed there)
    renews the TTL of the blocks the replica already holds, so hot prefixes do not age out."""
    clock = FakeClock()
    index = make_index(clock_override_ms=clock, entry_ttl_s=60)
    await index.record_stored("r0", 1, Q)  # expires at +60 s unless renewed
    await index.record_stored("r1", 1, Q)
    clock.ms += 50_000
    await index.speculate("r0", 1, Q[:6], 2.0)  # a request for Q[:6] routed to r0
    clock.ms += 20_000
    await index.record_stored("r0", 1, OTHER)  # stores trim what has expired
    await index.record_stored("r1", 1, OTHER)
    assert await index.flush()
    got = await index.lookup(Q, [("r0", 1), ("r1", 1)])
    assert got == {"r0": PrefixMatch("r0", 6, 6)}  # renewed blocks only; r1's all expired
    assert redis_admin.zscore("t:idx:t:r0", struct.pack(">Q", Q[0])) == clock.ms - 20_000 + 60_000


async def test_entries_die_with_their_ttl(make_index: Factory, redis_admin: redis.Redis) -> None:
    index = make_index(entry_ttl_s=0.3)
    await index.record_stored("r0", 1, Q)
    assert await index.flush()
    assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 10, 10)}
    assert 0 < redis_admin.pttl("t:idx:c:r0") <= 300
    assert 300 < redis_admin.pttl("t:idx:i:r0") <= 600
    await asyncio.sleep(0.4)
    assert await index.lookup(Q, [("r0", 1)]) == {}


async def test_no_text_is_stored(make_index: Factory, redis_admin: redis.Redis) -> None:
    """Write a canary prompt's hashes every way there is, then read back every key and value."""
    canary = "CANARY-7f3a: the launch code is swordfish, tell nobody"
    tokens = list(canary.encode())  # one token per byte
    hasher = BlockHasher(4, key=scope_key("test-model", salt="tenant-a"))
    hashes = hasher.hash_blocks(tokens)
    index = make_index()
    await index.record_stored("r0", 1, hashes)
    await index.speculate("r1", 7, hashes, 30.0)
    await index.record_stored("r2", 1, hashes)
    await index.record_removed("r2", 1, hashes[-2:])
    assert await index.flush()
    assert (await index.lookup(hashes, [("r0", 1)])) == {
        "r0": PrefixMatch("r0", len(hashes), len(hashes))
    }

    blobs: list[bytes] = []
    admin: Any = redis_admin  # untyped view: the replies are bytes (decode_responses=False)
    for key in admin.scan_iter("*"):
        assert re.fullmatch(rb"t:idx:[icts]:r[0-9]", key), key
        blobs.append(key)
        kind = admin.type(key)
        if kind == b"string":
            blobs.append(admin.get(key))
        elif kind == b"set":
            blobs.extend(admin.smembers(key))
        elif kind == b"zset":
            for member, score in admin.zrange(key, 0, -1, withscores=True):
                blobs += [member, repr(score).encode()]
        else:
            pytest.fail(f"unexpected key type {kind!r}")
    dump = b"\x00".join(blobs)
    as_bytes = bytes(tokens)
    for needle in (canary.encode(), b"canary", b"swordfish", b"launch", as_bytes[:8]):
        assert needle.lower() not in dump.lower()
    members = set(redis_admin.smembers("t:idx:c:r0"))
    assert members == {struct.pack(">Q", h) for h in hashes}  # only the 64-bit hashes


async def test_one_round_trip_per_lookup(make_index: Factory, redis_admin: redis.Redis) -> None:
    index = make_index()
    long_q = chain(range(2000))
    for i in range(16):
        await index.record_stored(f"r{i}", 1, long_q[: 100 * i])
    assert await index.flush(10)
    candidates = [(f"r{i}", 1) for i in range(16)]
    await index.lookup(long_q, candidates)  # connect and load the script first
    redis_admin.config_resetstat()
    trips = index.round_trips
    for _ in range(20):
        assert await index.lookup(long_q, candidates)
    stats = redis_admin.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 20
    assert index.round_trips - trips == 20
    assert "cmdstat_script|load" not in stats


async def test_scripts_are_reloaded_after_noscript(
    make_index: Factory, redis_admin: redis.Redis
) -> None:
    index = make_index()
    await index.record_stored("r0", 1, Q)
    assert await index.flush()
    assert await index.lookup(Q, [("r0", 1)])
    loads = index.script_loads
    redis_admin.script_flush()
    assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 10, 10)}
    redis_admin.script_flush()
    await index.record_removed("r0", 1, Q[4:5])
    assert await index.flush()
    assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 4, 4)}
    assert index.script_loads == loads + 3
    assert index.writes_failed == 0 and index.unknown == 0


async def test_full_write_queue_drops_without_blocking(make_index: Factory) -> None:
    index = make_index(write_queue_size=4)
    for i in range(200):
        assert without_suspending(index.record_stored("r0", 1, chain(range(i, i + 8))))
    assert index.writes_dropped == 196
    assert await index.flush()
    assert index.writes_applied == 4


async def test_closed_index_answers_unknown_and_drops(make_index: Factory) -> None:
    index = make_index()
    await index.record_stored("r0", 1, Q)
    await index.aclose(flush_timeout_s=1.0)
    assert index.writes_applied == 1
    assert await index.lookup(Q, [("r0", 1)]) is None
    await index.record_stored("r0", 1, Q)
    await index.clear("r0")
    assert index.writes_dropped == 2
    await index.aclose()  # idempotent


@pytest.mark.parametrize(
    ("url", "kwargs", "ok"),
    [
        ("redis://127.0.0.1:6390/0", {}, True),
        ("redis://localhost:6390", {}, True),
        ("redis://[::1]:6390", {}, True),
        ("unix:///tmp/redis.sock", {}, True),
        ("redis://10.0.0.5:6379/0", {}, False),
        ("rediss://redis.internal:6380/0", {}, False),
        ("redis://redis.internal:6379", {"allow_insecure": True}, True),
        ("redis://:secret@10.0.0.5:6379/0", {}, True),
        ("rediss://router:secret@redis.internal:6380/0", {}, True),
        ("redis://10.0.0.5:6379/0", {"password": "secret"}, True),
        ("http://127.0.0.1:6379", {}, False),
    ],
)
async def test_unauthenticated_remote_urls_are_refused(
    url: str, kwargs: dict[str, object], ok: bool
) -> None:
    if not ok:
        with pytest.raises(ConfigError):
            RedisPrefixIndex(url, **kwargs)  # type: ignore[arg-type]
        return
    index = RedisPrefixIndex(url, **kwargs)  # type: ignore[arg-type]
    assert "secret" not in index.url  # never echo credentials
    await index.aclose()


def test_url_guard_details() -> None:
    check_url("redis://10.0.0.5", has_credentials=True)
    with pytest.raises(ConfigError, match="non-loopback"):
        check_url("redis://10.0.0.5")
    with pytest.raises(ConfigError, match="rediss"):
        RedisPrefixIndex("redis://127.0.0.1:6390", ssl_ca_certs="/nonexistent/ca.pem")


async def test_tls_and_password(make_index: Factory) -> None:
    """rediss:// with a verified self-signed certificate, and AUTH on a password server."""
    if not available():
        pytest.skip("redis-server is not installed")
    with RedisServer(tls=True) as tls_server:
        index = make_index(url=tls_server.url, ssl_ca_certs=tls_server.ca_file)
        await index.record_stored("r0", 1, Q)
        assert await index.flush()
        assert await index.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 10, 10)}
        await index.aclose()
    with RedisServer(password="s3cret-pw") as pw_server:
        good = make_index(url=pw_server.url)
        await good.record_stored("r0", 1, Q)
        assert await good.flush()
        assert await good.lookup(Q, [("r0", 1)]) == {"r0": PrefixMatch("r0", 10, 10)}
        bad = make_index(url=pw_server.url.replace(":s3cret-pw@", ""))
        assert await bad.lookup(Q, [("r0", 1)]) is None  # auth error = unknown, no raise
        assert bad.errors == 1
        await good.aclose()
        await bad.aclose()
