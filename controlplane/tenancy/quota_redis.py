"""`RedisQuotaStore`: token quotas shared by every router of a fleet, in Redis.

**Key layout** (`P` = key prefix, default `cp:quota`; `{T}` = the tenant id as a hash tag, so a
tenant's keys share a cluster slot; keys hold tenant ids, members and values hold numbers only):

    P:{T}:log    ZSET  reservation id -> admission time (ms): the entries in the current window
    P:{T}:amt    HASH  reservation id -> tokens charged (the reserved amount, then the usage)
    P:{T}:acc    HASH  sum = tokens charged in the window (used + reserved)
    P:{T}:open   ZSET  reservation id -> expiry (ms): reservations not settled yet
    P:{T}:done   ZSET  id (settled) or -id (expired) -> when (ms): exactly-once tombstones,
                       trimmed after one reservation TTL
    P:{T}:stats  HASH  seq (the last reservation id), reserved, settled, duplicate, late,
                       unknown, expired, rejected: counters, never expire
    P:routers    ZSET  router id (random 62-bit number) -> heartbeat expiry (ms)

log/amt/acc/open/done expire 2 x max(window, reservation TTL) after the tenant's last write.
Scripts (`quota_lua.py`): RESERVE is the check-and-add (the window's used + reserved plus the
request must fit the quota), SETTLE replaces one open reservation by its usage (a second settle is
`duplicate`, one after expiry `late`, an id never issued `unknown`), STATS, HEARTBEAT; all on
Redis TIME, each sweeping expired reservations, so a router that dies leaves no open reservation
past the TTL (its tokens stay charged at the reserved amount).

**Calls** go through the shared `controlplane.store.caller.ScriptCaller`: concurrent
reservations are pipelined on a couple of connections, a call's `timeout_s` budget runs from when
its round trip is sent (a burst queueing in the router is not an outage), and only reservations
are guarded by the circuit breaker (settles, heartbeats and stats are not).

**Redis unreachable** (a reservation failed or timed out, or the circuit breaker is open): a hard
quota refuses with `QuotaUnavailableError` (503); a soft one reserves against a local
`MemoryQuotaStore` with this router's share, `quota // live routers` (the last heartbeat count,
or `expected_routers` before Redis ever answered). A settle that cannot reach Redis is retried by
the heartbeat task until the reservation's TTL (then the sweeper has charged it in full); a
reservation whose reply never came expires the same way: both err on charging too much. A
reserve whose caller was cancelled, or gave up at its budget, settles its reservation (0 tokens)
if the reply arrives after all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from controlplane.errors import QuotaUnavailableError, StoreUnavailableError
from controlplane.store.breaker import BreakerState, CircuitBreaker
from controlplane.store.caller import ScriptCaller
from controlplane.store.scripts import Script, check_key_prefix, script_client
from controlplane.store.urls import check_url
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import (
    QuotaReason,
    QuotaStats,
    Reservation,
    SettleOutcome,
    WindowKind,
    refusal,
)
from controlplane.tenancy.quota_lua import HEARTBEAT, RESERVE, SETTLE, STATS
from controlplane.tenancy.quota_memory import MemoryQuotaStore

log = logging.getLogger(__name__)


class RedisQuotaStore:
    kind = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "cp:quota",
        window: WindowKind = WindowKind.FIXED,
        reservation_ttl_s: float = 900.0,
        timeout_s: float = 0.25,
        heartbeat_s: float = 2.0,
        expected_routers: int = 1,
        password: str | None = None,
        allow_insecure: bool = False,
        client_name: str = "cp-quota",
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 1.0,
        clock_override_ms: Callable[[], int] | None = None,
    ) -> None:
        check_key_prefix(key_prefix, "quota")
        check_url(url, allow_insecure=allow_insecure, has_credentials=password is not None)
        self.key_prefix = key_prefix
        self.window = window
        self.ttl_ms = max(1, round(reservation_ttl_s * 1000))
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.expected_routers = max(1, expected_routers)
        self.router_id = secrets.randbits(62)
        self.routers: int | None = None  # live routers at the last heartbeat
        self.local = MemoryQuotaStore(
            window=window, reservation_ttl_s=reservation_ttl_s, kind="local"
        )
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self.on_settle: Callable[[SettleOutcome], None] | None = None
        self._clock_ms = clock_override_ms
        self._pool, self._redis = script_client(
            url,
            client_name=client_name,
            max_connections=64,
            pool_timeout_s=timeout_s,
            socket_timeout_s=max(timeout_s, 1.0),
            connect_timeout_s=min(timeout_s, 1.0),
            password=password,
        )
        self._caller = ScriptCaller(self._redis, self.breaker, stall_s=max(timeout_s, 1.0))
        self._scripts = {n: Script(s) for n, s in [("r", RESERVE), ("s", SETTLE), ("t", STATS)]}
        self._heartbeat = Script(HEARTBEAT)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending: deque[tuple[Reservation, int, float]] = deque(maxlen=100_000)
        self._beat: asyncio.Task[None] | None = None
        self.errors = 0
        self.fallbacks = 0  # reservations decided without Redis (503 or the local share)
        self.dropped_settles = 0  # deferred settles given up after the reservation TTL

    @property
    def degraded_reason(self) -> str | None:
        return None if self.breaker.state is BreakerState.CLOSED else "quota store unreachable"

    @property
    def live_routers(self) -> int:
        return max(1, self.routers) if self.routers is not None else self.expected_routers

    # -- Redis calls -----------------------------------------------------------------------------
    def _args(self, tenant_id: str, window_s: float) -> list[str]:
        now = "" if self._clock_ms is None else str(int(self._clock_ms()))
        win = str(max(0, round(window_s * 1000)))
        return [self.key_prefix, now, tenant_id, win, str(self.window), str(self.ttl_ms)]

    async def _call(self, script: Script, args: list[str], timeout_s: float) -> Any:
        """An unguarded script call with a budget of `timeout_s` from its send."""
        return await self._caller.call(script, args, budget_s=timeout_s, guarded=False)

    # -- reserve ---------------------------------------------------------------------------------
    async def reserve(
        self,
        tenant: Tenant,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        default_cap: int,
        sequences: int = 1,
    ) -> Reservation | None:
        limit = tenant.quota_tokens
        if limit is None:
            return None
        args = self._args(tenant.tenant_id, tenant.quota_window_s)
        args += [str(limit), str(prompt_tokens), str(sequences), str(max_tokens or 0)]
        args.append(str(default_cap))
        try:
            reply = await self._caller.call(
                self._scripts["r"],
                args,
                budget_s=self.timeout_s,
                on_orphan=lambda r: self._orphan(r, tenant, prompt_tokens),
            )
        except StoreUnavailableError as exc:
            if exc.reason != "open":  # refused by the breaker: nothing was tried
                self.errors += 1
                log.warning("quota store unavailable: %s", exc)
        except Exception as exc:
            self.errors += 1
            log.warning("quota store unreachable: %r", exc)
        else:
            return self._reply(tenant, limit, prompt_tokens, sequences, max_tokens, reply)
        self.fallbacks += 1
        if tenant.quota_mode == "hard":
            raise QuotaUnavailableError(
                f"the quota store is unreachable: tenant {tenant.tenant_id}'s hard quota "
                "cannot be checked"
            )
        share = limit // self.live_routers
        return self.local.reserve_within(
            tenant, share, prompt_tokens, max_tokens, default_cap=default_cap, sequences=sequences
        )

    def _reply(
        self,
        tenant: Tenant,
        limit: int,
        prompt: int,
        sequences: int,
        max_tokens: int | None,
        reply: list[Any],
    ) -> Reservation:
        rid, reason, charged, reset_ms, wait_ms, cap, amount = reply
        reason = reason.decode() if isinstance(reason, bytes) else str(reason)
        if int(rid) == 0:
            raise refusal(
                tenant,
                QuotaReason(reason),
                limit=limit,
                charged=int(charged),
                need=prompt + sequences * (max_tokens or 1),
                reset_s=int(reset_ms) / 1000,
                retry_after_s=int(wait_ms) / 1000,
            )
        return Reservation(
            tenant_id=tenant.tenant_id,
            reservation_id=int(rid),
            prompt_tokens=prompt,
            amount=int(amount),
            max_tokens=int(cap),
            limit=limit,
            remaining=limit - int(charged),
            reset_s=int(reset_ms) / 1000,
            store=self.kind,
            window_s=tenant.quota_window_s,
        )

    def _orphan(self, reply: list[Any], tenant: Tenant, prompt: int) -> None:
        """A reserve whose caller is gone (cancelled, or gave up at its budget) was answered
        anyway: give back what it reserved, if anything."""
        rid, amount, window_s = int(reply[0]), int(reply[6]), tenant.quota_window_s
        if rid:
            res = Reservation(
                tenant.tenant_id, rid, prompt, amount, 0, 0, 0, 0.0, "redis", window_s
            )
            self.settle_soon(res, 0)

    # -- settle ----------------------------------------------------------------------------------
    async def settle(self, reservation: Reservation, used: int) -> SettleOutcome:
        if reservation.store == "local":
            outcome = self.local.settle_now(reservation, used)
        else:
            outcome = await self._settle(reservation, used, retry=False)
        if self.on_settle is not None:
            self.on_settle(outcome)
        return outcome

    async def _settle(self, res: Reservation, used: int, *, retry: bool) -> SettleOutcome:
        args = self._args(res.tenant_id, res.window_s)
        args += [str(res.reservation_id), str(max(0, int(used))), "1" if retry else "0"]
        try:
            raw = await self._call(self._scripts["s"], args, max(self.timeout_s, 2.0))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.errors += 1
            if not retry:
                self._pending.append((res, used, time.monotonic()))
            log.debug("quota settle deferred: %r", exc)
            return SettleOutcome.DEFERRED
        return SettleOutcome(raw.decode() if isinstance(raw, bytes) else str(raw))

    def settle_soon(self, reservation: Reservation | None, used: int) -> None:
        if reservation is None:
            return
        if reservation.store == "local":
            outcome = self.local.settle_now(reservation, used)
            if self.on_settle is not None:
                self.on_settle(outcome)
            return
        task = asyncio.get_running_loop().create_task(self.settle(reservation, used))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retry_pending(self) -> None:
        for _ in range(len(self._pending)):
            res, used, since = self._pending.popleft()
            if time.monotonic() - since > self.ttl_ms / 1000:
                self.dropped_settles += 1  # expired by now: charged in full
                continue
            outcome = await self._settle(res, used, retry=True)
            if outcome is SettleOutcome.DEFERRED:
                self._pending.append((res, used, since))
                return
            if self.on_settle is not None:
                self.on_settle(outcome)

    # -- heartbeat, stats, lifecycle -------------------------------------------------------------
    async def heartbeat(self, ttl_ms: int | None = None) -> int:
        ttl = round(3 * self.heartbeat_s * 1000) if ttl_ms is None else ttl_ms
        now = "" if self._clock_ms is None else str(int(self._clock_ms()))
        args = [self.key_prefix, now, str(self.router_id), str(ttl)]
        count = int(await self._call(self._heartbeat, args, max(self.timeout_s, 1.0)))
        self.routers = count
        return count

    async def _beat_loop(self) -> None:
        while True:
            try:
                await self.heartbeat()
                await self._retry_pending()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("quota heartbeat failed: %r", exc)
            await asyncio.sleep(self.heartbeat_s)

    async def start(self) -> None:
        if self._beat is None:
            self._beat = asyncio.get_running_loop().create_task(self._beat_loop(), name="quota-hb")

    async def stats(self, tenant_id: str) -> QuotaStats:
        args = self._args(tenant_id, 0.0)  # window 0: the sweep leaves the window alone
        raw = await self._call(self._scripts["t"], args, max(self.timeout_s, 2.0))
        pairs = dict(zip(raw[::2], raw[1::2], strict=True))
        vals = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in pairs.items()}
        names = ("reserved", "settled", "duplicate", "late", "unknown", "expired", "rejected")
        extra = {"open": vals.get("open", 0), "charged": vals.get("charged", 0)}
        return QuotaStats(**{n: vals.get(n, 0) for n in names}, **extra)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for the settles in flight (and retry deferred ones once)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._tasks:
                    await asyncio.gather(*list(self._tasks), return_exceptions=True)
                if self._pending:
                    await self._retry_pending()

    async def aclose(self) -> None:
        await self.drain()
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.heartbeat(ttl_ms=0)  # leave: the others' share grows at once
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._caller.aclose()
        try:
            async with asyncio.timeout(1.0):
                await self._redis.aclose(close_connection_pool=True)
        except Exception:
            pool: Any = self._pool
            conns = [*pool._available_connections, *pool._in_use_connections]
            await asyncio.gather(
                *(c.disconnect(nowait=True) for c in conns), return_exceptions=True
            )


__all__ = ["RedisQuotaStore"]
