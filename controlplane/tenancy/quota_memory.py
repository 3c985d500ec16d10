"""`MemoryQuotaStore`: token quotas held by one process (the rules are in `quota.py`).

The router's store when no Redis is configured, and a soft quota's local share while Redis is
unreachable (`kind="local"`). State, per store:

    windows   tenant -> entries {reservation id: [admitted at, charged]} in admission order (the
              clock is monotonic, so the oldest entry is first) and their sum; entries that left
              the window are dropped from the front on every call
    open      reservation id -> (tenant, expiry), in expiry order (one TTL for all)
    done      reservation id -> (when, expired?), kept one reservation TTL: a second settle of the
              same id is a `duplicate`, a settle after expiry `late`, an id never seen `unknown`

Single-threaded (asyncio) use; the clock is injectable.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import (
    QuotaReason,
    QuotaStats,
    Reservation,
    SettleOutcome,
    WindowKind,
    counts,
    grant,
    refusal,
    reset_after,
    retry_after,
)


@dataclass(slots=True)
class _Window:
    entries: dict[int, list[float]] = field(default_factory=dict)  # rid -> [t, charged]
    charged: int = 0


class MemoryQuotaStore:
    def __init__(
        self,
        *,
        window: WindowKind = WindowKind.FIXED,
        reservation_ttl_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
        kind: str = "memory",
    ) -> None:
        self.kind = kind
        self.window = window
        self.reservation_ttl_s = reservation_ttl_s
        self.clock = clock
        self.on_settle: Callable[[SettleOutcome], None] | None = None
        self._windows: dict[str, _Window] = {}
        self._open: dict[int, tuple[str, float]] = {}
        self._done: dict[int, tuple[float, bool]] = {}
        self._stats: dict[str, Counter[str]] = {}
        self._seq = 0

    @property
    def degraded_reason(self) -> str | None:
        return None

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    # -- housekeeping ----------------------------------------------------------------------------
    def _count(self, tenant_id: str, what: str) -> None:
        self._stats.setdefault(tenant_id, Counter())[what] += 1

    def _sweep(self, now: float) -> None:
        while self._open:
            rid, (tenant_id, expiry) = next(iter(self._open.items()))
            if expiry > now:
                break
            del self._open[rid]
            self._done[rid] = (now, True)
            self._count(tenant_id, "expired")
        while self._done:
            rid, (when, _) = next(iter(self._done.items()))
            # the age compared as an age: `when > now - ttl` rounds differently at the boundary
            if now - when < self.reservation_ttl_s:
                break
            del self._done[rid]

    def _window(self, tenant_id: str, window_s: float, now: float) -> _Window:
        win = self._windows.setdefault(tenant_id, _Window())
        while win.entries:
            rid, (t, charged) = next(iter(win.entries.items()))
            if counts(self.window, window_s, now, t):
                break
            del win.entries[rid]
            win.charged -= int(charged)
        return win

    # -- reserve / settle ------------------------------------------------------------------------
    async def reserve(
        self,
        tenant: Tenant,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        default_cap: int,
        sequences: int = 1,
    ) -> Reservation | None:
        if tenant.quota_tokens is None:
            return None
        return self.reserve_within(
            tenant,
            tenant.quota_tokens,
            prompt_tokens,
            max_tokens,
            default_cap=default_cap,
            sequences=sequences,
        )

    def reserve_within(
        self,
        tenant: Tenant,
        limit: int,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        default_cap: int,
        sequences: int = 1,
    ) -> Reservation:
        """Reserve against `limit` (the quota, or this router's share of it)."""
        now = self.clock()
        self._sweep(now)
        tid, window_s = tenant.tenant_id, tenant.quota_window_s
        win = self._window(tid, window_s, now)
        g = grant(limit, win.charged, prompt_tokens, sequences, max_tokens, default_cap)
        newest = next(reversed(win.entries.values()))[0] if win.entries else None
        if isinstance(g, QuotaReason):
            self._count(tid, "rejected")
            room = limit - win.charged
            need = prompt_tokens + sequences * (max_tokens or 1)
            if g is QuotaReason.TOO_LARGE:
                wait = window_s
            else:
                olds = ((t, int(c)) for t, c in win.entries.values())
                wait = retry_after(self.window, window_s, now, olds, room, need)
            if g is QuotaReason.EXHAUSTED and self.kind == "local":
                g = QuotaReason.LOCAL_SHARE
            raise refusal(
                tenant,
                g,
                limit=limit,
                charged=win.charged,
                need=need,
                reset_s=reset_after(self.window, window_s, now, newest),
                retry_after_s=wait,
            )
        self._seq += 1
        rid = self._seq
        win.entries[rid] = [now, float(g.amount)]
        win.charged += g.amount
        self._open[rid] = (tid, now + self.reservation_ttl_s)
        self._count(tid, "reserved")
        return Reservation(
            tenant_id=tid,
            reservation_id=rid,
            prompt_tokens=prompt_tokens,
            amount=g.amount,
            max_tokens=g.max_tokens,
            limit=limit,
            remaining=limit - win.charged,
            reset_s=reset_after(self.window, window_s, now, now),
            store=self.kind,
            window_s=window_s,
        )

    def settle_now(self, reservation: Reservation, used: int) -> SettleOutcome:
        now = self.clock()
        rid, tid = reservation.reservation_id, reservation.tenant_id
        if rid in self._open:
            del self._open[rid]
            self._done[rid] = (now, False)
            win = self._window(tid, reservation.window_s, now)
            entry = win.entries.get(rid)
            if entry is not None:
                win.charged += int(used) - int(entry[1])
                entry[1] = float(used)
            outcome = SettleOutcome.SETTLED
        elif rid in self._done:
            outcome = SettleOutcome.LATE if self._done[rid][1] else SettleOutcome.DUPLICATE
        else:
            outcome = SettleOutcome.UNKNOWN
        self._count(tid, str(outcome))
        self._sweep(now)
        if self.on_settle is not None:
            self.on_settle(outcome)
        return outcome

    async def settle(self, reservation: Reservation, used: int) -> SettleOutcome:
        return self.settle_now(reservation, used)

    def settle_soon(self, reservation: Reservation | None, used: int) -> None:
        if reservation is not None:
            self.settle_now(reservation, used)

    async def stats(self, tenant_id: str) -> QuotaStats:
        self._sweep(self.clock())
        c = self._stats.get(tenant_id, Counter())
        held = sum(1 for tid, _ in self._open.values() if tid == tenant_id)
        return QuotaStats(
            reserved=c["reserved"],
            settled=c["settled"],
            duplicate=c["duplicate"],
            late=c["late"],
            unknown=c["unknown"],
            expired=c["expired"],
            rejected=c["rejected"],
            open=held,
            charged=win.charged if (win := self._windows.get(tenant_id)) else 0,
        )

    def charged(self, tenant: Tenant) -> int:
        """Tokens the tenant's window holds now (used + reserved)."""
        return self._window(tenant.tenant_id, tenant.quota_window_s, self.clock()).charged


__all__ = ["MemoryQuotaStore"]
