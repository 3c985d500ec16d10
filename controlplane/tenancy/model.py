"""A tenant as the router and the simulator see it: identity, weight, class and limits.

`Tenant` is a frozen value built from the configuration (`router/config.py` `TenantConfig`) or the
admin API. `salt` is derived by the router from a secret (never a client value) and scopes the
tenant's cache and prefix-index keys. `DEFAULT_TENANT` serves every request when no tenant is
configured (open mode: no API keys required).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from controlplane.types import PriorityClass

QuotaMode = Literal["hard", "soft"]


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    weight: float = 1.0
    priority: PriorityClass = PriorityClass.INTERACTIVE
    salt: str = ""
    quota_tokens: int | None = None
    quota_window_s: float = 60.0
    quota_mode: QuotaMode = "hard"
    max_queued: int = 256


DEFAULT_TENANT = Tenant("default")

__all__ = ["DEFAULT_TENANT", "QuotaMode", "Tenant"]
