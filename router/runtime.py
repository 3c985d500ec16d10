"""Everything one router process runs, built from `RouterSettings` and closed in reverse order.

guard    ReplicaGuard: every replica's id and URL are checked before the fleet knows it
         (configured ones here, at startup; every source's in the registry): router/fleet/urls.py
fleet    LiveFleet: probes, scrapes, passive ejection
registry FleetRegistry: membership and lifecycle, per process or shared in Redis
         (router/fleet/registry.py); sources report to it (static, DNS, admin: sources.py) and
         the follower makes `fleet` match it (router/fleet/follower.py, through the FleetOps
         methods below: members, join, drain, resume, leave, seen)
index    in-memory, or the shared Redis index
events   EventIndexer over the replicas that publish KV events (when `redis.ingest_events`
         or no Redis: a process-local index has no other source)
tenancy  KeyRing: API key -> tenant (its salt derived from $CP_CACHE_SALT_SECRET)
core     RouterCore: tokenize, hash (scoped by the request's cache salt), look up, decide, reserve
proxy    Proxy: upstream calls, retries, streaming deadlines
quotas   token quotas per tenant (MemoryQuotaStore, or RedisQuotaStore with `redis.url`)
demand   RouterDemand: the autoscaler's demand signal (cp_demand_*, cp_backlog_*)
metrics  RouterMetrics (its own registry)
status   StatusFeed: GET /admin/status, /status (router/status/); `decisions` the last routing
         decisions; `status_sources` scaling decisions of an autoscaler in this process
hooks    what a request's scope (router/scope.py) closes when it ends: quota, fair queue,
         routing books, demand, telemetry
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, ClassVar

import httpx
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from controlplane.errors import RegistryUnavailableError, StoreError
from controlplane.kvevents.config import ReplicaSource
from controlplane.kvevents.service import EventIndexer
from controlplane.replica_info import ReplicaInfo
from controlplane.roofline.profile import EngineProfile
from controlplane.routing.books import Routed, RoutingBooks
from controlplane.store.breaker import CircuitBreaker
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import QuotaStore
from controlplane.tenancy.quota_redis import RedisQuotaStore
from controlplane.types import FleetSnapshot
from router.config import ReplicaConfig, RouterSettings
from router.core import Prefetch, RouterCore
from router.fairness.queue import FairQueue, Ticket
from router.fairness.shared import SharedFairQueue, fair_queue_for
from router.fairness.tenants import QuotaHooks, key_ring, quota_store_for, salt_policy
from router.fleet.follower import RegistryFollower
from router.fleet.index import RedisRouterIndex, RouterIndex, open_index
from router.fleet.lifecycle import ADMIN_SOURCE, Seen
from router.fleet.live_fleet import LiveFleet
from router.fleet.registry import RegistryMetrics, Snapshot
from router.fleet.sources import (
    Source,
    member_of,
    membership_sources,
    open_registry,
    router_id,
    static_source,
)
from router.fleet.urls import Resolver
from router.http.proxy import Proxy
from router.scope import RequestScope, ScopeHooks
from router.status.feed import StatusFeed, StatusSource
from router.status.ring import DecisionRing
from router.telemetry import RouterMetrics, decision_header_value
from router.telemetry.demand import RouterDemand
from router.telemetry.requests import RequestTelemetry
from router.telemetry.tracing import TRACER_NAME
from router.tokenizer import router_tokenizer

if TYPE_CHECKING:
    from router.http.relay import Exchange

log = logging.getLogger("controlplane.router")


class RouterRuntime:
    # the upstream side of a request (router/http/relay.py's `Exchange` when None); the Serve
    # ingress sends through a deployment handle instead (router/serve/ingress.py)
    exchange_type: ClassVar[type[Exchange] | None] = None

    def __init__(
        self,
        settings: RouterSettings,
        *,
        metrics: RouterMetrics | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        tracer_provider: TracerProvider | None = None,
        resolve: Resolver | None = None,
    ) -> None:
        """`resolve`: host name -> addresses for the replica guard (default: getaddrinfo;
        tests whose `transport` serves made-up names pass their own)."""
        self.settings = settings
        # before anything probes a replica: a refused configured replica fails the startup
        self.replica_guard = settings.check_replicas(resolve)
        self.metrics = metrics or RouterMetrics()
        # the process's global provider unless one is given (tests)
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)
        # the routing books: policies (one per A/B arm), ledger, predictor (the simulator's too)
        self.books = RoutingBooks(settings.policy)
        self.ledger = self.books.ledger
        self.fleet = LiveFleet(settings, ledger=self.ledger, transport=transport)
        self.registry = open_registry(
            settings, self.replica_guard, RegistryMetrics(self.metrics.registry)
        )
        self.follower = RegistryFollower(
            self.registry,
            self,
            router_id=router_id(settings),
            resync_s=settings.fleet.resync_s,
        )
        self.static = static_source(settings, self.registry)
        self.sources: list[Source] = membership_sources(
            settings, self.registry, resolve=resolve, metrics=self.metrics.registry
        )
        if self.static is not None:
            self.sources.insert(0, self.static)
        self.index: RouterIndex = open_index(settings.redis)
        self.tokenizer = router_tokenizer(settings.tokenizer, self.fleet, settings.served_model)
        # API key -> tenant (config file, then /admin/tenants)
        self.tenancy = key_ring(settings)
        self.core = RouterCore(
            settings,
            self.fleet,
            self.index,
            self.tokenizer,
            self.metrics,
            books=self.books,
            salts=salt_policy(settings),
        )
        t = settings.timeouts
        self.proxy = Proxy(
            self.fleet, ttft_s=t.ttft_s, idle_s=t.idle_s, retry_budget=t.retry_budget
        )
        self.events: dict[str, EventIndexer] = {}
        # the fair queue: local, or shared by every router in Redis (router/fairness/shared.py)
        self.fairq: FairQueue = fair_queue_for(
            settings,
            self.fleet_snapshot,
            on_change=lambda tenant, queued: self.metrics.queued.labels(tenant).set(queued),
            on_outcome=lambda outcome: self.metrics.fair_shared.labels(outcome).inc(),
        )
        # token quotas: reserve before dispatch, settle once (Redis when configured)
        self.quotas: QuotaStore = quota_store_for(settings)
        self.quotas.on_settle = lambda o: self.metrics.quota_settlements.labels(str(o)).inc()
        # the demand signal the autoscaler reads from /metrics (router/telemetry/demand.py)
        self.demand = RouterDemand(settings, self.metrics.registry)
        # what keeps books about each request, closed in this order when its scope ends
        self.hooks: tuple[ScopeHooks, ...] = (
            QuotaHooks(self.quotas, settings.quota.unknown_usage),
            self.fairq,
            self.core,
            self.demand,
            RequestTelemetry(self.metrics),
        )
        self.fleet.on_restart(self._restarted)
        self.fleet.on_eject(
            lambda rid, reason: self.metrics.ejections.labels(rid, str(reason)).inc()
        )
        # the status view: the last decisions, scaling decisions appended by an attached autoscaler
        self.decisions = DecisionRing(settings.status.decisions)
        self.core.observers.append(self.decisions.record)
        self.status_sources: list[StatusSource] = []
        self.status = StatusFeed(self, window_s=settings.status.demand_window_s)
        self.fleet.on_described(self._described)
        self.started_s = time.monotonic()
        self.started_wall_s = time.time()

    @property
    def ingests_events(self) -> bool:
        return self.index.kind == "memory" or self.settings.redis.ingest_events

    def _follow(self, r: ReplicaConfig) -> None:
        if not (r.kv_events and self.ingests_events) or r.id in self.events:
            return
        src = ReplicaSource(
            replica_id=r.id,
            events=r.kv_events,
            replay=r.kv_replay,
            topic=r.kv_topic,
            model=self.settings.served_model,
            block_size=r.block_size,
        )
        secret = os.environ.get(self.settings.hash_secret_env, "").encode()
        follower = EventIndexer([src], self.index.events_sink, secret=secret)
        follower.start()
        self.events[r.id] = follower

    def _described(self, replica_id: str, info: ReplicaInfo) -> None:
        """The replica's KV events are keyed by the model it says it serves (several models:
        not necessarily `served_model`), as `RouterCore` keys the prompts routed to it."""
        follower = self.events.get(replica_id)
        ingestor = follower.ingestors.get(replica_id) if follower is not None else None
        base = next((m.name for m in info.models if m.parent is None), None)
        if ingestor is not None and base is not None:
            ingestor.model = base

    def _restarted(self, replica_id: str) -> None:
        if replica_id in self.events:
            return  # its event follower sees the restart (sequence going back) and purges
        self.core._spawn(self.index.clear(replica_id))

    async def start(self) -> None:
        await self.quotas.start()
        await self.fairq.start()
        # the configured replicas first, then this router's fleet as the registry holds it
        # (a restarted router reads back what other sources and routers put there)
        if self.static is not None:
            await self.static.report_once()
        await self.follower.sync()
        for s in self.sources:
            s.start()
        self.follower.start()
        await self.fleet.start()
        await self.fleet.refresh()
        for r in self.settings.replicas:
            if r.id in self.members():
                self._follow(r)

    # -- admin: through the registry, so every router sharing it follows --------------------------
    async def add_replica(self, cfg: ReplicaConfig) -> None:
        """Add `cfg` as the admin source (`ReplicaRefusedError` when the guard refuses it or
        the id is in the fleet at another URL), then follow the registry at once."""
        async with _registry_call():
            await self.registry.add(ADMIN_SOURCE, member_of(cfg))
        await self.follower.sync()

    async def drain_replica(self, replica_id: str) -> None:
        """Drain fleet-wide (`UnknownReplicaError` for an id the registry lacks)."""
        async with _registry_call():
            await self.registry.drain([replica_id])
        await self.follower.sync()

    async def retire_replica(self, replica_id: str, wait_s: float) -> bool:
        """Drain it and wait up to `wait_s` for it to leave every router; whether it left."""
        async with _registry_call():
            await self.registry.withdraw(ADMIN_SOURCE, replica_id)
        await self.drain_replica(replica_id)
        async with _registry_call():
            left = await self.registry.wait_drained([replica_id], wait_s)
        await self.follower.sync()
        return not left

    async def fleet_records(self) -> Snapshot:
        """The registry's records now (`RegistryUnavailableError` when it cannot be read)."""
        async with _registry_call():
            return await self.registry.load()

    # -- FleetOps: what the registry follower changes ----------------------------------------------
    def members(self) -> dict[str, tuple[str, bool]]:
        return {r.replica_id: (r.url, r.draining) for r in self.fleet.replicas()}

    async def join(self, cfg: ReplicaConfig) -> None:
        self.fleet.add(cfg)
        self._follow(cfg)

    def drain(self, replica_id: str) -> None:
        self.fleet.drain(replica_id)

    def resume(self, replica_id: str) -> None:
        self.fleet.resume(replica_id)

    def seen(self) -> dict[str, Seen]:
        return self.fleet.seen()

    async def leave(self, replica_id: str) -> None:
        await self.fleet.remove(replica_id)
        follower = self.events.pop(replica_id, None)
        if follower is not None:
            await follower.close()
        self.ledger.drop_replica(replica_id)
        await self.index.clear(replica_id)

    def fleet_snapshot(self) -> FleetSnapshot:
        """The replicas requests go to, as the fair queue sizes its room on them."""
        return self.fleet.snapshot()

    def ready_count(self) -> int:
        return self.fleet.ready_count()

    def degraded_reasons(self) -> list[str]:
        reasons = []
        if self.ready_count() == 0:
            reasons.append("no ready replica")
        if self.follower.degraded_reason:
            reasons.append(self.follower.degraded_reason)
        idx = self.index.degraded_reason
        if idx:
            reasons.append(idx)
        quota = self.quotas.degraded_reason
        if quota:
            reasons.append(quota)
        fair = self.fairq.degraded_reason
        if fair:
            reasons.append(fair)
        return reasons

    # -- per-request -------------------------------------------------------------------------------
    def scope(
        self, request_id: str, tenant: Tenant, model: str, *, stream: bool, started_s: float
    ) -> RequestScope:
        """A new request's scope, closed by every part that keeps books about it."""
        return RequestScope(request_id, tenant, model, self.hooks, started_s, stream)

    async def route(self, scope: RequestScope, ticket: Ticket, prefetched: Prefetch | None) -> None:
        """Choose the request's replica (among those the fair queue found room on), book it,
        and move its fair-queue slot there."""
        assert scope.request is not None
        routed = await self.core.route(scope.request, allowed=ticket.room, prefetched=prefetched)
        scope.routed_to(routed)
        self.fairq.place(ticket, routed.replica_id, self.profile_of(routed))

    def profile_of(self, routed: Routed) -> EngineProfile:
        """The roofline profile of the replica a request was routed to."""
        return self.fleet.get(routed.replica_id).profile

    def decision_header(self, routed: Routed) -> dict[str, str]:
        if not self.settings.telemetry.decision_header:
            return {}
        value = decision_header_value(
            routed.arm.name,
            routed.replica_id,
            str(routed.decision.reason),
            routed.predicted_hit_tokens,
        )
        return {"x-cp-decision": value}

    def refresh_gauges(self) -> None:
        """Values read from other components at scrape time."""
        m = self.metrics
        for rep in self.fleet.replicas():
            m.set_engine_prefix(rep.replica_id, rep.prefix_hits, rep.prefix_queries)
        described = {r.replica_id: r.info is not None for r in self.fleet.replicas()}
        sources = {r.replica_id: str(r.profile_source) for r in self.fleet.replicas()}
        m.sync_descriptions(self.fleet.groups.drift_of(), described, sources)
        m.inflight.set(len(self.ledger))
        m.routable.set(self.ready_count())
        m.sync_quotas(self.tenancy.tenants())
        for follower in self.events.values():
            m.kv_events.sync(follower.status())
        for store, breaker in self.breakers().items():
            m.breakers.sync(store, breaker)

    def breakers(self) -> dict[str, CircuitBreaker]:
        """The circuit breakers of this router's Redis-backed stores, by store name."""
        out: dict[str, CircuitBreaker] = {}
        if isinstance(self.index, RedisRouterIndex):
            out["prefix_index"] = self.index.redis.breaker
        if isinstance(self.quotas, RedisQuotaStore):
            out["quota"] = self.quotas.breaker
        if isinstance(self.fairq, SharedFairQueue):
            out["fair_queue"] = self.fairq.store.breaker
        return out

    async def aclose(self) -> None:
        for s in self.sources:
            await s.aclose()
        await self.follower.aclose()
        await self.registry.aclose()
        await self.fairq.aclose()
        await self.quotas.aclose()  # settles in flight reach the store first
        for follower in self.events.values():
            await follower.close()
        self.events.clear()
        await self.core.aclose()
        await self.fleet.aclose()
        await self.tokenizer.aclose()
        await self.index.aclose()


@contextlib.asynccontextmanager
async def _registry_call() -> AsyncIterator[None]:
    """A store failure of the shared registry, as the error the admin API answers (503)."""
    try:
        yield
    except StoreError as exc:
        raise RegistryUnavailableError(f"the fleet registry is unreachable ({exc})") from None
