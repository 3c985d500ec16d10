"""The autoscaler's Kubernetes scale-down drains through live routers before any pod is removed.

Two routers share a private real Redis fleet registry; three simulated replicas speak vLLM's
HTTP protocol under the ids of the fake API server's pods (`fake_kube.py`, a Deployment of 3).
Streams are held in flight on every replica (engines stalled, `/health` still 200), one replica
holding the fewest. The scaler, with a `RouterDrainer` over both routers' admin API, scales the
Deployment to 2: the victim is that replica; it is drained through the routers (new requests go
elsewhere, from either router), its stream finishes, the registry says `gone`, and only then
are the victim's pod-deletion-cost and the scale PATCHed; the fake ReplicaSet removes exactly
that pod, and every client request succeeded. A wrong admin key or no router answering abandons
the scale-down with a `RouterAdminError` and no PATCH at all.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_kube import NS, FakeKube
from redis_server import RedisServer
from router_fixtures import (
    MODEL,
    assert_router_idle,
    finished_requests,
    replica_entry,
    replica_status,
    router_settings,
    sim_args,
)
from router_harness import RouterServer
from sim_fleet import SimReplica

from autoscaler.hosts.kube_scaler import DrainOutcome, KubernetesScaler, ScalerSettings
from autoscaler.hosts.router_drainer import RouterDrainer
from autoscaler.types import ScaleDecision, ScaleReason
from autoscaler.victims import VictimReason
from controlplane.errors import RouterAdminError
from controlplane.kube.pods import DELETION_COST
from router.telemetry import parse_decision_header

ADMIN = "drain-admin-key"
AUTH = {"authorization": f"Bearer {ADMIN}"}
WAIT_S = 30.0  # a failure bound
DOWN = ScaleDecision(2, ScaleReason.SCALE_DOWN)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def sims(model_dir: Path) -> Iterator[list[SimReplica]]:
    with (
        SimReplica(*sim_args(model_dir)) as a,
        SimReplica(*sim_args(model_dir)) as b,
        SimReplica(*sim_args(model_dir)) as c,
    ):
        yield [a, b, c]


def shared(model_dir: Path, redis_url: str, replicas: list[dict[str, Any]]) -> Any:
    return router_settings(
        model_dir,
        replicas,
        admin_key=ADMIN,
        redis={"url": redis_url},
        fleet={"shared": True, "resync_s": 0.2, "heartbeat_ttl_s": 3.0},
        health={"scrape_interval_s": 0.2, "probe_interval_s": 0.2},
        telemetry={"decision_header": True},
    )


def scaler_for(kube: FakeKube, drainer: RouterDrainer) -> KubernetesScaler:
    settings = ScalerSettings(
        mode="kubernetes", namespace=NS, api_url=kube.url, retry_backoff_s=0.0,
        drain_timeout_s=WAIT_S * 2, deployment="vllm",
    )  # fmt: skip
    return KubernetesScaler(settings, drainer=drainer)


class RecordingDrainer(RouterDrainer):
    """The real drainer, noting how many API requests the fake server had seen at each call."""

    def __init__(self, kube: FakeKube, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kube = kube
        self.calls: list[tuple[str, tuple[str, ...], int, Any]] = []

    async def drain(self, ids: Sequence[str]) -> None:
        await super().drain(ids)
        self.calls.append(("drain", tuple(ids), len(self.kube.requests), None))

    async def wait_drained(self, ids: Sequence[str], timeout: float) -> bool:
        drained = await super().wait_drained(ids, timeout)
        self.calls.append(("wait_drained", tuple(ids), len(self.kube.requests), drained))
        return drained


STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "a long story, please"}],
    "max_tokens": 16,
    "stream": True,
}


class HeldStream:
    """A streaming chat completion held open; `replica` from the decision header."""

    def __init__(self, client: httpx.AsyncClient, router: str, n: int) -> None:
        self.client, self.router, self.n = client, router, n
        self.replica = ""
        self.opened = asyncio.Event()
        self.finish: str | None = None
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        body = {**STREAM, "messages": [{"role": "user", "content": f"story number {self.n}"}]}
        url = f"{self.router}/v1/chat/completions"
        async with self.client.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            self.replica = parse_decision_header(resp.headers["x-cp-decision"])["replica"]
            self.opened.set()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or []
                    if choices and choices[0].get("finish_reason"):
                        self.finish = choices[0]["finish_reason"]


async def hold_streams(
    client: httpx.AsyncClient, routers: list[str], ids: list[str]
) -> list[HeldStream]:
    """Open streams (alternating routers) until every replica holds one and exactly one replica
    holds the fewest; bounded."""
    held: list[HeldStream] = []
    for n in range(12):
        s = HeldStream(client, routers[n % 2], n)
        held.append(s)
        await asyncio.wait_for(s.opened.wait(), WAIT_S)
        counts = Counter(h.replica for h in held)
        least = min(counts[i] for i in ids)
        if least >= 1 and [counts[i] for i in ids].count(least) == 1:
            return held
    raise AssertionError(f"no unique least-loaded replica: {Counter(h.replica for h in held)}")


async def routed_to(client: httpx.AsyncClient, router: str, content: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = await client.post(f"{router}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return str(parse_decision_header(r.headers["x-cp-decision"])["replica"])


async def fleet_states(client: httpx.AsyncClient, router: str) -> dict[str, str]:
    r = await client.get(f"{router}/admin/replicas", headers=AUTH)
    assert r.status_code == 200, r.text
    return {row["id"]: row["state"] for row in r.json()["fleet"]}


async def until(predicate: Any, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not await predicate():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out after {WAIT_S}s waiting for: {what}") from None


async def test_scale_down_drains_the_least_loaded_replica_through_the_routers_first(
    model_dir: Path, redis_server: RedisServer, sims: list[SimReplica], kube: FakeKube
) -> None:
    kube.add_workload("deployments", "vllm", 3)
    pods = sorted(kube.pods)
    by_id = dict(zip(pods, sims, strict=True))
    entries = [replica_entry(pod, sim) for pod, sim in by_id.items()]
    a = RouterServer(shared(model_dir, redis_server.url, entries))
    b = RouterServer(shared(model_dir, redis_server.url, []))
    await asyncio.to_thread(a.start)
    try:
        await asyncio.to_thread(b.start)
        await asyncio.to_thread(a.wait_ready, 3)
        await asyncio.to_thread(b.wait_ready, 3)
        await scale_down_under_traffic(kube, a, b, by_id)
    finally:
        for s in sims:
            s.set_faults(reset=True)
        await asyncio.to_thread(b.stop)
        await asyncio.to_thread(a.stop)


async def scale_down_under_traffic(
    kube: FakeKube, a: RouterServer, b: RouterServer, by_id: dict[str, SimReplica]
) -> None:
    pods = sorted(by_id)
    routers = [a.url, b.url]
    async with httpx.AsyncClient(timeout=WAIT_S * 3) as client:
        # the wrong admin key: the scale-down is abandoned before anything is PATCHed
        wrong = RouterDrainer(routers, "not-the-key", client=client)
        scaler = scaler_for(kube, wrong)
        try:
            with pytest.raises(RouterAdminError, match="HTTP 401"):
                await scaler.apply(2, DOWN, await scaler.observe())
            assert scaler.drains.labels(DrainOutcome.FAILED)._value.get() == 1
        finally:
            await scaler.aclose()
        assert not [r for r in kube.requests if r.method == "PATCH"] and len(kube.pods) == 3

        for sim in by_id.values():  # engines frozen: the streams stay in flight
            sim.set_faults(stall=True, lie_health=True)
        held = await hold_streams(client, routers, pods)
        counts = Counter(h.replica for h in held)
        victim = min(pods, key=lambda p: counts[p])
        others = [p for p in pods if p != victim]
        started = {p: finished_requests(s) for p, s in by_id.items()}

        drainer = RecordingDrainer(kube, routers, ADMIN, poll_s=0.05, client=client)
        scaler = scaler_for(kube, drainer)
        try:
            task = asyncio.create_task(scaler.apply(2, DOWN, await scaler.observe()))
            # the victim drains fleet-wide; its stream holds it, so nothing is PATCHed yet
            await until(lambda: _draining_on(a, b, victim), f"both routers to drain {victim}")
            assert (await fleet_states(client, b.url))[victim] == "draining"
            for p in others:  # the others' streams finish; new requests only reach them
                by_id[p].set_faults(stall=False)
            for n, router in enumerate(routers * 2):
                assert await routed_to(client, router, f"during the drain {n}") in others
            assert not [r for r in kube.requests if r.method == "PATCH"]
            assert not task.done()
            by_id[victim].set_faults(stall=False)  # its stream finishes: the drain completes
            assert await asyncio.wait_for(task, WAIT_S)
        finally:
            await scaler.aclose()
        for h in held:
            await asyncio.wait_for(h.task, WAIT_S)

        # every stream, the victim's included, ended normally: no failed client request
        assert [h.finish for h in held] == ["length"] * len(held)
        # the least-loaded replica was chosen, drained and awaited before any PATCH
        assert scaler.victims.labels(VictimReason.LEAST_WORK)._value.get() == 1
        assert scaler.drains.labels(DrainOutcome.DRAINED)._value.get() == 1
        (_, drained, at_drain, _), (_, waited, at_gone, ok) = drainer.calls
        assert drained == waited == (victim,) and ok is True
        patches = [i for i, r in enumerate(kube.requests) if r.method == "PATCH"]
        assert patches and min(patches) >= at_gone >= at_drain
        paths = [kube.requests[i].path for i in patches]
        scale = f"/apis/apps/v1/namespaces/{NS}/deployments/vllm/scale"
        assert paths == [f"/api/v1/namespaces/{NS}/pods/{victim}", scale]
        assert kube.requests[patches[0]].body == {
            "metadata": {"annotations": {DELETION_COST: "-2147483648"}}
        }
        assert sorted(kube.pods) == others  # the fake ReplicaSet removed the drained pod
        # the registry says gone, both routers dropped it, and it got no request after the drain
        assert (await fleet_states(client, a.url))[victim] == "gone"
        assert victim not in replica_status(a) and victim not in replica_status(b)
        assert finished_requests(by_id[victim]) == started[victim] + counts[victim]
        for server in (a, b):
            await asyncio.to_thread(assert_router_idle, server)


async def _draining_on(a: RouterServer, b: RouterServer, victim: str) -> bool:
    rows = [await asyncio.to_thread(replica_status, r) for r in (a, b)]
    return all(row.get(victim, {}).get("phase") == "draining" for row in rows)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_no_router_answering_abandons_the_scale_down(kube: FakeKube) -> None:
    kube.add_workload("deployments", "vllm", 3)
    routers = [f"http://127.0.0.1:{_closed_port()}", f"http://127.0.0.1:{_closed_port()}"]
    drainer = RouterDrainer(routers, ADMIN, timeout_s=2.0)
    scaler = scaler_for(kube, drainer)
    try:
        with pytest.raises(RouterAdminError, match="no router's admin API answered") as info:
            await scaler.apply(2, DOWN, await scaler.observe())
        assert scaler.drains.labels(DrainOutcome.FAILED)._value.get() == 1
    finally:
        await scaler.aclose()
        await drainer.aclose()
    assert len(info.value.failures) == 2 and "ConnectError" in info.value.failures[0]
    assert not [r for r in kube.requests if r.method == "PATCH"]
    assert len(kube.pods) == 3
