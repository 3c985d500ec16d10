"""The actuator of the `kubernetes` mode: replicas of one Deployment/StatefulSet, drained down.

Read: `GET .../{deployments|statefulsets}/{name}/scale` (spec) and `GET .../{name}`
(`status.readyReplicas`). Scale up: `PATCH .../scale` with the JSON merge patch
`{"metadata": {"resourceVersion": rv}, "spec": {"replicas": N}}` at the version just read; a 409
re-reads and retries. Scale down, in this order, so no request is cut and the right pod goes:

    1. victims: a StatefulSet's top ordinals; a Deployment's cheapest pods
       (`autoscaler.victims.deployment_victims` over `GET pods?labelSelector=<its matchLabels>`
       and the drainer's per-pod in-flight and cached blocks)
    2. drain: `drainer.drain(victims)`, then `drainer.wait_drained(victims, drain_timeout_s)`
       (on a timeout the scale-down goes on: the timeout is the drain's bound, logged; a
       drainer error, here or in 1., abandons the scale-down: nothing is PATCHed, the next
       tick decides again); `cp_autoscaler_drains_total{outcome}`: drained/timed_out/failed
    3. Deployment only: `PATCH pods/<victim>` with the merge patch of the annotation
       `controller.kubernetes.io/pod-deletion-cost: "-2147483648"` (the ReplicaSet removes the
       lowest cost first); a pod still carrying that mark from a scale-down whose PATCH failed,
       and not a victim now, has it removed first (merge patch `null`)
    4. `PATCH .../scale`

RBAC: `get` on the deployment/statefulset; `get`, `patch` on its `/scale`; for a Deployment's
scale-down `list` and `patch` on `pods`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, Literal

import httpx
from prometheus_client import CollectorRegistry, Counter
from pydantic import Field

from autoscaler.hosts import FleetObservation
from autoscaler.types import ScaleDecision
from autoscaler.victims import (
    Drainer,
    NoDrainer,
    PodState,
    Victim,
    deployment_victims,
    statefulset_victims,
)
from controlplane.errors import ConfigError, ControlPlaneError, KubernetesApiError
from controlplane.kube.api import KubeClient, KubeConnection, resolve_namespace
from controlplane.kube.pods import (
    DELETION_COST,
    LOWEST_DELETION_COST,
    deletion_cost_patch,
    match_labels_selector,
    pod_ready,
    pod_terminating,
    pods_path,
)

log = logging.getLogger("controlplane.autoscaler.kubernetes")


class DrainOutcome(StrEnum):
    """How a scale-down's drain ended (metric label)."""

    DRAINED = "drained"  # every victim's requests ended: removed
    TIMED_OUT = "timed_out"  # drain_timeout_s passed first: removed anyway
    FAILED = "failed"  # the drainer raised: nothing removed this time


class ScalerSettings(KubeConnection):
    """What to scale and how to drain (a mixin of the host's settings)."""

    mode: Literal["advisory", "kubernetes", "keda"] = Field(
        default="advisory", description="advisory: log only; kubernetes: PATCH scale; keda: metric."
    )
    namespace: str = Field(default="", description="Namespace ('' = the service account's).")
    deployment: str = Field(default="", description="Deployment to scale (or `statefulset`).")
    statefulset: str = Field(default="", description="StatefulSet to scale (or `deployment`).")
    drain_timeout_s: float = Field(
        default=60.0, ge=0, description="Longest wait for scale-down victims' requests to end."
    )

    def target_ref(self) -> tuple[str, str] | None:
        """(resource, name) of the scaled object; None when none is named."""
        if self.deployment and self.statefulset:
            raise ConfigError("name a --deployment or a --statefulset, not both")
        if self.deployment:
            return "deployments", self.deployment
        if self.statefulset:
            return "statefulsets", self.statefulset
        if self.mode == "kubernetes":
            raise ConfigError("kubernetes mode needs a --deployment or a --statefulset to scale")
        return None


