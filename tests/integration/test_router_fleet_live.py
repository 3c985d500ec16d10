"""`LiveFleet` against real simulated replica processes: readiness from their metrics, a replica
that lies on /health while hung ejected through the proxy's slowness signal, a killed replica
ejected by its failed probes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sim_fleet import SimReplica

from controlplane.routing.ledger import RouterLedger
from controlplane.types import Phase
from deploy.processes import group_alive
from router.config import HealthConfig, ReplicaConfig, RouterSettings
from router.fleet.live_fleet import LiveFleet, SlowReason

MODEL = "tiny-llama"
BLOCK_SIZE = 64  # not the simulator's default (32): it must come from the metrics
NUM_BLOCKS = 1500
SIM_ARGS = ("--speed", "20", "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(NUM_BLOCKS))
# what the proxy would allow before the first byte (the test's own deadline, not a threshold)
TTFT_DEADLINE_S = 1.0

pytestmark = pytest.mark.timeout(60)


def start_replicas(n: int) -> list[SimReplica]:
    replicas = [SimReplica(*SIM_ARGS) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(SimReplica.start, replicas))
    return replicas


def stop_replicas(replicas: list[SimReplica]) -> None:
    for r in replicas:
        if r.child is not None:
            r.stop()
            assert not group_alive(r.pid), "a sim replica left processes behind"


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimReplica]]:
    replicas = start_replicas(2)
    try:
        yield replicas
    finally:
        stop_replicas(replicas)


@pytest.fixture(autouse=True)
def _reset_faults(sims: list[SimReplica]) -> Iterator[None]:
    yield
    for r in sims:
        if r.child is not None and r.child.poll() is None:
            r.set_faults(reset=True)


def settings(urls: list[str], **health: float) -> RouterSettings:
    knobs = {"probe_interval_s": 0.1, "scrape_interval_s": 0.1, "probe_timeout_s": 2.0, **health}
    return RouterSettings(
        served_model=MODEL,
        replicas=[
            ReplicaConfig(id=f"r{i}", url=url, gpu="cpu", model=MODEL) for i, url in enumerate(urls)
        ],
        health=HealthConfig.model_validate(knobs),
    )


async def wait_for(cond: Callable[[], bool]) -> None:
    """Poll until `cond()` holds; the test's hard timeout bounds the wait."""
    while not cond():
        await asyncio.sleep(0.02)


async def test_the_fleet_becomes_ready_with_the_replicas_cache_layout(
    sims: list[SimReplica],
) -> None:
    ledger = RouterLedger()
    fleet = LiveFleet(settings([s.url for s in sims]), ledger=ledger)
    try:
        await fleet.start()
        await wait_for(lambda: fleet.ready_count() == 2)
        snap = fleet.snapshot()
        assert [r.phase for r in snap.replicas] == [Phase.READY, Phase.READY]
        assert fleet.block_size() == BLOCK_SIZE
        for st in snap.replicas:
            assert (st.block_size, st.profile.num_gpu_blocks) == (BLOCK_SIZE, NUM_BLOCKS)
            assert st.kv_capacity_tokens == BLOCK_SIZE * NUM_BLOCKS
            assert st.incarnation == 0 and not st.ejected
        # a completion moves the engine's counters, and the next scrapes show it
        body = {"model": MODEL, "prompt": "hello fleet " * 20, "max_tokens": 4}
        resp = await fleet.get("r0").client.post("/v1/completions", json=body)
        assert resp.status_code == 200
        await wait_for(lambda: fleet.get("r0").prefix_queries > 0)
        assert fleet.get("r0").incarnation == 0  # counters going up are no restart
    finally:
        await fleet.aclose()
    assert all(r.client.is_closed for r in fleet.replicas())


async def test_a_replica_lying_on_health_while_hung_is_ejected_for_slowness(
    sims: list[SimReplica],
) -> None:
    hung = sims[1]
    hung.set_faults(stall=True, lie_health=True)
    fleet = LiveFleet(settings([s.url for s in sims], eject_s=60.0))
    try:
        await fleet.refresh()
        # its /health lies: the probes cannot tell it apart
        assert [r.phase for r in fleet.snapshot().replicas] == [Phase.READY, Phase.READY]
        body = {"model": MODEL, "prompt": "are you there", "max_tokens": 4, "stream": True}
        timed_out = False
        try:
            async with asyncio.timeout(TTFT_DEADLINE_S):
                async with fleet.get("r1").client.stream(
                    "POST", "/v1/completions", json=body
                ) as resp:
                    async for _ in resp.aiter_bytes():
                        break
        except TimeoutError:
            timed_out = True
        assert timed_out, "the stalled replica answered"
        assert fleet.record_slow("r1", SlowReason.TTFT) is True
        await fleet.refresh()  # a good (lying) probe does not end the ejection
        snap = fleet.snapshot().by_id()
        assert snap["r1"].ejected and snap["r1"].phase is Phase.READY
        assert [r.replica_id for r in fleet.snapshot().routable()] == ["r0"]
        # the cap: the last routable replica is not ejected for slowness
        assert fleet.record_slow("r0", SlowReason.TTFT) is False
        ok = await fleet.get("r0").client.post(
            "/v1/completions", json={**body, "stream": False}, timeout=10.0
        )
        assert ok.status_code == 200
    finally:
        await fleet.aclose()


async def test_a_killed_replica_is_ejected_by_failed_probes(sims: list[SimReplica]) -> None:
    (victim,) = start_replicas(1)
    try:
        fleet = LiveFleet(settings([sims[0].url, victim.url], consecutive_failures=2))
        try:
            await fleet.start()
            await wait_for(lambda: fleet.ready_count() == 2)
            victim.stop()
            await wait_for(lambda: fleet.get("r1").phase is Phase.DEAD)
            snap = fleet.snapshot()
            assert [r.replica_id for r in snap.routable()] == ["r0"]
            assert not snap.by_id()["r1"].routable
            row = next(r for r in fleet.status() if r["id"] == "r1")
            failures = row["probe_failures"]
            assert row["phase"] == "dead" and isinstance(failures, int) and failures >= 2
        finally:
            await fleet.aclose()
    finally:
        stop_replicas([victim])
