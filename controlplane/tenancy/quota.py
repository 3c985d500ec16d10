"""Token quotas per tenant: reserve before dispatch, settle the actual usage exactly once after.

    reserve(tenant, prompt, max_tokens)   before the request is queued or sent; 429 when no room
    settle(reservation, used)             once, however the request ended; again = `duplicate`

**Window arithmetic** (pure functions below; `MemoryQuotaStore` and the Redis scripts in
`quota_redis.py` implement the same rules). A tenant's window holds entries (reservation id,
admission time t, charged tokens). An entry is charged its reserved amount
`prompt + sequences x max_tokens` from admission until it is settled, then its actual usage; it
counts while its admission time is inside the window:

    fixed:    t >= now - (now mod W)      calendar windows: everything resets at the boundary
    sliding:  t >  now - W                the last W seconds
    admit     iff  charged(window) + amount <= quota_tokens
    no max_tokens in the request: max_tokens = min(default_cap, (room - prompt) // sequences),
              injected into the upstream request, so no request can spend more than it reserved
    refused:  `exhausted` (no room now) or `too_large` (prompt + sequences x 1 > quota, never fits)
    Retry-After: fixed: the window's end; sliding: when enough of the oldest entries leave the
              window for the request to fit; x-ratelimit-reset-tokens: until the window is empty

A reservation not settled within its TTL (the router holding it died) expires: it stays charged at
its reserved amount, an upper bound of what it can have used, and a settle arriving after that is
`late` (a no-op). Tokens are charged to the window the request was admitted in.

Stores: `quota_memory.MemoryQuotaStore` (one router, or a soft quota's local share) and
`quota_redis.RedisQuotaStore` (every router of a fleet, one Lua script per event).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Protocol

from controlplane.errors import QuotaExceededError
from controlplane.tenancy.model import Tenant

UnknownUsage = Literal["reserved", "streamed"]


class WindowKind(StrEnum):
    FIXED = "fixed"
    SLIDING = "sliding"


class QuotaReason(StrEnum):
    """Why a reservation was refused (the `reason` label of cp_quota_rejections_total)."""

    EXHAUSTED = "exhausted"  # the window has no room for this request now
    TOO_LARGE = "too_large"  # the request alone exceeds the quota
    STORE_DOWN = "store_down"  # hard quota, store unreachable: 503
    LOCAL_SHARE = "local_share"  # soft quota, store unreachable: this router's share is spent


class SettleOutcome(StrEnum):
    """What a settle did (the `outcome` label of cp_quota_settlements_total)."""

    SETTLED = "settled"  # the reservation was replaced by the actual usage
    DUPLICATE = "duplicate"  # already settled: no-op
    LATE = "late"  # already expired (charged in full): no-op
    UNKNOWN = "unknown"  # no such reservation: no-op
    DEFERRED = "deferred"  # the store was unreachable: retried in the background


@dataclass(frozen=True, slots=True)
class Reservation:
    tenant_id: str
    reservation_id: int
    prompt_tokens: int
    amount: int  # tokens held: prompt + sequences x max_tokens
    max_tokens: int  # the output cap the request runs with (injected when it had none)
    limit: int
    remaining: int  # room left in the window after this reservation
    reset_s: float
    store: str  # memory | redis | local (a soft quota's share while Redis is unreachable)
    window_s: float  # the tenant's window (a settle's sweep trims with it)

    def headers(self) -> dict[str, str]:
        return ratelimit_headers(self.limit, self.remaining, self.reset_s)


@dataclass(frozen=True, slots=True)
class Grant:
    amount: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class QuotaStats:
    """A tenant's reservation counters, as the store holds them."""

    reserved: int = 0
    settled: int = 0
    duplicate: int = 0
    late: int = 0
    unknown: int = 0
    expired: int = 0
    rejected: int = 0
    open: int = 0
    charged: int = 0  # tokens the window held at the last reserve or settle (used + reserved)

    @property
    def missing(self) -> int:
        """Reservations neither settled by a router nor still open (expired or lost)."""
        return self.reserved - self.settled - self.open


# -- pure window arithmetic -----------------------------------------------------------------------
def window_start(kind: WindowKind, window_s: float, now: float) -> float:
    """Entries admitted at t >= this count (sliding: strictly after now - W, see `counts`)."""
    return now - (now % window_s) if kind is WindowKind.FIXED else now - window_s


def counts(kind: WindowKind, window_s: float, now: float, t: float) -> bool:
    start = window_start(kind, window_s, now)
    return t >= start if kind is WindowKind.FIXED else t > start


