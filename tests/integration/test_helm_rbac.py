"""The chart's RBAC grants exactly what the autoscaler and the router's discovery call.

The processes run from the rendered configuration against the fake API server
(tests/integration/fake_kube.py, real HTTP): the autoscaler's scaler (settings from the rendered
container's environment) observes, scales up and scales down a StatefulSet (the chart's engines)
and a Deployment (an existing workload), in kubernetes and advisory mode; the router's
Kubernetes discovery (settings from the rendered router.yaml) lists and watches the engine pods.
Each request of the fake's log becomes (API group, resource, verb, name); every one must be
allowed by the rendered Role of that process, and every verb a Role grants must have been used.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import yaml
from fake_kube import NS, FakeKube
from helm_chart import ChartCopy, Obj, env_of, one, tool

from autoscaler.hosts.kube_scaler import KubernetesScaler, ScalerSettings
from autoscaler.types import ScaleDecision, ScaleReason
from autoscaler.victims import VictimInfo
from router.fleet.discovery.kubernetes import KubernetesDiscovery, KubernetesDiscoveryConfig
from router.fleet.membership import Member

WAIT_S = 15.0  # a failure bound, not a threshold
Call = tuple[str, str, str, str]  # (api group, resource, verb, name or "")


def call_of(method: str, path: str, query: Mapping[str, str]) -> Call:
    """A request of the fake's log as RBAC sees it."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[parts.index("namespaces") + 2 :]  # resource [name [subresource]]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    name = rest[1] if len(rest) > 1 else ""
    if method == "GET":
        verb = "watch" if query.get("watch") == "true" else ("get" if name else "list")
    else:
        verb = method.lower()
    return group, resource, verb, name


def allowed(rules: Sequence[Mapping[str, Any]], call: Call) -> Mapping[str, Any] | None:
    group, resource, verb, name = call
    for rule in rules:
        names = rule.get("resourceNames")
        if (
            group in rule["apiGroups"]
            and resource in rule["resources"]
            and verb in rule["verbs"]
            and (not names or name in names)
        ):
            return rule
    return None


def check_exact(role: Obj, calls: list[Call]) -> None:
    rules = role.doc["rules"]
    unallowed = [c for c in calls if allowed(rules, c) is None]
    assert unallowed == [], f"{role.name} does not allow {unallowed}"
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip
    used = {(g, r, v) for g, r, v, _ in calls}
    assert granted - used == set(), f"{role.name} grants unused {granted - used}"


class KnownLoad:
    """A drainer that knows every pod (idle) and drains at once."""

    async def victim_info(self, ids: Sequence[str]) -> Mapping[str, VictimInfo]:
        return {i: VictimInfo(i, 0, 0) for i in ids}

    async def drain(self, ids: Sequence[str]) -> None:
        return None

    async def wait_drained(self, ids: Sequence[str], timeout: float) -> bool:
        return True


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> ChartCopy:
    tool("helm")
    return ChartCopy.make(tmp_path_factory.mktemp("chart"))


def scaler_settings(objs: list[Obj], kube: FakeKube) -> ScalerSettings:
    """The rendered autoscaler's own settings, pointed at the fake API server."""
    deploy = next(o for o in objs if o.kind == "Deployment" and "-autoscaler-" in o.name)
    env = {k: v for k, v in env_of(deploy.container("autoscaler")).items() if isinstance(v, str)}
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        from autoscaler.hosts.kubernetes import HostSettings

        host = HostSettings()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    fields = {k: getattr(host, k) for k in ScalerSettings.model_fields}
    fields.update(api_url=kube.url, namespace=NS, retry_backoff_s=0.0, drain_timeout_s=5.0)
    return ScalerSettings(**fields)