class KubernetesScaler:
    """Reads and sets the replicas of one Deployment/StatefulSet (an `Actuator`)."""

    def __init__(
        self,
        settings: ScalerSettings,
        *,
        drainer: Drainer | None = None,
        registry: CollectorRegistry | None = None,
        client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        ref = settings.target_ref()
        if ref is None:
            raise ConfigError("no Deployment or StatefulSet named")
        self.api = KubeClient(settings, client=client, sleep=sleep)
        self.retries = settings.retries
        self.mode: str = settings.mode
        self.namespace = resolve_namespace(settings.namespace)
        self.resource, self.name = ref
        self.path = f"/apis/apps/v1/namespaces/{self.namespace}/{self.resource}/{self.name}"
        self.what = f"{self.resource[:-1]} {self.namespace}/{self.name}"
        self.drainer: Drainer = drainer or NoDrainer()
        self.drain_timeout_s = settings.drain_timeout_s
        self._marked: set[str] = set()  # pods carrying our lowest deletion cost, at the last list
        registry = registry if registry is not None else CollectorRegistry()
        self.victims = Counter(
            "cp_autoscaler_victims", "Replicas chosen for removal.", ["reason"], registry=registry
        )
        self.drains = Counter(
            "cp_autoscaler_drains", "Scale-down drains by outcome.", ["outcome"], registry=registry
        )

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        return await self.api.call(method, path, body, what=self.what)

    async def observe(self) -> FleetObservation:
        scale = await self._call("GET", f"{self.path}/scale")
        obj = await self._call("GET", self.path)
        spec = int(scale.get("spec", {}).get("replicas", 0))
        ready = int(obj.get("status", {}).get("readyReplicas", 0) or 0)
        return FleetObservation(spec=spec, ready=ready)

    async def set_replicas(self, target: int) -> None:
        """PATCH the scale subresource at the version just read; a 409 re-reads and retries."""
        for attempt in range(self.retries + 1):
            scale = await self._call("GET", f"{self.path}/scale")
            rv = scale.get("metadata", {}).get("resourceVersion")
            patch: dict[str, Any] = {"spec": {"replicas": target}}
            if rv:
                patch["metadata"] = {"resourceVersion": rv}
            try:
                await self._call("PATCH", f"{self.path}/scale", patch)
                return
            except KubernetesApiError as exc:
                if exc.status != 409 or attempt == self.retries:
                    raise
                log.info("%s changed under us (409), re-reading", self.what)

    async def choose_victims(self, current: int, target: int) -> tuple[Victim, ...]:
        """The replicas a scale-down from `current` to `target` removes."""
        if self.resource == "statefulsets":
            return statefulset_victims(self.name, current, target)
        obj = await self._call("GET", self.path)
        match = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        if not match:
            raise KubernetesApiError(f"{self.what}: no spec.selector.matchLabels to list pods by")
        selector = {"labelSelector": match_labels_selector(match)}
        listed = await self.api.call(
            "GET", pods_path(self.namespace), params=selector, what=f"pods of {self.what}"
        )
        items = listed.get("items") or []
        pods = [PodState(p["metadata"]["name"], pod_ready(p), pod_terminating(p)) for p in items]
        # pods an earlier scale-down marked and did not remove (its scale PATCH failed)
        self._marked = {
            p["metadata"]["name"]
            for p in items
            if (p["metadata"].get("annotations") or {}).get(DELETION_COST)
            == str(LOWEST_DELETION_COST)
        }
        try:
            info = await self.drainer.victim_info([p.name for p in pods if not p.terminating])
        except ControlPlaneError:  # the drainer cannot say: no blind removal
            self.drains.labels(DrainOutcome.FAILED).inc()
            raise
        return deployment_victims(pods, info, current - target)

    async def _set_cost(self, name: str, cost: int | None) -> None:
        await self.api.call(
            "PATCH", f"{pods_path(self.namespace)}/{name}", deletion_cost_patch(cost),
            what=f"pod {name}",
        )  # fmt: skip

    async def scale_down(self, current: int, target: int) -> tuple[Victim, ...]:
        """Choose, drain, mark (Deployment), then PATCH the scale subresource."""
        self._marked = set()
        victims = await self.choose_victims(current, target)
        ids = [v.name for v in victims]
        for v in victims:
            self.victims.labels(v.reason).inc()
        if ids:
            await self._drain(ids)
        if self.resource == "deployments":
            for name in sorted(self._marked - set(ids)):
                await self._set_cost(name, None)  # a stale mark would make it go instead
            for name in ids:
                await self._set_cost(name, LOWEST_DELETION_COST)
        await self.set_replicas(target)
        return victims

    async def _drain(self, ids: list[str]) -> None:
        try:
            await self.drainer.drain(ids)
            drained = await self.drainer.wait_drained(ids, self.drain_timeout_s)
        except ControlPlaneError:
            self.drains.labels(DrainOutcome.FAILED).inc()
            raise
        if drained:
            self.drains.labels(DrainOutcome.DRAINED).inc()
        else:
            self.drains.labels(DrainOutcome.TIMED_OUT).inc()
            log.warning("%s: %s not drained in %.0f s, removing them anyway",
                        self.what, ids, self.drain_timeout_s)  # fmt: skip

    async def apply(self, target: int, decision: ScaleDecision, fleet: FleetObservation) -> bool:
        if self.mode != "kubernetes":
            return False  # advisory/keda: read only
        if target < fleet.spec:
            victims = await self.scale_down(fleet.spec, target)
            log.info("%s: replicas %d -> %d (%s), removed %s", self.what, fleet.spec, target,
                     decision.reason, [f"{v.name} ({v.reason})" for v in victims])  # fmt: skip
        elif target > fleet.spec:
            await self.set_replicas(target)
            log.info("%s: replicas %d -> %d (%s)", self.what, fleet.spec, target, decision.reason)
        return True

    async def aclose(self) -> None:
        await self.api.aclose()


__all__ = ["DrainOutcome", "KubernetesScaler", "ScalerSettings"]
