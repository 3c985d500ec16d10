"""The live router's configuration: one pydantic-settings model, every field described.

Sources, highest first: explicit values (CLI flags), `CP_*` environment variables (`__` nests:
`CP_REDIS__URL`, `CP_LIMITS__MAX_TOKENS`), a YAML file (`CP_CONFIG_FILE` or `--config`), the
defaults below. `controlplane config show` prints the resolved result with every default made
explicit; `controlplane config diff A B` compares two.

Model groups: the replicas say which models they serve (`/v1/models`); `models` adds what they
cannot say, per served model name: the GPU kind of the group's replicas and where its
config.json is, from which the roofline profile is built. Migration: a replica whose model has
no `models` entry keeps the legacy roofline keys of its `ReplicaConfig` (`gpu`, `model`), and
`/admin/replicas` says which source its profile came from (`profile_source`: `config_json`,
`replica_keys` or `defaults` when neither was configured); `served_model` stays the name of
replicas that cannot describe themselves and the model accepted before any replica is up.

The routing policy is either one policy (`policy.name` + `policy.params`) or an A/B split
(`policy.arms`: several named arms, each a policy with parameters and a weight; a request's arm is
a deterministic function of its sticky key, the tenant or the session key, so one tenant or one
conversation always sees one arm).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, IPvAnyNetwork, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from controlplane.errors import ConfigError, ReplicaRefusedError
from controlplane.routing.config import PolicyConfig, Section
from controlplane.tenancy.config import FairnessConfig
from controlplane.tracing import Exporter, OtlpEndpoint
from router.fleet.discovery.kubernetes import KubernetesDiscoveryConfig
from router.fleet.urls import DEFAULT_ALLOWED_NETWORKS, ReplicaGuard, Resolver, check_replica_id

CONFIG_FILE_ENV = "CP_CONFIG_FILE"


class ModelGroupConfig(Section):
    name: str = Field(
        min_length=1,
        description="Served model name, as the replicas list it in /v1/models and clients send "
        "it in `model`.",
    )
    gpu: str = Field(
        description="GPU kind of this group's replicas (roofline GPU key, e.g. h100, a100, "
        "cpu); required: the profile is never built for a guessed GPU."
    )
    config_json: str | None = Field(
        default=None,
        description="The model's Hugging Face config.json (the file, or a directory holding "
        "it, e.g. a local HF-cache snapshot); None: the `root` the replicas report in "
        "/v1/models, when it is a directory on the router's machine. Not found: the replica "
        "stays LOADING with the reason in /admin/replicas.",
    )
    tp: int = Field(default=1, ge=1, description="Tensor parallel degree of the replicas.")
    kv_cache_dtype: str = Field(
        default="auto", description="vLLM's --kv-cache-dtype of the replicas (auto, fp8, ...)."
    )


class ReplicaConfig(Section):
    id: str = Field(
        description="Stable replica id (metric label, index key part): 1 to 63 characters of "
        "A-Z a-z 0-9 . _ -, starting with a letter or a digit."
    )
    url: str = Field(
        description="Base URL of the vLLM OpenAI server, e.g. http://10.0.0.5:8000: http or "
        "https, no user info, query or fragment, its address inside replica_allowed_networks "
        "(checked when the replica joins: at startup, or POST /admin/replicas)."
    )
    gpu: str = Field(
        default="h100",
        description="Legacy: GPU key of the roofline profile, used when the replica's served "
        "model has no `models` entry (the default is reported as profile_source=defaults).",
    )
    model: str = Field(
        default="llama-3.1-8b",
        description="Legacy: roofline model key, used when the replica's served model has no "
        "`models` entry (see `gpu`).",
    )
    tp: int = Field(default=1, ge=1, description="Tensor parallel degree of the replica.")
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="KV block size; None: read from vllm:cache_config_info at the first scrape.",
    )
    num_gpu_blocks: int | None = Field(
        default=None, ge=1, description="KV blocks; None: from cache_config_info or the roofline."
    )
    long_prefill_token_threshold: int = Field(
        default=0,
        ge=0,
        description="The replica's --long-prefill-token-threshold (0: off), so the fair queue's "
        "prefill gate counts the chunks vLLM schedules for long prompts.",
    )
    kv_events: str | None = Field(
        default=None, description="ZMQ endpoint of the replica's KV events (tcp://host:port)."
    )
    kv_replay: str | None = Field(
        default=None, description="ZMQ endpoint of the replica's KV-event replay socket."
    )
    kv_topic: str = Field(default="", description="KV-event topic ('' = every topic).")

    @field_validator("id")
    @classmethod
    def _label_safe(cls, v: str) -> str:
        return check_replica_id(v)


class RedisConfig(Section):
    url: str | None = Field(
        default=None, description="Redis holding the shared prefix index; None: in-memory index."
    )
    key_prefix: str = Field(default="rtr:pidx", description="Index key prefix (per model pool).")
    lookup_budget_ms: float = Field(
        default=25.0, gt=0, description="Lookup time budget; past it the match is unknown."
    )
    entry_ttl_s: float = Field(default=600.0, gt=0, description="Confirmed entry lifetime.")
    password_env: str = Field(
        default="CP_REDIS_PASSWORD", description="Environment variable holding the password."
    )
    ingest_events: bool = Field(
        default=True,
        description="This router follows the replicas' KV events into Redis itself; turn off "
        "when a separate `controlplane indexer` does (several routers).",
    )


class FleetConfig(Section):
    shared: bool = Field(
        default=False,
        description="Keep the fleet registry in Redis (redis.url) so every router sharing it "
        "follows one fleet; off: the registry is this process's own.",
    )
    key_prefix: str = Field(default="cp:fleet", description="Redis key prefix of the registry.")
    router_id: str | None = Field(
        default=None,
        description="This router's id in the registry's observations; None: host name and pid.",
    )
    resync_s: float = Field(
        default=2.0,
        gt=0,
        description="Re-read the registry (and re-report the static replicas) at least this "
        "often, whether or not a change notification arrived.",
    )
    heartbeat_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="A router's published observations (in-flight counts) count this long; a "
        "dead router stops blocking drains after it. Must exceed resync_s.",
    )
    drain_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A draining replica leaves after this long even with requests in flight.",
    )
    delete_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="DELETE /admin/replicas/{id} waits this long for the drain to finish "
        "(200 when gone, else 202 while it still drains).",
    )
    dns_name: str | None = Field(
        default=None,
        description="A headless service name whose A/AAAA records are replicas; None: no DNS.",
    )
    dns_port: int = Field(default=8000, ge=1, le=65535, description="Port of DNS replicas.")
    dns_scheme: Literal["http", "https"] = Field(
        default="http", description="Scheme of DNS replicas' URLs."
    )
    dns_interval_s: float = Field(default=10.0, gt=0, description="DNS poll interval.")
    dns_model: str | None = Field(
        default=None, description="Model key (roofline) of DNS replicas; None: the default."
    )
    dns_gpu: str | None = Field(
        default=None, description="GPU key (roofline) of DNS replicas; None: the default."
    )
    kubernetes: KubernetesDiscoveryConfig | None = Field(
        default=None,
        description="Pods matching a label selector are replicas (list + watch, "
        "router/fleet/discovery/kubernetes.py); None: no Kubernetes discovery.",
    )

    @model_validator(mode="after")
    def _ttl_covers_resync(self) -> FleetConfig:
        if self.heartbeat_ttl_s <= self.resync_s:
            raise ValueError("fleet.heartbeat_ttl_s must exceed fleet.resync_s")
        return self


class LimitsConfig(Section):
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="Largest request body (413 beyond)."
    )
    max_prompt_tokens: int = Field(
        default=131_072, ge=1, description="Largest prompt in tokens (400 beyond)."
    )
    max_tokens: int = Field(
        default=32_768, ge=1, description="Largest max_tokens a request may ask (400 beyond)."
    )
    default_max_tokens: int | None = Field(
        default=None, ge=1, description="max_tokens injected when a request gives none."
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="Time to receive a whole request body (408 beyond)."
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="The whole head of a request (request line and headers) must arrive within "
        "this long of the connection opening or of the previous response (408 or close beyond).",
    )
    keepalive_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="An idle keep-alive connection (no byte of a next request) is closed after "
        "this long.",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Largest request head: request line plus header lines (431 beyond).",
    )
    max_headers: int = Field(
        default=100, ge=8, description="Most header lines in one request (431 beyond)."
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="Open connections the router serves at once; a request arriving on one "
        "beyond is answered 503 (the client may retry).",
    )
    max_prompts_per_request: int = Field(
        default=256,
        ge=1,
        description="Prompts one /v1/completions request may carry (400 beyond, before any is "
        "tokenized); each is a sequence the quota and the fair queue reserve for.",
    )


_TENANT_ID = r"^[A-Za-z0-9._:-]{1,64}$"
_SHA256_HEX = r"^[0-9a-f]{64}$"


class TenantConfig(Section):
    id: str = Field(
        pattern=_TENANT_ID, description="Tenant id (metric label, quota and fairness key)."
    )
    api_key_sha256: list[str] = Field(
        default_factory=list,
        description="Lower-case hex SHA-256 digests of the tenant's API keys (`controlplane "
        "tenant key` makes a key and its digest); keys themselves are never stored.",
    )
    weight: float = Field(default=1.0, gt=0, description="Share of GPU work when backlogged.")
    priority: Literal["interactive", "batch"] = Field(
        default="interactive", description="Priority class: interactive is dispatched first."
    )
    quota_tokens: int | None = Field(
        default=None, ge=1, description="Tokens (prompt + output) per window; None: no quota."
    )
    quota_window_s: float = Field(default=60.0, gt=0, description="Quota window in seconds.")
    quota_mode: Literal["hard", "soft"] = Field(
        default="hard",
        description="hard: fail closed (503) when the quota store is unreachable; soft: admit "
        "at most this router's share.",
    )
    max_queued: int = Field(
        default=256, ge=1, description="Requests of this tenant waiting in the router at most."
    )

    @field_validator("api_key_sha256")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        bad = [d for d in v if not re.fullmatch(_SHA256_HEX, d)]
        if bad:
            raise ValueError("api_key_sha256 entries must be 64 lower-case hex characters")
        if len(v) != len(set(v)):
            raise ValueError("api_key_sha256 entries must be unique")
        return v


class PublicPrefixConfig(Section):
    name: str = Field(pattern=_TENANT_ID, description="Name of the shared prefix (its salt).")
    tokens_sha256: str = Field(
        pattern=_SHA256_HEX,
        description="SHA-256 of the prefix's token ids as little-endian u32 (`controlplane "
        "tenant prefix` computes it).",
    )
    num_tokens: int = Field(ge=1, description="Length of the prefix in tokens.")
    tenants: list[str] = Field(
        default_factory=list,
        description="Tenants that share it (empty: every tenant). A request whose prompt "
        "starts with it is sent with the prefix's public salt: the whole request, its private "
        "continuation included, then shares one cache scope with these tenants.",
    )


class TimeoutsConfig(Section):
    connect_s: float = Field(default=2.0, gt=0, description="TCP connect to a replica.")
    ttft_s: float = Field(
        default=60.0, gt=0, description="Deadline for the first byte of a response body."
    )
    idle_s: float = Field(
        default=30.0, gt=0, description="Longest gap between two chunks of a stream."
    )
    total_s: float = Field(default=600.0, gt=0, description="Longest request end to end.")
    retry_budget: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Retries allowed as a fraction of recent requests (plus a floor of 3).",
    )


class HealthConfig(Section):
    probe_interval_s: float = Field(default=2.0, gt=0, description="Active /health probes.")
    probe_timeout_s: float = Field(default=1.0, gt=0, description="One probe's timeout.")
    scrape_interval_s: float = Field(default=0.5, gt=0, description="/metrics scrape period.")
    consecutive_failures: int = Field(
        default=3,
        ge=1,
        description="Failures in a row that eject a replica (proxy errors), or that mark it "
        "dead (failed /health probes).",
    )
    eject_s: float = Field(default=15.0, gt=0, description="How long an ejection lasts first.")
    max_ejected_fraction: float = Field(
        default=0.5, ge=0, le=1, description="Never eject more than this share for slowness."
    )
    eject_max_s: float = Field(
        default=300.0,
        gt=0,
        description="Cap of the ejection time, which doubles on each repeated ejection; a "
        "replica admitted this long since its last ejection starts again at eject_s.",
    )
    scrape_timeout_s: float = Field(default=1.0, gt=0, description="One /metrics scrape's timeout.")


class DemandConfig(Section):
    enabled: bool = Field(
        default=True,
        description="Measure the demand signal the autoscaler reads (cp_demand_*, cp_backlog_*).",
    )
    ttft_slo_s: float = Field(
        default=2.0, gt=0, description="TTFT SLO that prices work (autoscaler capacity unit)."
    )
    tpot_slo_s: float = Field(
        default=0.1, gt=0, description="TPOT SLO that sets the decode batch work is priced at."
    )
    gpu: str | None = Field(
        default=None, description="GPU key of the priced replica; None: the first replica's."
    )
    model: str | None = Field(
        default=None, description="Model key of the priced replica; None: the first replica's."
    )
    tp: int | None = Field(
        default=None, ge=1, description="Tensor parallel degree; None: the first replica's."
    )


class StatusConfig(Section):
    """The fleet status (GET /admin/status, /status, `controlplane status`)."""

    decisions: int = Field(
        default=50, ge=1, le=10_000, description="Routing decisions kept for the status view."
    )
    demand_window_s: float = Field(
        default=30.0,
        gt=0,
        description="Span over which the status view averages the arrival rate of demand.",
    )


class QuotaConfig(Section):
    window: Literal["fixed", "sliding"] = Field(
        default="fixed",
        description="Token quota windows: fixed (calendar windows of quota_window_s, all reset at "
        "the boundary) or sliding (the last quota_window_s seconds).",
    )
    key_prefix: str = Field(default="cp:quota", description="Redis key prefix of the quotas.")
    default_max_tokens: int = Field(
        default=1024,
        ge=1,
        description="max_tokens injected into a quota tenant's request that gives none (lowered "
        "to what the window has room for), so no request spends more than it reserved.",
    )
    unknown_usage: Literal["reserved", "streamed"] = Field(
        default="reserved",
        description="What a request whose usage the replica never reported (client left, replica "
        "died) is charged: the whole reservation (an upper bound: the hard bound holds), or the "
        "prompt plus the tokens relayed (may undercount the engine's work).",
    )
    reservation_ttl_s: float = Field(
        default=900.0,
        gt=0,
        description="An unsettled reservation expires (charged in full) after this; keep it "
        "above timeouts.total_s.",
    )
    timeout_ms: float = Field(
        default=250.0, gt=0, description="Budget of one Redis reservation (then: unreachable)."
    )
    heartbeat_s: float = Field(
        default=2.0, gt=0, description="Router heartbeat period (live routers: soft shares)."
    )
    approx_template_tokens: int = Field(
        default=64,
        ge=0,
        description="With tokenizer 'approx': tokens a chat template may add once per request "
        "(BOS, generation prompt, a default system preamble) on top of the bound the quota "
        "reserves for the messages (their UTF-8 JSON bytes); raise it for templates that inject "
        "a long default system prompt.",
    )
    expected_routers: int = Field(
        default=1,
        ge=1,
        description="Routers assumed when Redis never answered: a soft quota's local share is "
        "quota_tokens / this.",
    )


class TelemetryConfig(Section):
    decision_header: bool = Field(
        default=False,
        description="Add x-cp-decision (arm, replica, reason, predicted hit) to responses. "
        "Off by default: it names internal replicas.",
    )
    json_logs: bool = Field(default=True, description="One JSON object per log line.")
    log_level: str = Field(default="INFO", description="Python log level of the router.")
    otel_exporter: Exporter = Field(
        default="none",
        description="Where OpenTelemetry spans go: none (off), console (stdout) or otlp "
        "(OTLP/HTTP protobuf to otlp_endpoint; headers, TLS and timeouts from the standard "
        "OTEL_EXPORTER_OTLP_* variables).",
    )
    otlp_endpoint: OtlpEndpoint = Field(
        default=None,
        description="The collector's OTLP/HTTP traces URL for otel_exporter=otlp, e.g. "
        "http://otel-collector:4318/v1/traces (a URL without a path gets /v1/traces); None: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4318.",
    )
    service_name: str = Field(
        default="controlplane-router",
        min_length=1,
        description="The spans' service.name resource attribute.",
    )

    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /metrics (which names tenants) on this port of its own, in the same "
        "process, and answer 404 for it on the main port; None: /metrics on the main port. "
        "0: a free port (logged).",
    )
    metrics_host: str | None = Field(
        default=None,
        description="Interface of the metrics listener; None: the router's own host.",
    )


class ShutdownConfig(Section):
    """What SIGTERM (or SIGINT) does: a Kubernetes pod's termination, `preStop` included."""

    drain_s: float = Field(
        default=5.0,
        ge=0,
        description="After the signal, /ready answers 503 at once but new requests are still "
        "served for this long (the endpoint's removal takes a moment to reach every load "
        "balancer); then the listener closes and new connections are refused.",
    )
    grace_s: float = Field(
        default=20.0,
        gt=0,
        description="Then in-flight requests get this long (rounded up to whole seconds) to "
        "finish; those still running are cut (cp_shutdown_cut_requests_total) and the process "
        "exits 0. drain_s + grace_s should stay under the pod's terminationGracePeriodSeconds "
        "(30 s by default).",
    )


