"""One router following the fleet registry: its `LiveFleet` made to match the records.

    follower = RegistryFollower(registry, ops, router_id="router-a", resync_s=2.0)
    await follower.sync()        # once now (startup, after an admin change)
    follower.start()             # then on every registry change, and every resync_s anyway

Each sync: read the records; reconcile (a member this router lacks joins, a DRAINING one drains
here, a member reported again resumes if this follower drained it, a GONE one or one at a new
URL leaves); publish what this
router sees (phase, ejected, in-flight per replica) with the version it has applied; let the
registry settle finished drains, and reconcile again if that changed anything. A failed read
keeps the last fleet: the follower reports degraded and retries at the next resync. A replica
missing from the registry leaves only when the registry is not behind what this router already
applied (a registry that restarted empty does not empty the fleet before its sources re-report).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from pydantic import ValidationError

from controlplane.errors import ControlPlaneError
from router.config import ReplicaConfig
from router.fleet.lifecycle import Lifecycle, Observation, Record, Seen
from router.fleet.registry import FleetRegistry, Snapshot
from router.fleet.sources import stop_task

log = logging.getLogger(__name__)


class FleetOps(Protocol):
    """What the follower changes: the router's live fleet (RouterRuntime implements it)."""

    def members(self) -> Mapping[str, tuple[str, bool]]:
        """replica id -> (url, draining)"""
        ...

    async def join(self, cfg: ReplicaConfig) -> None: ...
    def drain(self, replica_id: str) -> None: ...
    def resume(self, replica_id: str) -> None: ...
    async def leave(self, replica_id: str) -> None: ...
    def seen(self) -> Mapping[str, Seen]: ...


def replica_config(rec: Record) -> ReplicaConfig:
    """The router's configuration of a registry record (`ValidationError` when bad)."""
    extra: dict[str, object] = {k: v for k, v in (("gpu", rec.gpu), ("model", rec.model)) if v}
    return ReplicaConfig.model_validate(
        {**rec.options, **extra, "id": rec.replica_id, "url": rec.url}
    )


class RegistryFollower:
    def __init__(
        self,
        registry: FleetRegistry,
        ops: FleetOps,
        *,
        router_id: str,
        resync_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.ops = ops
        self.router_id = router_id
        self.resync_s = resync_s
        self.clock = clock
        self.version = 0  # the registry version this router has applied
        self.degraded_reason: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._lock = asyncio.Lock()
        self._drained: set[str] = set()  # the replicas this follower drained

    async def sync(self) -> bool:
        """One round; False when the registry could not be reached (the fleet is kept)."""
        async with self._lock:
            try:
                snap = await self.registry.load()
                await self._reconcile(snap)
                await self._publish()
                settled = await self.registry.settle()
                if settled.version != snap.version:
                    await self._reconcile(settled)
                    await self._publish()
            except ControlPlaneError as exc:
                if self.degraded_reason is None:
                    log.warning("fleet registry unreachable", extra={"error": str(exc)})
                self.degraded_reason = f"fleet registry unreachable: {exc}"
                return False
            if self.degraded_reason is not None:
                log.info("fleet registry reachable again")
            self.degraded_reason = None
            return True

    async def _publish(self) -> None:
        obs = Observation(self.router_id, self.clock(), self.version, dict(self.ops.seen()))
        await self.registry.observe(obs)

    async def _reconcile(self, snap: Snapshot) -> None:
        want = {i: r for i, r in snap.records.items() if r.state is not Lifecycle.GONE}
        behind = snap.version < self.version
        for i, (url, _) in list(self.ops.members().items()):
            rec = snap.records.get(i)
            stale = rec is None and not behind
            if stale or (
                rec is not None and (i not in want or rec.url.rstrip("/") != url.rstrip("/"))
            ):
                await self.ops.leave(i)
                self._drained.discard(i)
        have = self.ops.members()
        for i, rec in want.items():
            if i not in have:
                if rec.state is not Lifecycle.DRAINING:
                    await self._join(rec)
            elif rec.state is Lifecycle.DRAINING and not have[i][1]:
                self.ops.drain(i)
                self._drained.add(i)
            elif rec.state is Lifecycle.LOADING and have[i][1] and i in self._drained:
                self.ops.resume(i)  # only a drain the registry made is undone by it
                self._drained.discard(i)
        self.version = snap.version if not behind else self.version

    async def _join(self, rec: Record) -> None:
        try:
            cfg = replica_config(rec)
        except ValidationError as exc:
            self.registry.metrics.errors.labels("bad_record").inc()
            log.warning(
                "registry record unusable",
                extra={"replica": rec.replica_id, "error": str(exc)[:300]},
            )
            return
        await self.ops.join(cfg)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fleet-follower")

    async def _run(self) -> None:
        while not self._closing:
            try:
                await self.sync()
                await self.registry.backend.wait_change(self.version, self.resync_s)
            except ControlPlaneError:
                await asyncio.sleep(self.resync_s)
            except Exception:  # a bug must not stop the router following its fleet
                log.exception("fleet follower round failed")
                await asyncio.sleep(self.resync_s)

    async def aclose(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        if task is not None:
            await stop_task(task)
