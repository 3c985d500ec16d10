"""Cache salts: the vLLM `cache_salt` a request is sent with, and the prefix-index scope it implies.

vLLM folds a request's `cache_salt` into the hash of its block 0, so every later block (chained)
is keyed by it: requests with different salts never share a cached block, and so never give each
other a cache hit or its timing. The router therefore decides the salt, never the client:

    tenant salt  = hex HMAC-SHA256(secret, tenant_id)                    one per tenant
    public salt  = hex HMAC-SHA256(secret, "\\0public\\0" + prefix name)  one per shared prefix

`SaltPolicy.choose(tenant, token_ids, client_salt)`, in order:

    1. open mode (the tenant has no salt): the router is not the isolation boundary; the client's
       `cache_salt` passes through untouched and, when it is a non-empty string, scopes the index
       as vLLM scopes its cache (reason `client`; `none` without one)
    2. a single-prompt request whose token ids start with an allow-listed public prefix open to
       this tenant (the longest such prefix): its public salt (reason `public_prefix`)
    3. otherwise the tenant's salt (reason `tenant`); any client value is overwritten

The index scope of a request is `scope_key(model, adapter, salt, hash secret)` for the salt chosen
here; the KV-event ingestor reads the same salt back from block 0's extra keys of the engine's
`BlockStored` events, so both sides name a tenant's blocks alike and one tenant's hashes are
meaningless in another's scope.

**Public prefixes, and their trade-off.** A salt covers the whole request, not a prefix of it:
vLLM cannot share the first N tokens and isolate the rest. A request sent under a public salt
shares its whole block chain (its private continuation too) with every tenant of that prefix.
Chaining limits what leaks: another tenant hits the continuation's blocks only by sending the same
prefix *and* the same continuation, so what it can learn (by timing) is whether someone sent a
full prompt it had already guessed. Allow-list only prefixes that are public text, name the
tenants that may share each (empty = every tenant), and keep them out of it when that guess
matters. Batches (several prompts) always get the tenant salt: the salt would cover prompts that
do not start with the prefix. Prefixes are matched on token ids (`prefix_digest`: SHA-256 of the
ids as little-endian u32), which is what the engine caches.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from controlplane.tenancy.model import Tenant


class SaltReason(StrEnum):
    """Which rule chose a request's salt (the `reason` label of `cp_cache_salt_total`)."""

    TENANT = "tenant"
    PUBLIC_PREFIX = "public_prefix"
    CLIENT = "client"
    NONE = "none"


def tenant_salt(secret: bytes, tenant_id: str) -> str:
    """The tenant's cache salt: hex HMAC-SHA256(secret, tenant_id) (64 chars, vLLM accepts it)."""
    return hmac.new(secret, tenant_id.encode(), hashlib.sha256).hexdigest()


def public_salt(secret: bytes, name: str) -> str:
    """The salt of a shared public prefix (a domain no tenant id can reach: ids have no NUL)."""
    return hmac.new(secret, b"\x00public\x00" + name.encode(), hashlib.sha256).hexdigest()


def prefix_digest(token_ids: Sequence[int]) -> str:
    """Hex SHA-256 of token ids packed as little-endian u32: how public prefixes are named."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


@dataclass(frozen=True, slots=True)
class PublicPrefix:
    """An allow-listed shared prefix: the first `num_tokens` ids hash to `tokens_sha256`."""

    name: str
    tokens_sha256: str
    num_tokens: int
    # tenants that may share it; empty = every tenant
    tenants: frozenset[str] = frozenset()
    salt: str = ""

    def open_to(self, tenant_id: str) -> bool:
        return not self.tenants or tenant_id in self.tenants


@dataclass(frozen=True, slots=True)
class SaltChoice:
    """The salt to send (`None`: leave the body's own value as it is) and the index scope."""

    salt: str | None
    scope: str
    reason: SaltReason
    # the public prefix used, when reason is PUBLIC_PREFIX
    prefix: str | None = None


class SaltPolicy:
    """Chooses each request's salt (see the module docstring); pure given its prefixes."""

    def __init__(self, secret: bytes, prefixes: Iterable[PublicPrefix] = ()) -> None:
        self.secret = secret
        derived = [replace(p, salt=public_salt(secret, p.name)) for p in prefixes]
        names = [p.name for p in derived]
        if len(names) != len(set(names)):
            raise ValueError(f"public prefix names must be unique: {names}")
        # longest first: the longest allow-listed prefix wins
        self.prefixes: tuple[PublicPrefix, ...] = tuple(
            sorted(derived, key=lambda p: (-p.num_tokens, p.name))
        )

    def tenant_salt(self, tenant_id: str) -> str:
        return tenant_salt(self.secret, tenant_id)

    def public_prefix(self, tenant_id: str, token_ids: Sequence[int]) -> PublicPrefix | None:
        """The longest allow-listed prefix open to `tenant_id` that `token_ids` starts with."""
        digests: dict[int, str] = {}
        for p in self.prefixes:
            if p.num_tokens > len(token_ids) or not p.open_to(tenant_id):
                continue
            d = digests.get(p.num_tokens)
            if d is None:
                d = digests[p.num_tokens] = prefix_digest(token_ids[: p.num_tokens])
            if hmac.compare_digest(d, p.tokens_sha256):
                return p
        return None

    def choose(
        self,
        tenant: Tenant,
        token_ids: Sequence[int],
        client_salt: object = None,
        *,
        batch: bool = False,
    ) -> SaltChoice:
        if not tenant.salt:
            if isinstance(client_salt, str) and client_salt:
                return SaltChoice(None, client_salt, SaltReason.CLIENT)
            return SaltChoice(None, "", SaltReason.NONE)
        if not batch and self.prefixes:
            p = self.public_prefix(tenant.tenant_id, token_ids)
            if p is not None:
                return SaltChoice(p.salt, p.salt, SaltReason.PUBLIC_PREFIX, p.name)
        return SaltChoice(tenant.salt, tenant.salt, SaltReason.TENANT)


__all__ = [
    "PublicPrefix",
    "SaltChoice",
    "SaltPolicy",
    "SaltReason",
    "prefix_digest",
    "public_salt",
    "tenant_salt",
]
