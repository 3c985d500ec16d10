"""The fleet simulator: replicas, routers and a shared prefix index on one event heap.

Everything happens at simulated times popped from a single heap (the injected clock):

    ARRIVAL   a trace request reaches router (i mod R): index lookup -> snapshot -> policy ->
              reservation + speculative index entry -> the replica's waiting queue
    STEP      a replica's step (or fast-forwarded decode run) ends: outputs, first tokens and
              completions go back to the router that sent them; the next step is scheduled
    KV        KV events reach the shared index (after `kv_event_delay_s`; evictions after an
              extra `eviction_notice_delay_s`)
    SCRAPE    every `scrape_interval_s` the routers read each replica's metrics (running,
              waiting, KV usage); 0 means metrics are always fresh
    CONTROL   a replica joins (ready after its load time) or leaves (drains, or dies)
    TICK      every `tick_s`, when a host set `on_tick` (the autoscaler: autoscaler.hosts.sim)

With `FleetConfig.fairness` set, ARRIVAL only queues the request in the router's per-tenant FIFOs
(`controlplane.tenancy.queue.TenantQueueCore`, the live router's queue core); it is routed when
the queue dispatches it: after the arrival, and whenever a request finishes or a replica becomes
ready, while a replica has room, and only to the replicas with room. Decode tokens are charged in
sweeps (every `charge_interval_s` while tenants contend) where the router charges them per chunk.

Hooks for a host (all optional): `observer` hears each request's arrival (with the router's
predicted output), the replica it is dispatched to, its first scheduling there, its first token
and its end (completed, rejected or failed); `join` / `leave` change the fleet at once;
`busy_time` reads a replica's busy seconds so far (its duty cycle).

Routers only ever see what a live router sees: scraped metrics, their own ledger, index lookups.
Each router is one `RoutingBooks` (controlplane.routing.books), the object the live router
drives: its policies (one per A/B arm of `FleetConfig.policy`), ledger and predictor; the index
operations the books return are applied at once.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.roofline.profile import EngineProfile
from controlplane.routing.books import IndexOp, Routed, RoutingBooks, Speculate
from controlplane.routing.config import PolicyConfig
from controlplane.routing.interfaces import RoutingPolicy
from controlplane.routing.predictor import OutputLengthPredictor
from controlplane.sim.block_pool import BlockPool
from controlplane.sim.engine import SimEngine
from controlplane.sim.engine_index import EngineBackedIndex
from controlplane.sim.ids import Ids, dense_block_ids
from controlplane.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from controlplane.sim.request import EngineRequest, Status, priority_value
from controlplane.sim.results import FleetResult, ReplicaStats, RequestRecord
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.queue import QueueEntry, TenantQueueCore
from controlplane.tenancy.work import WorkModel
from controlplane.traces.model import Trace, TraceRequest
from controlplane.types import (
    DecisionReason,
    EngineMetrics,
    FleetSnapshot,
    Ledger,
    Phase,
    PrefixMatch,
    ReplicaState,
    RoutingRequest,
)

ARRIVAL, STEP, KV, SCRAPE, CONTROL, TICK = range(6)
_JOIN, _READY, _LEAVE, _KILL = range(4)


class RequestObserver(Protocol):
    """What a host hears about each request (autoscaler.demand.DemandMeter has this shape)."""

    def arrived(
        self, request_id: str, prompt_tokens: int, predicted_output_tokens: int, now: float
    ) -> object: ...

    def dispatched(self, request_id: str, replica: str, now: float) -> None: ...

    def started(self, request_id: str, now: float) -> None: ...

    def first_token(self, request_id: str, now: float) -> None: ...

    def finished(self, request_id: str, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How the simulated fleet and its routers behave."""

    profile: EngineProfile
    replicas: int = 8
    routers: int = 1
    # the routing policy (or A/B arms) and the books' settings: the live router's `policy:`
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    kv_event_delay_s: float = 0.0
    eviction_notice_delay_s: float = 0.0
    scrape_interval_s: float = 0.5
    oracle_output: bool = False
    priority_policy: bool = False
    fast_forward: bool = True
    # the router-side tenant queue (None, or mode "off": every request is routed at arrival)
    fairness: FairnessConfig | None = None
    # tenant -> fair-queue weight (absent tenants weigh 1)
    tenant_weights: tuple[tuple[str, float], ...] = ()


