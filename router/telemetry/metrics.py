"""The router's Prometheus metrics, in a registry of their own.

Every `RouterMetrics` owns a `CollectorRegistry` (a fresh one unless given), so tests and several
router apps in one process never collide on the global registry; `render()` is the `/metrics`
body. Names carry the `cp_` prefix and their unit (`_seconds`, `_tokens`, `_total`).

Per request (labels `arm`, `policy`; `arm` is the A/B arm, `policy` its routing policy):

    cp_requests_total{arm,policy,reason,status}   reason = DecisionReason value; status = the HTTP
                                                  status code ("200", "503", ...), or
                                                  "client_closed" (the client went away) or
                                                  "upstream_died" (the replica broke mid-response)
    cp_ttft_seconds / cp_tpot_seconds / cp_e2e_seconds{arm,policy}       histograms
    cp_prompt_tokens_total{arm,policy}
    cp_predicted_prefix_hit_tokens_total{arm,policy}   what the router expected the replica to hold
    cp_engine_cached_tokens_total{arm,policy}          usage.prompt_tokens_details.cached_tokens

The A/B report (`controlplane ab report`) reads exactly these: prefix hit rate per arm =
engine cached / prompt tokens, predicted hit rate = predicted / prompt tokens.

Routing internals: `cp_decision_seconds{policy}` (the policy's `choose`),
`cp_index_lookup_seconds{outcome}` (outcome: hit, miss, unknown = budget exceeded or index down),
`cp_routing_fallbacks_total{reason}` (e.g. index_unknown).

Per replica: `cp_outstanding_requests` / `cp_outstanding_tokens` (the router's ledger),
`cp_engine_prefix_cache_hits_tokens` / `cp_engine_prefix_cache_queries_tokens` (gauges: the
replica's own cumulative vLLM counters as last scraped, so they reset when the replica restarts),
`cp_kv_events_*{replica}` of the KV-event followers in this router (applied, lost, gaps,
restarts, last batch time, trusted: controlplane/kvevents/metrics.py),
`cp_upstream_errors_total{replica,kind}`, `cp_ejections_total{replica,reason}`.

Resilience: `cp_retries_total{reason}`, `cp_client_disconnects_total`, `cp_inflight_requests`,
`cp_shutdown_cut_requests_total`, `cp_routable_replicas`, and the Redis stores' breakers
`cp_redis_breaker_open{store}` / `cp_redis_breaker_opens_total{store}`
(controlplane/store/metrics.py).

Quotas: `cp_quota_rejections_total{tenant,reason}`, `cp_quota_settlements_total{outcome}`,
`cp_tenant_quota_tokens{tenant}` / `cp_tenant_quota_window_seconds{tenant}` (the configured
quota), and usage `cp_tenant_tokens_total{tenant,kind}` (kind: prompt, completion).

Fair queue shared by several routers: `cp_fair_shared_calls_total{outcome}`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from controlplane.kvevents.metrics import KvEventMetrics
from controlplane.store.metrics import BreakerMetrics
from controlplane.tenancy.model import Tenant

STATUS_CLIENT_CLOSED = "client_closed"
STATUS_UPSTREAM_DIED = "upstream_died"

# time to first token: a cached short prompt (ms) to a long prefill behind a queue (minutes)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# time per output token after the first: a small batch (ms) to a saturated or preempted replica
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
# end to end: a short completion to a long generation
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# in-process routing decisions: microseconds
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
# prefix-index lookups: in-memory (us) to a Redis round trip near its budget (tens of ms)
LOOKUP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25)

ARM_LABELS = ("arm", "policy")


class RouterMetrics:
    """Every metric of one router (see the module docstring), as attributes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "cp_requests_total",
            "Requests by arm, policy, decision reason and outcome status.",
            ("arm", "policy", "reason", "status"),
            registry=r,
        )
        self.ttft = Histogram(
            "cp_ttft_seconds", "Time to first token.", ARM_LABELS, buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "cp_tpot_seconds",
            "Mean time per output token after the first, per request.",
            ARM_LABELS,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "cp_e2e_seconds", "Request end to end.", ARM_LABELS, buckets=E2E_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter(
            "cp_prompt_tokens_total", "Prompt tokens of finished requests.", ARM_LABELS, registry=r
        )
        self.predicted_hit_tokens = Counter(
            "cp_predicted_prefix_hit_tokens_total",
            "Prompt tokens the router expected the chosen replica to hold in its prefix cache.",
            ARM_LABELS,
            registry=r,
        )
        self.engine_cached_tokens = Counter(
            "cp_engine_cached_tokens_total",
            "Prompt tokens the replica reported as cached (usage.prompt_tokens_details).",
            ARM_LABELS,
            registry=r,
        )
        self.engine_prefix_hits = Gauge(
            "cp_engine_prefix_cache_hits_tokens",
            "The replica's cumulative prefix-cache hit tokens, as last scraped.",
            ("replica",),
            registry=r,
        )
        self.engine_prefix_queries = Gauge(
            "cp_engine_prefix_cache_queries_tokens",
            "The replica's cumulative prefix-cache query tokens, as last scraped.",
            ("replica",),
            registry=r,
        )
        self.decision_seconds = Histogram(
            "cp_decision_seconds",
            "Time the routing policy took to decide.",
            ("policy",),
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.index_lookup_seconds = Histogram(
            "cp_index_lookup_seconds",
            "Prefix-index lookup time by outcome (hit, miss, unknown).",
            ("outcome",),
            buckets=LOOKUP_BUCKETS,
            registry=r,
        )
        self.replica_drift = Gauge(
            "cp_replica_drift",
            "1 per field in which a replica's configuration differs from its model group's "
            "(block_size, max_model_len, prefix_caching, hash_algo, version); such a replica is "
            "kept out of prefix affinity.",
            ("model", "replica", "field"),
            registry=r,
        )
        self.replica_described = Gauge(
            "cp_replica_described",
            "1 when the replica described itself (/v1/models, cache config, version); 0 when "
            "it could not and is routed as configured.",
            ("replica",),
            registry=r,
        )
        self.replica_profile_source = Gauge(
            "cp_replica_profile_source",
            "1 for where the replica's roofline profile came from: config_json (the model "
            "group's config.json and GPU kind), replica_keys (its configured roofline keys) or "
            "defaults (nothing configured: the profile is a guess).",
            ("replica", "source"),
            registry=r,
        )
        self.outstanding_requests = Gauge(
            "cp_outstanding_requests", "Requests in flight per replica.", ("replica",), registry=r
        )
        self.outstanding_tokens = Gauge(
            "cp_outstanding_tokens",
            "Outstanding work per replica in tokens (the router's ledger).",
            ("replica",),
            registry=r,
        )
        self.fallbacks = Counter(
            "cp_routing_fallbacks_total",
            "Decisions made without full information, by reason (e.g. index_unknown).",
            ("reason",),
            registry=r,
        )
        # the KV-event followers running in this router (controlplane/kvevents/metrics.py)
        self.kv_events = KvEventMetrics(r)
        # the Redis-backed stores' circuit breakers (controlplane/store/metrics.py)
        self.breakers = BreakerMetrics(r)
        self.routable = Gauge(
            "cp_routable_replicas",
            "Replicas this router may send requests to now (ready and not ejected); 0 makes "
            "/ready answer 'no ready replica'.",
            registry=r,
        )
        self.retries = Counter(
            "cp_retries_total", "Requests retried on another replica.", ("reason",), registry=r
        )
        self.upstream_errors = Counter(
            "cp_upstream_errors_total",
            "Failed upstream attempts by replica and kind.",
            ("replica", "kind"),
            registry=r,
        )
        self.ejections = Counter(
            "cp_ejections_total", "Replica ejections.", ("replica", "reason"), registry=r
        )
        self.client_disconnects = Counter(
            "cp_client_disconnects_total", "Clients that went away mid-request.", registry=r
        )
        self.shutdown_cut = Counter(
            "cp_shutdown_cut_requests_total",
            "Requests still running when the shutdown grace deadline cut them.",
            registry=r,
        )
        self.inflight = Gauge("cp_inflight_requests", "Requests in the router now.", registry=r)
        # tenancy: the fair queue
        self.queued = Gauge(
            "cp_queued_requests",
            "Requests waiting in the router's fair queue.",
            ("tenant",),
            registry=r,
        )
        self.fair_shared = Counter(
            "cp_fair_shared_calls_total",
            "Calls of the shared fair queue to Redis by outcome (granted, full, turn, order, "
            "priority, batch_kv, idle, synced, unreachable).",
            ("outcome",),
            registry=r,
        )
        # tenancy: identity and cache salts
        self.auth_failures = Counter(
            "cp_auth_failures_total",
            "Requests refused with 401, by reason (missing, malformed, conflicting, unknown).",
            ("reason",),
            registry=r,
        )
        self.cache_salts = Counter(
            "cp_cache_salt_total",
            "Requests by the rule that chose their cache salt (tenant, public_prefix, client, "
            "none).",
            ("reason",),
            registry=r,
        )
        # tenancy: token quotas
        self.quota_rejections = Counter(
            "cp_quota_rejections_total",
            "Requests refused by a token quota, by tenant and reason (exhausted, too_large, "
            "store_down, local_share).",
            ("tenant", "reason"),
            registry=r,
        )
        self.quota_settlements = Counter(
            "cp_quota_settlements_total",
            "Quota reservations settled, by outcome (settled, duplicate, late, unknown, deferred).",
            ("outcome",),
            registry=r,
        )
        # tenancy: what each tenant used, and its quota (the dashboard's share and quota panels)
        self.tenant_tokens = Counter(
            "cp_tenant_tokens_total",
            "Tokens of finished requests per tenant, by kind (prompt, completion), as the "
            "replica reported them.",
            ("tenant", "kind"),
            registry=r,
        )
        self.tenant_quota_tokens = Gauge(
            "cp_tenant_quota_tokens",
            "The tenant's token quota per window (absent: no quota).",
            ("tenant",),
            registry=r,
        )
        self.tenant_quota_window = Gauge(
            "cp_tenant_quota_window_seconds",
            "The length of the tenant's quota window.",
            ("tenant",),
            registry=r,
        )

    def set_engine_prefix(self, replica: str, hits: float, queries: float) -> None:
        """The replica's cumulative prefix-cache counters (tokens) from its last scrape."""
        self.engine_prefix_hits.labels(replica=replica).set(hits)
        self.engine_prefix_queries.labels(replica=replica).set(queries)

    def sync_descriptions(
        self,
        drift: Mapping[str, Sequence[tuple[str, str]]],
        described: Mapping[str, bool],
        profile_sources: Mapping[str, str],
    ) -> None:
        """The drift gauge from the fleet's current verdict (replica -> (model, field)...),
        which replicas described themselves and where their profiles came from; stale series
        are dropped."""
        self.replica_profile_source.clear()
        for replica, source in profile_sources.items():
            self.replica_profile_source.labels(replica=replica, source=source).set(1)
        self.replica_drift.clear()
        for replica, fields in drift.items():
            for model, field in fields:
                self.replica_drift.labels(model=model, replica=replica, field=field).set(1)
        self.replica_described.clear()
        for replica, ok in described.items():
            self.replica_described.labels(replica=replica).set(1 if ok else 0)

    def sync_quotas(self, tenants: Iterable[Tenant]) -> None:
        """The configured quotas of the tenants known now (stale tenants dropped)."""
        self.tenant_quota_tokens.clear()
        self.tenant_quota_window.clear()
        for t in tenants:
            if t.quota_tokens is not None:
                self.tenant_quota_tokens.labels(t.tenant_id).set(t.quota_tokens)
                self.tenant_quota_window.labels(t.tenant_id).set(t.quota_window_s)

    def forget_replica(self, replica: str) -> None:
        """Drop the per-replica gauges of a replica that left the fleet (counters stay)."""
        for gauge in (
            self.engine_prefix_hits,
            self.engine_prefix_queries,
            self.outstanding_requests,
            self.outstanding_tokens,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(replica)
        self.kv_events.forget(replica)

    def render(self) -> tuple[bytes, str]:
        """The exposition (Prometheus text format) and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = [
    "STATUS_CLIENT_CLOSED",
    "STATUS_UPSTREAM_DIED",
    "RouterMetrics",
]
