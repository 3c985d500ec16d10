"""End to end: a fleet's own KV events reach the Redis prefix index; real vLLM and the simulator.

The same client code and the same assertions run against two real vLLM CPU replicas of the tiny
model and against two simulated replicas launched alike (`deploy.local_fleet`). Requests that
share a long prefix go to replica r0 through the OpenAI SDK (prompts as token ids); the indexer
(`EventIndexer`: ZMQ subscribers + engine-to-project hash mapping) writes the blocks into a
private Redis; a lookup for a new request with that prefix must name r0 with the full-block match
within a second of the response, and must not once r0 cleared its prefix cache
(`AllBlocksCleared`) or restarted (its event sequence starts again at 0).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from redis_server import RedisServer
from vllm_fleet import vllm_missing_reason

from controlplane.hashing import BlockHasher, scope_key
from controlplane.kvevents.config import ReplicaSource
from controlplane.kvevents.service import EventIndexer
from controlplane.prefix.redis_index import RedisPrefixIndex
from controlplane.types import PrefixMatch
from deploy.local_fleet import FleetSpec, LocalFleet

pytestmark = [pytest.mark.redis, pytest.mark.timeout(900)]

MODEL = "tiny-llama"
BLOCK = 32
PREFIX_BLOCKS = 10
LEARN_WITHIN_S = 1.0
REPLICAS = ("r0", "r1")


@pytest.fixture(scope="module", params=["sim", "vllm"])
def fleet(request: pytest.FixtureRequest) -> Iterator[LocalFleet]:
    engine = request.param
    if engine == "vllm" and (why := vllm_missing_reason()) is not None:
        pytest.skip(why)
    spec = FleetSpec(
        replicas=2,
        engine=engine,
        base_port=0,
        model_name=MODEL,
        block_size=BLOCK,
        python_hash_seed="0",
        # both engines serve POST /reset_prefix_cache only in dev mode
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),),
        startup_timeout_s=420.0,
    )
    with LocalFleet(spec) as f:
        yield f


@pytest.fixture
async def indexed(
    fleet: LocalFleet, redis_server: RedisServer
) -> AsyncIterator[tuple[EventIndexer, RedisPrefixIndex]]:
    index = RedisPrefixIndex(redis_server.url, key_prefix="e2e", lookup_budget_s=1.0)
    sources = [
        ReplicaSource(
            replica_id=rid,
            events=rep.launch.events_connect,
            replay=rep.launch.replay_connect,
            topic=fleet.spec.topic,
            model=MODEL,
            block_size=BLOCK,
        )
        for rid, rep in zip(REPLICAS, fleet.replicas, strict=True)
    ]
    indexer = EventIndexer(sources, index)
    indexer.start()
    try:
        yield indexer, index
    finally:
        await indexer.close()
        await index.aclose()


def tokens(seed: int, n: int) -> list[int]:
    """Token ids of the tiny model's ordinary vocabulary (specials are 506-511)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def project_hashes(ids: list[int]) -> list[int]:
    return BlockHasher(BLOCK, scope_key(MODEL)).hash_blocks(ids)


async def complete(fleet: LocalFleet, replica: int, prompt: list[int]) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{fleet.urls[replica]}/v1", api_key="unused", max_retries=0
    ) as client:
        out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)


async def lookup(
    indexer: EventIndexer, index: RedisPrefixIndex, hashes: list[int]
) -> dict[str, PrefixMatch]:
    candidates = [(rid, indexer.ingestors[rid].incarnation) for rid in REPLICAS]
    got = await index.lookup(hashes, candidates)
    assert got is not None, "the index answered 'unknown' with Redis up"
    return got


async def wait_for(
    indexer: EventIndexer,
    index: RedisPrefixIndex,
    hashes: list[int],
    want: dict[str, PrefixMatch],
    within_s: float,
) -> float:
    t0 = time.monotonic()
    while True:
        got = await lookup(indexer, index, hashes)
        if got == want:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"index shows {got}, expected {want}"
        await asyncio.sleep(0.02)


async def learn_prefix(
    fleet: LocalFleet, indexer: EventIndexer, index: RedisPrefixIndex, seed: int
) -> list[int]:
    """Send two requests sharing a prefix to r0; the index must learn it within a second."""
    prefix = tokens(seed, PREFIX_BLOCKS * BLOCK)
    await complete(fleet, 0, prefix + tokens(seed + 1, 13))
    await complete(fleet, 0, prefix + tokens(seed + 2, 7))
    probe = project_hashes(prefix + tokens(seed + 3, 21))
    full = PrefixMatch("r0", PREFIX_BLOCKS, PREFIX_BLOCKS)
    await wait_for(indexer, index, probe, {"r0": full}, LEARN_WITHIN_S)
    return probe


async def test_index_learns_a_prefix_from_the_replicas_events(
    fleet: LocalFleet, indexed: tuple[EventIndexer, RedisPrefixIndex]
) -> None:
    indexer, index = indexed
    probe = await learn_prefix(fleet, indexer, index, seed=1)
    # the other replica holds nothing of it
    assert "r1" not in await lookup(indexer, index, probe)
    # a request with a different first block matches nowhere
    assert await lookup(indexer, index, project_hashes(tokens(99, 4 * BLOCK))) == {}


async def test_all_blocks_cleared_forgets_the_replica(
    fleet: LocalFleet, indexed: tuple[EventIndexer, RedisPrefixIndex]
) -> None:
    indexer, index = indexed
    probe = await learn_prefix(fleet, indexer, index, seed=11)
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.post(f"{fleet.urls[0]}/reset_prefix_cache")
    assert resp.status_code == 200 and resp.json() == {"success": True}
    # vLLM publishes the queued AllBlocksCleared with its next step's batch: make it step
    await complete(fleet, 0, tokens(13, BLOCK))
    await wait_for(indexer, index, probe, {}, within_s=LEARN_WITHIN_S)


async def test_restart_forgets_the_replica(
    fleet: LocalFleet, indexed: tuple[EventIndexer, RedisPrefixIndex]
) -> None:
    indexer, index = indexed
    probe = await learn_prefix(fleet, indexer, index, seed=21)
    before = indexer.ingestors["r0"].incarnation
    await asyncio.to_thread(fleet.restart, 0)
    # the new process publishes from sequence 0: the indexer purges r0 and moves to a new
    # incarnation as soon as it hears from it. Its first batches can be lost while the SUB socket
    # reconnects (ZMQ's slow joiner), so keep making it speak until one arrives.
    deadline = time.monotonic() + 60
    seed = 31
    while indexer.ingestors["r0"].incarnation == before:
        assert time.monotonic() < deadline, "the indexer never noticed the restart"
        await complete(fleet, 0, tokens(seed, 3 * BLOCK))
        seed += 1
        await asyncio.sleep(0.1)
    await wait_for(indexer, index, probe, {}, within_s=LEARN_WITHIN_S)
    # and it learns again from the new incarnation
    await learn_prefix(fleet, indexer, index, seed=41)
