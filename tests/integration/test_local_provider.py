"""The local fleet provider with real replica processes and an in-process registry (no router:
nothing probes the replicas, so none becomes READY and a drain has no router to wait for).

Scale-up starts processes and reports them as source `local`; scale-down picks the victim by
`autoscaler/victims.py` (none ready: by name), drains it, and only after it is GONE withdraws
it and stops its process; close stops the rest. Every process is gone at the end.
"""

from __future__ import annotations

import asyncio

import pytest

from autoscaler.types import ScaleDecision, ScaleReason
from deploy.local_fleet import FleetSpec
from deploy.local_provider import SOURCE, EventKind, LocalProvider, ProviderEvent
from deploy.processes import group_alive
from router.fleet.lifecycle import Lifecycle
from router.fleet.registry import FleetRegistry
from router.fleet.registry_memory import MemoryBackend
from router.fleet.urls import ReplicaGuard

pytestmark = pytest.mark.timeout(120)


def test_scale_up_then_drain_before_stop() -> None:
    async def run() -> tuple[list[ProviderEvent], dict[str, Lifecycle], list[int], bool]:
        registry = FleetRegistry(MemoryBackend(), ReplicaGuard(), drain_s=60.0, ttl_s=10.0)
        provider = LocalProvider(registry, FleetSpec(engine="sim", load_time_s=30.0))
        events: list[ProviderEvent] = []
        provider.on_event.append(events.append)
        try:
            fleet = await provider.observe()
            assert (fleet.spec, fleet.ready) == (0, 0)
            assert await provider.apply(2, ScaleDecision(2, ScaleReason.FORECAST_UP), fleet)
            pids = [r.child.pid for r in provider.replicas.values()]
            fleet = await provider.observe()
            assert (fleet.spec, fleet.ready) == (2, 0)
            snap = await registry.load()
            assert {r.replica_id: r.sources for r in snap.records.values()} == {
                "local-0": (SOURCE,), "local-1": (SOURCE,),
            }  # fmt: skip
            assert await provider.apply(1, ScaleDecision(1, ScaleReason.SCALE_DOWN), fleet)
            stopped_gone = not group_alive(pids[0])
            states = {r.replica_id: r.state for r in (await registry.load()).records.values()}
            fleet = await provider.observe()
            assert (fleet.spec, fleet.ready) == (1, 0)
        finally:
            await provider.aclose()
        return events, states, pids, stopped_gone

    events, states, pids, stopped_gone = asyncio.run(run())
    assert states == {"local-0": Lifecycle.GONE, "local-1": Lifecycle.LOADING}
    assert stopped_gone
    kinds = [(e.replica, e.kind) for e in events]
    assert kinds == [
        ("local-0", EventKind.SPAWNED),
        ("local-1", EventKind.SPAWNED),
        ("local-0", EventKind.DRAINING),
        ("local-0", EventKind.GONE),
        ("local-0", EventKind.STOPPED),
    ]
    # still loading (nothing listens yet): no counts to read
    assert events[3].served is None and events[4].served is None
    assert not any(group_alive(pid) for pid in pids)
