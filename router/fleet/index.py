"""The live router's prefix index: one async face over the in-memory and the Redis backends.

    lookup(hashes, replicas) -> {replica: PrefixMatch} | None      None = unknown (route on load)
    speculate(replica, hashes, ttl)   at routing time, before the request is sent
    retract(replica, hashes, grace)   at the first token: speculation ends after `grace`
    clear(replica)                    a replica restarted or was removed

In-memory (no Redis configured): the process-local index, fed by this router's own KV-event
subscribers. Redis: the shared index; lookups and speculative writes use `ANY_INCARNATION`
("whatever incarnation Redis holds"), because the incarnation belongs to whoever follows the
replica's events (this router's subscribers, or a separate `controlplane indexer`), and a
restarted replica's entries are purged by that follower. Either way the KV-event follower
(`EventIndexer`) can run inside the router: `events_sink` is the object it writes to.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from controlplane.prefix.memory import InMemoryPrefixIndex
from controlplane.prefix.protocol import AsyncPrefixIndex, PrefixIndex
from controlplane.prefix.redis_index import ANY_INCARNATION, RedisPrefixIndex
from controlplane.types import PrefixMatch
from router.config import RedisConfig


class RouterIndex:
    """Base: the in-memory backend."""

    kind = "memory"

    def __init__(self) -> None:
        self._mem = InMemoryPrefixIndex(clock=time.monotonic)

    @property
    def events_sink(self) -> PrefixIndex | AsyncPrefixIndex:
        return self._mem

    @property
    def degraded_reason(self) -> str | None:
        """Why the index cannot answer now (None: it can)."""
        return None

    async def lookup(
        self, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, PrefixMatch] | None:
        return self._mem.lookup(hashes, replicas)

    async def speculate(self, replica_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        self._mem.speculate(replica_id, hashes, ttl_s)

    async def retract(self, replica_id: str, hashes: Sequence[int], grace_s: float) -> None:
        self._mem.retract(replica_id, hashes, grace_s)

    async def clear(self, replica_id: str) -> None:
        self._mem.clear(replica_id)

    def counters(self) -> dict[str, int | str]:
        return {"stored": self._mem.stored_total, "removed": self._mem.removed_total}

    async def aclose(self) -> None:
        return None


class RedisRouterIndex(RouterIndex):
    kind = "redis"

    def __init__(self, cfg: RedisConfig, *, url: str) -> None:
        super().__init__()
        self.redis = RedisPrefixIndex(
            url,
            key_prefix=cfg.key_prefix,
            entry_ttl_s=cfg.entry_ttl_s,
            lookup_budget_s=cfg.lookup_budget_ms / 1000.0,
            password=os.environ.get(cfg.password_env) or None,
            client_name="cp-router",
        )

    @property
    def events_sink(self) -> PrefixIndex | AsyncPrefixIndex:
        return self.redis

    @property
    def degraded_reason(self) -> str | None:
        state = str(self.redis.breaker_state)
        return None if state == "closed" else f"redis unreachable (breaker {state})"

    async def lookup(
        self, hashes: Sequence[int], replicas: Sequence[str]
    ) -> dict[str, PrefixMatch] | None:
        return await self.redis.lookup(hashes, [(r, ANY_INCARNATION) for r in replicas])

    async def speculate(self, replica_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        await self.redis.speculate(replica_id, ANY_INCARNATION, hashes, ttl_s)

    async def retract(self, replica_id: str, hashes: Sequence[int], grace_s: float) -> None:
        await self.redis.retract(replica_id, ANY_INCARNATION, hashes, grace_s)

    async def clear(self, replica_id: str) -> None:
        await self.redis.clear(replica_id)

    def counters(self) -> dict[str, int | str]:
        return self.redis.counters()

    async def ping(self) -> bool:
        return await self.redis.ping()

    async def aclose(self) -> None:
        await self.redis.aclose(flush_timeout_s=0.5)


def open_index(cfg: RedisConfig) -> RouterIndex:
    return RedisRouterIndex(cfg, url=cfg.url) if cfg.url else RouterIndex()
