"""The router's tenant queue: the queue core (`controlplane.tenancy.queue`) with waiters.

    acquire(tenant, request)   admit at once when nothing waits and some replica has room;
                               else wait in the tenant's FIFO (bounded: 429 tenant, 503 total)
    dispatch                   while the fairest tenant's head (or a bounded overtaker's) has
                               room on some replica: admit it (charge its prefill)
    place(ticket, replica)     the replica routing chose, among those with room (`ticket.room`)
    first_token(ticket)        it leaves its replica's prefill backlog (the gate may open)
    charge_tokens(ticket, n)   decode work charged as tokens stream
    release(ticket, usage)     exactly once: the rest of the decode, cached prompt tokens
                               refunded, the slot freed; dispatches the next

Room is the core's, per replica, the simulator's rules (`controlplane.tenancy.room`): slots at
the roofline's concurrency ceilings counting this queue's requests and the work the replica
reports that this router did not send (other routers', `controlplane.routing.load.estimate`),
headroom for tenants under their share, the batch class's KV share, and the prefill gate, so one
long prompt cannot stall every other request's first token. An admitted request is booked on the
replica with the most free slots until routing places it, so admissions in between see it.
Capacity changes as scrapes arrive, so waiting requests are re-checked on a short tick too.

Work units are `controlplane.tenancy.work.WorkModel`'s, the simulator's own: `vtc` counts
tokens; `vtc-roofline` counts roofline seconds (a long document costs what it costs the GPU);
`request` charges 1 per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controlplane.errors import CapacityError, NoReadyReplicaError, RequestError
from controlplane.roofline.profile import EngineProfile
from controlplane.routing.load import estimate
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.queue import QueueEntry, TenantQueueCore
from controlplane.tenancy.room import ReplicaBooks
from controlplane.tenancy.room import slots as room_slots
from controlplane.tenancy.work import WorkModel
from controlplane.types import FleetSnapshot, ReplicaState, RoutingRequest

if TYPE_CHECKING:
    from router.scope import Outcome, RequestScope

TICK_S = 0.02


class TenantQueueFullError(RequestError):
    """The tenant already has its maximum number of requests waiting."""

    status_code = 429


class QueueFullError(CapacityError):
    """The router's queue is full."""