@dataclass(slots=True)
class _Replica:
    rid: str
    engine: SimEngine
    phase: Phase
    incarnation: int = 0
    version: int = 0
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    joined_s: float = 0.0
    ready_s: float = 0.0
    left_s: float = -1.0
    # requests its last schedule could not admit (what it reports as waiting, minus arrivals
    # since); the tenant queue sends it nothing while there are any
    blocked: int = 0
    # when the step (or run) in progress started; when a loading replica is due to serve
    busy_since: float = 0.0
    ready_eta_s: float = 0.0


@dataclass(slots=True)
class _Router:
    books: RoutingBooks
    # replica id -> (what the view was built from, the view); reused while unchanged
    views: dict[str, tuple[tuple[object, ...], ReplicaState]] = field(default_factory=dict)


class FleetSim:
    """One simulated fleet. Build, optionally schedule joins/leaves, then `run(trace)` once."""

    def __init__(
        self,
        config: FleetConfig,
        policy_factory: Callable[[], RoutingPolicy] | None = None,
    ) -> None:
        """`policy_factory`: one policy object per router instead of `config.policy`'s arms."""
        self.config = config
        self.now = 0.0
        self._heap: list[tuple[float, int, int, object, object]] = []
        self._seq = itertools.count()
        self.replicas: list[_Replica] = []
        self._by_id: dict[str, _Replica] = {}
        # zero event delay: the index reads the engines' pools (identical state, no events)
        self._direct = config.kv_event_delay_s <= 0 and config.eviction_notice_delay_s <= 0
        self._pools: dict[str, BlockPool] = {}
        self._id_floor = 0
        self._engine_index = (
            EngineBackedIndex(lambda: self.now, self._pools, self._sync_for_lookup)
            if self._direct
            else None
        )
        self.index: InMemoryPrefixIndex = (
            self._engine_index
            if self._engine_index is not None
            else InMemoryPrefixIndex(clock=lambda: self.now)
        )
        self.routers = [_Router(self._books(policy_factory)) for _ in range(max(1, config.routers))]
        for _ in range(config.replicas):
            self._new_replica(Phase.READY, 0.0)
        self.records: list[RequestRecord] = []
        self._routing: dict[int, tuple[Routed, _Router, _Replica, EngineRequest]] = {}
        self.kv_events_applied = 0
        fair = config.fairness
        self.queue: TenantQueueCore[int] | None = (
            TenantQueueCore(fair, WorkModel.build(fair.mode, config.profile))
            if fair is not None and fair.mode != "off"
            else None
        )
        self._weights = dict(config.tenant_weights)
        self._dispatch_due = False
        # queued request index -> (record, what the queue knows of it)
        self._queued: dict[int, tuple[RequestRecord, QueueEntry]] = {}
        # host hooks (see the module docstring)
        self.observer: RequestObserver | None = None
        self.on_tick: Callable[[float], None] | None = None
        self.tick_s = 0.0

    def _books(self, policy_factory: Callable[[], RoutingPolicy] | None) -> RoutingBooks:
        cfg = self.config
        predictor = OutputLengthPredictor(oracle=cfg.oracle_output)
        if policy_factory is not None:
            return RoutingBooks.single(policy_factory(), cfg.policy, predictor=predictor)
        return RoutingBooks(cfg.policy, predictor=predictor)

    # -- fleet changes ---------------------------------------------------------------------------
    def _new_replica(self, phase: Phase, now: float) -> _Replica:
        cfg = self.config
        rid = f"replica-{len(self.replicas)}"
        engine = SimEngine(
            cfg.profile,
            events_enabled=not self._direct,
            priority_policy=cfg.priority_policy,
            fast_forward=cfg.fast_forward,
        )
        engine.reserve_ids(self._id_floor)
        rep = _Replica(rid, engine, phase, joined_s=now, ready_s=now)
        self._pools[rid] = engine.pool
        self.replicas.append(rep)
        self._by_id[rid] = rep
        return rep

    def schedule_join(self, at_s: float, load_time_s: float) -> None:
        """A replica starts loading at `at_s` and serves from `at_s + load_time_s`."""
        self._push(at_s, CONTROL, _JOIN, load_time_s)

    def schedule_leave(self, at_s: float, replica_id: str, *, drain: bool = True) -> None:
        """A replica stops taking requests at `at_s`; it finishes them (drain) or dies."""
        self._push(at_s, CONTROL, _LEAVE if drain else _KILL, replica_id)

    def join(self, now: float, load_time_s: float) -> str:
        """A replica starts loading now (from a tick handler); returns its id."""
        return self._join(now, load_time_s).rid

    def leave(self, replica_id: str, now: float, *, drain: bool = True) -> None:
        """A replica stops taking requests now: a loading one is gone at once, a ready one
        drains (finishes what it holds) or dies."""
        self._on_control(_LEAVE if drain else _KILL, replica_id, now)

    def busy_time(self, replica_id: str, now: float) -> float:
        """Seconds the replica's engine has been running steps up to `now`."""
        rep = self._by_id[replica_id]
        eng = rep.engine
        return eng.busy_s + (max(0.0, now - rep.busy_since) if not eng.idle else 0.0)

    # -- the loop --------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: object = None, b: object = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, a, b))

    def run(
        self,
        trace: Trace,
        *,
        block_ids: Sequence[Ids] | None = None,
        id_floor: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> FleetResult:
        wall0 = time.perf_counter()
        cfg = self.config
        bs = cfg.profile.resolved_block_size
        reqs = trace.requests
        if block_ids is None:
            block_ids, id_floor = dense_block_ids(trace, bs)
        self._id_floor = max(self._id_floor, id_floor)
        for rep in self.replicas:
            rep.engine.reserve_ids(self._id_floor)
        t0 = reqs[0].arrival_s if reqs else 0.0
        for i, r in enumerate(reqs):
            self._push(r.arrival_s - t0, ARRIVAL, i)
        if cfg.scrape_interval_s > 0:
            self._push(0.0, SCRAPE)
        if self.on_tick is not None and self.tick_s > 0:
            self._push(self.tick_s, TICK)
        heap, pop = self._heap, heapq.heappop
        arrivals_left = len(reqs)
        done = 0
        while heap:
            t, _, kind, a, b = pop(heap)
            self.now = t
            if kind == STEP:
                rep = self._by_id[a]  # type: ignore[index]
                if b == rep.version:
                    self._on_step_end(rep, t)
            elif kind == ARRIVAL:
                i = int(a)  # type: ignore[call-overload]
                if self.queue is None:
                    self._on_arrival(i, reqs[i], block_ids[i], t)
                else:
                    self._enqueue(i, reqs[i], t)
                arrivals_left -= 1
                done += 1
                if progress is not None and done % 256 == 0:
                    progress(done)
            elif kind == KV:
                self._apply_events(a, b)  # type: ignore[arg-type]
            elif kind == SCRAPE:
                self._scrape(t)
                if arrivals_left or any(not rep.engine.idle for rep in self.replicas):
                    self._push(t + cfg.scrape_interval_s, SCRAPE)
            elif kind == TICK:
                assert self.on_tick is not None
                self.on_tick(t)
                if arrivals_left or any(not rep.engine.idle for rep in self.replicas):
                    self._push(t + self.tick_s, TICK)
            else:
                self._on_control(a, b, t)  # type: ignore[arg-type]
            if self._dispatch_due:
                self._dispatch(reqs, block_ids, t)
        for record, _ in self._queued.values():
            record.rejected = "queued_at_end"
            if self.observer is not None:
                self.observer.finished(record.request_id, self.now)
        if progress is not None:
            progress(done)
        wall = time.perf_counter() - wall0
        stats = [
            ReplicaStats(
                replica_id=rep.rid,
                busy_s=rep.engine.busy_s,
                steps=rep.engine.steps,
                tokens_out=rep.engine.tokens_out,
                prefix_queries=rep.engine.sched.prefix_queries,
                prefix_hits=rep.engine.sched.prefix_hits,
                preemptions=rep.engine.sched.num_preemptions,
                joined_s=rep.joined_s,
                ready_s=rep.ready_s,
                left_s=rep.left_s if rep.left_s >= 0 else self.now,
            )
            for rep in self.replicas
        ]
        result = FleetResult(
            records=self.records,
            replicas=stats,
            simulated_s=self.now,
            wall_s=wall,
            trace_span_s=trace.duration_s,
            kv_events_applied=self.kv_events_applied,
        )
        if self.queue is not None:
            result.meta["backlog"] = self.queue.close(self.now)
        return result

    # -- handlers --------------------------------------------------------------------------------
    def _snapshot(self, router: _Router, now: float) -> FleetSnapshot:
        live = self.config.scrape_interval_s <= 0
        use_ledger = self.config.policy.reservations
        states = []
        views = router.views
        ledger_of = router.books.ledger
        version_of = ledger_of.version
        for rep in self.replicas:
            if rep.phase is Phase.DEAD:
                continue
            eng = rep.engine
            key = (
                version_of(rep.rid) if use_ledger else 0,
                rep.metrics,
                rep.phase,
                rep.incarnation,
            )
            cached = views.get(rep.rid)
            if cached is not None and cached[0] == key and not live:
                states.append(cached[1])
                continue
            metrics = (
                EngineMetrics(eng.num_running, eng.num_waiting, eng.kv_usage(now), now)
                if live
                else rep.metrics
            )
            ledger = ledger_of.view(rep.rid) if use_ledger else Ledger()
            if live and use_ledger and ledger.unscraped_requests:
                ledger = _visible(ledger)
            state = ReplicaState(
                replica_id=rep.rid,
                profile=eng.profile,
                phase=rep.phase,
                incarnation=rep.incarnation,
                metrics=metrics,
                ledger=ledger,
            )
            views[rep.rid] = (key, state)
            states.append(state)
        return FleetSnapshot(tuple(states), now)

    def _on_arrival(self, i: int, tr: TraceRequest, ids: Ids, now: float) -> None:
        self._route(i, tr, ids, self._new_record(i, tr, now), now)

    def _new_record(self, i: int, tr: TraceRequest, now: float) -> RequestRecord:
        record = RequestRecord(
            request_id=tr.request_id or f"req-{i}",
            tenant=tr.tenant,
            priority=tr.priority.value,
            arrival_s=now,
            prompt_tokens=tr.prompt_tokens,
            output_tokens=max(1, tr.output_tokens),
            router=i % len(self.routers),
        )
        self.records.append(record)
        return record

    def _route(
        self,
        i: int,
        tr: TraceRequest,
        ids: Ids,
        record: RequestRecord,
        now: float,
        room: Callable[[ReplicaState], bool] | None = None,
        entry: QueueEntry | None = None,
    ) -> None:
        """Route one request now (only to replicas `room` accepts, when the queue dispatches it;
        `entry`: what the queue knows of it)."""
        cfg = self.config
        router = self.routers[i % len(self.routers)]
        rid = record.request_id
        if not self._direct:
            self._sync_all(now)  # the event-fed index needs every event published by now
        books = router.books
        predicted = books.predict(tr.tenant, tr.prompt_tokens, tr.max_tokens, tr.output_tokens)
        observer = self.observer
        if observer is not None and room is None:
            observer.arrived(rid, tr.prompt_tokens, predicted, now)
        rreq = RoutingRequest(
            request_id=rid,
            prompt_tokens=tr.prompt_tokens,
            block_hashes=tuple(ids.tolist()),
            tenant=tr.tenant,
            priority=tr.priority,
            max_tokens=tr.max_tokens,
            predicted_output_tokens=predicted,
            session_key=tr.session_key,
            arrival_s=now,
            block_size=cfg.profile.resolved_block_size,
        )
        snapshot = self._snapshot(router, now)
        if room is not None:
            snapshot = FleetSnapshot(tuple(r for r in snapshot.replicas if room(r)), now)
        candidates = [r.replica_id for r in snapshot.replicas if r.routable]
        if not candidates:
            matches: Mapping[str, PrefixMatch] = {}
        elif self._engine_index is not None:
            matches = self._engine_index.lookup(rreq.block_hashes, candidates, ids)
        else:
            matches = self.index.lookup(rreq.block_hashes, candidates)
        arm = books.arm_for(rreq)
        decision = books.decide(rreq, snapshot, matches, arm)
        record.arm = arm.name
        record.reason = decision.reason.value
        record.expected_hit_blocks = decision.expected_hit_blocks
        if decision.replica_id is None:
            record.rejected = "no_ready_replica"
            if observer is not None:
                observer.finished(rid, now)
            return
        rep = self._by_id[decision.replica_id]
        record.replica = rep.rid
        engine = rep.engine
        if not engine.fits(tr.prompt_tokens, max(1, tr.output_tokens)):
            record.rejected = "too_long"
            record.reason = DecisionReason.NO_HEALTHY_REPLICA.value
            if observer is not None:
                observer.finished(rid, now)
            return
        if observer is not None:
            observer.dispatched(rid, rep.rid, now)
        routed, ops = books.commit(rreq, decision, snapshot, arm, now)
        self._apply(ops)
        ereq = EngineRequest(
            rid,
            i,
            tr.prompt_tokens,
            max(1, tr.output_tokens),
            ids,
            now,
            priority=priority_value(tr.priority),
            tag=record,
        )
        self._routing[i] = (routed, router, rep, ereq)
        if self.queue is not None and entry is not None:
            record.dispatched_s = now
            self.queue.admit(i, entry)
            self.queue.place(i, rep.rid, engine.profile)
        if engine.add_request(ereq, now) or engine.idle:
            self._restart(rep, now)

    # -- the router-side tenant queue ------------------------------------------------------------
    def _enqueue(self, i: int, tr: TraceRequest, now: float) -> None:
        assert self.queue is not None
        record = self._new_record(i, tr, now)
        out = max(1, tr.output_tokens)
        if not any(rep.engine.fits(tr.prompt_tokens, out) for rep in self.replicas):
            record.rejected = "too_long"
            record.reason = DecisionReason.NO_HEALTHY_REPLICA.value
            return
        router = self.routers[i % len(self.routers)]
        predicted = router.books.predict(
            tr.tenant, tr.prompt_tokens, tr.max_tokens, tr.output_tokens
        )
        entry = QueueEntry(
            tr.tenant,
            tr.priority,
            self._weights.get(tr.tenant, 1.0),
            tr.prompt_tokens,
            tr.prompt_tokens + max(1, predicted),
        )
        self._queued[i] = (record, entry)
        if self.observer is not None:
            self.observer.arrived(record.request_id, tr.prompt_tokens, predicted, now)
        self.queue.enqueue(i, entry, now)
        self._dispatch_due = True

    def _dispatch(self, reqs: Sequence[TraceRequest], block_ids: Sequence[Ids], now: float) -> None:
        """Dispatch queued requests, fairest tenant first, while a replica has room."""
        q = self.queue
        assert q is not None
        self._dispatch_due = False
        if not q.queued:
            return
        if q.sweep_due(now):
            self._sync_all(now)
            routing = self._routing
            q.produced_many(((k, routing[k][3].num_output) for k in q.inflight), now)
        ready = [r for r in self.replicas if r.phase is Phase.READY]
        q.fleet_kv = sum(r.engine.profile.num_gpu_blocks * r.engine.block_size for r in ready)
        q.fleet_replicas = len(ready)

        def fits(rep: _Replica, i: int, entry: QueueEntry) -> bool:
            tr = reqs[i]
            return (
                not rep.blocked and rep.engine.fits(tr.prompt_tokens, max(1, tr.output_tokens))
            ) and q.room(rep.rid, rep.engine.profile, entry)

        while True:
            i = q.next(lambda i: any(fits(rep, i, self._queued[i][1]) for rep in ready), now)
            if i is None:
                return
            record, entry = self._queued.pop(i)

            def room(state: ReplicaState, i: int = i, entry: QueueEntry = entry) -> bool:
                return fits(self._by_id[state.replica_id], i, entry)

            self._route(i, reqs[i], block_ids[i], record, now, room, entry)

    def _restart(self, rep: _Replica, now: float) -> None:
        """(Re)schedule the replica's step-end event after a cut or when it was idle."""
        eng = rep.engine
        rep.version += 1
        end = eng.busy_until if not eng.idle else self._start(rep, now)
        rep.blocked = eng.num_waiting
        if not self._direct:  # engines publish events only when the index is event-fed
            self._publish(rep, now)
        if end is not None:
            self._push(end, STEP, rep.rid, rep.version)

    def _start(self, rep: _Replica, now: float) -> float | None:
        """The engine's next step; tells the observer which requests it schedules first."""
        end = rep.engine.start(now)
        if end is not None:
            rep.busy_since = now
            if self.observer is not None:
                for req in rep.engine.sched.running:
                    if req.first_scheduled_s < 0:
                        req.first_scheduled_s = now
                        self.observer.started(req.request_id, now)
        return end

    def _on_step_end(self, rep: _Replica, now: float) -> None:
        eng = rep.engine
        eng.complete(now)
        first, finished = eng.drain()
        observer, queue, routing = self.observer, self.queue, self._routing
        for req in first:
            if observer is not None:
                observer.first_token(req.request_id, now)
            if queue is not None:
                queue.first_token(req.uid)
            routed, router, _rep, _ = routing[req.uid]
            self._apply(router.books.first_token(routed))
        for req in finished:
            self._finish(req, now)
        end = self._start(rep, now)
        if self.queue is not None:
            if rep.blocked and not eng.num_waiting and self.queue.queued:
                self._dispatch_due = True
            rep.blocked = eng.num_waiting
        if not self._direct:
            self._publish(rep, now)
        if end is not None:
            self._push(end, STEP, rep.rid, rep.version)
        elif rep.phase is Phase.DRAINING and not eng.num_waiting:
            self._retire(rep, now)

    def _finish(self, req: EngineRequest, now: float, failed: str = "") -> None:
        routed, router, _rep, _ = self._routing.pop(req.uid)
        record = req.tag
        assert isinstance(record, RequestRecord)
        record.first_token_s = req.first_token_s
        record.finish_s = now
        record.cached_tokens = max(0, req.cached_tokens)
        record.preemptions = req.preemptions
        if failed:
            record.rejected = failed
        if self.queue is not None:
            self.queue.finished(req.uid, max(0, req.cached_tokens), req.num_output)
            self._dispatch_due = True
        self._apply(router.books.finish(routed, None if failed else req.num_output) or [])
        if self.observer is not None:
            self.observer.finished(routed.request_id, now)

    def _apply(self, ops: list[IndexOp]) -> None:
        """The index operations the books asked for, applied at once."""
        index = self.index
        for op in ops:
            if isinstance(op, Speculate):
                index.speculate(op.replica_id, op.hashes, op.ttl_s)
            else:
                index.retract(op.replica_id, op.hashes, op.grace_s)

    def _publish(self, rep: _Replica, now: float) -> None:
        events = rep.engine.take_events()
        if not events:
            return
        cfg = self.config
        removals: list[KVEvent] = []
        if cfg.eviction_notice_delay_s > 0:
            removals = [e for e in events if isinstance(e, BlockRemoved)]
            events = [e for e in events if not isinstance(e, BlockRemoved)]
        key = (rep.rid, rep.incarnation)
        if cfg.kv_event_delay_s > 0:
            self._push(now + cfg.kv_event_delay_s, KV, key, events)
        else:
            self._apply_events(key, events)
        if removals:
            delay = cfg.kv_event_delay_s + cfg.eviction_notice_delay_s
            self._push(now + delay, KV, key, removals)

    def _apply_events(self, key: tuple[str, int], events: list[KVEvent]) -> None:
        rid, incarnation = key
        rep = self._by_id.get(rid)
        if rep is None or rep.incarnation != incarnation or rep.phase is Phase.DEAD:
            return
        index = self.index
        for ev in events:
            if isinstance(ev, BlockStored):
                index.record_stored(rid, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                index.record_removed(rid, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                index.clear(rid)
            self.kv_events_applied += 1

    def _sync_for_lookup(self, replica_id: str, first_hash: int) -> None:
        eng = self._by_id[replica_id].engine
        if eng.in_run and (eng.pool.cached_block(first_hash) is not None or eng.run_caches_shared):
            eng.sync(self.now)

    def _sync_all(self, now: float) -> None:
        """Routers are about to observe the fleet: bring fast-forwarded runs up to `now`."""
        for rep in self.replicas:
            if rep.engine.in_run:
                rep.engine.sync(now)
                self._publish(rep, now)

    def _scrape(self, now: float) -> None:
        ledgers = [router.books.ledger for router in self.routers]
        for rep in self.replicas:
            eng = rep.engine
            rep.metrics = EngineMetrics(eng.num_running, eng.num_waiting, eng.kv_usage(now), now)
            for ledger in ledgers:
                ledger.scraped(rep.rid, now)

    def _on_control(self, op: int, arg: object, now: float) -> None:
        if op == _JOIN:
            self._join(now, float(arg))  # type: ignore[arg-type]
        elif op == _READY:
            rep = self._by_id[str(arg)]
            if rep.phase is Phase.LOADING:
                rep.phase = Phase.READY
                rep.ready_s = now
                self._dispatch_due = self.queue is not None
        elif op == _LEAVE:
            rep = self._by_id[str(arg)]
            if rep.phase in (Phase.READY, Phase.LOADING):
                rep.phase = Phase.DRAINING
                if rep.engine.idle and not rep.engine.num_waiting:
                    self._retire(rep, now)
        else:
            rep = self._by_id[str(arg)]
            self._kill(rep, now)

    def _join(self, now: float, load_time_s: float) -> _Replica:
        rep = self._new_replica(Phase.LOADING, now)
        rep.ready_eta_s = now + load_time_s
        self._push(now + load_time_s, CONTROL, _READY, rep.rid)
        return rep

    def _retire(self, rep: _Replica, now: float) -> None:
        rep.phase = Phase.DEAD
        rep.left_s = now
        self.index.clear(rep.rid)
        self._pools.pop(rep.rid, None)

    def _kill(self, rep: _Replica, now: float) -> None:
        eng = rep.engine
        victims = list(eng.sched.running) + list(eng.sched.waiting)
        for req in victims:
            eng.abort(req, now)
            self._finish(req, now, failed="replica_died")
        rep.version += 1
        eng.busy_until = None
        self._retire(rep, now)


def _visible(ledger: Ledger) -> Ledger:
    """With always-fresh metrics nothing this router sent is invisible."""
    return Ledger(
        requests=ledger.requests,
        prefill_tokens=ledger.prefill_tokens,
        pending_prompt_tokens=ledger.pending_prompt_tokens,
        decoding=ledger.decoding,
        decode_tokens=ledger.decode_tokens,
        context_tokens=ledger.context_tokens,
        unscraped_requests=0,
    )


__all__ = ["FairnessConfig", "FleetConfig", "FleetSim", "RequestObserver", "Status"]
