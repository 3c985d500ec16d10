"""The fleet registry in Redis, shared by every router that points at the same server.

Keys (under `fleet.key_prefix`): `{p}:records` a hash replica id -> record JSON, `{p}:version`
the registry version, `{p}:routers` a hash router id -> its last observation JSON; channel
`{p}:changed` carries each new version.

Algorithm: an update WATCHes the version and the records, reads them, lets the decision run,
then writes the changed records, the next version and the notification in one MULTI/EXEC (a
concurrent writer makes it retry). A follower waits on the channel with a timeout, so a lost
notification only delays it until its periodic re-read. One coroutine reads the channel at a
time; others waiting meanwhile are woken when it returns. Every Redis failure surfaces as a
`StoreUnavailableError`: the follower keeps its last fleet and reports degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from controlplane.errors import StoreUnavailableError
from router.fleet.lifecycle import Observation, Record
from router.fleet.registry import Decide, Snapshot

T = TypeVar("T")
_MAX_RETRIES = 50


class RedisBackend:
    def __init__(
        self,
        url: str,
        key_prefix: str,
        *,
        password_env: str = "CP_REDIS_PASSWORD",
        timeout_s: float = 2.0,
    ) -> None:
        self.records_key = f"{key_prefix}:records"
        self.version_key = f"{key_prefix}:version"
        self.routers_key = f"{key_prefix}:routers"
        self.channel = f"{key_prefix}:changed"
        self.timeout_s = timeout_s
        password = os.environ.get(password_env) or None
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            password=password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            client_name="cp-fleet-registry",
        )
        self._pubsub: Any = None
        self._reader = asyncio.Lock()
        self._woken = asyncio.Condition()

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except (RedisError, OSError) as exc:
            raise StoreUnavailableError(f"fleet registry {what}: {exc}") from None

    async def load(self) -> Snapshot:
        async def read() -> Snapshot:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.get(self.version_key)
                pipe.hgetall(self.records_key)
                pipe.hgetall(self.routers_key)
                version, records, routers = await pipe.execute()
            return _snapshot(version, records, routers)

        return await self._call("load", read)

    async def update(self, decide: Decide) -> Snapshot:
        async def write() -> Snapshot:
            async with self.client.pipeline(transaction=True) as pipe:
                for _ in range(_MAX_RETRIES):
                    try:
                        await pipe.watch(self.version_key, self.records_key)
                        version = int(await pipe.get(self.version_key) or 0)
                        raw = await pipe.hgetall(self.records_key)
                        records = {r.replica_id: r for r in map(Record.from_json, raw.values())}
                        changed = decide(records, version + 1)
                        if not changed:
                            await pipe.unwatch()  # type: ignore[no-untyped-call]
                            return Snapshot(version, records, [])
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.hset(
                            self.records_key,
                            mapping={k: r.to_json() for k, r in changed.items()},
                        )
                        pipe.set(self.version_key, version + 1)
                        pipe.publish(self.channel, version + 1)
                        await pipe.execute()
                        return Snapshot(version + 1, records | dict(changed), [])
                    except WatchError:
                        continue
            raise StoreUnavailableError("fleet registry update: too much contention")

        await self._call("update", write)
        return await self.load()

    async def observe(self, obs: Observation, ttl_s: float) -> None:
        async def write() -> None:
            await self.client.hset(self.routers_key, obs.router_id, obs.to_json())
            # drop routers whose heartbeat is long gone (many TTLs: clocks differ a little)
            for rid, raw in (await self.client.hgetall(self.routers_key)).items():
                if obs.at - Observation.from_json(raw).at > 10 * ttl_s:
                    await self.client.hdel(self.routers_key, rid)

        await self._call("observe", write)

    async def wait_change(self, version: int, timeout_s: float) -> None:
        # one coroutine reads the channel at a time (a connection has one reader); the others
        # (an admin call waiting for a drain) wait for that reader to wake them
        async def wait() -> None:
            current = int(await self.client.get(self.version_key) or 0)
            if current != version:
                return
            if self._reader.locked():
                async with self._woken:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._woken.wait(), timeout_s)
                return
            async with self._reader:
                if self._pubsub is None:
                    self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                    await self._pubsub.subscribe(self.channel)
                await self._pubsub.get_message(timeout=timeout_s)
            async with self._woken:
                self._woken.notify_all()

        try:
            await self._call("wait", wait)
        except StoreUnavailableError:
            await self._drop_pubsub()
            raise

    async def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()

    async def aclose(self) -> None:
        await self._drop_pubsub()
        await self.client.aclose()


def _snapshot(version: bytes | None, records: dict[Any, Any], routers: dict[Any, Any]) -> Snapshot:
    recs = {r.replica_id: r for r in map(Record.from_json, records.values())}
    return Snapshot(int(version or 0), recs, [Observation.from_json(v) for v in routers.values()])