class RouterSettings(BaseSettings):
    """The resolved configuration of one router process."""

    model_config = SettingsConfigDict(
        env_prefix="CP_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    host: str = Field(default="127.0.0.1", description="Interface the router listens on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port the router listens on.")
    served_model: str = Field(
        default="tiny-llama", description="Model name clients send; also scopes the index."
    )
    tokenizer: str = Field(
        default="remote",
        description="How prompts become token ids: a directory with tokenizer.json, "
        "'remote' (a replica's /tokenize) or 'approx' (text estimate).",
    )
    hash_secret_env: str = Field(
        default="CP_HASH_SECRET", description="Environment variable holding the hash secret."
    )
    admin_key: SecretStr | None = Field(
        default=None, description="Bearer key for /admin/*; None disables the admin API."
    )
    replicas: list[ReplicaConfig] = Field(
        default_factory=list, description="The fleet (more can be added through /admin)."
    )
    models: list[ModelGroupConfig] = Field(
        default_factory=list,
        description="Per served model: the GPU kind and config.json its roofline profile is "
        "built from (replicas report the rest: block size, blocks, max_model_len, version).",
    )
    replica_allowed_networks: Annotated[list[IPvAnyNetwork], NoDecode] = Field(
        default_factory=lambda: [ipaddress.ip_network(n) for n in DEFAULT_ALLOWED_NETWORKS],
        description="Networks (CIDRs) every replica address must lie in, a literal IP or each "
        "address its host name resolves to (configured replicas at startup, POST "
        "/admin/replicas). Link-local and cloud metadata addresses are refused unless a network "
        "listed lies within them (169.254.169.254/32 itself); 0.0.0.0 and the router's Redis "
        "host:port always are. CP_REPLICA_ALLOWED_NETWORKS: comma-separated or a JSON list.",
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list,
        description="Tenants and their API keys; none (and require_api_keys off): open mode, "
        "every request is the `default` tenant. More through /admin/tenants.",
    )
    require_api_keys: bool = Field(
        default=False,
        description="Refuse requests without a known key even while no tenant is configured.",
    )
    cache_salt_secret_env: str = Field(
        default="CP_CACHE_SALT_SECRET",
        description="Environment variable holding the secret tenant cache salts derive from.",
    )
    public_prefixes: list[PublicPrefixConfig] = Field(
        default_factory=list,
        description="Named prompt prefixes tenants may share a cache scope for (allow-list).",
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Routing policy.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Shared prefix index.")
    fleet: FleetConfig = Field(
        default_factory=FleetConfig,
        description="The fleet registry (shared in Redis or per process) and its sources.",
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig, description="Timeouts.")
    health: HealthConfig = Field(default_factory=HealthConfig, description="Fleet health.")
    fairness: FairnessConfig = Field(
        default_factory=FairnessConfig, description="Tenant fair queue and priority classes."
    )
    quota: QuotaConfig = Field(
        default_factory=QuotaConfig, description="Tenant token quotas (in Redis when configured)."
    )
    status: StatusConfig = Field(
        default_factory=StatusConfig, description="The fleet status view (router/status/)."
    )
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig, description="Metrics, traces, logs."
    )
    demand: DemandConfig = Field(
        default_factory=DemandConfig,
        description="The demand signal for the autoscaler (work in replica-seconds at the SLO).",
    )
    shutdown: ShutdownConfig = Field(
        default_factory=ShutdownConfig,
        description="Graceful shutdown on SIGTERM: drain window, then grace for in-flight work.",
    )

    @model_validator(mode="after")
    def _metrics_listener_apart(self) -> RouterSettings:
        t = self.telemetry
        same_host = (t.metrics_host or self.host) == self.host
        if t.metrics_port and t.metrics_port == self.port and same_host:
            raise ValueError("telemetry.metrics_port must differ from the router's port")
        return self

    @field_validator("replica_allowed_networks", mode="before")
    @classmethod
    def _networks_from_env(cls, v: Any) -> Any:
        if isinstance(v, str):  # the environment: "10.0.0.0/8,fc00::/7" or a JSON list
            text = v.strip()
            return (
                json.loads(text)
                if text.startswith("[")
                else [n.strip() for n in text.split(",") if n.strip()]
            )
        return v

    @field_validator("replicas")
    @classmethod
    def _unique_ids(cls, v: list[ReplicaConfig]) -> list[ReplicaConfig]:
        ids = [r.id for r in v]
        if len(ids) != len(set(ids)):
            raise ValueError(f"replica ids must be unique: {ids}")
        return v

    @model_validator(mode="after")
    def _shared_fleet_needs_redis(self) -> RouterSettings:
        if self.fleet.shared and not self.redis.url:
            raise ValueError("fleet.shared needs redis.url")
        return self

    @field_validator("models")
    @classmethod
    def _unique_models(cls, v: list[ModelGroupConfig]) -> list[ModelGroupConfig]:
        names = [m.name for m in v]
        if len(names) != len(set(names)):
            raise ValueError(f"model group names must be unique: {names}")
        return v

    @field_validator("tenants")
    @classmethod
    def _unique_tenants(cls, v: list[TenantConfig]) -> list[TenantConfig]:
        ids = [t.id for t in v]
        if len(ids) != len(set(ids)):
            raise ValueError(f"tenant ids must be unique: {ids}")
        digests = [d for t in v for d in t.api_key_sha256]
        if len(digests) != len(set(digests)):
            raise ValueError("an API key digest is listed under two tenants")
        return v

    def replica_guard(self, resolve: Resolver | None = None) -> ReplicaGuard:
        """The check every replica passes before the router probes it (`router/fleet/urls.py`):
        these allowed networks, and this router's Redis refused."""
        return ReplicaGuard.of(
            self.replica_allowed_networks, redis_url=self.redis.url, resolve=resolve
        )

    def check_replicas(self, resolve: Resolver | None = None) -> ReplicaGuard:
        """The guard, once every configured replica passed it; a refused one raises
        `ReplicaRefusedError` (a `ConfigError`) naming it."""
        guard = self.replica_guard(resolve)
        for r in self.replicas:
            try:
                guard.check(r.id, r.url)
            except ReplicaRefusedError as exc:
                msg = f"configured replica {r.id!r}: {exc}"
                raise ReplicaRefusedError(msg, param=exc.param) from None
        return guard

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get(CONFIG_FILE_ENV)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def load_settings(config_file: Path | None = None, **overrides: Any) -> RouterSettings:
    """Resolve the settings: `overrides` > env > `config_file` (or $CP_CONFIG_FILE) > defaults.

    Raises `ConfigError` with every problem listed."""
    from pydantic import ValidationError

    if config_file is not None and not Path(config_file).is_file():
        raise ConfigError(f"config file not found: {config_file}")
    old = os.environ.get(CONFIG_FILE_ENV)
    try:
        if config_file is not None:
            os.environ[CONFIG_FILE_ENV] = str(config_file)
        return RouterSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(f"invalid router configuration:\n{exc}") from None
    except (yaml.YAMLError, OSError) as exc:
        raise ConfigError(f"cannot read config file {config_file}: {exc}") from None
    finally:
        if config_file is not None:
            if old is None:
                os.environ.pop(CONFIG_FILE_ENV, None)
            else:
                os.environ[CONFIG_FILE_ENV] = old


def resolved_dict(settings: RouterSettings) -> dict[str, Any]:
    """Every field with its value (secrets masked): what `config show` prints."""
    data = settings.model_dump(mode="json")
    if settings.admin_key is not None:
        data["admin_key"] = "**********"
    return data


def to_yaml(settings: RouterSettings) -> str:
    return yaml.safe_dump(resolved_dict(settings), sort_keys=False)
