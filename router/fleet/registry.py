"""The fleet registry: which replicas the fleet has and where each is in its lifecycle, shared by
every router (a `MembershipSink` for the sources).

    registry = FleetRegistry(MemoryBackend(), guard, drain_s=300, ttl_s=10)   # or RedisBackend
    (backends: router.fleet.registry_memory, router.fleet.registry_redis)
    await registry.set_members("dns", members)      # a source's whole view
    await registry.drain(["r3"]); left = await registry.wait_drained(["r3"], timeout_s=60)

Algorithm: every change is one atomic read-modify-write of the records through the backend
(`router.fleet.lifecycle` decides, stamped with the next registry version); the backend then
wakes every follower (`wait_change`). Before a member enters, its id and URL pass the replica
guard off the event loop; a refused member is logged, counted and skipped, never raised into the
source. Routers publish observations (`observe`) with their wall-clock time; `settle` turns
drained DRAINING records GONE. The in-process backend (no Redis) serves one process; the Redis
one (`router.fleet.registry_redis`) every router sharing it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from controlplane.errors import ReplicaRefusedError, UnknownReplicaError
from router.fleet import lifecycle as lc
from router.fleet.lifecycle import Lifecycle, Observation, Record, Refusal
from router.fleet.membership import Member
from router.fleet.urls import ReplicaGuard

log = logging.getLogger(__name__)

# decide(records, next_version) -> the changed records
Decide = Callable[[Mapping[str, Record], int], Mapping[str, Record]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    records: Mapping[str, Record]
    observations: Sequence[Observation]


class Backend(Protocol):
    async def load(self) -> Snapshot: ...
    async def update(self, decide: Decide) -> Snapshot:
        """Apply `decide` atomically; bump the version and notify when it changed anything."""
        ...

    async def observe(self, obs: Observation, ttl_s: float) -> None: ...
    async def wait_change(self, version: int, timeout_s: float) -> None:
        """Return once the version differs from `version`, or after `timeout_s`."""
        ...

    async def aclose(self) -> None: ...


class RegistryMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.replicas = Gauge(
            "cp_fleet_replicas",
            "Replicas in the fleet registry by state.",
            ["state"],
            registry=registry,
        )
        self.updates = Counter(
            "cp_fleet_registry_updates_total",
            "Registry changes by source (or drain, settle).",
            ["source"],
            registry=registry,
        )
        self.errors = Counter(
            "cp_fleet_registry_errors_total",
            "Registry calls that failed (backend down).",
            ["op"],
            registry=registry,
        )
        self.refused = Counter(
            "cp_fleet_members_refused_total",
            "Reported members kept out of the registry.",
            ["source", "reason"],
            registry=registry,
        )


class FleetRegistry:
    """Membership and lifecycle of the fleet, over a backend; a `MembershipSink`."""

    def __init__(
        self,
        backend: Backend,
        guard: ReplicaGuard,
        *,
        drain_s: float,
        ttl_s: float,
        metrics: RegistryMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.guard = guard
        self.drain_s = drain_s
        self.ttl_s = ttl_s
        self.metrics = metrics or RegistryMetrics(CollectorRegistry())
        self.clock = clock

    # -- sources -----------------------------------------------------------------------------------
    async def _checked(self, source: str, members: Iterable[Member]) -> list[Member]:
        ok = []
        for m in members:
            try:
                await asyncio.to_thread(self.guard.check, m.replica_id, m.url)
            except ReplicaRefusedError as exc:
                self._refused(source, m, Refusal.ID if exc.param == "id" else Refusal.URL, exc)
            else:
                ok.append(m)
        return ok

    def _refused(self, source: str, m: Member, why: Refusal, detail: object = "") -> None:
        self.metrics.refused.labels(source, str(why)).inc()
        # the id may be the refused part: logged with repr, never a metric label
        log.warning(
            "member refused",
            extra={
                "source": source,
                "replica": repr(m.replica_id)[:80],
                "why": str(why),
                "detail": str(detail)[:300],
            },
        )

    async def set_members(self, source: str, members: Sequence[Member]) -> None:
        """Replace `source`'s view with `members` (the refused ones are skipped). A member
        the source says is not ready (a pod not Ready, or terminating) counts as not reported:
        it does not join, and a member that was drains unless another source reports it."""
        ok = await self._checked(source, [m for m in members if m.ready])
        refused: list[tuple[Member, Refusal]] = []

        def decide(records: Mapping[str, Record], version: int) -> Mapping[str, Record]:
            changed, why = lc.apply_report(records, source, ok, version, self.clock(), self.drain_s)
            refused[:] = why
            return changed

        await self._update(source, decide)
        for m, why in refused:
            self._refused(source, m, why)

    async def add(self, source: str, member: Member) -> Record:
        """Add one member for `source` (the admin API); raises `ReplicaRefusedError` when the
        guard refuses it or another source has this id at another URL."""
        await asyncio.to_thread(self.guard.check, member.replica_id, member.url)
        refusal: list[Refusal] = []

        def decide(records: Mapping[str, Record], version: int) -> Mapping[str, Record]:
            rec, why = lc.apply_member(records, source, member, version)
            refusal[:] = [why] if why else []
            return {rec.replica_id: rec} if rec is not None else {}

        snap = await self._update(source, decide)
        if refusal:
            raise ReplicaRefusedError(
                f"replica {member.replica_id!r} is already in the fleet at another URL",
                param="id",
            )
        return snap.records[member.replica_id]

    async def withdraw(self, source: str, replica_id: str) -> None:
        """`source` no longer reports `replica_id` (it drains when no source does)."""

        def decide(records: Mapping[str, Record], version: int) -> Mapping[str, Record]:
            rec = records.get(replica_id)
            gone = rec and lc.withdraw(rec, source, version, self.clock(), self.drain_s)
            return {replica_id: gone} if gone else {}

        await self._update(source, decide)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def drain(self, ids: Iterable[str]) -> None:
        """Drain these replicas on purpose: no new requests, in-flight ones finish, then they
        leave every router. `UnknownReplicaError` for an id the registry does not hold."""
        ids = list(ids)
        snap = await self.backend.load()
        unknown = [i for i in ids if i not in snap.records]
        if unknown:
            raise UnknownReplicaError(f"unknown replica(s) {unknown}")

        def decide(records: Mapping[str, Record], version: int) -> Mapping[str, Record]:
            return lc.apply_drain(records, ids, version, self.clock(), self.drain_s)

        await self._update("drain", decide)

    async def settle(self) -> Snapshot:
        """Turn drained DRAINING records GONE (any router may call it; it is idempotent)."""

        def decide(records: Mapping[str, Record], version: int) -> Mapping[str, Record]:
            return lc.settle(records, obs, version, self.clock(), self.ttl_s)

        obs = (await self.backend.load()).observations
        return await self._update("settle", decide)

    async def wait_drained(self, ids: Iterable[str], timeout_s: float) -> set[str]:
        """Wait until these replicas are GONE (or unknown); the ids still not gone at the
        timeout (empty: all gone)."""
        ids = set(ids)
        deadline = time.monotonic() + timeout_s
        while True:
            snap = await self.settle()
            left = {
                i for i in ids if i in snap.records and snap.records[i].state is not Lifecycle.GONE
            }
            remaining = deadline - time.monotonic()
            if not left or remaining <= 0:
                return left
            await self.backend.wait_change(snap.version, min(remaining, self.ttl_s / 4))

    async def observe(self, obs: Observation) -> None:
        try:
            await self.backend.observe(obs, self.ttl_s)
        except Exception:
            self.metrics.errors.labels("observe").inc()
            raise

    async def load(self) -> Snapshot:
        try:
            snap = await self.backend.load()
        except Exception:
            self.metrics.errors.labels("load").inc()
            raise
        self._count(snap)
        return snap

    def fleet_view(self, snap: Snapshot) -> list[dict[str, object]]:
        """One row per record with its fleet-wide state (the routers' probes folded in)."""
        routers = lc.live(snap.observations, self.clock(), self.ttl_s)
        return [
            {
                "id": r.replica_id,
                "url": r.url,
                "state": str(lc.observed_state(r, routers)),
                "sources": list(r.sources),
                "version": r.version,
                "in_flight": sum(
                    o.replicas[r.replica_id].in_flight
                    for o in routers
                    if r.replica_id in o.replicas
                ),
            }
            for r in snap.records.values()
        ]

    def _count(self, snap: Snapshot) -> None:
        routers = lc.live(snap.observations, self.clock(), self.ttl_s)
        counts = dict.fromkeys(Lifecycle, 0)
        for r in snap.records.values():
            counts[lc.observed_state(r, routers)] += 1
        for state, n in counts.items():
            self.metrics.replicas.labels(str(state)).set(n)

    async def _update(self, source: str, decide: Decide) -> Snapshot:
        changed = False

        def counted(records: Mapping[str, Record], version: int) -> Mapping[str, Record]:
            nonlocal changed
            out = decide(records, version)
            changed = bool(out)  # the last attempt's (a Redis conflict retries)
            return out

        try:
            snap = await self.backend.update(counted)
        except Exception:
            self.metrics.errors.labels("update").inc()
            raise
        if changed:  # updates that changed the registry, by who made them
            self.metrics.updates.labels(source).inc()
        self._count(snap)
        return snap

    async def aclose(self) -> None:
        await self.backend.aclose()
