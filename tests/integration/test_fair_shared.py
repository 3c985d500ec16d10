"""The fair queue shared by several routers, against a private redis-server: two routers' queues
(one event loop, fake fleets) admit in the fleet-wide fair order, a dead router's backlog and
slots are swept once its heartbeat expires, a charge batch whose reply was lost applies once,
the shared state stays consistent under any sequence of events (Hypothesis), and with Redis
killed a router falls back to local fairness and reports it, then shares again once Redis is
back."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_server import RedisServer

from controlplane.roofline.profile import profile
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.fair_redis import Head, Reply, RouterState, SharedFairStore, SharedView
from controlplane.tenancy.model import Tenant
from controlplane.types import FleetSnapshot, PriorityClass, ReplicaState, RoutingRequest
from router.config import load_settings
from router.fairness.queue import FairQueue, Ticket
from router.fairness.shared import SharedFairQueue, fair_queue_for, fast_room

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

PROFILE = profile("h100", "llama-3.1-8b")
CLIENT = "cp-test-fair"
A, B = Tenant("A"), Tenant("B")
BULK = Tenant("bulk", priority=PriorityClass.BATCH)


def fleet(replicas: int = 1) -> Callable[[], FleetSnapshot]:
    snap = FleetSnapshot(tuple(ReplicaState(f"r{i}", PROFILE) for i in range(replicas)))
    return lambda: snap


def req(prompt: int = 100, out: int = 10) -> RoutingRequest:
    """A request predicted to produce `out` tokens (its KV reservation: prompt + out)."""
    return RoutingRequest(
        request_id="x", prompt_tokens=prompt, max_tokens=out, predicted_output_tokens=out
    )


Factory = Callable[..., SharedFairQueue]


@pytest.fixture
async def make_queue(redis_server: RedisServer) -> AsyncIterator[Factory]:
    """Shared queues (routers) on the private server; teardown closes them and checks nothing
    was left behind: no task, no connection."""
    before = asyncio.all_tasks()
    made: list[SharedFairQueue] = []

    def factory(slots: int = 1, replicas: int = 1, **kw: Any) -> SharedFairQueue:
        knobs = ("timeout_s", "router_ttl_s", "breaker_cooldown_s")
        store_kw = {k: kw.pop(k) for k in knobs if k in kw}
        store_kw.setdefault("timeout_s", 2.0)  # semantics must not depend on machine load
        cfg = FairnessConfig(slots_per_replica=slots, mode="vtc", **kw)
        store = SharedFairStore(redis_server.url, client_name=CLIENT, **store_kw)
        q = SharedFairQueue(cfg, fleet(replicas), store)
        made.append(q)
        return q

    yield factory
    for q in made:
        await q.aclose()
    await asyncio.sleep(0)
    leaked = {t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()}
    assert not {t for t in leaked if not t.done()}, f"leaked tasks: {leaked}"
    if redis_server.running:
        admin = redis.Redis.from_url(redis_server.url, socket_timeout=2)
        try:
            clients: list[dict[str, Any]] = admin.client_list()
            assert not [c for c in clients if c.get("name") == CLIENT], "connections left open"
        finally:
            admin.close()


async def until(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.01)


async def until_view(
    store: SharedFairStore, pred: Callable[[SharedView], bool], timeout_s: float = 10.0
) -> SharedView:
    async with asyncio.timeout(timeout_s):
        while not pred(view := await store.view()):
            await asyncio.sleep(0.01)
    return view


async def drain(
    waiters: dict[asyncio.Task[Ticket], FairQueue], holders: list[tuple[Ticket, FairQueue]]
) -> list[tuple[str, FairQueue]]:
    """Release the holders, then each waiter as soon as it is admitted; the admission order
    (tenant, router)."""
    order: list[tuple[str, FairQueue]] = []
    for h, q in holders:
        q.release(h)
    pending = set(waiters)
    async with asyncio.timeout(20):
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1  # one slot: one admission at a time
            task = done.pop()
            t, q = task.result(), waiters[task]
            order.append((t.tenant.tenant_id, q))
            q.release(t, output_tokens=0)
    return order


def waiting(
    q: FairQueue, tenant: Tenant, n: int, prompt: int
) -> dict[asyncio.Task[Ticket], FairQueue]:
    return {asyncio.create_task(q.acquire(tenant, req(prompt))): q for _ in range(n)}


async def test_a_router_holding_only_one_tenant_waits_for_the_other_routers_turn(
    make_queue: Factory,
) -> None:
    r1, r2 = make_queue(slots=1), make_queue(slots=1)
    await asyncio.gather(r1.start(), r2.start())
    holder = await asyncio.wait_for(r1.acquire(A, req(1000)), 5)  # A's 1000 tokens charged
    heavy, light = waiting(r1, A, 3, 1000), waiting(r2, B, 12, 100)
    await until(lambda: r1.queued == 3 and r2.queued == 12)
    view = await until_view(r1.store, lambda v: v.backlog == {"A": 1, "B": 1})
    assert sum(view.inflight.values()) == 1
    assert view.counters["B"] == view.counters["A"] == 1000  # B lifted: no banked credit
    order = [tenant for tenant, _ in await drain(heavy | light, [(holder, r1)])]
    # one A (1000 tokens) is worth ten Bs (100): router 1 waits while B is behind at router 2
    assert order[:11].count("B") >= 10, order
    # the last release reaches Redis with router 2's next call
    view = await until_view(r1.store, lambda v: sum(v.inflight.values()) == 0)
    assert view.backlog == {}
    assert view.counters["A"] == pytest.approx(4000) and view.counters["B"] == pytest.approx(2200)


async def test_interactive_anywhere_goes_before_batch_here(make_queue: Factory) -> None:
    r1, r2 = make_queue(slots=1), make_queue(slots=1)
    holder = await asyncio.wait_for(r1.acquire(A, req()), 5)
    bulk, chat = waiting(r1, BULK, 2, 10), waiting(r2, B, 2, 5000)
    await until(lambda: r1.queued == 2 and r2.queued == 2)
    # the order is fleet-wide once Redis knows both backlogs (each router registers its own
    # with its next call; a release before that would see only the batch tenant waiting)
    await until_view(r1.store, lambda v: v.backlog.keys() == {"B", "bulk"})
    order = [tenant for tenant, _ in await drain(bulk | chat, [(holder, r1)])]
    assert order == ["B", "B", "bulk", "bulk"]


async def test_one_tenant_is_one_fifo_across_routers(make_queue: Factory) -> None:
    r1, r2 = make_queue(slots=1), make_queue(slots=1)
    holder = await asyncio.wait_for(r2.acquire(A, req()), 5)
    early = waiting(r1, A, 3, 100)
    await until_view(r1.store, lambda v: v.backlog == {"A": 1})
    await asyncio.sleep(0.01)
    late = waiting(r2, A, 3, 100)
    await until_view(r1.store, lambda v: v.backlog == {"A": 2})
    order = [q for _, q in await drain(early | late, [(holder, r2)])]
    # router 1's requests came first, so they go first, though router 2 frees the slot
    assert order == [r1, r1, r1, r2, r2, r2]


@pytest.mark.parametrize(
    ("free", "routers", "backlogged", "meanwhile", "room"),
    [
        (8, 1, 0, 0, 4),  # half of the free slots
        (8, 2, 0, 0, 2),  # half of this router's share
        (8, 2, 0, 1, 1),  # less what it admitted while the call was in flight
        (8, 2, 0, 5, 0),
        (8, 2, 0, -3, 2),  # releases meanwhile add nothing
        (3, 2, 0, 0, 0),  # fewer than 2 free slots per router: always ask
        (1, 1, 0, 0, 0),
        (-2, 1, 0, 0, 0),  # over-committed
        (64, 1, 1, 0, 0),  # somebody waits somewhere: the fair order decides
    ],
)
def test_the_fast_path_room(
    free: int, routers: int, backlogged: int, meanwhile: int, room: int
) -> None:
    reply = Reply(None, "synced", 0.0, routers, free, backlogged)
    assert fast_room(reply, meanwhile) == room


async def test_while_nobody_waits_requests_go_without_waiting_for_redis(
    make_queue: Factory,
) -> None:
    q = make_queue(slots=8)  # one router, 8 free slots: room for 4 before it asks again
    await q.start()
    await until(lambda: q._room == 4)
    gate = asyncio.Event()  # Redis answers nothing until the gate opens
    real = q.store.call

    async def slow(state: RouterState, *, grant: bool, ttl_ms: int | None = None) -> Any:
        await gate.wait()
        return await real(state, grant=grant, ttl_ms=ttl_ms)

    q.store.call = slow  # type: ignore[method-assign]
    tickets = [await asyncio.wait_for(q.acquire(A, req()), 5) for _ in range(4)]
    fifth = asyncio.create_task(q.acquire(A, req()))  # no room left: it asks, and waits
    for _ in range(20):
        await asyncio.sleep(0)
    assert not fifth.done() and q.queued == 1 and q.admitted == 4
    gate.set()
    tickets.append(await asyncio.wait_for(fifth, 5))
    # Redis learnt of every admission and charged each prefill once
    view = await until_view(q.store, lambda v: sum(v.inflight.values()) == 5)
    assert view.counters["A"] == pytest.approx(5 * 100)
    for t in tickets:
        q.release(t)
    await until_view(q.store, lambda v: sum(v.inflight.values()) == 0)


async def test_a_tenant_waiting_anywhere_turns_the_fast_path_off(make_queue: Factory) -> None:
    r1, r2 = make_queue(slots=1, replicas=8), make_queue(slots=1, replicas=8)
    await asyncio.gather(r1.start(), r2.start())
    await until_view(r1.store, lambda v: len(v.routers) == 2)
    # BULK holds the batch KV share, so another batch request waits at router 2 with slots free
    held = await asyncio.wait_for(r2.acquire(BULK, req(100, 10**7)), 5)
    bulk = asyncio.create_task(r2.acquire(BULK, req(100, 10**7)))
    await until_view(r1.store, lambda v: v.backlog == {"bulk": 1})
    outcomes: list[str] = []
    r1.on_outcome = outcomes.append
    r1.dispatch()  # router 1 syncs and learns that somebody waits
    await until(lambda: bool(outcomes))
    assert r1._room == 0
    # its next request is still admitted (slots are free, it is interactive), but by Redis
    chat = await asyncio.wait_for(r1.acquire(A, req()), 5)
    assert outcomes.count("granted") == 1
    r1.release(chat)
    r2.release(held)
    r2.release(await asyncio.wait_for(bulk, 5))


def ghost_head(tenant: str, *, batch: bool = False, age_ms: int = 0) -> RouterState:
    """A router's state with `tenant` waiting there (3 requests)."""
    return RouterState(0, 0, 2, 0, (Head(tenant, batch, 3, 1.0, 9, age_ms),))


