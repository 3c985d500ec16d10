"""The fleet registry of one process (no Redis, the default): records and observations in dicts.

Algorithm: an update runs the decision on a copy of the records and applies the changed ones
with the next version; waiters on an `asyncio.Condition` wake on every new version. An
observation older than the heartbeat TTL (relative to the newest one) is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib

from router.fleet.lifecycle import Observation, Record
from router.fleet.registry import Decide, Snapshot


class MemoryBackend:
    """One process's registry (the default without Redis)."""

    def __init__(self) -> None:
        self.version = 0
        self.records: dict[str, Record] = {}
        self.observations: dict[str, Observation] = {}
        self._changed = asyncio.Condition()

    async def load(self) -> Snapshot:
        return Snapshot(self.version, dict(self.records), list(self.observations.values()))

    async def update(self, decide: Decide) -> Snapshot:
        changed = decide(dict(self.records), self.version + 1)
        if changed:
            self.version += 1
            self.records.update(changed)
            async with self._changed:
                self._changed.notify_all()
        return await self.load()

    async def observe(self, obs: Observation, ttl_s: float) -> None:
        self.observations[obs.router_id] = obs
        for rid, o in list(self.observations.items()):
            if obs.at - o.at > ttl_s:
                del self.observations[rid]

    async def wait_change(self, version: int, timeout_s: float) -> None:
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.version != version), timeout_s
                )

    async def aclose(self) -> None:
        pass
