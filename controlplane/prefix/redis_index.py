"""`RedisPrefixIndex`: the prefix index shared by many router processes, in Redis.

Implements `AsyncPrefixIndex` with the semantics of `InMemoryPrefixIndex` (confirmed entries plus
speculative ones that expire; a replica's match ends at the first block held by neither kind),
tied to replica incarnations, bounded in memory, and built so that a slow or dead Redis never
slows or fails routing.

**Key layout** (`P` = the key prefix, one per model/pool, e.g. `rtr:pidx:llama-8b`; keys hold
the prefix and replica ids, values hold 64-bit block hashes and numbers, never text):

    P:i:<replica>   STRING  the replica's incarnation (16 hex digits of incarnation + 2^63, so
                            string order = numeric order); TTL 2 x entry TTL, refreshed on write
    P:c:<replica>   SET     confirmed blocks: member = the block hash as 8 bytes (big-endian u64);
                            what lookups read (SMISMEMBER)
    P:t:<replica>   ZSET    the same blocks, score = expiry (ms, Redis TIME): trimming of expired
                            entries and the per-replica cap (oldest = soonest-expiring out first)
    P:s:<replica>   ZSET    speculative blocks, score = expiry (ms) of the latest chain that
                            covers the block; read by lookups with ZMSCORE (exact expiry)

Every key has a TTL: `c`/`t` = entry TTL, refreshed on store; `s` >= its latest score.

Replica-major rather than one key per block (llm-d's and AIBrix's layout): a lookup searches each
candidate's run of blocks (a few commands of six blocks each, not one read per block),
`clear` and a new incarnation are one `UNLINK` (freed off the main thread), expiry and the cap are
range operations on the lowest scores, and an entry costs a SET plus a ZSET element (~180 bytes
per confirmed block, measured) instead of a key, a hash field and an index element.

Writes carrying a newer incarnation drop the replica's entries first; writes carrying an older one
are ignored (`stale_writes`), so incarnations must increase per replica (a counter, or the start
time). A lookup only counts entries when the candidate's incarnation equals the stored one, so a
restarted replica matches nothing until its new incarnation's events arrive.

**Memory bound**: every key has a TTL. A confirmed entry lives `entry_ttl_s` (default 10 min)
after it was last stored, or last hit by a request routed to the replica (`speculate` renews the
blocks the replica already holds, since vLLM sends no event for a cache hit). Stores trim expired
entries and evict the soonest-expiring beyond `max_entries_per_replica` (per kind), a bounded
number per call; lookups read confirmed membership only, so an expired entry can still match
until the replica's next store (or until its keys expire, at most one TTL after its last write).
Speculative expiry is exact.

**Lookup** is one EVALSHA (the script is reloaded on NOSCRIPT); see `redis_lua.LOOKUP`.

**Calls** (lookups and write batches) go through the shared `controlplane.store.caller`
`ScriptCaller`: concurrent lookups are pipelined on a couple of connections, in the same round
trips as the writes, and a call's budget runs from when its round trip is sent, so lookups that
queue behind the router's own CPU are not timed out for it.

**Resilience**: the lookup has a time budget (default 25 ms, from its send) and returns None
("unknown") on a timeout, a connection error or anything else; writes go through a bounded queue
drained by one background task (one call batch per drain; full queue = drop and count); a
circuit breaker (3 consecutive failed round trips, one half-open probe after a cool-down) makes a
dead Redis free, and opens on Redis-side failures only. Clears that could not be applied are
kept and applied once Redis answers (a late clear only forgets, which is the safe direction).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import ResponseError

from controlplane.errors import ConfigError, StoreTimeoutError, StoreUnavailableError
from controlplane.prefix.redis_lua import LOOKUP, WRITE
from controlplane.store.breaker import BreakerState, CircuitBreaker
from controlplane.store.caller import ScriptCaller
from controlplane.store.scripts import Script, script_client
from controlplane.store.urls import check_url, redacted
from controlplane.types import PrefixMatch

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
_INC_OFFSET = 1 << 63
# A router that does not follow a replica's KV events (a separate `controlplane indexer` writes
# them) does not know the incarnation the indexer uses: it looks up and speculates with this
# value, which matches whatever incarnation Redis holds for the replica (the lowest possible one
# when none is held, so the indexer's first write replaces its speculative entries).
ANY_INCARNATION = -(1 << 63)

Arg = str | bytes | int


def chain_blob(hashes: Sequence[int]) -> bytes:
    """The chain as 8 bytes (big-endian u64) per block; negative ints as two's complement."""
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
    except struct.error:
        return struct.pack(f">{len(hashes)}Q", *(int(h) & MASK64 for h in hashes))


