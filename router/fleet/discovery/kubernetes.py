"""Kubernetes discovery: the pods matching a label selector, as fleet members, list + watch.

    rv = LIST pods?labelSelector=S                 -> the whole view; report it
    loop: WATCH pods?labelSelector=S&resourceVersion=rv&allowWatchBookmarks=true&timeoutSeconds=T
        ADDED / MODIFIED -> the pod's member (or none: no IP, no port yet); DELETED -> gone
        BOOKMARK         -> only rv moves
        after an event that changed the view: report the whole view
        the server ends the watch (timeoutSeconds) -> watch again from the last rv
        410 Gone (HTTP or an ERROR event)         -> LIST again (relist), report, watch from it
        transport error / 5xx / 403 ...            -> back off (doubling, capped), watch from rv
        the sink refuses a report (ControlPlaneError) -> counted; offered again with the next
                                                        event or watch renewal

A report is `sink.set_members("kubernetes", members)` (`router.fleet.membership`). A pod is a
member once it has an IP: id = pod name, url = `scheme://podIP:port` (the port of the container
port named `port_name`, else `port`), ready = its Ready condition is True and it is not
terminating, model / gpu from a label (or else an annotation) under the configured keys. While
the API is unreachable the last view stands (the router's probes still judge each replica).

RBAC (a Role in the router's namespace): `list`, `watch` on `pods`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from enum import StrEnum
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter
from pydantic import Field

from controlplane.errors import ControlPlaneError, KubernetesApiError, ResourceGoneError
from controlplane.kube.api import KubeClient, KubeConnection, resolve_namespace
from controlplane.kube.pods import pod_ready, pods_path
from controlplane.routing.config import Section
from router.fleet.membership import Member, MembershipSink

log = logging.getLogger("controlplane.router.discovery.kubernetes")

SOURCE = "kubernetes"


class KubernetesDiscoveryConfig(Section, KubeConnection):
    """Which pods are the fleet, and how to reach them."""

    namespace: str = Field(default="", description="Namespace of the pods ('' = our own).")
    label_selector: str = Field(
        min_length=1, description="Label selector of the engine pods, e.g. app=vllm,model=llama."
    )
    port_name: str = Field(
        default="http", description="Name of the container port the engine serves on."
    )
    port: int | None = Field(
        default=8000, ge=1, le=65535, description="Port when no container port has port_name."
    )
    scheme: Literal["http", "https"] = Field(default="http", description="Scheme of the URLs.")
    model_key: str = Field(
        default="", description="Label (else annotation) naming a pod's model ('' = ask it)."
    )
    gpu_key: str = Field(default="", description="Label (else annotation) naming a pod's GPU.")
    watch_timeout_s: int = Field(
        default=300, ge=1, description="timeoutSeconds of one watch; then it is renewed."
    )
    backoff_s: float = Field(default=0.5, ge=0, description="First wait after an API error.")
    backoff_max_s: float = Field(default=30.0, ge=0, description="Longest wait between retries.")


class RelistReason(StrEnum):
    """Why the pods were listed again (metric label)."""

    START = "start"
    GONE = "gone"


def _port(pod: Mapping[str, Any], cfg: KubernetesDiscoveryConfig) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == cfg.port_name and port.get("containerPort"):
                return int(port["containerPort"])
    return cfg.port


def _key(meta: Mapping[str, Any], key: str) -> str | None:
    if not key:
        return None
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    value = labels.get(key, annotations.get(key))
    return str(value) if value else None


def pod_member(pod: Mapping[str, Any], cfg: KubernetesDiscoveryConfig) -> Member | None:
    """The member a pod is, or None while it has no IP (or no port to reach)."""
    meta = pod.get("metadata") or {}
    ip = (pod.get("status") or {}).get("podIP")
    port = _port(pod, cfg)
    if not ip or port is None or not meta.get("name"):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return Member(
        replica_id=meta["name"],
        url=f"{cfg.scheme}://{host}:{port}",
        ready=pod_ready(pod),
        model=_key(meta, cfg.model_key),
        gpu=_key(meta, cfg.gpu_key),
        labels=dict(meta.get("labels") or {}),
    )


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("kubernetes discovery stopped", exc_info=task.exception())


class KubernetesDiscovery:
    """Keeps `sink` told of the pods matching the selector, until closed."""

    def __init__(
        self,
        cfg: KubernetesDiscoveryConfig,
        sink: MembershipSink,
        *,
        registry: CollectorRegistry | None = None,
        api: KubeClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.cfg = cfg
        self.sink = sink
        self.api = api or KubeClient(cfg)
        self.sleep = sleep
        self.path = pods_path(resolve_namespace(cfg.namespace))
        self.members: dict[str, Member] = {}
        self.reported: tuple[Member, ...] | None = None
        self.rv: str | None = None
        self._task: asyncio.Task[None] | None = None
        r = registry if registry is not None else CollectorRegistry()
        self.events = Counter(
            "cp_discovery_kubernetes_events", "Watch events by type.", ["type"], registry=r
        )
        self.relists = Counter(
            "cp_discovery_kubernetes_relists", "Pod lists by reason.", ["reason"], registry=r
        )
        self.errors = Counter(
            "cp_discovery_kubernetes_errors", "Failed list/watch calls.", ["stage"], registry=r
        )

    async def _report(self) -> None:
        view = tuple(sorted(self.members.values(), key=lambda m: m.replica_id))
        if view == self.reported:
            return
        try:
            await self.sink.set_members(SOURCE, view)
        except ControlPlaneError as exc:  # sent again with the next event or watch renewal
            self.errors.labels("report").inc()
            log.warning("the fleet registry refused the kubernetes view: %s", exc)
            self.reported = None
        else:
            self.reported = view

    async def relist(self, reason: RelistReason) -> None:
        """LIST the pods: the view is replaced, reported, and the watch starts from its rv."""
        self.relists.labels(reason).inc()
        listed = await self.api.call(
            "GET", self.path, params={"labelSelector": self.cfg.label_selector}
        )
        members = (pod_member(p, self.cfg) for p in listed.get("items") or [])
        self.members = {m.replica_id: m for m in members if m is not None}
        self.rv = str((listed.get("metadata") or {}).get("resourceVersion") or "") or None
        await self._report()

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = str(event.get("type"))
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.rv = str(meta["resourceVersion"])
        name = meta.get("name")
        if kind == "BOOKMARK" or not name:
            return
        member = pod_member(obj, self.cfg) if kind in ("ADDED", "MODIFIED") else None
        if member is None:
            self.members.pop(name, None)
        else:
            self.members[name] = member

    async def watch_once(self) -> None:
        """One watch from the current rv, applied and reported event by event."""
        params = {
            "labelSelector": self.cfg.label_selector,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.cfg.watch_timeout_s),
        }
        if self.rv:
            params["resourceVersion"] = self.rv
        read_timeout = self.cfg.watch_timeout_s + self.cfg.request_timeout_s
        seen = 0
        async for event in self.api.watch(self.path, params, read_timeout_s=read_timeout):
            seen += 1
            self.events.labels(str(event.get("type"))).inc()
            self._apply(event)
            await self._report()
        if not seen:  # a watch ended without a word: do not spin on an API that closes at once
            await self.sleep(self.cfg.backoff_s)

    async def run(self) -> None:
        """List, then watch forever: relist on 410, back off and rewatch on other errors."""
        reason: RelistReason | None = RelistReason.START
        backoff = self.cfg.backoff_s
        while True:
            stage = "list" if reason is not None else "watch"
            try:
                if reason is not None:
                    await self.relist(reason)
                    reason = None
                    stage = "watch"
                await self.watch_once()
                await self._report()  # a view the sink refused is offered again
                backoff = self.cfg.backoff_s
            except ResourceGoneError:
                log.info("resourceVersion %s expired (410): listing the pods again", self.rv)
                reason = RelistReason.GONE
            except KubernetesApiError as exc:
                self.errors.labels(stage).inc()
                log.warning("kubernetes discovery %s failed, retrying in %.1f s: %s",
                            stage, backoff, exc)  # fmt: skip
                await self.sleep(backoff)
                backoff = min(max(backoff * 2, self.cfg.backoff_s), self.cfg.backoff_max_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="kubernetes-discovery")
            self._task.add_done_callback(_log_crash)

    async def aclose(self) -> None:
        """Stop watching and close the API client (the last view stays with the sink)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.api.aclose()


__all__ = [
    "SOURCE",
    "KubernetesDiscovery",
    "KubernetesDiscoveryConfig",
    "RelistReason",
    "pod_member",
]