@pytest.mark.parametrize(
    ("dead_state", "tenant", "blocked_by"),
    [
        # the dead router held every slot of the fleet
        (RouterState(inflight=2, batch_tokens=0, slots=2, batch_kv=0), BULK, "full"),
        # an interactive tenant was waiting there: batch tenants elsewhere wait for it
        (ghost_head("ghost"), BULK, "priority"),
        # a fairer tenant was waiting there (rich was served 500 meanwhile): the others wait
        (ghost_head("ghost"), Tenant("rich"), "turn"),
        # the same tenant's older requests were waiting there: they go first
        (ghost_head("A", age_ms=60_000), A, "order"),
    ],
)
async def test_a_dead_routers_slots_and_backlog_are_swept(
    make_queue: Factory,
    redis_server: RedisServer,
    dead_state: RouterState,
    tenant: Tenant,
    blocked_by: str,
) -> None:
    dead = SharedFairStore(redis_server.url, client_name=CLIENT, router_ttl_s=0.4, timeout_s=2.0)
    assert (await dead.call(dead_state, grant=False)) is not None
    dead.charge("rich", 500.0)
    assert (await dead.call(dead_state, grant=False)) is not None
    await dead._redis.aclose(close_connection_pool=True)  # it dies: no goodbye, no heartbeat
    live = make_queue(slots=1, replicas=2)
    outcomes: Counter[str] = Counter()
    live.on_outcome = lambda outcome: outcomes.update([outcome])
    waiter = asyncio.create_task(live.acquire(tenant, req()))
    await until(lambda: outcomes[blocked_by] > 0)
    view = await live.store.view()
    assert dead.router_id in view.routers and not waiter.done()
    ticket = await asyncio.wait_for(waiter, 5)  # once the heartbeat expires
    view = await live.store.view()
    assert dead.router_id not in view.routers and view.stats["swept"] == 1
    assert view.backlog == {} and dead.router_id not in view.inflight
    live.release(ticket)