@dataclass(eq=False)
class Ticket:
    tenant: Tenant
    entry: QueueEntry
    # replicas with room when it was admitted (None: any routable replica)
    room: frozenset[str] | None = None
    decoded: int = 0
    admitted: bool = False
    released: bool = False
    waiter: asyncio.Future[None] | None = field(default=None, repr=False)
    queued_at: float = field(default_factory=time.monotonic, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return self.entry.prompt_tokens

    @property
    def reserved_tokens(self) -> int:
        return self.entry.reserved_tokens

    @property
    def batch(self) -> bool:
        return self.entry.batch


def entry_for(tenant: Tenant, req: RoutingRequest) -> QueueEntry:
    """What the queue knows of a request: KV reserved = every prompt's tokens + the predicted
    output of each sequence (a completions batch or `n` > 1 holds several)."""
    reserved = req.prompt_tokens + req.sequences * max(1, req.predicted_output_tokens)
    return QueueEntry(tenant.tenant_id, tenant.priority, tenant.weight, req.prompt_tokens, reserved)


class FairQueue:
    def __init__(
        self,
        cfg: FairnessConfig,
        snapshot: Callable[[], FleetSnapshot],
        *,
        on_change: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.snapshot = snapshot
        self.on_change = on_change or (lambda tenant, queued: None)
        self.clock = clock
        self.core: TenantQueueCore[Ticket] = TenantQueueCore(cfg, WorkModel.build("vtc"))
        self._priced = False
        self._ticker: asyncio.Task[None] | None = None

    # -- the core's books, as the router reports them ---------------------------------------------
    @property
    def queued(self) -> int:
        return self.core.queued

    @property
    def admitted(self) -> int:
        return len(self.core.inflight)

    @property
    def batch_tokens(self) -> int:
        return sum(b.batch_reserved for b in self.core.replicas.values())

    # -- capacity ---------------------------------------------------------------------------------
    def units(self, snap: FleetSnapshot) -> WorkModel:
        """The mode's work model, priced on the fleet's profile once one replica is known
        (until then roofline work is counted in tokens; "off" charges like "request")."""
        if not self._priced and snap.replicas:
            mode = "request" if self.cfg.mode == "off" else self.cfg.mode
            self.core.work = WorkModel.build(mode, snap.replicas[0].profile)
            self._priced = True
        elif not self._priced and self.cfg.mode in ("off", "request"):
            self.core.work = WorkModel.build("request")
        return self.core.work

    def _replica_slots(self, prof: EngineProfile) -> int:
        """A replica's slots at the configured mean context (the fleet's count for Redis)."""
        return room_slots(self.core.rules, prof, _EMPTY_BOOKS, 0)

    def _fleet(self, snap: FleetSnapshot) -> list[ReplicaState]:
        routable = snap.routable()
        self.core.fleet_kv = float(sum(r.kv_capacity_tokens for r in routable))
        self.core.fleet_replicas = len(routable)
        self.units(snap)
        return list(routable)

    def _rooms(self, reps: list[ReplicaState], t: Ticket) -> list[ReplicaState]:
        core = self.core
        return [r for r in reps if core.room(r.replica_id, r.profile, t.entry, max(0, _others(r)))]

    def _admit(
        self, t: Ticket, rooms: list[ReplicaState], *, queued: bool, fleet: list[ReplicaState]
    ) -> None:
        """Charge its prefill and book it on the replica with the fewest requests among those
        with room (any routable one when none has: a grant from the shared queue) until routing
        places it."""
        core = self.core
        core.admit(t, t.entry, queued=queued)
        t.admitted = True
        if rooms:
            t.room = frozenset(r.replica_id for r in rooms)
        candidates = rooms or fleet
        if candidates:
            books = core.replicas
            first = min(
                candidates,
                key=lambda r: (
                    (books[r.replica_id].requests if r.replica_id in books else 0) + _others(r)
                ),
            )
            core.place(t, first.replica_id, first.profile)

    def place(self, t: Ticket, replica_id: str, prof: EngineProfile) -> None:
        """Routing sent `t` to `replica_id` (its books move there)."""
        if t.admitted and not t.released and self.cfg.mode != "off":
            self.core.place(t, replica_id, prof)

    # -- the queue --------------------------------------------------------------------------------
    async def acquire(self, tenant: Tenant, req: RoutingRequest) -> Ticket:
        t = Ticket(tenant, entry_for(tenant, req))
        if self.cfg.mode == "off":
            t.admitted = True
            return t
        core = self.core
        if not self.snapshot().routable():  # nothing could ever admit it: say so now
            raise NoReadyReplicaError("no ready replica: every replica is loading, ejected or gone")
        fifo = core.fifos.get(tenant.tenant_id)
        waiting_here = len(fifo) if fifo else 0
        if not core.queued and self._admit_now(t):
            return t
        if waiting_here >= tenant.max_queued:
            raise TenantQueueFullError(
                f"tenant {tenant.tenant_id} already has {waiting_here} requests waiting (its limit)"
            )
        if core.queued >= self.cfg.max_queued_total:
            raise QueueFullError("the router's queue is full; retry later")
        t.waiter = asyncio.get_running_loop().create_future()
        self.on_change(tenant.tenant_id, core.enqueue(t, t.entry, self.clock()))
        self._ensure_ticker()
        self.dispatch()
        try:
            await t.waiter
        except BaseException:
            if t.admitted:  # admitted as its caller left: nobody else will release it
                self.release(t)
            else:
                self._forget(t)
            raise
        return t

    def _admit_now(self, t: Ticket) -> bool:
        """May `t` go at once (nobody waits here)? Locally: when some replica has room."""
        if not self._local():
            return False
        reps = self._fleet(self.snapshot())
        rooms = self._rooms(reps, t)
        if not rooms:
            return False
        self._admit(t, rooms, queued=False, fleet=reps)
        return True

    def _forget(self, t: Ticket) -> None:
        if self.core.remove(t, self.clock()):
            fifo = self.core.fifos.get(t.tenant.tenant_id)
            self.on_change(t.tenant.tenant_id, len(fifo) if fifo else 0)

    def dispatch(self) -> None:
        """Admit waiting requests while a replica has room for them, fairest tenant first."""
        core = self.core
        while core.queued:
            reps = self._fleet(self.snapshot())
            if not reps:  # the whole fleet went away: the waiters get a 503, not a hang
                self._fail_waiters(
                    NoReadyReplicaError("no ready replica: the fleet left while it waited")
                )
                return

            def fits(t: Ticket, reps: list[ReplicaState] = reps) -> bool:
                return bool(self._rooms(reps, t))

            t = core.next(fits, self.clock())
            if t is None:
                return
            fifo = core.fifos.get(t.tenant.tenant_id)
            self.on_change(t.tenant.tenant_id, len(fifo) if fifo else 0)
            assert t.waiter is not None
            if t.waiter.done():  # cancelled, its task not yet resumed: it must not hold a slot
                continue
            self._admit(t, self._rooms(reps, t), queued=True, fleet=reps)
            t.waiter.set_result(None)

    # -- charges while it runs, and the end -------------------------------------------------------
    def first_token(self, t: Ticket) -> None:
        """Its prefill is done: the replica's prefill gate opens for the next prompt."""
        if t.admitted and not t.released and self.cfg.mode != "off":
            self.core.first_token(t)
            if self.core.queued:
                self.dispatch()

    def charge_tokens(self, t: Ticket, n: int) -> None:
        """`n` more tokens streamed: charge their decode work."""
        if n <= 0 or not t.admitted or t.released or self.cfg.mode == "off":
            return
        before = self.core.state.counter(t.tenant.tenant_id)
        t.decoded += n
        self.core.produced(t, t.decoded)
        self._charged(t.tenant.tenant_id, self.core.state.counter(t.tenant.tenant_id) - before)

    def release(
        self, t: Ticket, *, cached_tokens: int = 0, output_tokens: int | None = None
    ) -> None:
        if t.released or not t.admitted or self.cfg.mode == "off":
            t.released = True
            return
        t.released = True
        tid = t.tenant.tenant_id
        before = self.core.state.counter(tid)
        self.core.finished(t, cached_tokens, output_tokens)
        self._charged(tid, self.core.state.counter(tid) - before)
        self.dispatch()

    # -- the request scope's hooks (router/scope.py) ----------------------------------------------
    def on_admitted(self, scope: RequestScope) -> None:
        return None

    def on_routed(self, scope: RequestScope) -> None:
        return None

    def on_first_token(self, scope: RequestScope) -> None:
        if scope.ticket is not None:
            self.first_token(scope.ticket)

    def on_tokens(self, scope: RequestScope, n: int) -> None:
        if scope.ticket is not None:
            self.charge_tokens(scope.ticket, n)

    def on_end(self, scope: RequestScope, outcome: Outcome) -> None:
        if scope.ticket is not None:
            u = scope.usage
            self.release(
                scope.ticket,
                cached_tokens=u.cached_tokens if u else 0,
                output_tokens=u.completion_tokens if u else None,
            )

    # -- hooks of a queue shared by several routers (`router/fairness/shared.py`) ----------------
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
        while self.core.queued:
            await asyncio.sleep(TICK_S)
            self.dispatch()

    def _fail_waiters(self, exc: Exception) -> None:
        """Every waiting request leaves the queue with `exc`."""
        core, now = self.core, self.clock()
        for fifo in list(core.fifos.values()):
            while fifo:
                t = fifo[0]
                core.remove(t, now)
                self.on_change(t.tenant.tenant_id, len(fifo))
                if t.waiter is not None and not t.waiter.done():
                    t.waiter.set_exception(exc)

    async def aclose(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        self._fail_waiters(CapacityError("the router is shutting down"))


def _others(r: ReplicaState) -> int:
    """Requests the replica reports that this router did not send."""
    return int(max(0.0, estimate(r).requests - r.ledger.requests))


_EMPTY_BOOKS = ReplicaBooks()