def _replied(exc: Exception) -> bool:
    """An error Redis answered for one call (the round trip itself worked)."""
    return isinstance(exc, ResponseError)


def encode_incarnation(incarnation: int) -> str:
    """16 hex digits whose string order is the numeric order of signed 64-bit incarnations;
    `ANY_INCARNATION` is the empty string (the scripts read it as "the stored one")."""
    if incarnation == ANY_INCARNATION:
        return ""
    return f"{(int(incarnation) + _INC_OFFSET) & MASK64:016x}"


@dataclass(slots=True)
class _Op:
    """One queued write: a script call's arguments after the (prefix, now) pair."""

    kind: str  # 's' stored, 'r' removed, 'p' speculate, 'x' retract, 'c' clear
    replica: str
    incarnation: str
    blob: bytes
    spec_ttl_ms: int = 0
    now: str = ""  # '' = Redis TIME when applied; set only with a test clock

    @property
    def blocks(self) -> int:
        return len(self.blob) // 8


class RedisPrefixIndex:
    """A shared prefix index in Redis (see the module docstring for layout and behaviour).

    Counters, for the router's metrics: `lookups`, `unknown` (returned None), `fallbacks` (None
    at once because the breaker is open), `timeouts`, `errors`, `round_trips` (pipelined round
    trips to Redis, lookups and writes together), `script_loads`, `writes_enqueued`,
    `writes_applied`, `writes_dropped` (queue full, breaker open, or closed), `writes_failed`
    (sent but Redis failed), `stale_writes` (older incarnation, ignored), `incarnations_replaced`,
    `cap_evictions` (entries dropped by the per-replica cap), `breaker_state`; `counters()` has
    them all as a dict. Writes count operations (a `record_stored` call), not blocks.

    Use one instance per event loop (connections belong to the loop that opened them); call
    `aclose()` at shutdown. Construction does no I/O: a router starts with Redis unreachable.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        key_prefix: str = "rtr:pidx",
        entry_ttl_s: float = 600.0,
        max_entries_per_replica: int = 100_000,
        lookup_budget_s: float = 0.025,
        write_timeout_s: float = 0.5,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.1,
        max_connections: int = 64,
        write_queue_size: int = 4096,
        write_batch_blocks: int = 4096,
        write_chunk_blocks: int = 512,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 1.0,
        password: str | None = None,
        username: str | None = None,
        allow_insecure: bool = False,
        ssl_ca_certs: str | None = None,
        client_name: str | None = "cp-prefix-index",
        clock_override_ms: Callable[[], int] | None = None,
        coalesce_s: float = 0.003,
    ) -> None:
        if entry_ttl_s <= 0 or lookup_budget_s <= 0 or write_timeout_s <= 0:
            raise ConfigError("entry_ttl_s, lookup_budget_s and write_timeout_s must be > 0")
        if max_entries_per_replica < 1 or write_queue_size < 1 or write_chunk_blocks < 1:
            raise ConfigError("max_entries_per_replica, write_queue_size, chunk must be >= 1")
        if not key_prefix or any(c.isspace() for c in key_prefix):
            raise ConfigError("key_prefix must be non-empty, without whitespace")
        check_url(url, allow_insecure=allow_insecure, has_credentials=password is not None)
        self.url = redacted(url)
        self.key_prefix = key_prefix
        self.entry_ttl_ms = max(1, round(entry_ttl_s * 1000))
        self.max_entries_per_replica = max_entries_per_replica
        self.lookup_budget_s = lookup_budget_s
        self.write_timeout_s = write_timeout_s
        self._batch_blocks = max(1, write_batch_blocks)
        self._chunk = min(write_chunk_blocks, 2048)  # Lua unpack() stack limit (2 args per block)
        # entries a write call may trim or evict at most (bounds the time a call holds Redis)
        self._budget = max(1024, 2 * self._chunk)
        self._idle_wake_s = 0.5
        self._coalesce_s = coalesce_s
        self._clock_ms = clock_override_ms
        self._connect_timeout_s = connect_timeout_s

        extra: dict[str, Any] = {}
        if username is not None:
            extra["username"] = username
        if ssl_ca_certs is not None:
            if urlsplit(url).scheme != "rediss":
                raise ConfigError("ssl_ca_certs needs a rediss:// URL")
            extra["ssl_ca_certs"] = ssl_ca_certs
        self._pool, self._redis = script_client(
            url,
            client_name=client_name,
            max_connections=max_connections,
            pool_timeout_s=max(write_timeout_s, lookup_budget_s),  # wait for a free connection
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
            password=password,
            **extra,
        )
        self._lookup = Script(LOOKUP)
        self._write = Script(WRITE)
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self._caller = ScriptCaller(self._redis, self.breaker, stall_s=socket_timeout_s)

        self._queue: asyncio.Queue[_Op] = asyncio.Queue(maxsize=write_queue_size)
        self._worker: asyncio.Task[None] | None = None
        self._pending_clears: dict[str, None] = {}  # an ordered set of replica ids
        self._closed = False

        self.lookups = 0
        self.unknown = 0
        self.fallbacks = 0
        self.timeouts = 0
        self.errors = 0
        self.writes_enqueued = 0
        self.writes_applied = 0
        self.writes_dropped = 0
        self.writes_failed = 0
        self.stale_writes = 0
        self.incarnations_replaced = 0
        self.cap_evictions = 0

    # -- state -----------------------------------------------------------------------------------
    @property
    def breaker_state(self) -> BreakerState:
        return self.breaker.state

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def round_trips(self) -> int:
        return self._caller.round_trips

    @property
    def script_loads(self) -> int:
        return self._caller.script_loads

    @property
    def pending_writes(self) -> int:
        return self._queue.qsize()

    def counters(self) -> dict[str, int | str]:
        return {
            "lookups": self.lookups,
            "unknown": self.unknown,
            "fallbacks": self.fallbacks,
            "timeouts": self.timeouts,
            "errors": self.errors,
            "round_trips": self.round_trips,
            "script_loads": self.script_loads,
            "writes_enqueued": self.writes_enqueued,
            "writes_applied": self.writes_applied,
            "writes_dropped": self.writes_dropped,
            "writes_failed": self.writes_failed,
            "stale_writes": self.stale_writes,
            "incarnations_replaced": self.incarnations_replaced,
            "cap_evictions": self.cap_evictions,
            "breaker_state": str(self.breaker.state),
        }

    def _now_arg(self) -> str:
        return "" if self._clock_ms is None else str(int(self._clock_ms()))

    # -- reads -----------------------------------------------------------------------------------
    async def lookup(
        self, hashes: Sequence[int], candidates: Sequence[tuple[str, int]]
    ) -> dict[str, PrefixMatch] | None:
        """Leading blocks of `hashes` held by each candidate; None when Redis cannot answer
        within the budget. Never raises (except the caller's own cancellation)."""
        self.lookups += 1
        if not hashes or not candidates:
            return {}
        if self._closed:
            self.unknown += 1
            return None
        valid = [(rid, inc) for rid, inc in candidates if "\0" not in rid]  # NUL separates
        if not valid:
            return {}
        try:
            packed = "\0".join(f"{rid}\0{encode_incarnation(inc)}" for rid, inc in valid)
            args: list[Arg] = [self.key_prefix, self._now_arg(), chain_blob(hashes), packed]
            raw = await self._caller.call(self._lookup, args, budget_s=self.lookup_budget_s)
            counts = [int(x) for x in raw.split(b",")]
            out: dict[str, PrefixMatch] = {}
            for c, (rid, _inc) in enumerate(valid):
                matched = counts[2 * c]
                if matched:
                    out[rid] = PrefixMatch(rid, matched, counts[2 * c + 1])
        except StoreUnavailableError as exc:  # not sent: the breaker is open (or overload)
            self.unknown += 1
            if exc.reason == "open":
                self.fallbacks += 1
            else:
                self.errors += 1
            return None
        except StoreTimeoutError:
            self.timeouts += 1
            self.unknown += 1
            return None
        except Exception as exc:  # Redis down, reset, bad reply: all mean "unknown"
            self.errors += 1
            self.unknown += 1
            log.debug("prefix index lookup failed: %r", exc)
            return None
        return out

    # -- writes (queued; never block the caller) -------------------------------------------------
    async def record_stored(self, replica_id: str, incarnation: int, hashes: Sequence[int]) -> None:
        if hashes:
            inc = encode_incarnation(incarnation)
            self._enqueue(_Op("s", replica_id, inc, chain_blob(hashes), 0, self._now_arg()))

    async def record_removed(
        self, replica_id: str, incarnation: int, hashes: Sequence[int]
    ) -> None:
        if hashes:
            inc = encode_incarnation(incarnation)
            self._enqueue(_Op("r", replica_id, inc, chain_blob(hashes), 0, self._now_arg()))

    async def speculate(
        self, replica_id: str, incarnation: int, hashes: Sequence[int], ttl_s: float
    ) -> None:
        if not hashes or ttl_s <= 0:
            return
        ttl_ms = min(self.entry_ttl_ms, max(1, round(ttl_s * 1000)))
        inc = encode_incarnation(incarnation)
        self._enqueue(_Op("p", replica_id, inc, chain_blob(hashes), ttl_ms, self._now_arg()))

    async def retract(
        self, replica_id: str, incarnation: int, hashes: Sequence[int], grace_s: float
    ) -> None:
        """The chain was computed (the request's first token): its speculative entries expire
        within `grace_s`, so a speculative claim never outlives an eviction by more than that."""
        if not hashes:
            return
        ms = max(1, round(grace_s * 1000))
        inc = encode_incarnation(incarnation)
        self._enqueue(_Op("x", replica_id, inc, chain_blob(hashes), ms, self._now_arg()))

    async def clear(self, replica_id: str) -> None:
        """Forget the replica's entries (all incarnations). If the clear cannot be queued or
        applied now it is kept and applied once Redis answers again."""
        if self._closed:
            self.writes_dropped += 1
            return
        self.writes_enqueued += 1
        try:
            self._start_worker()
            self._queue.put_nowait(_Op("c", replica_id, "", b"", 0, self._now_arg()))
        except asyncio.QueueFull:
            self._pending_clears[replica_id] = None

    def _enqueue(self, op: _Op) -> None:
        if self._closed:
            self.writes_dropped += 1
            return
        self.writes_enqueued += 1
        try:
            self._start_worker()
            self._queue.put_nowait(op)
        except asyncio.QueueFull:
            self.writes_dropped += 1

    def _start_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(
                self._run(), name="prefix-index-writer"
            )

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write was sent or dropped (and kept clears applied, unless
        the breaker is open). True if that happened within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._queue.join()
                while self._backlog():
                    await asyncio.sleep(0.005)
        except TimeoutError:
            return False
        return True

    def _backlog(self) -> bool:
        return bool(self._pending_clears) and self.breaker.state is not BreakerState.OPEN

    async def _run(self) -> None:
        """The writer: one pipelined round trip per batch of queued writes, in queue order."""
        queue = self._queue
        while not self._closed:
            batch: list[_Op] = []
            if not self._backlog():
                # wake up now and then so clears kept while Redis was down get retried
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._idle_wake_s):
                        batch.append(await queue.get())
            try:
                if batch and queue.empty() and self._coalesce_s > 0:
                    # a moment for the writes that arrive together (a request's speculation,
                    # another's retraction, a KV event) to share one round trip
                    await asyncio.sleep(self._coalesce_s)
                blocks = sum(op.blocks for op in batch)
                while not queue.empty() and blocks < self._batch_blocks:
                    op = queue.get_nowait()
                    batch.append(op)
                    blocks += op.blocks
                await self._apply(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the writer alive whatever happens
                log.warning("prefix index writer: %r", exc)
            finally:
                for _ in batch:
                    queue.task_done()
            if not batch and self._pending_clears:
                await asyncio.sleep(0.05)  # pending clears while a probe is out: do not spin

    def _calls(self, op: _Op) -> list[list[Arg]]:
        ttl, cap, budget = self.entry_ttl_ms, self.max_entries_per_replica, self._budget
        now = op.now
        if op.kind == "c":
            return [[self.key_prefix, now, "c", op.replica, "", b"", ttl, 0, cap, budget]]
        step = self._chunk * 8
        return [
            [self.key_prefix, now, op.kind, op.replica, op.incarnation,
             op.blob[start : start + step], ttl, op.spec_ttl_ms, cap, budget]
            for start in range(0, len(op.blob), step)
        ]  # fmt: skip

    async def _apply(self, batch: list[_Op]) -> None:
        clears = [_Op("c", rid, "", b"", 0, self._now_arg()) for rid in self._pending_clears]
        ops = clears + batch
        if not ops:
            return
        self._pending_clears.clear()
        calls = [(op, c) for op in ops for c in self._calls(op)]
        work = [(self._write, args) for _, args in calls]
        try:
            results = await self._caller.call_many(work, budget_s=self.write_timeout_s)
        except StoreUnavailableError:  # not sent: the breaker is open
            self._keep_clears(clears)
            self._drop(batch)
            return
        except asyncio.CancelledError:
            self._keep_clears(ops)
            raise
        # an exception other than an error reply: the round trip failed (timeout, connection)
        lost = next((r for r in results if isinstance(r, Exception) and not _replied(r)), None)
        if lost is not None:
            self.writes_failed += sum(op.kind != "c" for op in batch)
            self._keep_clears(ops)
            log.debug("prefix index write failed: %r", lost)
            return
        failed: set[int] = set()
        stale: set[int] = set()
        for (op, _), res in zip(calls, results, strict=True):
            if isinstance(res, Exception):  # a script/server error, not a connection failure
                failed.add(id(op))
                log.warning("prefix index write %r failed: %r", op.kind, res)
                continue
            status, evicted = int(res[0]), int(res[1])
            if status == 0:
                stale.add(id(op))
            elif status == 2:
                self.incarnations_replaced += 1
            self.cap_evictions += evicted
        for op in ops:
            if id(op) in failed:
                self.writes_failed += 1
            elif id(op) in stale:
                self.stale_writes += 1
            else:
                self.writes_applied += 1

    def _keep_clears(self, ops: list[_Op]) -> None:
        for op in ops:
            if op.kind == "c":
                self._pending_clears[op.replica] = None

    def _drop(self, batch: list[_Op]) -> None:
        """The breaker is open: drop data writes (counted), keep clears for later."""
        for op in batch:
            if op.kind == "c":
                self._pending_clears[op.replica] = None
            else:
                self.writes_dropped += 1

    # -- lifecycle -------------------------------------------------------------------------------
    async def ping(self) -> bool:
        """One PING within the lookup budget (for readiness: `degraded` when False)."""
        try:
            async with asyncio.timeout(self.lookup_budget_s * 4):
                return bool(await self._redis.ping())
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def aclose(self, flush_timeout_s: float = 0.0) -> None:
        """Stop the writer (after up to `flush_timeout_s` of flushing) and close every
        connection. Writes after this are dropped; lookups return None."""
        if self._closed:
            return
        if flush_timeout_s > 0 and self._worker is not None:
            await self.flush(flush_timeout_s)
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            # a cancel that lands while the worker's idle timeout fires can be absorbed (an
            # asyncio.timeout race in 3.11): keep cancelling until the task is really done
            while not worker.done():
                worker.cancel()
                await asyncio.wait({worker}, timeout=0.1)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                worker.result()
        dropped = 0
        while not self._queue.empty():
            self._queue.get_nowait()
            self._queue.task_done()
            dropped += 1
        self.writes_dropped += dropped
        await self._caller.aclose()
        try:
            async with asyncio.timeout(max(1.0, 2 * self._connect_timeout_s)):
                await self._redis.aclose(close_connection_pool=True)
        except Exception as exc:  # a hung server: drop the sockets without waiting for it
            log.debug("prefix index close: %r", exc)
            pool: Any = self._pool
            conns = [*pool._available_connections, *pool._in_use_connections]
            await asyncio.gather(
                *(c.disconnect(nowait=True) for c in conns), return_exceptions=True
            )

    async def __aenter__(self) -> RedisPrefixIndex:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
