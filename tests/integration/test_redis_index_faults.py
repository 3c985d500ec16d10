"""RedisPrefixIndex when Redis dies, hangs and comes back.

What happens, asserted from the index's counters: a lookup that Redis cannot answer gives up
(unknown) and counts an error or a timeout; three of them open the breaker, which then refuses
without any I/O (no further error or timeout is counted); one half-open probe; writes never
suspend the caller (the call completes at its first step). How long each takes is measured by
`bench/index_faults.py` (docs/benchmarks.md), not asserted here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from index_check import without_suspending
from redis_server import RedisServer, free_port

from controlplane.hashing import BlockHasher
from controlplane.prefix.redis_index import RedisPrefixIndex
from controlplane.store.breaker import BreakerState
from controlplane.types import PrefixMatch

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

Factory = Callable[..., RedisPrefixIndex]
Q = BlockHasher(1).hash_blocks(list(range(64)))
CANDS = [("r0", 1), ("r1", 1)]
BUDGET_S = 0.025


def state(index: RedisPrefixIndex) -> BreakerState:
    return index.breaker_state  # a call, so that type checkers do not narrow it between checks


async def populated(make_index: Factory, **kwargs: object) -> RedisPrefixIndex:
    """An index holding r0's chain, checked with a generous budget, then given the real one."""
    index = make_index(lookup_budget_s=2.0, write_timeout_s=0.1, **kwargs)
    await index.record_stored("r0", 1, Q)
    assert await index.flush()
    assert await index.lookup(Q, CANDS) == {"r0": PrefixMatch("r0", 64, 64)}
    index.lookup_budget_s = BUDGET_S
    return index


async def recovered(index: RedisPrefixIndex, limit_s: float = 30.0) -> dict[str, PrefixMatch]:
    """Poll until a lookup answers again (how soon: bench/index_faults.py)."""
    deadline = time.monotonic() + limit_s
    while True:
        got = await index.lookup(Q, CANDS)
        if got is not None:
            return got
        assert time.monotonic() < deadline, "affinity never came back"
        await asyncio.sleep(0.02)


async def test_dead_redis_answers_unknown_and_costs_no_io(
    make_index: Factory, redis_server: RedisServer
) -> None:
    index = await populated(make_index, breaker_cooldown_s=30.0)
    redis_server.kill()
    for _ in range(3):  # three failures open the breaker
        assert await index.lookup(Q, CANDS) is None
    assert state(index) is BreakerState.OPEN
    assert index.errors + index.timeouts == 3

    for _ in range(1000):
        assert await index.lookup(Q, CANDS) is None
    assert index.errors + index.timeouts == 3  # no I/O at all while open: nothing else failed
    assert index.fallbacks == 1000
    assert index.unknown == 1003

    # writes never block the caller and are dropped (counted) while the breaker is open
    for i in range(100):
        assert without_suspending(index.record_stored("r0", 1, Q[i % 8 :]))
        assert without_suspending(index.speculate("r1", 1, Q, 5.0))
    assert await index.flush(2.0)
    assert index.writes_dropped == 200
    assert index.writes_failed == 0


async def test_hung_redis_lookups_time_out_and_writes_queue(
    make_index: Factory, redis_server: RedisServer
) -> None:
    index = await populated(make_index, breaker_cooldown_s=0.2)
    redis_server.pause()
    try:
        for _ in range(3):
            assert await index.lookup(Q, CANDS) is None
        assert index.timeouts == 3 and index.errors == 0  # each waited for the budget
        assert state(index) is BreakerState.OPEN

        # queued; the writer times out, not the caller
        assert without_suspending(index.record_stored("r1", 1, Q))
    finally:
        redis_server.resume()
    await asyncio.sleep(0.25)  # cool-down: the next lookup is the half-open probe
    assert await recovered(index) == {"r0": PrefixMatch("r0", 64, 64)}
    assert state(index) is BreakerState.CLOSED
    assert index.breaker.probes >= 1


