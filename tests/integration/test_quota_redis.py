"""RedisQuotaStore against a private redis-server: the check-and-add is atomic under concurrent
reservations from many asyncio tasks and from several processes, a reservation settles exactly
once however many settles race, a dead router's reservations expire (charged in full) and its
heartbeat goes, the scripts agree with the in-memory store on every window decision, and with
Redis down a hard quota answers 503 while a soft one admits at most this router's share."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
from redis_server import RedisServer

from controlplane.errors import QuotaExceededError, QuotaUnavailableError
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import QuotaReason, Reservation, SettleOutcome, WindowKind
from controlplane.tenancy.quota_memory import MemoryQuotaStore
from controlplane.tenancy.quota_redis import RedisQuotaStore
from deploy.processes import Child, spawn

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

Factory = Callable[..., RedisQuotaStore]


async def clear_of_window_boundary(window_s: float = 600.0, margin_s: float = 20.0) -> None:
    """Fixed windows start at multiples of `window_s` (epoch time): a test that must stay in one
    window waits out a boundary less than `margin_s` away instead of straddling it."""
    left = window_s - time.time() % window_s
    if left < margin_s:
        await asyncio.sleep(left + 0.1)


async def try_reserve(
    store: RedisQuotaStore | MemoryQuotaStore, t: Tenant, prompt: int, max_tokens: int | None
) -> Reservation | QuotaReason:
    try:
        res = await store.reserve(t, prompt, max_tokens, default_cap=64)
    except QuotaExceededError as exc:
        return QuotaReason(exc.reason)
    assert res is not None
    return res


async def test_concurrent_reservations_never_exceed_the_quota(make_store: Factory) -> None:
    await clear_of_window_boundary()
    stores = [make_store() for _ in range(4)]  # four routers' stores, one event loop
    t = Tenant("acme", quota_tokens=5000, quota_window_s=600.0)
    rng = random.Random(7)
    asks = [(rng.randint(1, 80), rng.choice([None, rng.randint(1, 120)])) for _ in range(400)]
    got = await asyncio.gather(
        *(try_reserve(stores[i % 4], t, p, m) for i, (p, m) in enumerate(asks))
    )
    admitted = [r for r in got if isinstance(r, Reservation)]
    assert sum(r.amount for r in admitted) <= 5000
    assert len(admitted) < len(asks)  # the quota was the binding constraint
    assert sum(r.amount for r in admitted) > 5000 - 200  # and was (nearly) filled
    stats = await stores[0].stats("acme")
    assert (stats.reserved, stats.open) == (len(admitted), len(admitted))
    assert stats.rejected == len(asks) - len(admitted)
    assert len({r.reservation_id for r in admitted}) == len(admitted)


PROCESS = textwrap.dedent(
    """
    import asyncio, json, sys
    from controlplane.tenancy.model import Tenant
    from controlplane.tenancy.quota_redis import RedisQuotaStore
    from controlplane.errors import QuotaExceededError

    async def main(url, n, seed, ttl):
        store = RedisQuotaStore(url, timeout_s=5.0, reservation_ttl_s=ttl, heartbeat_s=ttl / 3)
        t = Tenant("acme", quota_tokens=3000, quota_window_s=600.0)
        async def one(i):
            try:
                r = await store.reserve(t, 10 + (seed * 7 + i) % 40, 30, default_cap=64)
                return r.amount
            except QuotaExceededError:
                return 0
        amounts = await asyncio.gather(*(one(i) for i in range(n)))
        print(json.dumps(amounts), flush=True)
        if ttl < 100:  # play dead: hold the reservations until killed
            await store.heartbeat()
            print("holding", flush=True)
            await asyncio.sleep(600)
        await store.aclose()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
    """
)


def store_process(url: str, n: int, seed: int, ttl: float = 900.0) -> Child:
    argv = [sys.executable, "-c", PROCESS, url, str(n), str(seed), str(ttl)]
    return spawn(argv, stdout=subprocess.PIPE)


async def test_reservations_from_several_processes_never_exceed_the_quota(
    make_store: Factory, redis_server: RedisServer
) -> None:
    await clear_of_window_boundary()
    procs = [store_process(redis_server.url, 40, seed) for seed in range(3)]
    outs = [p.proc.communicate(timeout=30)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    amounts = [a for out in outs for a in json.loads(out.splitlines()[0])]
    admitted = [a for a in amounts if a]
    assert sum(admitted) <= 3000 < sum(10 + 30 for _ in amounts)
    stats = await make_store().stats("acme")
    assert stats.reserved == len(admitted) and stats.rejected == len(amounts) - len(admitted)


async def test_a_reservation_settles_exactly_once(make_store: Factory) -> None:
    await clear_of_window_boundary()
    a, b = make_store(), make_store()
    t = Tenant("acme", quota_tokens=1000, quota_window_s=600.0)
    res = await a.reserve(t, 20, 80, default_cap=64)
    assert res is not None and res.amount == 100
    outcomes = await asyncio.gather(*(s.settle(res, 30) for s in [a, b] * 10))
    assert outcomes.count(SettleOutcome.SETTLED) == 1
    assert outcomes.count(SettleOutcome.DUPLICATE) == 19
    ghost = Reservation("acme", 10_000, 1, 1, 1, 1, 1, 0.0, "redis", 600.0)
    assert await a.settle(ghost, 1) is SettleOutcome.UNKNOWN
    nxt = await a.reserve(t, 0, 970, default_cap=64)  # 30 used + 970 = the quota exactly
    assert nxt is not None and nxt.remaining == 0
    stats = await b.stats("acme")
    assert (stats.reserved, stats.settled, stats.duplicate, stats.unknown) == (2, 1, 19, 1)
    assert stats.open == 1 and stats.missing == 0


async def test_a_dead_routers_reservations_expire_and_its_heartbeat_goes(
    make_store: Factory, redis_server: RedisServer
) -> None:
    await clear_of_window_boundary()
    live = make_store(heartbeat_s=0.2)
    assert await live.heartbeat() == 1
    # reserves 5 x (prompt + 30), then hangs
    # a TTL long enough that a loaded machine reads its output before anything expires
    dead = store_process(redis_server.url, 5, 0, ttl=2.0)
    assert dead.stdout is not None
    held = json.loads(dead.stdout.readline())
    assert dead.stdout.readline().strip() == b"holding"
    assert await live.heartbeat() == 2
    dead.kill()  # SIGKILL, reaped, its pipe closed
    t = Tenant("acme", quota_tokens=3000, quota_window_s=600.0)
    stats = await live.stats("acme")
    assert stats.open == 5
    await asyncio.sleep(2.3)  # past the reservations' TTL and the dead heartbeat's (3 x ttl / 3)
    stats = await live.stats("acme")
    assert (stats.open, stats.expired, stats.settled) == (0, 5, 0)
    res = await live.reserve(t, 0, 1, default_cap=64)
    assert res is not None and res.remaining == 3000 - sum(held) - 1  # charged in full
    assert await live.heartbeat() == 1


@pytest.mark.parametrize("kind", [WindowKind.FIXED, WindowKind.SLIDING])
async def test_scripts_agree_with_the_memory_store(make_store: Factory, kind: WindowKind) -> None:
    """The same random sequence (whole seconds, so both clocks agree) through both stores."""
    now = [1_000_000]
    red = make_store(window=kind, reservation_ttl_s=25.0, clock_override_ms=lambda: now[0] * 1000)
    mem = MemoryQuotaStore(window=kind, reservation_ttl_s=25.0, clock=lambda: float(now[0]))
    t = Tenant("acme", quota_tokens=400, quota_window_s=30.0)
    rng = random.Random(11)
    held: list[tuple[Reservation, Reservation]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            p, m = rng.randint(0, 60), rng.choice([None, rng.randint(1, 90)])
            try:
                r1 = await red.reserve(t, p, m, default_cap=50)
                ok1: Any = r1
            except QuotaExceededError as exc:
                ok1 = (exc.reason, exc.response_headers())
            try:
                r2 = await mem.reserve(t, p, m, default_cap=50)
                ok2: Any = r2
            except QuotaExceededError as exc:
                ok2 = (exc.reason, exc.response_headers())
            if isinstance(ok1, Reservation):
                assert isinstance(ok2, Reservation)
                assert (ok1.amount, ok1.max_tokens, ok1.remaining, ok1.reset_s) == (
                    ok2.amount,
                    ok2.max_tokens,
                    ok2.remaining,
                    ok2.reset_s,
                )
                held.append((ok1, ok2))
            else:
                assert ok1 == ok2
        elif op < 0.8 and held:
            r1, r2 = held.pop(rng.randrange(len(held)))
            used = rng.randint(0, r1.amount)
            assert await red.settle(r1, used) == await mem.settle(r2, used)
        else:
            now[0] += rng.randint(0, 12)
    s1, s2 = await red.stats("acme"), await mem.stats("acme")
    assert s1 == s2


async def test_redis_down_hard_fails_closed_soft_admits_its_share(
    make_store: Factory, redis_server: RedisServer
) -> None:
    a, b = make_store(timeout_s=0.2), make_store(timeout_s=0.2)
    assert await a.heartbeat() == 1 and await b.heartbeat() == 2
    assert await a.heartbeat() == 2  # a knows of two live routers
    hard = Tenant("h", quota_tokens=1000, quota_mode="hard")
    soft = Tenant("s", quota_tokens=1000, quota_mode="soft")
    assert await a.reserve(hard, 10, 10, default_cap=64) is not None
    redis_server.kill()
    with pytest.raises(QuotaUnavailableError) as info:
        await a.reserve(hard, 10, 10, default_cap=64)
    assert info.value.status_code == 503
    assert a.degraded_reason is None or "unreachable" in a.degraded_reason
    admitted = 0
    for _ in range(40):  # 40 x 50 = 2000 asked; this router's share is 1000 // 2
        try:
            res = await a.reserve(soft, 10, 40, default_cap=64)
        except QuotaExceededError as exc:
            assert exc.reason == "local_share"
            continue
        assert res is not None and res.store == "local"
        admitted += res.amount
    assert admitted == 500
    assert a.degraded_reason == "quota store unreachable"  # the breaker opened
    with pytest.raises(QuotaUnavailableError):
        await a.reserve(hard, 10, 10, default_cap=64)  # at once now: the breaker is open
    fresh = make_store(timeout_s=0.2, expected_routers=4)  # never reached Redis: assumes 4
    got = 0
    for _ in range(10):
        try:
            res = await fresh.reserve(soft, 10, 40, default_cap=64)
            assert res is not None
            got += res.amount
        except QuotaExceededError:
            pass
    assert got == 250