async def test_a_charge_batch_whose_reply_was_lost_applies_once(make_queue: Factory) -> None:
    store = make_queue().store
    idle = RouterState(0, 0, 1, 0)
    store.charge("A", 5.0)
    await store.call(idle, grant=False)
    store._unconfirmed = (store._seq, {"A": 5.0})  # as if the reply had been lost
    store.charge("A", 1.0)
    await store.call(idle, grant=False)  # sends batch 1 again: skipped
    await store.call(idle, grant=False)  # then batch 2
    assert (await store.view()).counters["A"] == 6.0
    assert store.pending_charges == {}


# -- the shared state stays consistent -----------------------------------------------------------
ROUTERS, TENANTS = ("r1", "r2", "r3"), ("A", "B", "C")
event = st.tuples(
    st.sampled_from(ROUTERS),
    st.sampled_from(["sync", "admit", "leave", "wait"]),
    st.integers(0, 3),  # in flight
    st.sets(st.sampled_from(TENANTS)),  # backlogged there
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(events=st.lists(event, max_size=25))
def test_the_shared_backlog_is_always_the_live_routers_backlog(
    redis_server: RedisServer, events: list[tuple[str, str, int, set[str]]]
) -> None:
    asyncio.run(_consistent(redis_server.url, events))


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


async def _consistent(url: str, events: list[tuple[str, str, int, set[str]]]) -> None:
    clock = [1_000_000]
    stores = {
        r: SharedFairStore(
            url,
            key_prefix="t:prop",
            router_ttl_s=1.0,
            timeout_s=2.0,
            client_name=CLIENT,
            clock_override_ms=lambda: clock[0],
        )
        for r in ROUTERS
    }
    admin = redis.Redis.from_url(url, socket_timeout=2)
    admin.flushall()
    last: dict[str, tuple[int, set[str], int]] = {}  # router -> (in flight, backlog, expiry)
    try:
        for router, kind, inflight, tenants in events:
            store = stores[router]
            heads = tuple(Head(t, False, 2, 1.0, 10) for t in sorted(tenants))
            if kind == "wait":  # time passes: routers silent for a second are dead
                clock[0] += 600
                last = {r: v for r, v in last.items() if v[2] >= clock[0]}
                continue
            if kind == "leave":
                await store.leave()
                last.pop(router, None)
                continue
            state = RouterState(inflight, 0, 4, 0, heads)
            reply = await store.call(state, grant=kind == "admit")
            assert reply is not None
            last = {r: v for r, v in last.items() if v[2] >= clock[0]}  # swept by the call
            if reply.granted is not None:
                inflight += 1
            last[router] = (inflight, set(tenants), clock[0] + 1000)
        view = await stores["r1"].view()
        live = {r: v for r, v in last.items() if v[2] >= clock[0]}
        ids = {stores[r].router_id: r for r in ROUTERS}
        assert {ids[r] for r in view.routers} == set(live)
        want = Counter(t for v in live.values() for t in v[1])
        assert view.backlog == dict(want)
        assert {ids[r]: n for r, n in view.inflight.items()} == {r: v[0] for r, v in live.items()}
        assert all(v >= 0 for v in view.counters.values())
        for tenant in TENANTS:  # head ages: one per router where the tenant waits
            keys = {ids[_text(k)] for k in admin.hkeys(f"t:prop:hd:{tenant}")}
            assert keys == {r for r, v in live.items() if tenant in v[1]}
    finally:
        admin.close()
        for s in stores.values():
            await s._redis.aclose(close_connection_pool=True)


# -- Redis down: local fairness, degraded; back: shared again --------------------------------------
async def test_redis_down_falls_back_to_local_then_shares_again(
    make_queue: Factory, redis_server: RedisServer
) -> None:
    q = make_queue(slots=2, timeout_s=0.025, breaker_cooldown_s=0.3)
    t1 = await asyncio.wait_for(q.acquire(A, req()), 5)
    assert q.shared and q.degraded_reason is None
    redis_server.kill()
    t2 = await asyncio.wait_for(q.acquire(B, req()), 5)  # admitted locally once the breaker opens
    assert not q.shared and q.degraded_reason == "fair queue state unreachable: local fairness"
    waiting = asyncio.create_task(q.acquire(A, req()))  # the fleet is full (2 slots): it waits
    await asyncio.sleep(0.1)
    assert not waiting.done() and q.queued == 1
    q.release(t1, output_tokens=5)  # local dispatch admits it
    t3 = await asyncio.wait_for(waiting, 5)
    redis_server.start()
    await until(lambda: q.shared)  # the breaker's probe succeeded
    assert q.degraded_reason is None
    view = await q.store.view()
    # the state admitted while Redis was down arrived with the first call: 2 in flight, and the
    # charges (prefill 100 each; of 5 output tokens the first comes from the prefill step, so
    # 4 decode tokens) of what ran meanwhile
    assert view.inflight == {q.store.router_id: 2}
    assert view.counters == {"A": pytest.approx(104), "B": pytest.approx(100)}
    for t in (t2, t3):
        q.release(t)


def test_the_router_picks_the_shared_queue_only_with_redis() -> None:
    local = fair_queue_for(load_settings(), fleet())
    shared = fair_queue_for(load_settings(redis={"url": "redis://127.0.0.1:1"}), fleet())
    off = fair_queue_for(
        load_settings(redis={"url": "redis://127.0.0.1:1"}, fairness={"shared": False}), fleet()
    )
    assert type(local) is FairQueue and type(off) is FairQueue
    assert isinstance(shared, SharedFairQueue) and shared.store.key_prefix == "cp:fair:tiny-llama"
    assert shared.degraded_reason is None  # optimistic until a call fails
