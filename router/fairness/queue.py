"""The router's tenant queue: per-tenant FIFOs, dispatched fairly when the fleet has room.

    acquire(tenant, request)   admit at once when nothing waits and the fleet has a free slot;
                               else wait in the tenant's FIFO (bounded: 429 tenant, 503 total)
    dispatch                   while a slot is free: tenant = vtc.pick(state) (interactive before
                               batch, then the smallest virtual counter), pop its FIFO head
    charges (vtc.charge)       prefill work at admission; decode work as tokens stream; cached
                               prompt tokens refunded at finish from the replica's usage;
                               every charge divided by the tenant's weight; an arriving tenant
                               is lifted to the smallest backlogged counter (no banked credit)
    release(ticket, usage)     exactly once; frees the slot and dispatches the next

Free slots: the fleet's slots (per routable replica the lowest of the roofline's three
concurrency ceilings, or a configured number) minus this router's admitted requests minus the
work the replicas report that this router did not send (other routers', from their metrics:
`controlplane.routing.load.estimate`). The batch class may also hold at most `batch_kv_share`
of the fleet's KV tokens (prompt + sequences x max_tokens reserved per request), so interactive
sequences always find room.
Capacity changes as scrapes arrive, so waiting requests are re-checked on a short tick too.

Work units are `controlplane.tenancy.work.WorkModel`'s, the simulator's own: `vtc` counts
tokens; `vtc-roofline` counts roofline seconds (a prefill token costs its compute at its
context, a decode token the step time per sequence at its context, so a long document costs
what it costs the GPU); `request` charges 1 per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.errors import CapacityError, RequestError
from controlplane.roofline.capacity import (
    concurrency_ceilings,
)
from controlplane.roofline.profile import EngineProfile
from controlplane.routing.load import estimate
from controlplane.tenancy import vtc
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.work import WorkModel
from controlplane.types import FleetSnapshot, PriorityClass, RoutingRequest
from router.config import FairnessConfig

TICK_S = 0.02


class TenantQueueFullError(RequestError):
    """The tenant already has its maximum number of requests waiting."""

    status_code = 429


class QueueFullError(CapacityError):
    """The router's queue is full."""


@dataclass(eq=False)
class Ticket:
    tenant: Tenant
    prompt_tokens: int
    reserved_tokens: int
    batch: bool
    decoded: int = 0
    admitted: bool = False
    released: bool = False
    waiter: asyncio.Future[None] | None = field(default=None, repr=False)
    queued_at: float = field(default_factory=time.monotonic, repr=False)


