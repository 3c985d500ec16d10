"""The router's fair queue over a fake fleet: the fast path, capacity gating, fairness between
tenants by work (and weights), interactive before batch, the batch KV share, bounded queues,
cancellation, exactly-once release, and nothing left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from controlplane.errors import CapacityError, NoReadyReplicaError
from controlplane.roofline.profile import profile
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.work import WorkModel
from controlplane.types import (
    EngineMetrics,
    FleetSnapshot,
    PriorityClass,
    ReplicaState,
    RoutingRequest,
)
from router.fairness.queue import FairQueue, QueueFullError, TenantQueueFullError, Ticket

PROFILE = profile("h100", "llama-3.1-8b")
A, B = Tenant("A"), Tenant("B")
BATCH = Tenant("bulk", priority=PriorityClass.BATCH)


class Fleet:
    def __init__(self, replicas: int = 1, running_elsewhere: int = 0) -> None:
        self.replicas = replicas
        self.running_elsewhere = running_elsewhere

    def __call__(self) -> FleetSnapshot:
        metrics = EngineMetrics(running=self.running_elsewhere)
        return FleetSnapshot(
            tuple(ReplicaState(f"r{i}", PROFILE, metrics=metrics) for i in range(self.replicas))
        )


def req(prompt: int = 100, out: int = 50) -> RoutingRequest:
    return RoutingRequest(request_id="x", prompt_tokens=prompt, max_tokens=out)


def queue(slots: int = 2, fleet: Fleet | None = None, **cfg: object) -> FairQueue:
    config = FairnessConfig(slots_per_replica=slots, **cfg)  # type: ignore[arg-type]
    return FairQueue(config, fleet or Fleet())


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_admits_at_once_while_there_is_room_then_queues() -> None:
    q = queue(slots=2)
    t1 = await q.acquire(A, req())
    t2 = await q.acquire(A, req())
    assert t1.admitted and t2.admitted and q.admitted == 2
    third = asyncio.create_task(q.acquire(A, req()))
    await settle()
    assert not third.done() and q.queued == 1
    q.release(t1)
    t3 = await asyncio.wait_for(third, 1)
    assert t3.admitted and q.queued == 0 and q.admitted == 2
    q.release(t2)
    q.release(t3)
    q.release(t3)  # a second release changes nothing
    assert q.admitted == 0


async def test_other_routers_work_takes_slots() -> None:
    q = queue(slots=4, fleet=Fleet(running_elsewhere=3))
    await q.acquire(A, req())
    waiting = asyncio.create_task(q.acquire(A, req()))
    await settle()
    assert not waiting.done()
    waiting.cancel()
    await settle()
    assert q.queued == 0


async def _drain_order(
    q: FairQueue, holder: Ticket, waiters: Sequence[asyncio.Task[Ticket]]
) -> list[str]:
    """Release the slot holder, then each admitted waiter in turn; the admission order."""
    order: list[str] = []
    q.release(holder)
    pending = list(waiters)
    while pending:
        await settle()
        done = [t for t in pending if t.done()]
        assert len(done) == 1
        ticket = done[0].result()
        order.append(ticket.tenant.tenant_id)
        pending.remove(done[0])
        q.release(ticket, output_tokens=50)
    return order


@pytest.mark.parametrize("mode", ["vtc", "vtc-roofline"])
async def test_a_light_tenant_is_not_stuck_behind_a_flood(mode: str) -> None:
    q = queue(slots=1, mode=mode)
    holder = await q.acquire(A, req(prompt=16_000))
    flood = [asyncio.create_task(q.acquire(A, req(prompt=16_000))) for _ in range(4)]
    await settle()
    light = [asyncio.create_task(q.acquire(B, req(prompt=200))) for _ in range(4)]
    await settle()
    order = await _drain_order(q, holder, [*flood, *light])
    # B arrives lifted to A's counter (no banked credit), so at most one of A's 16k-token
    # documents (charged in full) goes before all of B's short requests
    assert order[:5].count("B") == 4, order
    assert q.admitted == 0 and q.queued == 0


async def test_request_fair_mode_alternates_by_request() -> None:
    q = queue(slots=1, mode="request")
    holder = await q.acquire(A, req(prompt=16_000))
    flood = [asyncio.create_task(q.acquire(A, req(prompt=16_000))) for _ in range(3)]
    await settle()
    light = [asyncio.create_task(q.acquire(B, req(prompt=200))) for _ in range(3)]
    await settle()
    order = await _drain_order(q, holder, [*flood, *light])
    # one request each in turn, whatever their sizes
    assert all(order[i] != order[i + 1] for i in range(len(order) - 1)), order


async def test_weights_divide_charges() -> None:
    heavy = Tenant("heavy", weight=3.0)
    q = queue(slots=1, mode="vtc")
    holder = await q.acquire(A, req())
    a = [asyncio.create_task(q.acquire(A, req())) for _ in range(8)]
    await settle()
    h = [asyncio.create_task(q.acquire(heavy, req())) for _ in range(8)]
    await settle()
    order = await _drain_order(q, holder, [*a, *h])
    # with three times the weight, "heavy" gets about three of every four turns early on
    assert order[:8].count("heavy") >= 5


async def test_interactive_goes_before_batch() -> None:
    q = queue(slots=1)
    holder = await q.acquire(A, req())
    bulk = [asyncio.create_task(q.acquire(BATCH, req(prompt=10))) for _ in range(3)]
    await settle()
    chat = [asyncio.create_task(q.acquire(B, req(prompt=5000))) for _ in range(2)]
    await settle()
    order = await _drain_order(q, holder, [*bulk, *chat])
    assert order == ["B", "B", "bulk", "bulk", "bulk"]


async def test_batch_holds_at_most_its_kv_share() -> None:
    kv = PROFILE.num_gpu_blocks * PROFILE.resolved_block_size
    q = queue(slots=100, batch_kv_share=0.1, prefill_steps=0)  # no prefill gate here
    size = int(kv * 0.04)
    first = await q.acquire(BATCH, req(prompt=size - 50))
    second = await q.acquire(BATCH, req(prompt=size - 50))
    third = asyncio.create_task(q.acquire(BATCH, req(prompt=size - 50)))
    await settle()
    assert not third.done()  # 3 x 4% > 10%
    chat = await q.acquire(A, req())  # interactive still has room
    q.release(first)
    assert (await asyncio.wait_for(third, 1)).admitted
    for t in (second, chat, third.result()):
        q.release(t)
    assert q.batch_tokens == 0


async def test_bounded_queues() -> None:
    q = queue(slots=1, max_queued_total=3)
    small = Tenant("small", max_queued=1)
    holder = await q.acquire(A, req())
    w1 = asyncio.create_task(q.acquire(small, req()))
    await settle()
    with pytest.raises(TenantQueueFullError):
        await q.acquire(small, req())
    w2 = [asyncio.create_task(q.acquire(B, req())) for _ in range(2)]
    await settle()
    with pytest.raises(QueueFullError):
        await q.acquire(Tenant("C"), req())
    for t in (w1, *w2):
        t.cancel()
    await settle()
    assert q.queued == 0
    q.release(holder)
    assert q.admitted == 0


async def test_close_fails_waiters() -> None:
    q = queue(slots=1)
    await q.acquire(A, req())
    waiting = asyncio.create_task(q.acquire(B, req()))
    await settle()
    await q.aclose()
    with pytest.raises(CapacityError):
        await waiting


async def test_off_mode_bypasses_everything() -> None:
    q = queue(slots=1, mode="off")
    tickets = [await q.acquire(A, req()) for _ in range(5)]
    assert all(t.admitted for t in tickets) and q.admitted == 0


@pytest.mark.parametrize(
    ("mode", "short_vs_long"),
    [("vtc", "linear"), ("vtc-roofline", "grows"), ("request", "flat")],
)
def test_work_units(mode: str, short_vs_long: str) -> None:
    units = WorkModel.build(mode, PROFILE)
    short, long_ = units.decode(100, 1000), units.decode(100, 30_000)
    if short_vs_long == "grows":
        assert long_ > short > 0  # decode cost grows with context
        assert units.prefill(16_000) > 20 * units.prefill(200)
    elif short_vs_long == "linear":
        assert long_ == short == 100 and units.prefill(16_000) == 16_000
    else:
        assert units.prefill(16_000) == units.prefill(200) == 1.0 and long_ == 0


async def test_a_waiter_cancelled_before_it_resumes_never_holds_a_slot() -> None:
    q = queue(slots=1)
    holder = await q.acquire(A, req())
    waiter = asyncio.create_task(q.acquire(B, req()))
    await settle()
    waiter.cancel()  # its future is cancelled now; its task resumes only later
    q.release(holder)  # dispatch runs before the cancelled task does
    await settle()
    assert waiter.cancelled() and q.admitted == 0 and q.queued == 0


async def test_the_prefill_gate_spreads_long_prompts_and_opens_at_the_first_token() -> None:
    q = queue(slots=100, fleet=Fleet(replicas=2))
    doc1 = await q.acquire(A, req(prompt=32_000))
    doc2 = await q.acquire(A, req(prompt=32_000))
    assert doc1.room == frozenset({"r0", "r1"})
    assert doc2.room is not None and len(doc2.room) == 1  # the other replica: r0 is prefilling
    q.place(doc1, "r0", PROFILE)
    q.place(doc2, next(iter(doc2.room)), PROFILE)
    doc3 = asyncio.create_task(q.acquire(A, req(prompt=32_000)))
    chat = asyncio.create_task(q.acquire(B, req(prompt=200)))
    await settle()
    assert not doc3.done()  # every replica has a long prompt ahead of its first chunk
    assert not chat.done()  # vLLM's default chunking: the document takes every step's budget
    q.first_token(doc1)  # its prefill is done: r0 takes the next prompt (one: it is long)
    done, pending = await asyncio.wait({doc3, chat}, timeout=1, return_when="FIRST_COMPLETED")
    assert len(done) == 1 and len(pending) == 1
    first = done.pop().result()
    assert first.room == frozenset({"r0"})
    q.place(first, "r0", PROFILE)
    q.first_token(first)
    second = await asyncio.wait_for(pending.pop(), 1)
    assert second.room == frozenset({"r0"})
    for t in (doc1, doc2, first, second):
        q.release(t)
    assert q.admitted == 0 and not any(b.requests for b in q.core.replicas.values())


async def test_no_routable_replica_is_a_503_at_once_not_a_wait() -> None:
    q = queue(fleet=Fleet(replicas=0))
    with pytest.raises(NoReadyReplicaError):
        await asyncio.wait_for(q.acquire(A, req()), 1)
    assert q.queued == 0


async def test_a_waiter_admitted_as_its_caller_leaves_gives_its_slot_back() -> None:
    q = queue(slots=1)
    holder = await q.acquire(A, req())
    waiter = asyncio.create_task(q.acquire(B, req()))
    await settle()
    q.release(holder)  # dispatch admits the waiter (its future is done) ...
    waiter.cancel()  # ... and its caller leaves before the task resumes
    await settle()
    assert waiter.cancelled() and q.admitted == 0 and q.queued == 0
    assert not any(b.requests for b in q.core.replicas.values())
