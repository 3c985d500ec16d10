"""The drained scale-down of the autoscaler's Kubernetes actuator, against the fake API server.

A Deployment: the victim is the pod with the least in-flight, then least cached work; it is
drained (and the drain awaited) before any PATCH, its pod-deletion-cost annotation is set before
the scale subresource is PATCHed, and the fake ReplicaSet then removes exactly that pod. A
StatefulSet: its top ordinals are drained, then the scale PATCH; no pod is annotated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fake_kube import NS, FakeKube

from autoscaler.hosts import FleetObservation
from autoscaler.hosts.kube_scaler import DrainOutcome, KubernetesScaler, ScalerSettings
from autoscaler.types import ScaleDecision, ScaleReason
from autoscaler.victims import VictimInfo, VictimReason
from controlplane.kube.pods import DELETION_COST

WAIT_S = 15.0  # a failure bound
DOWN = ScaleDecision(0, ScaleReason.SCALE_DOWN)


@dataclass
class FakeDrainer:
    """The registry's side: known load, drains recorded with the API requests seen so far."""

    kube: FakeKube
    load: dict[str, tuple[int, int]]  # id -> (in flight, cached blocks)
    drained_in_time: bool = True
    calls: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def victim_info(self, ids: Sequence[str]) -> Mapping[str, VictimInfo]:
        self.calls.append(("victim_info", tuple(ids), len(self.kube.requests)))
        return {i: VictimInfo(i, *self.load[i]) for i in ids if i in self.load}

    async def drain(self, ids: Sequence[str]) -> None:
        self.calls.append(("drain", tuple(ids), len(self.kube.requests)))

    async def wait_drained(self, ids: Sequence[str], timeout: float) -> bool:
        self.calls.append(("wait_drained", tuple(ids), len(self.kube.requests)))
        self.waiting.set()
        await self.release.wait()
        return self.drained_in_time


def scaler_for(kube: FakeKube, drainer: FakeDrainer, **target: str) -> KubernetesScaler:
    settings = ScalerSettings(
        mode="kubernetes", namespace=NS, api_url=kube.url, retry_backoff_s=0.0,
        drain_timeout_s=30.0, **target,  # type: ignore[arg-type]
    )  # fmt: skip
    return KubernetesScaler(settings, drainer=drainer)


async def scale_to(scaler: KubernetesScaler, drainer: FakeDrainer, target: int) -> None:
    """apply(target): held in wait_drained until the test saw that nothing was PATCHed yet."""
    fleet = await scaler.observe()
    task = asyncio.create_task(scaler.apply(target, DOWN, fleet))
    try:
        await asyncio.wait_for(drainer.waiting.wait(), WAIT_S)
        assert not [r for r in drainer.kube.requests if r.method == "PATCH"]
        drainer.release.set()
        assert await asyncio.wait_for(task, WAIT_S)
    finally:
        task.cancel()


async def test_deployment_victim_is_drained_annotated_then_scaled(kube: FakeKube) -> None:
    kube.add_workload("deployments", "vllm", 3)
    busy, cached, idle = sorted(kube.pods)
    drainer = FakeDrainer(kube, {busy: (4, 10), cached: (0, 500), idle: (0, 20)})
    scaler = scaler_for(kube, drainer, deployment="vllm")
    try:
        await scale_to(scaler, drainer, 2)
    finally:
        await scaler.aclose()
    # the drainer was asked about the pods, then drained and waited on the victim
    assert [(c[0], c[1]) for c in drainer.calls] == [
        ("victim_info", (busy, cached, idle)), ("drain", (idle,)), ("wait_drained", (idle,)),
    ]  # fmt: skip
    # the API: the victim's annotation, then the scale PATCH
    patches = [r for r in kube.requests if r.method == "PATCH"]
    base = f"/apis/apps/v1/namespaces/{NS}/deployments/vllm"
    assert [r.path for r in patches] == [f"/api/v1/namespaces/{NS}/pods/{idle}", f"{base}/scale"]
    assert patches[0].body == {"metadata": {"annotations": {DELETION_COST: "-2147483648"}}}
    assert patches[1].body["spec"] == {"replicas": 2}
    # the ReplicaSet removed the cheapest pod: the drained one
    assert sorted(kube.pods) == [busy, cached]
    assert scaler.victims.labels(VictimReason.LEAST_WORK)._value.get() == 1
    assert scaler.drains.labels(DrainOutcome.DRAINED)._value.get() == 1


