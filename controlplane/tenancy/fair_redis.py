"""`SharedFairStore`: one router's client of the fair-queue state that every router shares.

**Key layout** (`P` = `fairness.key_prefix` + `:` + the served model; keys and values hold tenant
ids, router ids and numbers, never request text):

    P:routers       ZSET  router id (random 62-bit number) -> heartbeat expiry (ms, Redis TIME)
    P:inf           HASH  router id -> requests it has in flight (the fleet's slots it holds)
    P:bkv           HASH  router id -> KV tokens its batch requests hold (prompt + max_tokens)
    P:seq           HASH  router id -> the last charge batch applied (charges apply once)
    P:q:<router>    SET   tenants with requests waiting at that router
    P:hd:<tenant>   HASH  router id -> since when its head request of the tenant waits (ms)
    P:bl            HASH  tenant -> routers where it is backlogged (the global backlog)
    P:cls           HASH  tenant -> 0 interactive | 1 batch
    P:vc            HASH  tenant -> virtual counter (work served / weight)
    P:stats         HASH  granted, swept (dead routers removed), joined
    P:wake          pub/sub channel: slots were freed while requests wait (payload: router id)

Every call carries the router's whole state (absolute in-flight count, batch KV, the set of
tenants waiting there with their head request), so a call lost to a timeout, or a router swept
while it was only slow, is repaired by the next call; decode charges and refunds accumulate
locally (`charge`) and travel with the next call as one numbered batch, applied at most once
(a batch whose reply was lost is sent again under the same number). Scripts: `fair_lua.py`.

**Redis unreachable**: each call has a time budget (`fairness.shared_timeout_ms`, default 25 ms)
from when it is sent, through the shared `controlplane.store.caller.ScriptCaller` (concurrent
calls pipelined; only Redis-side failures count); a circuit breaker (3 consecutive failures, one
probe after a 1 s cool-down) guards `call` and makes a dead Redis free. `call` answers None when
Redis did not decide; the queue then runs on its own (`router/fairness/shared.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from controlplane.errors import StoreUnavailableError
from controlplane.store.breaker import BreakerState, CircuitBreaker
from controlplane.store.caller import ScriptCaller
from controlplane.store.scripts import Script, check_key_prefix, script_client
from controlplane.store.urls import check_url
from controlplane.tenancy.fair_lua import ADMIT, SYNC, VIEW

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Head:
    """A tenant waiting at this router: its class and the request at the front of its FIFO."""

    tenant: str
    batch: bool
    queued: int
    charge: float  # the head's prefill work / the tenant's weight
    reserved: int  # the head's prompt + max_tokens (batch KV)
    age_ms: int = 0  # how long the head has waited here


@dataclass(frozen=True, slots=True)
class RouterState:
    inflight: int
    batch_tokens: int
    slots: int  # the fleet's request slots, as this router sees the fleet
    batch_kv: int  # the fleet's batch KV share, in tokens
    heads: tuple[Head, ...] = ()


@dataclass(frozen=True, slots=True)
class Reply:
    granted: str | None  # the tenant whose head may go now
    reason: str  # granted | idle | full | turn | priority | batch_kv | synced | left
    counter: float
    routers: int
    free: int = 0  # the fleet's free slots after the call (every live router's in flight)
    backlogged: int = 0  # tenants waiting at any live router after the call


@dataclass(frozen=True, slots=True)
class SharedView:
    routers: dict[str, float] = field(default_factory=dict)  # id -> heartbeat expiry (ms)
    inflight: dict[str, int] = field(default_factory=dict)
    batch_kv: dict[str, int] = field(default_factory=dict)
    backlog: dict[str, int] = field(default_factory=dict)  # tenant -> routers
    counters: dict[str, float] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pairs(raw: list[Any], conv: Callable[[str], Any]) -> dict[str, Any]:
    return {_s(k): conv(_s(v)) for k, v in zip(raw[::2], raw[1::2], strict=True)}


class SharedFairStore:
    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "cp:fair",
        router_ttl_s: float = 1.5,
        timeout_s: float = 0.025,
        password: str | None = None,
        allow_insecure: bool = False,
        client_name: str = "cp-fair",
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 1.0,
        clock_override_ms: Callable[[], int] | None = None,
    ) -> None:
        check_key_prefix(key_prefix, "fairness")
        check_url(url, allow_insecure=allow_insecure, has_credentials=password is not None)
        self.key_prefix = key_prefix
        self.router_id = str(secrets.randbits(62))
        self.ttl_ms = max(1, round(router_ttl_s * 1000))
        self.timeout_s = timeout_s
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self._clock_ms = clock_override_ms
        self._pool, self._redis = script_client(
            url,
            client_name=client_name,
            max_connections=4,
            pool_timeout_s=max(timeout_s, 1.0),
            socket_timeout_s=max(timeout_s, 1.0),
            connect_timeout_s=min(max(timeout_s, 0.1), 1.0),
            password=password,
        )
        self._caller = ScriptCaller(self._redis, self.breaker, stall_s=max(timeout_s, 1.0))
        self._scripts = {"a": Script(ADMIT), "s": Script(SYNC), "v": Script(VIEW)}
        self._pending: dict[str, float] = {}
        self._unconfirmed: tuple[int, dict[str, float]] | None = None
        self._seq = 0
        self.routers = 0  # live routers at the last reply
        self.errors = 0

    @property
    def degraded_reason(self) -> str | None:
        if self.breaker.state is BreakerState.CLOSED:
            return None
        return "fair queue state unreachable: local fairness"

    def charge(self, tenant: str, delta: float) -> None:
        """Add `delta` (work / weight; negative: a refund) to the tenant's shared counter with
        this router's next call."""
        if delta:
            self._pending[tenant] = self._pending.get(tenant, 0.0) + delta

    @property
    def pending_charges(self) -> dict[str, float]:
        out = dict(self._pending)
        if self._unconfirmed is not None:
            for t, d in self._unconfirmed[1].items():
                out[t] = out.get(t, 0.0) + d
        return out

    # -- calls -------------------------------------------------------------------------------------
    async def _run(self, script: Script, args: list[str], timeout_s: float) -> Any:
        """An unguarded script call with a budget of `timeout_s` from its send."""
        return await self._caller.call(script, args, budget_s=timeout_s, guarded=False)

    def _now(self) -> str:
        return "" if self._clock_ms is None else str(int(self._clock_ms()))

    def _batch(self) -> tuple[int, dict[str, float]]:
        if self._unconfirmed is None and self._pending:
            self._seq += 1
            self._unconfirmed, self._pending = (self._seq, self._pending), {}
        return self._unconfirmed or (0, {})

    def _unbatch(self) -> None:
        """The numbered batch just made was never sent: back into the pending charges."""
        assert self._unconfirmed is not None
        _, charges = self._unconfirmed
        for tenant, delta in self._pending.items():
            charges[tenant] = charges.get(tenant, 0.0) + delta
        self._pending, self._unconfirmed = charges, None
        self._seq -= 1

    async def call(
        self, state: RouterState, *, grant: bool, ttl_ms: int | None = None
    ) -> Reply | None:
        """SYNC (or ADMIT when `grant`) this router's state; None when Redis did not answer (or
        the breaker is open)."""
        fresh = self._unconfirmed is None
        batch, charges = self._batch()
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        args = [self.key_prefix, self._now(), self.router_id, str(ttl), str(state.inflight)]
        args += [str(state.batch_tokens), str(state.slots), str(state.batch_kv)]
        args += ["1" if grant else "0", str(batch), str(len(charges))]
        for tenant, delta in charges.items():
            args += [tenant, repr(delta)]
        args.append(str(len(state.heads)))
        for h in state.heads:
            args += [h.tenant, "1" if h.batch else "0", str(h.queued), repr(h.charge)]
            args += [str(h.reserved), str(max(0, h.age_ms))]
        script = self._scripts["a" if grant else "s"]
        try:
            raw = await self._caller.call(script, args, budget_s=self.timeout_s)
        except StoreUnavailableError as exc:  # not sent: the charges wait for the next call
            if fresh and batch:
                self._unbatch()
            if exc.reason != "open":  # refused by the breaker: nothing was tried
                self.errors += 1
            return None
        except Exception as exc:
            self.errors += 1
            log.debug("fair queue state unreachable: %r", exc)
            return None
        if batch:
            self._unconfirmed = None
        ok, what, counter, routers, free, backlogged = raw
        self.routers = int(routers)
        value = float(_s(counter)) if _s(counter) else 0.0
        tail = (int(float(_s(free))), int(backlogged))  # free slots, backlogged tenants
        if int(ok):
            return Reply(_s(what), "granted", value, self.routers, *tail)
        return Reply(None, _s(what), value, self.routers, *tail)

    async def view(self) -> SharedView:
        raw = await self._run(self._scripts["v"], [self.key_prefix, self._now(), ""], 2.0)
        routers, inf, bkv, bl, vc, st = raw
        return SharedView(
            routers=_pairs(routers, float),
            inflight=_pairs(inf, int),
            batch_kv=_pairs(bkv, int),
            backlog=_pairs(bl, int),
            counters=_pairs(vc, float),
            stats=_pairs(st, int),
        )

    async def listen(self, on_wake: Callable[[], None]) -> None:
        """Call `on_wake` whenever another router freed slots while requests wait (until
        cancelled; reconnects after a failure)."""
        me = self.router_id.encode()
        while True:
            pubsub: Any = self._redis.pubsub()
            try:
                await pubsub.subscribe(f"{self.key_prefix}:wake")
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg.get("data") != me:
                        on_wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("fair queue wake-ups unavailable: %r", exc)
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()
            await asyncio.sleep(0.5)

    async def leave(self) -> None:
        """This router closes: its backlog and slots leave the shared state at once."""
        args = [self.key_prefix, self._now(), self.router_id, "0"]  # TTL 0: leave
        with contextlib.suppress(Exception):
            await self._run(self._scripts["s"], args, max(self.timeout_s, 0.5))

    async def aclose(self) -> None:
        await self.leave()
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


__all__ = ["Head", "Reply", "RouterState", "SharedFairStore", "SharedView"]