class FairQueue:
    def __init__(
        self,
        cfg: FairnessConfig,
        snapshot: Callable[[], FleetSnapshot],
        *,
        on_change: Callable[[str, int], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.snapshot = snapshot
        self.on_change = on_change or (lambda tenant, queued: None)
        self.state = vtc.VtcState({}, frozenset())
        self.weights: dict[str, float] = {}
        self.classes: dict[str, PriorityClass] = {}
        self.fifos: dict[str, deque[Ticket]] = {}
        self.admitted = 0
        self.batch_tokens = 0
        self.queued = 0
        self._units: WorkModel | None = None
        self._ceilings: dict[EngineProfile, int] = {}
        self._ticker: asyncio.Task[None] | None = None

    # -- capacity ---------------------------------------------------------------------------------
    def units(self, snap: FleetSnapshot) -> WorkModel:
        """The mode's work model, priced on the fleet's profile once one replica is known
        (until then roofline work is counted in tokens; "off" charges like "request")."""
        if self._units is None or (self._units.cost is None and snap.replicas):
            mode = "request" if self.cfg.mode == "off" else self.cfg.mode
            if mode == "vtc-roofline" and not snap.replicas:
                mode = "vtc"
            prof = snap.replicas[0].profile if snap.replicas else None
            self._units = WorkModel.build(mode, prof)
        return self._units

    def _replica_slots(self, prof: EngineProfile) -> int:
        if self.cfg.slots_per_replica is not None:
            return self.cfg.slots_per_replica
        n = self._ceilings.get(prof)
        if n is None:
            n = self._ceilings[prof] = concurrency_ceilings(
                prof, self.cfg.mean_context_tokens
            ).sequences
        return n

    def _slots(self, snap: FleetSnapshot) -> tuple[float, float]:
        """(free request slots, free batch KV tokens) right now."""
        slots = others = kv = 0.0
        for r in snap.routable():
            slots += self._replica_slots(r.profile)
            others += max(0.0, estimate(r).requests - r.ledger.requests)
            kv += r.kv_capacity_tokens
        free = slots - others - self.admitted
        return free, kv * self.cfg.batch_kv_share - self.batch_tokens

    def _fits(self, t: Ticket, free: float, batch_free: float) -> bool:
        # a batch request larger than the whole batch share still goes when no other batch
        # request holds KV, so it cannot starve
        return free >= 1 and (
            not t.batch or t.reserved_tokens <= batch_free or self.batch_tokens == 0
        )

    # -- the queue --------------------------------------------------------------------------------
    async def acquire(self, tenant: Tenant, req: RoutingRequest) -> Ticket:
        cap = req.max_tokens or req.predicted_output_tokens
        t = Ticket(
            tenant,
            req.prompt_tokens,
            req.prompt_tokens + req.sequences * cap,
            tenant.priority is PriorityClass.BATCH,
        )
        if self.cfg.mode == "off":
            t.admitted = True
            return t
        tid = tenant.tenant_id
        self.weights[tid] = tenant.weight
        self.classes[tid] = tenant.priority
        fifo = self.fifos.setdefault(tid, deque())
        snap = self.snapshot()
        if not self.queued and self._admit_now(t, snap):
            self.state = vtc.on_arrival(self.state, tid)
            self._admit(t, snap)
            self.state = vtc.on_idle(self.state, tid)
            return t
        if len(fifo) >= tenant.max_queued:
            raise TenantQueueFullError(
                f"tenant {tid} already has {len(fifo)} requests waiting (its limit)"
            )
        if self.queued >= self.cfg.max_queued_total:
            raise QueueFullError("the router's queue is full; retry later")
        if not fifo:
            self.state = vtc.on_arrival(self.state, tid)
        t.waiter = asyncio.get_running_loop().create_future()
        fifo.append(t)
        self.queued += 1
        self.on_change(tid, len(fifo))
        self._ensure_ticker()
        self.dispatch()
        try:
            await t.waiter
        except BaseException:
            if not t.admitted:
                self._forget(t)
            raise
        return t

    def _forget(self, t: Ticket) -> None:
        fifo = self.fifos.get(t.tenant.tenant_id)
        if fifo is not None and t in fifo:
            fifo.remove(t)
            self.queued -= 1
            self.on_change(t.tenant.tenant_id, len(fifo))
            if not fifo:
                self.state = vtc.on_idle(self.state, t.tenant.tenant_id)

    def _admit(self, t: Ticket, snap: FleetSnapshot) -> None:
        t.admitted = True
        self.admitted += 1
        if t.batch:
            self.batch_tokens += t.reserved_tokens
        work = self.units(snap).prefill(t.prompt_tokens)
        self.state = vtc.charge(self.state, t.tenant.tenant_id, work, t.tenant.weight)

    def dispatch(self) -> None:
        """Admit waiting requests while the fleet has room, fairest tenant first."""
        while self.queued:
            snap = self.snapshot()
            free, batch_free = self._slots(snap)
            if free < 1:
                return
            # tenants whose next request fits (a batch request may wait for batch KV to free)
            waiting = {
                tid: self.classes[tid]
                for tid, f in self.fifos.items()
                if f and self._fits(f[0], free, batch_free)
            }
            for stranded in waiting.keys() - self.state.backlogged:  # never strand a FIFO
                self.state = vtc.on_arrival(self.state, stranded)
            picked = vtc.pick(self.state, waiting)
            if picked is None or picked not in waiting:
                return
            tid = picked
            fifo = self.fifos[tid]
            t = fifo.popleft()
            self.queued -= 1
            self.on_change(tid, len(fifo))
            if not fifo:
                self.state = vtc.on_idle(self.state, tid)
            assert t.waiter is not None
            if t.waiter.done():  # cancelled, its task not yet resumed: it must not hold a slot
                continue
            self._admit(t, snap)
            t.waiter.set_result(None)

    # -- charges while it runs, and the end -------------------------------------------------------
    def on_tokens(self, t: Ticket, n: int) -> None:
        if n <= 0 or not t.admitted or t.released or self.cfg.mode == "off":
            return
        units = self._units or self.units(self.snapshot())
        work = units.decode(n, t.prompt_tokens + t.decoded)
        t.decoded += n
        self.state = vtc.charge(self.state, t.tenant.tenant_id, work, t.tenant.weight)
        self._charged(t.tenant.tenant_id, work / t.tenant.weight)

    def release(
        self, t: Ticket, *, cached_tokens: int = 0, output_tokens: int | None = None
    ) -> None:
        if t.released or not t.admitted or self.cfg.mode == "off":
            t.released = True
            return
        if output_tokens is not None and output_tokens > t.decoded:  # before `released`
            self.on_tokens(t, output_tokens - t.decoded)
        t.released = True
        if cached_tokens > 0:
            units = self._units or self.units(self.snapshot())
            refund = units.refund_cached(min(cached_tokens, t.prompt_tokens))
            if refund > 0:
                self.state = vtc.refund(self.state, t.tenant.tenant_id, refund, t.tenant.weight)
                self._charged(t.tenant.tenant_id, -refund / t.tenant.weight)
        self.admitted -= 1
        if t.batch:
            self.batch_tokens -= t.reserved_tokens
        self.dispatch()

    # -- hooks of a queue shared by several routers (`router/fairness/shared.py`) ------------------
    def _admit_now(self, t: Ticket, snap: FleetSnapshot) -> bool:
        """May `t` go at once (nobody waits here)? Locally: when it fits the free slots."""
        return self._local() and self._fits(t, *self._slots(snap))

    def _local(self) -> bool:
        """Does this queue admit on its own? (A shared one asks Redis while it answers.)"""
        return True

    def _charged(self, tenant_id: str, delta: float) -> None:
        """A decode charge or a refund (work / weight) was applied to the tenant's counter."""

    @property
    def degraded_reason(self) -> str | None:
        return None

    async def start(self) -> None:
        return None

    # -- re-checks as capacity changes ----------------------------------------------------------
    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self.queued:
            await asyncio.sleep(TICK_S)
            self.dispatch()

    async def aclose(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for fifo in self.fifos.values():
            for t in fifo:
                if t.waiter is not None and not t.waiter.done():
                    t.waiter.set_exception(CapacityError("the router is shutting down"))
            fifo.clear()
        self.queued = 0