async def test_a_stale_mark_is_removed_before_the_victim_is_marked(kube: FakeKube) -> None:
    kube.add_workload("deployments", "vllm", 3)
    stale, busy, idle = sorted(kube.pods)
    # an earlier scale-down marked `stale`, and its scale PATCH never went through
    kube.pods[stale]["metadata"]["annotations"][DELETION_COST] = "-2147483648"
    drainer = FakeDrainer(kube, {stale: (3, 0), busy: (2, 0), idle: (0, 0)})
    scaler = scaler_for(kube, drainer, deployment="vllm")
    try:
        await scale_to(scaler, drainer, 2)
    finally:
        await scaler.aclose()
    patches = [(r.path.rsplit("/", 1)[1], r.body) for r in kube.requests if r.method == "PATCH"]
    assert [p[0] for p in patches] == [stale, idle, "scale"]
    assert patches[0][1] == {"metadata": {"annotations": {DELETION_COST: None}}}
    assert sorted(kube.pods) == [stale, busy]
    assert DELETION_COST not in kube.pods[stale]["metadata"]["annotations"]


async def test_deployment_prefers_unready_and_unknown_pods(kube: FakeKube) -> None:
    kube.add_workload("deployments", "vllm", 4)
    a, b, c, d = sorted(kube.pods)
    kube.set_ready(c, False)
    drainer = FakeDrainer(kube, {a: (0, 0), b: (1, 0), c: (0, 0)}, drained_in_time=False)
    scaler = scaler_for(kube, drainer, deployment="vllm")
    try:
        await scale_to(scaler, drainer, 2)  # the drain timed out: the scale-down goes on
    finally:
        await scaler.aclose()
    assert drainer.calls[1][:2] == ("drain", (c, d))  # not ready first, then unknown to the router
    assert sorted(kube.pods) == [a, b]
    assert scaler.victims.labels(VictimReason.NOT_READY)._value.get() == 1
    assert scaler.victims.labels(VictimReason.UNKNOWN_TO_ROUTER)._value.get() == 1
    assert scaler.drains.labels(DrainOutcome.TIMED_OUT)._value.get() == 1


async def test_statefulset_top_ordinals_are_drained_then_scaled(kube: FakeKube) -> None:
    kube.add_workload("statefulsets", "vllm", 3)
    drainer = FakeDrainer(kube, {"vllm-0": (5, 5), "vllm-1": (0, 0), "vllm-2": (9, 9)})
    scaler = scaler_for(kube, drainer, statefulset="vllm")
    try:
        await scale_to(scaler, drainer, 1)
    finally:
        await scaler.aclose()
    # the top ordinals, however busy: a StatefulSet removes nothing else
    assert [(c[0], c[1]) for c in drainer.calls] == [
        ("drain", ("vllm-2", "vllm-1")), ("wait_drained", ("vllm-2", "vllm-1")),
    ]  # fmt: skip
    patches = [r for r in kube.requests if r.method == "PATCH"]
    assert [r.path for r in patches] == [f"/apis/apps/v1/namespaces/{NS}/statefulsets/vllm/scale"]
    assert sorted(kube.pods) == ["vllm-0"]


async def test_scale_up_drains_nothing(kube: FakeKube) -> None:
    kube.add_workload("deployments", "vllm", 1)
    drainer = FakeDrainer(kube, {})
    scaler = scaler_for(kube, drainer, deployment="vllm")
    try:
        fleet = await scaler.observe()
        assert fleet == FleetObservation(spec=1, ready=1)
        assert await scaler.apply(3, ScaleDecision(3, ScaleReason.FORECAST_UP), fleet)
    finally:
        await scaler.aclose()
    assert drainer.calls == [] and len(kube.pods) == 3
    assert [r.path.rsplit("/", 1)[1] for r in kube.requests if r.method == "PATCH"] == ["scale"]
