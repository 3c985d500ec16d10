"""API key -> tenant: the only source of a request's tenant.

    authenticate(headers)
      open mode (no tenant, keys not required)   -> DEFAULT_TENANT, whatever the headers say
      keys:  Authorization: Bearer <key>  (OpenAI clients)
             api-key: <key>                (Azure OpenAI clients)
             x-api-key: <key>              (others)
      none given                           -> 401 missing
      a malformed one (no Bearer scheme, whitespace or control characters, > 512 chars)
                                           -> 401 malformed
      two that differ                      -> 401 conflicting
      digest = SHA-256(key) hex; tenant = ring[digest], confirmed with hmac.compare_digest
      (against a dummy digest on a miss, so a miss does the same work)  -> the tenant | 401 unknown

Keys are never stored: the ring holds only their SHA-256 digests (`key_digest`), from the config
file (`api_key_sha256`) or the admin API. The lookup is a dict probe on the digest of the key
presented: the probe's timing depends on that digest, which the caller cannot steer towards a
stored one, so it reveals nothing about stored keys; the final equality is constant time. Nothing
else picks the tenant: headers such as `x-tenant-id` or `OpenAI-Organization` and body fields such
as `user` or `tenant` are never read here. Refusals name no key, not even a prefix of one.

Each tenant's salt is derived here (`tenant_salt(secret, id)`), replacing any value the `Tenant`
carried. Tenants can be added, replaced and removed at runtime; once keys are required (a tenant
was ever configured, or `require_keys`), removing the last tenant does not reopen the router.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import replace
from enum import StrEnum
from typing import Final, Protocol

from controlplane.errors import AuthError, ConfigError
from controlplane.tenancy.model import DEFAULT_TENANT, Tenant
from controlplane.tenancy.salts import tenant_salt

KEY_HEADERS: Final = ("authorization", "api-key", "x-api-key")
MAX_KEY_CHARS: Final = 512
KEY_PREFIX: Final = "cpk-"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
TENANT_ID: Final = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_KEY = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces
_BEARER = re.compile(r"^[Bb][Ee][Aa][Rr][Ee][Rr] +(\S+) *$")
# compared against on a miss, so a miss costs what a hit does
_DUMMY_DIGEST: Final = hashlib.sha256(b"controlplane: no such key").hexdigest()


class AuthReason(StrEnum):
    """Why a request was refused (the `reason` label of `cp_auth_failures_total`)."""

    MISSING = "missing"
    MALFORMED = "malformed"
    CONFLICTING = "conflicting"
    UNKNOWN = "unknown"


_MESSAGES: Final = {
    AuthReason.MISSING: "An API key is required (Authorization: Bearer <key>).",
    AuthReason.MALFORMED: "The API key header is malformed; send Authorization: Bearer <key>.",
    AuthReason.CONFLICTING: "Several different API keys were sent; send one.",
    AuthReason.UNKNOWN: "Incorrect API key provided.",
}


class KeyRejected(AuthError):
    """401: a request without a valid API key; `reason` says why (never the key)."""

    def __init__(self, reason: AuthReason) -> None:
        super().__init__(_MESSAGES[reason])
        self.reason = reason


class Headers(Protocol):
    def get(self, key: str, default: None = None) -> str | None: ...


def key_digest(key: str) -> str:
    """What the ring stores for a key: lower-case hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh API key (256 random bits) and its digest, for the config file."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, key_digest(key)


def _values(headers: Headers | Mapping[str, str], name: str) -> list[str]:
    getlist = getattr(headers, "getlist", None)
    if getlist is not None:
        return [str(v) for v in getlist(name)]
    value = headers.get(name)
    return [] if value is None else [value]


