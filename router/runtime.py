"""Everything one router process runs, built from `RouterSettings` and closed in reverse order.

guard    ReplicaGuard: every replica's id and URL are checked before the fleet knows it
         (configured ones here, at startup; added ones in `add_replica`): router/fleet/urls.py
fleet    LiveFleet: probes, scrapes, passive ejection, admin changes
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

import asyncio
import logging
import os
import time

import httpx
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from controlplane.kvevents.config import ReplicaSource
from controlplane.kvevents.service import EventIndexer
from controlplane.replica_info import ReplicaInfo
from controlplane.roofline.profile import EngineProfile
from controlplane.routing.books import Routed, RoutingBooks
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import QuotaStore
from router.config import ReplicaConfig, RouterSettings
from router.core import RouterCore
from router.fairness.queue import FairQueue
from router.fairness.shared import fair_queue_for
from router.fairness.tenants import QuotaHooks, key_ring, quota_store_for, salt_policy
from router.fleet.index import RouterIndex, open_index
from router.fleet.live_fleet import LiveFleet
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

log = logging.getLogger("controlplane.router")


class RouterRuntime:
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
            self.fleet.snapshot,
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
        await self.fleet.start()
        await self.fleet.refresh()
        for r in self.settings.replicas:
            self._follow(r)

    async def add_replica(self, cfg: ReplicaConfig) -> None:
        """Check `cfg` (`ReplicaRefusedError` refuses it: nothing added, nothing probed), then
        add it; the check may resolve a host name, off the event loop."""
        await asyncio.to_thread(self.replica_guard.check, cfg.id, cfg.url)
        self.fleet.add(cfg)
        self._follow(cfg)

    async def remove_replica(self, replica_id: str) -> None:
        await self.fleet.remove(replica_id)
        follower = self.events.pop(replica_id, None)
        if follower is not None:
            await follower.close()
        self.ledger.drop_replica(replica_id)
        await self.index.clear(replica_id)

    def degraded_reasons(self) -> list[str]:
        reasons = []
        if self.fleet.ready_count() == 0:
            reasons.append("no ready replica")
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
        for follower in self.events.values():
            for row in follower.status():
                m.sync_kv_events(row.replica_id, row.batches, row.lost)

    async def aclose(self) -> None:
        await self.fairq.aclose()
        await self.quotas.aclose()  # settles in flight reach the store first
        for follower in self.events.values():
            await follower.close()
        self.events.clear()
        await self.core.aclose()
        await self.fleet.aclose()
        await self.tokenizer.aclose()
        await self.index.aclose()
