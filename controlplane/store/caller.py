"""`ScriptCaller`: the one path by which the Redis stores call their server-side scripts.

The prefix index, the quota store and the shared fair queue each call Lua scripts with a time
budget behind a circuit breaker. Calling each script on its own pooled connection, a burst queued
for connections and for the event loop before its request was even written, its budget already
running: the client's own queueing timed calls out and opened the breaker while Redis was idle.
The caller instead:

**Coalesces.** Calls wait in one queue; up to `connections` lanes (default 2, one connection
each) send what waits (at most `max_batch` calls) as one pipelined round trip, then the calls that
arrived meanwhile as the next. A lane is a task that lives while there is work, so a burst of 200
calls costs a few round trips and an idle store holds no task.

**Budgets run from the send.** A call's budget starts when its round trip is written to the
socket (until then, from when the lane began connecting and writing it), not when it was
queued, and restarts whenever Redis answers any earlier call of this caller: the time Redis
spends on our own pipelined calls ahead of it is not held against it. A
call without a reply for its budget fails with `StoreTimeoutError`; a round trip with no call
left waiting is abandoned (its connection closed; redis-py reconnects on next use), and one
whose own connection has answered nothing for `stall_s` (or its longest budget) is abandoned
whatever Redis does on the other connection.
Deadlines are judged by one timer per round trip; when it fires while the event loop was busy
with other work, replies may be waiting unread: if the connection has bytes to read (its
buffer, or the socket: one `select` with no wait, only on this slow path), Redis has answered
and the judgment waits for the lane to read them (`trips.py`: a round trip on the wire).

**The breaker sees Redis only.** Guarded calls ask `breaker.allow()` when submitted (refused:
`StoreUnavailableError("open")`, no I/O); each round trip carrying guarded calls records one
verdict: failure when a guarded call got no reply within its budget, the connection failed or
Redis answered an error; success otherwise. A probe cancelled before it was sent is
`abandon()`ed; once sent, its round trip gives the verdict. Local queueing never counts: a call
waiting for a lane has no deadline, and past `max_pending` waiting calls a new one is refused at
once (`StoreUnavailableError("overloaded")`) without touching the breaker. Guarded calls still
waiting when the breaker opens are refused rather than sent. Unguarded calls (settles,
heartbeats, views) share the lanes and the budgets but neither ask nor inform the breaker.

**Scripts and orphans.** Calls are EVALSHA with no keys; calls answered NOSCRIPT (Redis lost
its scripts: a restart) are sent again behind a SCRIPT LOAD, in one more round trip. A call whose
caller gave up (cancelled, or timed out) and whose reply arrives anyway hands the reply to its
`on_orphan` callback (the quota store releases a reservation nobody will use).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from controlplane.errors import StoreTimeoutError, StoreUnavailableError
from controlplane.store.breaker import BreakerState, CircuitBreaker
from controlplane.store.scripts import Script
from controlplane.store.trips import Arg, Call, Trip, exchange, unread

log = logging.getLogger(__name__)

RECHECK_S = 0.001  # a deadline with replies waiting unread is judged again this soon
_EPS = 1e-4


class ScriptCaller:
    def __init__(
        self,
        client: aioredis.Redis,
        breaker: CircuitBreaker,
        *,
        connections: int = 2,
        max_batch: int = 64,
        max_pending: int = 10_000,
        stall_s: float = 1.0,
    ) -> None:
        self._pool = client.connection_pool
        self.breaker = breaker
        self.max_batch = max(1, max_batch)
        self.max_pending = max_pending
        self.stall_s = stall_s
        self._conns: list[Any] = [None] * max(1, connections)
        self._timeouts: list[float | None] = [None] * len(self._conns)  # the pool's, restored
        self._free = list(range(len(self._conns)))[::-1]
        self._waking = 0  # lanes started that have not taken their first batch yet
        self._queue: deque[Call] = deque()
        self._lanes: set[asyncio.Task[None]] = set()
        self._progress = -math.inf  # loop time of the last reply from Redis, any connection
        self._closed = False
        self.round_trips = 0
        self.calls_sent = 0
        self.script_loads = 0
        self.timeouts = 0  # calls without a reply within their budget
        self.errors = 0  # calls failed by a connection error or an error reply
        self.refused = 0  # guarded calls refused by the breaker (submitted or queued)
        self.shed = 0  # calls refused because too many were waiting

    # -- calling -----------------------------------------------------------------------------------
    async def call(
        self,
        script: Script,
        args: Sequence[Arg],
        *,
        budget_s: float,
        guarded: bool = True,
        on_orphan: Callable[[Any], None] | None = None,
    ) -> Any:
        """The script's reply; raises `StoreError`s, or a `RedisError` (connection, reply)."""
        (c,) = self._submit([(script, args)], budget_s, guarded, on_orphan)
        try:
            return await c.future
        except asyncio.CancelledError:
            self._gone([c])
            raise

    async def call_many(
        self,
        calls: Sequence[tuple[Script, Sequence[Arg]]],
        *,
        budget_s: float,
        guarded: bool = True,
    ) -> list[Any]:
        """Replies in order, an exception object in place of each failed call (sent together:
        one breaker decision, normally one round trip). Raises `StoreUnavailableError` when
        none was sent."""
        cs = self._submit(calls, budget_s, guarded, None)
        try:
            return list(await asyncio.gather(*(c.future for c in cs), return_exceptions=True))
        except asyncio.CancelledError:
            self._gone(cs)
            raise

    def _submit(
        self,
        calls: Sequence[tuple[Script, Sequence[Arg]]],
        budget_s: float,
        guarded: bool,
        on_orphan: Callable[[Any], None] | None,
    ) -> list[Call]:
        if self._closed:
            raise StoreUnavailableError("closed")
        if len(self._queue) + len(calls) > self.max_pending:
            self.shed += len(calls)
            raise StoreUnavailableError("overloaded")
        probe = False
        if guarded:
            if not self.breaker.allow():
                self.refused += len(calls)
                raise StoreUnavailableError("open")
            probe = self.breaker.state is BreakerState.HALF_OPEN  # allowed while half open
        loop = asyncio.get_running_loop()
        made = [
            Call(script, args, budget_s, guarded, loop.create_future(), on_orphan, probe)
            for script, args in calls
        ]
        self._queue.extend(made)
        self._kick(loop)
        return made

    def _gone(self, calls: list[Call]) -> None:
        """The caller was cancelled: a probe not sent yet lets the next caller probe."""
        if any(c.probe and not c.sent for c in calls):
            self.breaker.abandon()

    # -- lanes -------------------------------------------------------------------------------------
    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._waking or not self._free or self._closed:
            return
        slot = self._free.pop()
        self._waking += 1
        task = loop.create_task(self._lane(slot), name="store-lane")
        self._lanes.add(task)
        task.add_done_callback(self._lanes.discard)

    async def _lane(self, slot: int) -> None:
        waking = True
        try:
            while True:
                batch = self._take()
                if waking:
                    waking = False
                    self._waking -= 1
                if not batch:
                    return
                if self._queue:  # more than one batch waits: another lane takes the rest
                    self._kick(asyncio.get_running_loop())
                await self._run(slot, batch)
        finally:
            if waking:
                self._waking -= 1
            self._free.append(slot)
            if self._queue and not self._closed:
                self._kick(asyncio.get_running_loop())

    def _take(self) -> list[Call]:
        batch: list[Call] = []
        opened = self.breaker.state is BreakerState.OPEN
        while self._queue and len(batch) < self.max_batch:
            c = self._queue.popleft()
            if c.future.done():
                continue  # its caller left before it was sent
            if opened and c.guarded:  # the breaker opened while it waited
                self.refused += 1
                c.deliver(StoreUnavailableError("open"))
                continue
            batch.append(c)
        return batch

    async def _run(self, slot: int, batch: list[Call]) -> None:
        """Send `batch` on the lane's connection; calls answered NOSCRIPT once more, behind a
        SCRIPT LOAD of their scripts."""
        missing = await self._trip(slot, batch, [])
        batch = [c for c in missing if not c.future.done()]
        if batch:
            loads = list({c.script.sha: c.script for c in batch}.values())
            self.script_loads += len(loads)
            await self._trip(slot, batch, loads)

    async def _connection(self, slot: int) -> Any:
        conn = self._conns[slot]
        if conn is None:
            conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]
            self._timeouts[slot], conn.socket_timeout = conn.socket_timeout, None  # trips.py
            self._conns[slot] = conn
        return conn

    async def _trip(self, slot: int, calls: list[Call], loads: list[Script]) -> list[Call]:
        """One round trip, its deadlines and its breaker verdict; returns the calls answered
        NOSCRIPT when `loads` is empty (left pending, to be sent again)."""
        loop = asyncio.get_running_loop()
        stall = max(self.stall_s, max(c.budget for c in calls))
        trip = Trip(calls, loads, loop.time(), stall, any(c.guarded for c in calls))
        self.round_trips += 1
        self.calls_sent += len(calls)
        for c in calls:
            c.sent = True
        self._watch(trip, loop)
        missing: list[Call] = []
        error: BaseException | None = None
        guarded_error = closing = False
        try:
            async with asyncio.timeout(None) as trip.scope:
                trip.conn = await self._connection(slot)
                missing, errors, guarded_error = await exchange(
                    trip.conn, trip, loop, self._replied
                )
                self.errors += errors
        except asyncio.CancelledError:  # the caller is closing
            error, closing = StoreUnavailableError("closed"), True
            raise
        except TimeoutError:  # abandoned at the deadline: its calls have failed already
            error = StoreTimeoutError("no reply within the budget")
        except Exception as exc:  # connection refused or reset, a failed SCRIPT LOAD ...
            error = exc
            log.debug("store round trip failed: %r", exc)
        finally:
            trip.done = True
            if trip.timer is not None:
                trip.timer.cancel()
            if error is not None:
                missing = []
                for c in trip.waiting():
                    c.deliver(error)
                    self.errors += not isinstance(error, StoreTimeoutError)
                if trip.conn is not None:  # replies may be left unread: out of step
                    with contextlib.suppress(Exception):
                        await trip.conn.disconnect(nowait=True)
            if trip.guarded and not trip.failed and not closing:
                if error is not None or guarded_error:
                    self.breaker.record_failure()
                else:
                    self.breaker.record_success()
        return missing

    def _replied(self, at: float) -> None:
        self._progress = at

    # -- deadlines ---------------------------------------------------------------------------------
    def _watch(self, trip: Trip, loop: asyncio.AbstractEventLoop) -> None:
        waited = trip.waited()
        budget = min(c.budget for c in trip.waiting())
        when = min(max(waited, self._progress) + budget, waited + trip.stall)
        trip.timer = loop.call_at(when, self._judge, trip)

    def _judge(self, trip: Trip) -> None:
        if trip.done:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if unread(trip.conn):
            # Redis has answered; the lane has not read it yet (the loop was busy): not late
            trip.last = self._progress = now
            trip.timer = loop.call_at(now + RECHECK_S, self._judge, trip)
            return
        waited = trip.waited()
        since = max(waited, self._progress)
        stalled = now - waited >= trip.stall - _EPS
        late_guarded = False
        for c in trip.waiting():
            if stalled or now - since >= c.budget - _EPS:
                self.timeouts += 1
                late_guarded |= c.guarded
                c.deliver(StoreTimeoutError(f"Redis did not answer within {c.budget:g} s"))
        if late_guarded and not trip.failed:
            trip.failed = True  # Redis-side: from the send, with unread replies counted
            self.breaker.record_failure()
        if trip.waiting():
            self._watch(trip, loop)
        elif trip.scope is not None:
            trip.scope.reschedule(loop.time())  # nobody waits: abandon the round trip

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._queue)

    async def aclose(self) -> None:
        """Refuse new calls, fail waiting ones, stop the lanes, give the connections back."""
        self._closed = True
        lanes = list(self._lanes)
        for task in lanes:
            task.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
        while self._queue:
            self._queue.popleft().deliver(StoreUnavailableError("closed"))
        for i, conn in enumerate(self._conns):
            if conn is not None:
                self._conns[i] = None
                conn.socket_timeout = self._timeouts[i]
                with contextlib.suppress(Exception):
                    await self._pool.release(conn)


__all__ = ["RECHECK_S", "ScriptCaller"]
