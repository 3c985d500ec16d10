"""The fleet registry's Redis backend against a private real Redis: concurrent writers from
several registries all land (WATCH/MULTI retries), a follower waiting for a change wakes on
another process's update, and closing leaves no connection behind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from redis_server import RedisServer

from router.fleet.lifecycle import Lifecycle
from router.fleet.membership import Member
from router.fleet.registry import FleetRegistry
from router.fleet.registry_redis import RedisBackend
from router.fleet.urls import ReplicaGuard

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def registry(url: str) -> FleetRegistry:
    return FleetRegistry(RedisBackend(url, "test:fleet"), ReplicaGuard(), drain_s=60.0, ttl_s=10.0)


def clients(admin: redis.Redis) -> int:
    found: list[dict[str, Any]] = admin.client_list()
    return sum(1 for c in found if c.get("name") == "cp-fleet-registry")


async def test_concurrent_sources_all_land_and_followers_wake(
    redis_server: RedisServer, redis_admin: redis.Redis
) -> None:
    regs = [registry(redis_server.url) for _ in range(4)]
    try:
        start = await regs[0].load()
        waiter = asyncio.create_task(regs[3].backend.wait_change(start.version, 30.0))
        members = [
            [Member(f"s{i}-r{j}", f"http://10.0.{i}.{j}:8000") for j in range(5)] for i in range(3)
        ]
        await asyncio.gather(
            *(r.set_members(f"src{i}", members[i]) for i, r in enumerate(regs[:3]))
        )
        # woken by a notification; had it subscribed late, the version check returns at once
        await asyncio.wait_for(waiter, 30.0)
        snap = await regs[3].load()
        assert len(snap.records) == 15 and snap.version == 3
        assert {r.state for r in snap.records.values()} == {Lifecycle.LOADING}
        assert all(r.sources == (f"src{r.replica_id[1]}",) for r in snap.records.values())
        # one source withdraws everything: only its members drain
        await regs[1].set_members("src1", [])
        snap = await regs[2].load()
        draining = {i for i, r in snap.records.items() if r.state is Lifecycle.DRAINING}
        assert draining == {f"s1-r{j}" for j in range(5)}
    finally:
        for r in regs:
            await r.aclose()
    async with asyncio.timeout(10):  # the server sees every connection close
        while clients(redis_admin):
            await asyncio.sleep(0.02)


async def test_several_waiters_on_one_backend_all_wake(redis_server: RedisServer) -> None:
    """A router's follower and an admin call waiting for a drain share one backend: both wake
    on one update, and neither trips over the other reading the channel."""
    follower, writer = registry(redis_server.url), registry(redis_server.url)
    try:
        version = (await follower.load()).version
        waits = [asyncio.create_task(follower.backend.wait_change(version, 30.0)) for _ in range(3)]
        await writer.set_members("static", [Member("r1", "http://10.0.0.1:8000")])
        done, pending = await asyncio.wait(waits, timeout=30.0)
        assert not pending and all(t.exception() is None for t in done)
    finally:
        await follower.aclose()
        await writer.aclose()