async def test_exactly_one_half_open_probe(make_index: Factory, redis_server: RedisServer) -> None:
    index = await populated(make_index, breaker_cooldown_s=0.2)
    redis_server.pause()
    try:
        for _ in range(3):
            assert await index.lookup(Q, CANDS) is None
        assert state(index) is BreakerState.OPEN
        await asyncio.sleep(0.25)
        fallbacks, timeouts = index.fallbacks, index.timeouts
        results = await asyncio.gather(*(index.lookup(Q, CANDS) for _ in range(20)))
        assert all(got is None for got in results)
        assert index.breaker.probes == 1
        assert index.timeouts - timeouts == 1  # the probe went to Redis and timed out
        assert index.fallbacks - fallbacks == 19  # everybody else was refused at once
        assert state(index) is BreakerState.OPEN  # the failed probe re-opened it
    finally:
        redis_server.resume()


async def test_restart_recovers_and_new_entries_are_visible(
    make_index: Factory, redis_server: RedisServer
) -> None:
    index = await populated(make_index, breaker_cooldown_s=0.2)
    redis_server.kill()
    for _ in range(3):
        assert await index.lookup(Q, CANDS) is None
    assert state(index) is BreakerState.OPEN
    await index.record_stored("r1", 1, Q[:5])  # dropped or failed: Redis is gone
    assert await index.flush()

    redis_server.restart()  # same port, empty
    assert await recovered(index) == {}  # a fresh Redis knows nothing
    assert state(index) is BreakerState.CLOSED

    await index.record_stored("r1", 1, Q[:5])
    await index.speculate("r0", 1, Q[:9], 5.0)
    assert await index.flush()
    index.lookup_budget_s = 2.0  # from here on correctness, not timing
    assert await index.lookup(Q, CANDS) == {
        "r0": PrefixMatch("r0", 9, 0),
        "r1": PrefixMatch("r1", 5, 5),
    }
    assert index.writes_dropped + index.writes_failed == 1


async def test_a_clear_during_an_outage_is_applied_later(
    make_index: Factory, redis_server: RedisServer
) -> None:
    index = await populated(make_index, breaker_cooldown_s=0.2)
    await index.record_stored("r1", 1, Q[:3])
    assert await index.flush()
    redis_server.pause()
    try:
        await index.clear("r0")
        assert await index.flush(2.0)  # the write timed out; the clear is kept
        assert index.writes_failed + index.writes_dropped == 0
    finally:
        redis_server.resume()
    index.lookup_budget_s = 2.0
    deadline = time.monotonic() + 3.0
    while True:
        got = await index.lookup(Q, CANDS)
        if got == {"r1": PrefixMatch("r1", 3, 3)}:
            break
        assert time.monotonic() < deadline, f"clear not applied: {got}"
        await asyncio.sleep(0.05)


async def test_aclose_with_redis_hung_returns(
    make_index: Factory, redis_server: RedisServer
) -> None:
    """The flush gives up after its timeout and the sockets are dropped without waiting for the
    server (the fixture then checks that no task or connection is left)."""
    index = await populated(make_index)
    redis_server.pause()
    try:
        await index.record_stored("r0", 1, Q)
        await index.aclose(flush_timeout_s=0.2)
        assert await index.lookup(Q, CANDS) is None  # closed: unknown, no I/O
        dropped = index.writes_dropped
        assert without_suspending(index.record_stored("r1", 1, Q))
        assert index.writes_dropped == dropped + 1
    finally:
        redis_server.resume()


async def test_starts_and_answers_with_redis_unreachable(make_index: Factory) -> None:
    """G3: nothing listens on the port; construction succeeds, lookups are unknown at once."""
    index = make_index(url=f"redis://127.0.0.1:{free_port()}/0", lookup_budget_s=BUDGET_S)
    assert not await index.ping()
    for _ in range(5):
        assert await index.lookup(Q, CANDS) is None
    assert state(index) is BreakerState.OPEN
    assert index.errors + index.timeouts == 3 and index.fallbacks == 2
    await index.record_stored("r0", 1, Q)
    await index.clear("r0")
    assert await index.flush(1.0)
    assert index.writes_dropped == 1