def presented_key(headers: Headers | Mapping[str, str]) -> str:
    """The one API key the headers carry; raises `KeyRejected` (missing, malformed, conflicting)."""
    keys: set[str] = set()
    for name in KEY_HEADERS:
        for raw in _values(headers, name):
            value = raw.strip()
            if not value:
                continue
            if name == "authorization":
                m = _BEARER.match(value)
                if m is None:
                    raise KeyRejected(AuthReason.MALFORMED)
                value = m.group(1)
            if len(value) > MAX_KEY_CHARS or not _KEY.match(value):
                raise KeyRejected(AuthReason.MALFORMED)
            keys.add(value)
    if not keys:
        raise KeyRejected(AuthReason.MISSING)
    if len(keys) > 1:
        raise KeyRejected(AuthReason.CONFLICTING)
    return keys.pop()


class KeyRing:
    """Tenants and the digests of their keys (see the module docstring)."""

    def __init__(self, secret: bytes = b"", *, require_keys: bool = False) -> None:
        self.secret = secret
        self._require = require_keys
        self._tenants: dict[str, Tenant] = {}
        self._digests: dict[str, set[str]] = {}  # tenant id -> its key digests
        # key digest -> (the stored digest, tenant id)
        self._by_digest: dict[str, tuple[str, str]] = {}

    # -- reading -------------------------------------------------------------------------------
    @property
    def open_mode(self) -> bool:
        """No keys required: every request is `DEFAULT_TENANT`."""
        return not self._require and not self._tenants

    def get(self, tenant_id: str) -> Tenant | None:
        return self._tenants.get(tenant_id)

    def tenants(self) -> list[Tenant]:
        return sorted(self._tenants.values(), key=lambda t: t.tenant_id)

    def key_count(self, tenant_id: str) -> int:
        return len(self._digests.get(tenant_id, ()))

    def authenticate(self, headers: Headers | Mapping[str, str]) -> Tenant:
        """The request's tenant, from its key alone; raises `KeyRejected` (401)."""
        if self.open_mode:
            return DEFAULT_TENANT
        digest = key_digest(presented_key(headers))
        stored, tenant_id = self._by_digest.get(digest, (_DUMMY_DIGEST, None))
        if not hmac.compare_digest(stored, digest) or tenant_id is None:
            raise KeyRejected(AuthReason.UNKNOWN)
        return self._tenants[tenant_id]

    # -- changing ------------------------------------------------------------------------------
    def put(self, tenant: Tenant, digests: Iterable[str]) -> Tenant:
        """Add or replace a tenant and its key digests (the old digests go); its salt derived."""
        if not TENANT_ID.match(tenant.tenant_id):
            raise ConfigError("tenant ids are 1-64 characters of A-Z a-z 0-9 . _ : -")
        wanted = set(digests)
        bad = [d for d in wanted if not _DIGEST.match(d)]
        if bad:
            raise ConfigError("API key digests must be 64 lower-case hex characters (SHA-256)")
        owners = {self._by_digest[d][1] for d in wanted if d in self._by_digest}
        taken = sorted(owners - {tenant.tenant_id})
        if taken:
            raise ConfigError(f"an API key digest already belongs to tenant {taken[0]!r}")
        stored = replace(tenant, salt=tenant_salt(self.secret, tenant.tenant_id))
        for d in self._digests.pop(tenant.tenant_id, set()):
            self._by_digest.pop(d, None)
        self._tenants[tenant.tenant_id] = stored
        self._digests[tenant.tenant_id] = wanted
        for d in wanted:
            self._by_digest[d] = (d, tenant.tenant_id)
        self._require = True
        return stored

    def remove(self, tenant_id: str) -> Tenant | None:
        """Drop a tenant and its keys; its requests in flight finish (they hold the `Tenant`)."""
        tenant = self._tenants.pop(tenant_id, None)
        for d in self._digests.pop(tenant_id, set()):
            self._by_digest.pop(d, None)
        return tenant


__all__ = [
    "KEY_HEADERS",
    "TENANT_ID",
    "AuthReason",
    "KeyRejected",
    "KeyRing",
    "key_digest",
    "new_key",
    "presented_key",
    "tenant_salt",
]
