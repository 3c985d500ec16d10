"""The router's tenants: the key ring and salt policy built from `RouterSettings`, and their admin
views.

    secret      $CP_CACHE_SALT_SECRET (`cache_salt_secret_env`): tenant and public-prefix salts
                derive from it; without one they derive from the tenant ids alone (a warning:
                then anyone who can reach a replica directly could compute a tenant's salt)
    KeyRing     `tenants` from the config file, then /admin/tenants (per router process: with
                several routers, post to each, or keep the config file the source of truth)
    SaltPolicy  tenant salts + `public_prefixes` (see `controlplane.tenancy.salts`)

The admin view of a tenant never holds a key or a digest: its id, weight, class, limits and how
many keys it has.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from controlplane.errors import ConfigError
from controlplane.tenancy.identity import KeyRing
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import QuotaStore, UnknownUsage, WindowKind, settle_tokens
from controlplane.tenancy.quota_memory import MemoryQuotaStore
from controlplane.tenancy.quota_redis import RedisQuotaStore
from controlplane.tenancy.salts import PublicPrefix, SaltPolicy
from controlplane.types import PriorityClass
from router.config import RouterSettings, TenantConfig
from router.scope import NoHooks, Outcome, RequestScope

log = logging.getLogger("controlplane.router")


def salt_secret(settings: RouterSettings) -> bytes:
    return os.environ.get(settings.cache_salt_secret_env, "").encode()


def tenant_of(cfg: TenantConfig) -> Tenant:
    """The `Tenant` a config entry describes (its salt is derived by the key ring)."""
    return Tenant(
        tenant_id=cfg.id,
        weight=cfg.weight,
        priority=PriorityClass(cfg.priority),
        quota_tokens=cfg.quota_tokens,
        quota_window_s=cfg.quota_window_s,
        quota_mode=cfg.quota_mode,
        max_queued=cfg.max_queued,
    )


def key_ring(settings: RouterSettings) -> KeyRing:
    secret = salt_secret(settings)
    if settings.tenants and not secret:
        log.warning(
            "no cache-salt secret in $%s: tenant cache salts derive from tenant ids alone",
            settings.cache_salt_secret_env,
        )
    ring = KeyRing(secret, require_keys=settings.require_api_keys)
    for cfg in settings.tenants:
        ring.put(tenant_of(cfg), cfg.api_key_sha256)
    return ring


def salt_policy(settings: RouterSettings) -> SaltPolicy:
    known = {t.id for t in settings.tenants}
    prefixes = []
    for p in settings.public_prefixes:
        unknown = sorted(set(p.tenants) - known)
        if unknown and known:
            log.warning("public prefix %s names unconfigured tenants %s", p.name, unknown)
        prefixes.append(PublicPrefix(p.name, p.tokens_sha256, p.num_tokens, frozenset(p.tenants)))
    try:
        return SaltPolicy(salt_secret(settings), prefixes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def tenant_view(ring: KeyRing, tenant: Tenant) -> dict[str, Any]:
    """A tenant as the admin API shows it: no key, no digest, no salt."""
    return {
        "id": tenant.tenant_id,
        "weight": tenant.weight,
        "priority": str(tenant.priority),
        "quota_tokens": tenant.quota_tokens,
        "quota_window_s": tenant.quota_window_s,
        "quota_mode": tenant.quota_mode,
        "max_queued": tenant.max_queued,
        "api_keys": ring.key_count(tenant.tenant_id),
    }


__all__ = ["key_ring", "salt_policy", "salt_secret", "tenant_of", "tenant_view"]


def quota_store_for(settings: RouterSettings) -> QuotaStore:
    """The router's store: Redis when `redis.url` is configured, else in memory."""
    q = settings.quota
    window = WindowKind(q.window)
    if settings.redis.url is None:
        return MemoryQuotaStore(window=window, reservation_ttl_s=q.reservation_ttl_s)
    return RedisQuotaStore(
        settings.redis.url,
        key_prefix=q.key_prefix,
        window=window,
        reservation_ttl_s=q.reservation_ttl_s,
        timeout_s=q.timeout_ms / 1000,
        heartbeat_s=q.heartbeat_s,
        expected_routers=q.expected_routers,
        password=os.environ.get(settings.redis.password_env) or None,
    )


class QuotaHooks(NoHooks):
    """Settles a request's quota reservation when its scope ends (`settle_tokens`): the usage the
    replica reported; 0 when no replica accepted it or one refused it with a 4xx; else unknown,
    charged by `quota.unknown_usage` (the whole reservation, or the prompt plus what streamed)."""

    def __init__(self, store: QuotaStore, rule: UnknownUsage) -> None:
        self.store = store
        self.rule = rule

    def on_end(self, scope: RequestScope, outcome: Outcome) -> None:
        res = scope.reservation
        if res is None:
            return
        usage = scope.usage
        used = settle_tokens(
            res,
            reported=None if usage is None else usage.prompt_tokens + usage.completion_tokens,
            reached_replica=scope.reached and not scope.refused_by_replica,
            streamed=scope.streamed if scope.stream else None,
            rule=self.rule,
        )
        self.store.settle_soon(res, used)
