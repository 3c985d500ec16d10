"""Fake vLLM publishers -> ReplicaSubscriber -> EventIngestor -> InMemoryPrefixIndex lookups."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from controlplane.hashing import BlockHasher, scope_key, vllm_block_hashes
from controlplane.kvevents.ingest import EventIngestor
from controlplane.kvevents.subscriber import ReplicaSubscriber
from controlplane.kvevents.testing import FakePublisher, ReplayFormat
from controlplane.kvevents.wire import WireBlockRemoved, WireBlockStored
from controlplane.prefix.memory import InMemoryPrefixIndex

BS = 16
MODEL = "tiny"
SYSTEM = list(range(1000, 1032))  # a 2-block shared system prompt
A = SYSTEM + list(range(1, 33))
B = SYSTEM + list(range(500, 532))
C = SYSTEM[:16] + list(range(700, 748))


def engine(tokens: Sequence[int]) -> list[int]:
    return vllm_block_hashes(tokens, BS, seed="0")


def project(tokens: Sequence[int]) -> list[int]:
    return BlockHasher(BS, scope_key(MODEL)).hash_blocks(tokens)


def stored(tokens: Sequence[int], first_block: int = 0) -> WireBlockStored:
    """What vLLM publishes when a request fills blocks `first_block..` of `tokens`."""
    e = engine(tokens)
    parent = e[first_block - 1] if first_block else None
    return WireBlockStored(
        e[first_block:], parent, tokens[first_block * BS :], BS, medium="GPU", group_idx=0
    )


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.002)


def matches(index: InMemoryPrefixIndex, tokens: Sequence[int]) -> dict[str, int]:
    found = index.lookup(project(tokens), ["r0", "r1"])
    return {rid: m.matched_blocks for rid, m in sorted(found.items())}


async def test_events_drive_prefix_lookups() -> None:
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    pubs = [
        await FakePublisher(topic="kv@r0@tiny").start(),
        await FakePublisher(topic="kv@r1@tiny", replay_format=ReplayFormat.NO_TOPIC).start(),
    ]
    ingestors = [EventIngestor(f"r{i}", index, model=MODEL, block_size=BS) for i in range(2)]
    subs = [
        ReplicaSubscriber(
            ing.replica_id, pub.events_endpoint, ing,
            replay_endpoint=pub.replay_endpoint, topic=pub.topic,
        )
        for pub, ing in zip(pubs, ingestors, strict=True)
    ]  # fmt: skip
    p0, p1 = pubs
    s0, s1 = subs
    try:
        for sub, pub in zip(subs, pubs, strict=True):
            sub.start()
            await pub.wait_for_subscribers(1)
            await sub.wait_synced(5.0)

        # r0 serves A, then B (2 blocks hit: only blocks 2.. are new), r1 serves C
        await p0.publish([stored(A)])
        await p0.publish([stored(B, first_block=2)], send=False)  # lost on the wire
        await p1.publish([stored(C)])
        await until(lambda: s0.applied_seq == 0 and s1.applied_seq == 0)
        assert matches(index, A) == {"r0": 4, "r1": 1}
        assert matches(index, B) == {"r0": 2, "r1": 1}

        # the next batch exposes the gap; replay delivers B's blocks exactly once
        await p0.publish([WireBlockRemoved([engine(A)[3]], medium="GPU", group_idx=0)])
        await until(lambda: s0.applied_seq == 2)
        assert matches(index, A) == {"r0": 3, "r1": 1}
        assert matches(index, B) == {"r0": 4, "r1": 1}
        assert matches(index, C) == {"r0": 1, "r1": 4}
        assert s0.stats.gaps == 1 and s0.stats.lost == 0
        assert ingestors[0].stats.stored_blocks == 6

        # r1 restarts: its entries go, and come back from the new process's events
        p1.restart()
        await p1.publish([stored(A[:32])])
        await until(lambda: s1.stats.restarts == 1 and s1.applied_seq == 0)
        assert matches(index, C) == {"r0": 1, "r1": 1}
        assert matches(index, A) == {"r0": 3, "r1": 2}
        assert ingestors[1].incarnation == 1
    finally:
        for sub in subs:
            await sub.close()
        for pub in pubs:
            await pub.close()
    current = asyncio.current_task()
    assert not [t for t in asyncio.all_tasks() if t is not current and not t.done()]