def grant(
    limit: int,
    charged: int,
    prompt: int,
    sequences: int,
    max_tokens: int | None,
    default_cap: int,
) -> Grant | QuotaReason:
    """Admit `prompt + sequences x max_tokens` into a window already charged `charged`?"""
    if prompt + sequences * (max_tokens or 1) > limit:
        return QuotaReason.TOO_LARGE
    room = limit - charged
    if max_tokens is None:
        max_tokens = min(default_cap, (room - prompt) // sequences)
        if max_tokens < 1:
            return QuotaReason.EXHAUSTED
    amount = prompt + sequences * max_tokens
    return Grant(amount, max_tokens) if amount <= room else QuotaReason.EXHAUSTED


def retry_after(
    kind: WindowKind,
    window_s: float,
    now: float,
    entries: Iterable[tuple[float, int]],
    room: int,
    need: int,
) -> float:
    """Seconds until `need` tokens fit; `entries` = (admitted at, charged), oldest first."""
    if kind is WindowKind.FIXED:
        return window_s - (now % window_s)
    free = room
    for t, charged in entries:
        free += charged
        if free >= need:
            return max(0.0, t + window_s - now)
    return window_s


def reset_after(kind: WindowKind, window_s: float, now: float, newest: float | None) -> float:
    """Seconds until the window holds nothing of what it holds now."""
    if kind is WindowKind.FIXED:
        return window_s - (now % window_s)
    return 0.0 if newest is None else max(0.0, newest + window_s - now)


def settle_tokens(
    res: Reservation,
    *,
    reported: int | None,
    reached_replica: bool,
    streamed: int | None,
    rule: UnknownUsage,
) -> int:
    """The tokens a finished request is charged.

    The replica reported usage: prompt + completion tokens. The request never reached a replica
    (refused before sending, or every replica refused it): 0. Otherwise the usage is unknown (the
    client left, the replica died or failed): the whole reservation (`reserved`: an upper bound
    of what the engine can have spent, since max_tokens is always set), or the prompt plus the
    content events relayed so far (`streamed`: what the client received; may undercount the
    engine's work by tokens generated after the last relayed chunk)."""
    if reported is not None:
        return reported
    if not reached_replica:
        return 0
    if rule == "streamed" and streamed is not None:
        return min(res.amount, res.prompt_tokens + streamed)
    return res.amount


# -- HTTP face ------------------------------------------------------------------------------------
def go_duration(seconds: float) -> str:
    """OpenAI's reset format (Go durations): 120ms, 1.5s, 6m0s, 1h2m3s."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    return (f"{h}h{m}m" if h else f"{m}m" if m else "") + s


def ratelimit_headers(
    limit: int, remaining: int, reset_s: float, retry_after_s: float | None = None
) -> dict[str, str]:
    out = {
        "x-ratelimit-limit-tokens": str(limit),
        "x-ratelimit-remaining-tokens": str(max(0, remaining)),
        "x-ratelimit-reset-tokens": go_duration(reset_s),
    }
    if retry_after_s is not None:
        out["retry-after"] = str(max(1, math.ceil(retry_after_s)))
        out["retry-after-ms"] = str(max(0, math.ceil(retry_after_s * 1000)))
    return out


def refusal(
    tenant: Tenant,
    reason: QuotaReason,
    *,
    limit: int,
    charged: int,
    need: int,
    reset_s: float,
    retry_after_s: float,
) -> QuotaExceededError:
    per = f"tokens per {tenant.quota_window_s:g}s"
    if reason is QuotaReason.TOO_LARGE:
        msg = f"Request too large for tenant {tenant.tenant_id} on {per}: Limit {limit}, "
        msg += f"Requested {need}. Lower max_tokens or the prompt."
    else:
        msg = f"Rate limit reached for tenant {tenant.tenant_id} on {per}: Limit {limit}, "
        msg += (
            f"Used {charged}, Requested {need}. Please try again in {go_duration(retry_after_s)}."
        )
    headers = ratelimit_headers(limit, limit - charged, reset_s, retry_after_s)
    return QuotaExceededError(msg, reason=str(reason), retry_after_s=retry_after_s, headers=headers)


class QuotaStore(Protocol):
    """What the router holds as `runtime.quotas` (memory or Redis)."""

    kind: str
    on_settle: Callable[[SettleOutcome], None] | None

    async def start(self) -> None: ...

    async def reserve(
        self,
        tenant: Tenant,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        default_cap: int,
        sequences: int = 1,
    ) -> Reservation | None:
        """None: the tenant has no quota. Raises QuotaExceededError (429) or
        QuotaUnavailableError (503: a hard quota whose store is unreachable)."""
        ...

    async def settle(self, reservation: Reservation, used: int) -> SettleOutcome: ...

    def settle_soon(self, reservation: Reservation | None, used: int) -> None:
        """Settle without blocking the caller; happens even if the caller is cancelled."""
        ...

    async def stats(self, tenant_id: str) -> QuotaStats: ...

    @property
    def degraded_reason(self) -> str | None: ...

    async def aclose(self) -> None: ...


__all__ = [
    "Grant",
    "QuotaReason",
    "QuotaStats",
    "QuotaStore",
    "Reservation",
    "SettleOutcome",
    "WindowKind",
    "grant",
    "ratelimit_headers",
    "refusal",
    "settle_tokens",
]
