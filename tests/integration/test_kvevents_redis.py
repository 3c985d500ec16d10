"""Fake vLLM publisher -> EventIndexer -> RedisPrefixIndex on a private redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest
from redis_server import RedisServer, available

from controlplane.hashing import BlockHasher, scope_key, vllm_block_hashes
from controlplane.kvevents.config import ReplicaSource
from controlplane.kvevents.service import EventIndexer
from controlplane.kvevents.testing import FakePublisher
from controlplane.kvevents.wire import WireBlockRemoved, WireBlockStored
from controlplane.prefix.redis_index import RedisPrefixIndex

pytestmark = [
    pytest.mark.redis,
    pytest.mark.timeout(60),
    pytest.mark.skipif(not available(), reason="redis-server not installed"),
]

BS = 16
TOKENS = list(range(200, 264))  # 4 blocks
ENGINE = vllm_block_hashes(TOKENS, BS, seed="0")
PROJECT = BlockHasher(BS, scope_key("m")).hash_blocks(TOKENS)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


async def until_async(cond: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_events_reach_redis_under_the_replica_incarnation(server: RedisServer) -> None:
    index = RedisPrefixIndex(server.url, key_prefix="test:kv")
    pub = await FakePublisher().start()
    src = ReplicaSource("r0", pub.events_endpoint, "m", replay=pub.replay_endpoint, block_size=BS)
    incarnations = iter([100, 200])
    indexer = EventIndexer([src], index, initial_incarnation=lambda: next(incarnations))
    try:
        async with indexer:
            await pub.wait_for_subscribers(1)
            await indexer.subscribers["r0"].wait_synced(5.0)
            await pub.publish([WireBlockStored(ENGINE, None, TOKENS, BS)])
            await pub.publish([WireBlockRemoved([ENGINE[3]])])

            async def matched(inc: int, n: int) -> bool:
                await index.flush(2.0)
                found = await index.lookup(PROJECT, [("r0", inc)])
                got = found.get("r0") if found else None
                return (got.matched_blocks if got else 0) == n

            await until_async(lambda: matched(100, 3))
            # the replica restarts: its entries go, the new incarnation fills in again
            pub.restart()
            await pub.publish([WireBlockStored(ENGINE[:2], None, TOKENS[:32], BS)])
            await until_async(lambda: matched(200, 2))
            assert await matched(100, 0)
            assert indexer.ingestors["r0"].incarnation == 200
    finally:
        await index.aclose(flush_timeout_s=1.0)
        await pub.close()
