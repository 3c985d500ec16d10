"""A burst of calls to a healthy Redis store is no outage, whatever the caller's own queueing.

Each request first does the router's own work (tokenize and hash a 4 KB prompt with the approximate
tokenizer: a couple of milliseconds), as hundreds of concurrent requests do in one event loop;
then it calls the store. A private redis-server answers in well under a millisecond, so any
request refused for "the store is unreachable" was refused for the caller's queueing, not for
Redis:

- 200 concurrent reservations of one hard-quota tenant, with the production budget (250 ms):
  none is refused with QuotaUnavailable, the breaker stays closed, all 200 are in Redis;
- 600 concurrent prefix-index lookups with a 100 ms budget: none comes back unknown, the breaker
  stays closed, and they travel in far fewer round trips than lookups (pipelined).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from controlplane.errors import QuotaUnavailableError
from controlplane.hashing import BlockHasher
from controlplane.prefix.redis_index import RedisPrefixIndex
from controlplane.store.breaker import BreakerState
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import Reservation
from controlplane.tenancy.quota_redis import RedisQuotaStore
from controlplane.tokenization import approx_token_ids
from controlplane.types import PrefixMatch

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

HASHER = BlockHasher(16)
Q = BlockHasher(1).hash_blocks(list(range(64)))


def router_work(i: int) -> int:
    """What the router does for a request before it calls a store: tokens and block hashes."""
    prompt = " ".join(f"request {i} asks about item {j}, with details." for j in range(100))
    ids = approx_token_ids(prompt)
    HASHER.hash_blocks(ids)
    return len(ids)


async def test_a_burst_of_hard_quota_reservations_is_no_outage(
    make_store: Callable[..., RedisQuotaStore],
) -> None:
    store = make_store(timeout_s=0.25)  # the production budget (quota.timeout_ms)
    tenant = Tenant("burst", quota_tokens=10_000_000, quota_window_s=600.0, quota_mode="hard")

    async def request(i: int) -> Reservation | None:
        prompt = router_work(i)
        try:
            res = await store.reserve(tenant, prompt, 64, default_cap=64)
        except QuotaUnavailableError:
            return None
        for _ in range(3):  # then the rest: routing, the upstream request (others wait for Redis)
            router_work(i)
        return res

    got = await asyncio.gather(*(request(i) for i in range(200)))
    unavailable = sum(r is None for r in got)
    assert unavailable == 0, f"{unavailable} of 200 refused as QuotaUnavailable"
    assert store.breaker.state is BreakerState.CLOSED and store.fallbacks == 0
    stats = await store.stats("burst")
    assert (stats.reserved, stats.open) == (200, 200)
    for res in got:
        assert res is not None
        await store.settle(res, 0)


async def test_a_burst_of_index_lookups_is_no_outage(
    make_index: Callable[..., RedisPrefixIndex],
) -> None:
    index = make_index(lookup_budget_s=0.1)
    await index.record_stored("r0", 1, Q)
    assert await index.flush()
    cands = [("r0", 1), ("r1", 1)]
    trips = index.round_trips

    async def request(i: int) -> dict[str, PrefixMatch] | None:
        router_work(i)
        return await index.lookup(Q, cands)

    got = await asyncio.gather(*(request(i) for i in range(600)))
    unknown = sum(g is None for g in got)
    assert unknown == 0, f"{unknown} of 600 lookups came back unknown"
    assert all(g == {"r0": PrefixMatch("r0", 64, 64)} for g in got)
    assert index.breaker_state is BreakerState.CLOSED and index.unknown == 0
    assert index.round_trips - trips < 600 // 4  # pipelined: a few round trips, not one each