async def exercise(settings: ScalerSettings, kube: FakeKube) -> list[Call]:
    """observe, scale 3 -> 4 -> 2 (kubernetes mode acts; advisory only reads)."""
    kind, name = settings.target_ref() or ("", "")
    kube.add_workload(kind, name, 3)
    scaler = KubernetesScaler(settings, drainer=KnownLoad())
    try:
        for target in (4, 2):
            fleet = await scaler.observe()
            await scaler.apply(target, ScaleDecision(target, ScaleReason.FORECAST_UP), fleet)
    finally:
        await scaler.aclose()
    return [call_of(r.method, r.path, r.query) for r in kube.requests]


@pytest.mark.parametrize(
    ("values", "sets", "verbs"),
    [
        ("full", {}, {"get", "patch"}),  # the chart's engine StatefulSet
        ("engines-off", {}, {"get"}),  # advisory: reads only
        (
            "engines-off",
            {"autoscaler.mode": "kubernetes", "autoscaler.targets[0].kind": "Deployment"},
            {"get", "patch", "list"},  # victims by load, then the pod-deletion-cost annotation
        ),
    ],
    ids=["statefulset-kubernetes", "statefulset-advisory", "deployment-kubernetes"],
)
async def test_autoscaler_role_is_exactly_what_it_calls(
    chart: ChartCopy, kube: FakeKube, values: str, sets: dict[str, str], verbs: set[str]
) -> None:
    objs = chart.render(values, sets=sets)
    settings = scaler_settings(objs, kube)
    calls = await exercise(settings, kube)
    assert {c[2] for c in calls} == verbs
    role = next(o for o in objs if o.kind == "Role" and "-autoscaler-" in o.name)
    check_exact(role, calls)
    binding = one(objs, "RoleBinding", role.name.removeprefix("cp-controlplane"))
    deploy = one(objs, "Deployment", role.name.removeprefix("cp-controlplane"))
    assert binding.doc["subjects"][0]["name"] == deploy.pod_spec()["serviceAccountName"]


class Sink:
    def __init__(self) -> None:
        self.reports: list[tuple[Member, ...]] = []

    async def set_members(self, source: str, members: Sequence[Member]) -> None:
        self.reports.append(tuple(members))


async def test_router_discovery_role_is_exactly_what_it_calls(
    chart: ChartCopy, kube: FakeKube
) -> None:
    objs = chart.render("full")
    router_yaml = yaml.safe_load(one(objs, "ConfigMap", "-router").doc["data"]["router.yaml"])
    cfg = KubernetesDiscoveryConfig(
        **{**router_yaml["fleet"]["kubernetes"], "api_url": kube.url, "retries": 0}
    )
    # an engine pod as the chart's StatefulSet makes it, and a pod of something else
    sts = one(objs, "StatefulSet", "-engine-llama8b")
    meta = sts.doc["spec"]["template"]["metadata"]
    kube.add_pod(f"{sts.name}-0", ip="10.0.0.7", labels=meta["labels"],
                 annotations=meta["annotations"])  # fmt: skip
    kube.add_pod("redis-0", ip="10.0.0.9", labels={"app.kubernetes.io/component": "redis"})
    sink = Sink()
    discovery = KubernetesDiscovery(cfg, sink)
    discovery.start()
    try:
        async with asyncio.timeout(WAIT_S):
            while not (sink.reports and kube.open_watches):
                await asyncio.sleep(0.01)
    finally:
        await discovery.aclose()
    (member,) = sink.reports[-1]
    assert (member.replica_id, member.url) == (f"{sts.name}-0", "http://10.0.0.7:8000")
    assert (member.model, member.gpu) == ("llama-3.1-8b", "h100")
    calls = [call_of(r.method, r.path, r.query) for r in kube.requests]
    role = one(objs, "Role", "-router-discovery")
    check_exact(role, calls)
    binding = one(objs, "RoleBinding", "-router-discovery")
    router = one(objs, "Deployment", "-router")
    assert binding.doc["subjects"][0]["name"] == router.pod_spec()["serviceAccountName"]
