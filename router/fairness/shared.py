"""The fair queue across several routers: counters, backlog and slots shared in Redis.

Each router keeps its own per-tenant FIFOs (`router/fairness/queue.py`); with `redis.url` set (and
`fairness.shared`), *which* request may go and *when* is decided in Redis, atomically, so that N
routers behave as one queue in front of the fleet:

    shared state     per tenant a virtual counter (work / weight) and its class; per router its
                     backlogged tenants with the age of each one's head request, its in-flight
                     requests (the fleet's slots it holds), its batch KV, and a heartbeat; the
                     global backlog = tenants waiting at any live router
                     (`controlplane/tenancy/fair_redis.py`)
    a router's step  one script call carrying its whole state (absolute counts, the head of
                     each of its waiting tenants, its decode charges since the last call); on
                     arrival, release, a cancelled waiter, a wake-up, every 50 ms while requests
                     wait, and every `heartbeat_s` otherwise. Calls of one router are sequential.
    ADMIT            after the sweep and the sync: a tenant newly backlogged *fleet-wide* is
                     lifted to the smallest counter among backlogged tenants (no banked
                     credit); then this router's fairest waiting tenant T (interactive first,
                     smallest counter, smallest id) gets a slot iff
                        - the fleet has a free slot: Σ slots of routable replicas > Σ in flight
                          over live routers;
                        - T's class is interactive, or no interactive tenant waits anywhere;
                        - T's counter is the smallest of its class among every router's
                          backlogged tenants (ties allowed), so a router holding only tenant
                          X's requests waits while tenant Y, behind, waits at another router;
                        - T's head here is T's oldest head across routers (within 2 ms): a
                          tenant's requests leave in arrival order, whichever router holds them;
                        - a batch head fits the fleet's batch KV share (or no batch KV is held);
                     then T's counter += the head's prefill / weight, in the same script (two
                     routers can never both see T as the fairest after one grant)
    wake-ups         a call that frees slots (a release, a router swept or leaving) while
                     requests wait publishes on `P:wake`; every router listens and asks at once,
                     so a slot freed at one router reaches the tenant whose turn it is elsewhere
                     in about a round trip
    charges          decode work as it streams and refunds of cached prompt tokens at finish,
                     accumulated locally and sent with the next call (a numbered batch, applied
                     once)
    sweeper          in every script: a router whose heartbeat expired (`router_ttl_s`,
                     Redis TIME) loses its backlog entries and its slots, so a dead router
                     leaves no phantom backlog blocking the others, nor held slots
    Redis down       a call that fails or exceeds its budget (25 ms) counts towards the
                     breaker; once it opens, this router falls back to the local queue (its own
                     counters, capacity from the replicas' metrics, as with one router) and
                     `/ready` reports degraded; the breaker's probe that succeeds makes it
                     shared again, its state (what it admitted meanwhile, charges included)
                     carried by that call

Fast path: while no tenant waits at any router, a request does not wait for Redis. A reply
that shows no backlog anywhere gives this router room for floor(free slots / (2 x live routers))
admissions, less those it made while the call was in flight; such a request is admitted at
once (interactive class only: batch KV is always granted by Redis), charged locally, and Redis
learns of it with the call it triggers, about a round trip later. Each router takes at most half
its share of the free slots it last saw before asking again, so the routers together cannot
take more than the fleet had free unless the number of routers more than doubles between two
calls; any waiting tenant, anywhere, turns the fast path off at every router's next call, and
the fair order above applies again. A fleet with fewer than 2 free slots per router never
uses it.

Per request: one call admits it (or follows its fast admission), one call (its release) frees its
slot; while no request waits at a router, its follow-up calls within `SYNC_COALESCE_S` (10 ms)
are one call, so under load a router calls Redis about a hundred times a second, not twice per
request; the other routers' calls that a release wakes, and the 50 ms re-asks, are per free slot
rather than per token. Capacity is fleet-wide (the routing policy places each admitted request) and
every request is assumed to come through these routers (others' traffic is not subtracted, unlike
the local queue). A router that dies holding the fairest tenant's oldest request stalls admissions
until its heartbeat expires (`router_ttl_s`). The work units and charges are the local queue's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.fair_redis import Head, Reply, RouterState, SharedFairStore
from controlplane.types import FleetSnapshot, ReplicaState
from router.config import RouterSettings
from router.fairness.queue import TICK_S, FairQueue, Ticket

log = logging.getLogger(__name__)

# while requests wait, how often a router asks again unprompted (slots freed elsewhere wake it
# at once through `P:wake`; this covers lost wake-ups and capacity changes)
SHARED_TICK_S = 0.05
# while no request waits at this router, the kicks (fast admissions, releases) within this long
# go to Redis in one call: one call per window instead of two per request
SYNC_COALESCE_S = 0.01


def fast_room(reply: Reply, admitted_meanwhile: int) -> int:
    """Admissions this router may make without asking, after `reply` (see "Fast path"): half
    its share of the free slots when nobody waits anywhere, less what it admitted while the
    call was in flight."""
    if reply.backlogged > 0:
        return 0
    share = reply.free // (2 * max(1, reply.routers))
    return max(0, share - max(0, admitted_meanwhile))


class SharedFairQueue(FairQueue):
    def __init__(
        self,
        cfg: FairnessConfig,
        snapshot: Callable[[], FleetSnapshot],
        store: SharedFairStore,
        *,
        on_change: Callable[[str, int], None] | None = None,
        on_outcome: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(cfg, snapshot, on_change=on_change)
        self.store = store
        self.on_outcome = on_outcome or (lambda outcome: None)
        self.shared = True  # Redis decides admissions (False: the local fallback runs)
        self.heartbeat_s = cfg.heartbeat_s
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._closing = False
        # requests this router may still admit without asking (see "fast path" above)
        self._room = 0

    # -- hooks of the local queue ------------------------------------------------------------------
    def _local(self) -> bool:
        return not self.shared

    def _admit_now(self, t: Ticket) -> bool:
        if self._local():
            return super()._admit_now(t)
        if t.batch or self._room < 1:
            return False
        self._room -= 1
        reps = self._fleet(self.snapshot())
        self._admit(t, self._rooms(reps, t), queued=False, fleet=reps)
        self._kick()  # Redis learns of it (in-flight count, prefill charge) with the next call
        return True

    def _charged(self, tenant_id: str, delta: float) -> None:
        self.store.charge(tenant_id, delta)

    def _admit(
        self, t: Ticket, rooms: list[ReplicaState], *, queued: bool, fleet: list[ReplicaState]
    ) -> None:
        """A local admission (fast path, fallback): Redis learns its prefill charge with the
        next call."""
        super()._admit(t, rooms, queued=queued, fleet=fleet)
        self.store.charge(t.tenant.tenant_id, self._prefill(t, self.snapshot()))

    def _forget(self, t: Ticket) -> None:
        super()._forget(t)
        self._kick()  # the tenant may have left this router's backlog

    @property
    def degraded_reason(self) -> str | None:
        return None if self.shared else self.store.degraded_reason or "fair queue: local only"

    def dispatch(self) -> None:
        if self.shared:
            self._kick()
        else:
            super().dispatch()
            self._kick()  # the breaker's probe runs on the worker

    async def start(self) -> None:
        self._kick()

    def _ensure_ticker(self) -> None:
        """The worker is the ticker (see `_run`)."""

    # -- the worker: one call at a time ------------------------------------------------------------
    def _kick(self) -> None:
        if self._closing:
            return
        self._wake.set()
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run(), name="fair-shared")
        if self._listener is None or self._listener.done():
            listen = self.store.listen(self._wake.set)
            self._listener = loop.create_task(listen, name="fair-shared-wake")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._tick_s()):
                    await self._wake.wait()
            if self.shared and not self.queued and self._wake.is_set():
                # nobody waits here: the call only tells Redis what this router did (fast
                # admissions, releases), so the kicks of the next few ms share one call
                await asyncio.sleep(SYNC_COALESCE_S)
            self._wake.clear()
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the queue: log it, try again next tick
                log.exception("shared fair queue step failed")

    def _tick_s(self) -> float:
        if not self.queued:
            return self.heartbeat_s
        return SHARED_TICK_S if self.shared else TICK_S

    def _prefill(self, t: Ticket, snap: FleetSnapshot) -> float:
        return self.units(snap).prefill(t.prompt_tokens) / t.tenant.weight

    def _state(self, snap: FleetSnapshot) -> tuple[RouterState, dict[str, Head]]:
        now = time.monotonic()
        heads = {
            tid: Head(
                tid,
                f[0].batch,
                len(f),
                self._prefill(f[0], snap),
                f[0].reserved_tokens,
                int((now - f[0].queued_at) * 1000),
            )
            for tid, f in self.core.fifos.items()
            if f
        }
        slots = kv = 0
        share = 1.0
        for r in snap.routable():
            slots += self._replica_slots(r.profile)
            kv += r.kv_capacity_tokens
            share = min(share, self.core.batch_share(r.profile))
        state = RouterState(
            self.admitted,
            self.batch_tokens,
            slots,
            int(kv * share),
            tuple(heads.values()),
        )
        return state, heads

    async def _step(self) -> None:
        """Sync with Redis; while it grants slots, admit and ask again."""
        while not self._closing:
            snap = self.snapshot()
            state, heads = self._state(snap)
            reply = await self.store.call(state, grant=bool(heads))
            self._room = 0
            if reply is None:
                self.on_outcome("unreachable")
                if self.shared and self.store.degraded_reason is not None:
                    self.shared = False
                    log.warning("fair queue: Redis unreachable, local fairness until it answers")
                if not self.shared:
                    super().dispatch()
                return
            if not self.shared:
                self.shared = True
                log.warning("fair queue: Redis answers again, fairness shared across routers")
            self.on_outcome(reply.reason)
            self._room = fast_room(reply, self.admitted - state.inflight)
            if reply.granted is None:
                return
            self._grant(reply.granted, heads.get(reply.granted))
            if not self.queued:
                return

    def _grant(self, tid: str, sent: Head | None) -> None:
        core = self.core
        t = core.pop(tid, self.clock())
        if t is None:  # the waiter left while the call was in flight: give its charge back
            if sent is not None:
                self.store.charge(tid, -sent.charge)
            return  # the slot returns with the next call (absolute in-flight count)
        snap = self.snapshot()
        self.on_change(tid, len(core.fifos[tid]))
        assert t.waiter is not None
        if t.waiter.done():  # cancelled, its task not yet resumed: give the grant back
            if sent is not None:
                self.store.charge(tid, -sent.charge)
            return
        charge = self._prefill(t, snap)
        if sent is not None and charge != sent.charge:  # a different head than the one sent
            self.store.charge(tid, charge - sent.charge)
        # local bookkeeping (Redis charged the prefill); routing prefers replicas with room
        reps = self._fleet(snap)
        FairQueue._admit(self, t, self._rooms(reps, t), queued=True, fleet=reps)
        t.waiter.set_result(None)

    async def aclose(self) -> None:
        self._closing = True
        tasks = [t for t in (self._worker, self._listener) if t is not None]
        self._worker = self._listener = None
        for task in tasks:
            while not task.done():  # see RedisPrefixIndex.aclose: a cancel may be absorbed
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
        await super().aclose()
        await self.store.aclose()


def fair_queue_for(
    settings: RouterSettings,
    snapshot: Callable[[], FleetSnapshot],
    *,
    on_change: Callable[[str, int], None] | None = None,
    on_outcome: Callable[[str], None] | None = None,
) -> FairQueue:
    """The router's queue: shared in Redis when `redis.url` is set (and `fairness.shared`)."""
    cfg = settings.fairness
    if settings.redis.url is None or not cfg.shared or cfg.mode == "off":
        return FairQueue(cfg, snapshot, on_change=on_change)
    store = SharedFairStore(
        settings.redis.url,
        key_prefix=f"{cfg.key_prefix}:{settings.served_model}",
        router_ttl_s=cfg.router_ttl_s,
        timeout_s=cfg.shared_timeout_ms / 1000,
        password=os.environ.get(settings.redis.password_env) or None,
    )
    return SharedFairQueue(cfg, snapshot, store, on_change=on_change, on_outcome=on_outcome)


__all__ = ["SharedFairQueue", "fair_queue_for", "fast_room"]
