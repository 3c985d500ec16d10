"""The tenant-queue core: per-tenant FIFOs, virtual counters, charges and room. No I/O, no clock.

Both hosts drive it: the simulator (`controlplane.sim.fleet`, synchronously) and the live router
(`router.fairness.queue`, with waiters). A key is whatever the host names a request by.

    enqueue(key, entry, now)   the tenant's FIFO; `vtc.on_arrival` when it was empty (an idle
                               tenant is lifted to the smallest backlogged counter: no banked
                               credit)
    next(fits, now)            `vtc.pick` among backlogged tenants (interactive first, then the
                               smallest counter); its head goes if `fits(key)` (some replica has
                               room). When it has none (a long document waiting for KV), a tenant
                               of its class whose head fits may overtake it while its counter
                               stays within the blocked head's own prefill charge of the blocked
                               counter: the fleet keeps working, and a stream of small requests
                               cannot starve the long one. `vtc.on_idle` when the FIFO empties
    admit(key, entry, now)     charge the prompt's prefill (work / weight); `queued=False` is a
                               request that never waited (lifted, charged, idle again)
    room(replica, prof, entry) `controlplane.tenancy.room.has_room` on this queue's books
    place(key, replica, prof)  the replica it went to: slots, KV, prefill backlog
    first_token(key)           it leaves its replica's prefill backlog
    produced(key, outputs)     charge decode tokens produced so far (all but the first, which
                               the prefill step yields), each at its context
    finished(key, cached, outputs)   the rest of the decode, a refund of the prompt tokens the
                               replica served from its prefix cache, the slot freed; exactly once

The batch class's KV share is `FairnessConfig.batch_kv_share`, or sized with the roofline
(`controlplane.tenancy.classes`) so interactive TPOT p99 stays within the configured slowdown,
from the load the queue holds: interactive sequences per replica and their mean context, and
running means of batch prompts and outputs.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from controlplane.roofline.profile import EngineProfile
from controlplane.tenancy import vtc
from controlplane.tenancy.classes import ClassLoad, batch_kv_share, interactive_tpot
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.room import (
    ReplicaBooks,
    RoomRules,
    has_room,
    is_long_prefill,
    prefill_per_step,
)
from controlplane.tenancy.work import WorkModel
from controlplane.types import PriorityClass

K = TypeVar("K", bound=Hashable)
_EWMA = 0.05


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """What the queue knows of a request: its tenant, and the work and KV it will take."""

    tenant: str
    priority: PriorityClass
    weight: float
    prompt_tokens: int
    # KV the request will hold: prompt + predicted output
    reserved_tokens: int

    @property
    def batch(self) -> bool:
        return self.priority is PriorityClass.BATCH


@dataclass(slots=True)
class _Flight:
    entry: QueueEntry
    replica: str | None = None
    decoded: int = 0
    prefilling: bool = True
    per_step: int = 0
    long: bool = False


@functools.lru_cache(maxsize=1024)
def _derived_share(prof: EngineProfile, slowdown: float, load: ClassLoad) -> float:
    return batch_kv_share(prof, slowdown * interactive_tpot(prof, load), load)


@dataclass(slots=True)
class TenantQueueCore(Generic[K]):
    config: FairnessConfig
    work: WorkModel
    state: vtc.VtcState = field(default_factory=vtc.VtcState)
    fifos: dict[str, deque[K]] = field(default_factory=dict)
    waiting_entries: dict[K, QueueEntry] = field(default_factory=dict)
    classes: dict[str, PriorityClass] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    replicas: dict[str, ReplicaBooks] = field(default_factory=dict)
    inflight: dict[K, _Flight] = field(default_factory=dict)
    queued: int = 0
    # KV tokens reserved by each tenant's in-flight requests, and the ready replicas' total
    held: dict[str, int] = field(default_factory=dict)
    fleet_kv: float = 0.0
    fleet_replicas: int = 1
    # total work charged per tenant (before weights), for tests and reports
    charged: dict[str, float] = field(default_factory=dict)
    # per tenant, the [start, end] intervals during which it was backlogged
    backlog: dict[str, list[list[float]]] = field(default_factory=dict)
    last_sweep_s: float = -1e18
    # in-flight interactive requests and their reserved KV; running means of batch requests
    _interactive: list[int] = field(default_factory=lambda: [0, 0, 0])
    _batch_means: list[float] = field(default_factory=lambda: [1000.0, 500.0])

    @property
    def rules(self) -> RoomRules:
        c = self.config
        return RoomRules(
            c.slots_per_replica, c.mean_context_tokens, c.headroom, c.prefill_steps, c.long_prefills
        )

    # -- waiting ---------------------------------------------------------------------------------
    def _tenant(self, entry: QueueEntry) -> None:
        self.classes[entry.tenant] = entry.priority
        self.weights[entry.tenant] = entry.weight

    def enqueue(self, key: K, entry: QueueEntry, now: float) -> int:
        """Queue `key`; returns its tenant's queue length."""
        self._tenant(entry)
        fifo = self.fifos.setdefault(entry.tenant, deque())
        if not fifo:
            self.state = vtc.on_arrival(self.state, entry.tenant)
            self.backlog.setdefault(entry.tenant, []).append([now, now])
        fifo.append(key)
        self.waiting_entries[key] = entry
        self.queued += 1
        return len(fifo)

    def waiting(self) -> dict[str, PriorityClass]:
        return {t: self.classes[t] for t, f in self.fifos.items() if f}

    def contended(self) -> bool:
        return sum(1 for f in self.fifos.values() if f) > 1

    def next(self, fits: Callable[[K], bool], now: float) -> K | None:
        """Pop the head of the fairest tenant (or of one allowed to overtake it) if `fits`
        accepts it now; None otherwise."""
        waiting = self.waiting()
        tenant = vtc.pick(self.state, waiting)
        if tenant is None:
            return None
        if not fits(self.fifos[tenant][0]):
            tenant = self._overtaker(tenant, waiting, fits)
            if tenant is None:
                return None
        return self.pop(tenant, now)

    def pop(self, tenant: str, now: float) -> K | None:
        """The head of `tenant`'s FIFO, removed (None when it has none)."""
        fifo = self.fifos.get(tenant)
        if not fifo:
            return None
        key = fifo.popleft()
        self.waiting_entries.pop(key, None)
        self.queued -= 1
        if not fifo:
            self._idle(tenant, now)
        return key

    def remove(self, key: K, now: float) -> bool:
        """A waiting request left the queue (its client went away)."""
        entry = self.waiting_entries.pop(key, None)
        if entry is None:
            return False
        fifo = self.fifos[entry.tenant]
        fifo.remove(key)
        self.queued -= 1
        if not fifo:
            self._idle(entry.tenant, now)
        return True

    def _idle(self, tenant: str, now: float) -> None:
        self.state = vtc.on_idle(self.state, tenant)
        self.backlog[tenant][-1][1] = now

    def _overtaker(
        self, blocked: str, waiting: dict[str, PriorityClass], fits: Callable[[K], bool]
    ) -> str | None:
        """A tenant of the blocked one's class whose head fits, while its counter is within the
        blocked head's own charge of the blocked counter (bounded overtaking)."""
        state = self.state
        head = self.waiting_entries[self.fifos[blocked][0]]
        limit = state.counter(blocked) + self.work.prefill(head.prompt_tokens, 0) / head.weight
        cls = waiting[blocked]
        others = sorted(
            (state.counter(t), t) for t, c in waiting.items() if t != blocked and c is cls
        )
        for counter, t in others:
            if counter > limit:
                return None
            if fits(self.fifos[t][0]):
                return t
        return None

    def close(self, now: float) -> dict[str, list[tuple[float, float]]]:
        """The backlog intervals per tenant, those still open ending at `now`."""
        for tenant, fifo in self.fifos.items():
            if fifo:
                self.backlog[tenant][-1][1] = now
        return {t: [(a, b) for a, b in spans] for t, spans in self.backlog.items()}

    # -- room ------------------------------------------------------------------------------------
    def room(self, replica: str, prof: EngineProfile, entry: QueueEntry, others: int = 0) -> bool:
        books = self.replicas.get(replica)
        if books is None:
            books = self.replicas[replica] = ReplicaBooks()
        return has_room(
            self.rules,
            prof,
            books,
            prompt=entry.prompt_tokens,
            reserved=entry.reserved_tokens,
            batch=entry.batch,
            batch_share=self.batch_share(prof) if entry.batch else 1.0,
            under_share=self.under_share(entry.tenant, entry.reserved_tokens),
            others=others,
        )

    def under_share(self, tenant: str, reserved: int = 0) -> bool:
        """Whether `tenant` (with `reserved` more tokens) holds at most its weighted share of
        the fleet's KV, among the tenants holding some or waiting."""
        held = self.held.get(tenant, 0) + reserved
        active = {t for t, v in self.held.items() if v > 0} | self.state.backlogged | {tenant}
        total = sum(self.weights.get(t, 1.0) for t in active)
        return held <= self.weights.get(tenant, 1.0) / total * self.fleet_kv

    def batch_share(self, prof: EngineProfile) -> float:
        """The batch class's share of a replica's KV (see the module docstring)."""
        if self.config.batch_kv_share is not None:
            return self.config.batch_kv_share
        n, reserved, outputs = self._interactive
        if n == 0:
            return 1.0
        load = ClassLoad(
            interactive_sequences=round(n / max(1, self.fleet_replicas), 1),
            interactive_context=float(-(-reserved // n // 64) * 64),
            interactive_output=float(max(1, -(-outputs // n // 16) * 16)),
            batch_prompt=float(round(self._batch_means[0], -1)),
            batch_output=float(round(self._batch_means[1], -1)),
        )
        return _derived_share(prof, self.config.interactive_tpot_slowdown, load)

    # -- running ---------------------------------------------------------------------------------
    def _charge(self, tenant: str, work: float) -> None:
        if work > 0:
            self.state = vtc.charge(self.state, tenant, work, self.weights.get(tenant, 1.0))
            self.charged[tenant] = self.charged.get(tenant, 0.0) + work

    def admit(self, key: K, entry: QueueEntry, *, queued: bool = True) -> None:
        """`key` may go: charge its prefill; `queued=False` for one that never waited."""
        tenant = entry.tenant
        if not queued:
            self._tenant(entry)
            self.state = vtc.on_arrival(self.state, tenant)
        self.held[tenant] = self.held.get(tenant, 0) + entry.reserved_tokens
        self.inflight[key] = _Flight(entry)
        self._charge(tenant, self.work.prefill(entry.prompt_tokens, 0))
        if not queued:
            self.state = vtc.on_idle(self.state, tenant)
        output = entry.reserved_tokens - entry.prompt_tokens
        if entry.batch:
            m = self._batch_means
            m[0] += _EWMA * (entry.prompt_tokens - m[0])
            m[1] += _EWMA * (output - m[1])
        else:
            i = self._interactive
            i[0] += 1
            i[1] += entry.reserved_tokens
            i[2] += output

    def place(self, key: K, replica: str, prof: EngineProfile) -> None:
        """The admitted `key` went to `replica` (its books move there if it was elsewhere)."""
        f = self.inflight[key]
        if f.replica == replica:
            return
        if f.replica is not None:
            self._unplace(f)
        books = self.replicas.setdefault(replica, ReplicaBooks())
        f.replica = replica
        threshold = prof.long_prefill_token_threshold
        f.per_step = prefill_per_step(f.entry.prompt_tokens, threshold)
        f.long = is_long_prefill(f.entry.prompt_tokens, threshold)
        books.requests += 1
        books.reserved += f.entry.reserved_tokens
        books.prefill += f.per_step
        books.long_prefill += f.long
        if f.entry.batch:
            books.batch_reserved += f.entry.reserved_tokens

    def first_token(self, key: K) -> None:
        """The request's prefill is done: it leaves its replica's prefill backlog."""
        f = self.inflight.get(key)
        if f is not None and f.prefilling:
            f.prefilling = False
            if f.replica is not None:
                books = self.replicas[f.replica]
                books.prefill -= f.per_step
                books.long_prefill -= f.long

    def _decode_due(self, f: _Flight, outputs: int) -> float:
        produced = max(0, outputs - 1)
        new = produced - f.decoded
        if new <= 0:
            return 0.0
        work = self.work.decode(new, f.entry.prompt_tokens + f.decoded)
        f.decoded = produced
        return work

    def produced(self, key: K, outputs: int) -> None:
        """`outputs` tokens were produced so far: charge the decode tokens not charged yet."""
        f = self.inflight.get(key)
        if f is not None:
            self._charge(f.entry.tenant, self._decode_due(f, outputs))

    def produced_many(self, items: Iterable[tuple[K, int]], now: float) -> None:
        """`produced` for many requests, one counter update per tenant (the simulator's sweep)."""
        self.last_sweep_s = now
        due: dict[str, float] = {}
        for key, outputs in items:
            f = self.inflight.get(key)
            if f is not None:
                w = self._decode_due(f, outputs)
                if w:
                    due[f.entry.tenant] = due.get(f.entry.tenant, 0.0) + w
        for tenant, w in due.items():
            self._charge(tenant, w)

    def sweep_due(self, now: float) -> bool:
        return now - self.last_sweep_s >= self.config.charge_interval_s and self.contended()

    def finished(self, key: K, cached_tokens: int = 0, outputs: int | None = None) -> None:
        """The request ended (any way): charge the rest, refund cached prompt tokens, free it."""
        self.first_token(key)
        f = self.inflight.pop(key, None)
        if f is None:
            return
        entry, tenant = f.entry, f.entry.tenant
        if outputs is not None:
            self._charge(tenant, self._decode_due(f, outputs))
        cached = min(max(0, cached_tokens), entry.prompt_tokens)
        if cached:
            w = self.work.refund_cached(cached)
            self.state = vtc.refund(self.state, tenant, w, self.weights.get(tenant, 1.0))
            self.charged[tenant] = self.charged.get(tenant, 0.0) - w
        self.held[tenant] -= entry.reserved_tokens
        if not entry.batch:
            i = self._interactive
            i[0] -= 1
            i[1] -= entry.reserved_tokens
            i[2] -= entry.reserved_tokens - entry.prompt_tokens
        if f.replica is not None:
            self._unplace(f)

    def _unplace(self, f: _Flight) -> None:
        assert f.replica is not None
        books = self.replicas[f.replica]
        books.requests -= 1
        books.reserved -= f.entry.reserved_tokens
        if f.entry.batch:
            books.batch_reserved -= f.entry.reserved_tokens
        if f.prefilling:
            books.prefill -= f.per_step
            books.long_prefill -= f.long
        f.replica = None


__all__ = ["QueueEntry", "TenantQueueCore"]
