"""A fake Kubernetes API server: real HTTP (starlette + uvicorn on a loopback port), the wire
protocol of pods, Deployments, StatefulSets and their scale subresource, nothing more.

    kube = FakeKube(); await kube.start()            # kube.url
    kube.add_pod("vllm-a", ip="10.0.0.1"); kube.set_ready("vllm-a", False); kube.delete_pod(...)
    kube.expire()      # compact history: open watches get an ERROR 410 event, old rvs are gone
    await kube.stop(); await kube.start()            # the API down, then back on the same port
    kube.requests      # every request in order: (method, path, query, JSON body)

Pods: LIST (`labelSelector` of `k=v` terms, `metadata.resourceVersion`), WATCH (`watch=true`,
`resourceVersion`, `timeoutSeconds`, `allowWatchBookmarks`): the events after the given version
from the history, then live ones, one JSON object per line; a version older than the last
`expire()` is answered with `{"type": "ERROR", "object": {"kind": "Status", "code": 410}}`.
PATCH `pods/<name>` merges annotations. `apps/v1` deployments and statefulsets: GET (selector,
readyReplicas), GET/PATCH `/scale`; lowering replicas deletes pods the way the controllers do:
a StatefulSet its top ordinals, a Deployment its lowest `pod-deletion-cost` first (then name).
`fail_next` answers the next requests with the given HTTP statuses.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from controlplane.kube.pods import DELETION_COST

NS = "llm"


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    body: Any


@dataclass
class Workload:
    resource: str  # deployments | statefulsets
    name: str
    replicas: int
    labels: dict[str, str]
    serial: int = 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status(code: int, message: str) -> dict[str, Any]:
    reason = {410: "Expired", 404: "NotFound", 409: "Conflict"}.get(code, "InternalError")
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip


def _matches(labels: dict[str, str], selector: str) -> bool:
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return all(labels.get(k) == v for k, v in terms)


@dataclass
class FakeKube:
    namespace: str = NS
    rv: int = 100
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    oldest_rv: int = 0
    workloads: dict[tuple[str, str], Workload] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    fail_next: list[int] = field(default_factory=list)
    port: int = field(default_factory=_free_port)
    _watchers: set[asyncio.Queue[tuple[str, dict[str, Any]] | None]] = field(default_factory=set)
    _server: uvicorn.Server | None = None
    _task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- the cluster, as a test changes it ------------------------------------------------------

    def _event(self, kind: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        snapshot = copy.deepcopy(pod)
        self.history.append((self.rv, kind, snapshot))
        for queue in self._watchers:
            queue.put_nowait((kind, snapshot))

    def add_pod(
        self, name: str, *, ip: str | None = "10.0.0.1", ready: bool = True,
        labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        port: int = 8000, port_name: str = "http",
    ) -> None:  # fmt: skip
        pod: dict[str, Any] = {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": self.namespace, "labels": dict(labels or {}),
                         "annotations": dict(annotations or {})},
            "spec": {"containers": [{"name": "vllm", "ports": [
                {"name": port_name, "containerPort": port, "protocol": "TCP"}]}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]},
        }  # fmt: skip
        if ip is None:
            del pod["status"]["podIP"]
        self.pods[name] = pod
        self._event("ADDED", pod)

    def modify_pod(self, name: str, **status: Any) -> None:
        pod = self.pods[name]
        pod["status"].update(status)
        self._event("MODIFIED", pod)

    def set_ready(self, name: str, ready: bool) -> None:
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
        self.modify_pod(name, conditions=conditions)

    def terminate_pod(self, name: str) -> None:
        self.pods[name]["metadata"]["deletionTimestamp"] = "2026-12-04T12:00:00Z"
        self._event("MODIFIED", self.pods[name])

    def delete_pod(self, name: str) -> None:
        self._event("DELETED", self.pods.pop(name))

    def bookmark(self) -> None:
        marker = {"kind": "Pod", "metadata": {"resourceVersion": str(self.rv)}}
        for queue in self._watchers:
            queue.put_nowait(("BOOKMARK", marker))

    def expire(self) -> None:
        """Compact: every version so far is too old to watch from; open watches get a 410."""
        self.oldest_rv = self.rv  # a list now gives this version: watching from it is fine
        self.history.clear()
        for queue in self._watchers:
            queue.put_nowait(("ERROR", _status(410, "too old resource version")))

    def add_workload(self, resource: str, name: str, replicas: int) -> Workload:
        w = Workload(resource, name, 0, {"app": name})
        self.workloads[(resource, name)] = w
        self._scale(w, replicas)
        return w

    def _scale(self, w: Workload, replicas: int) -> None:
        mine = [p for p in self.pods.values() if _matches(p["metadata"]["labels"], f"app={w.name}")]
        if replicas < len(mine):
            if w.resource == "statefulsets":
                key: Any = lambda p: -int(p["metadata"]["name"].rsplit("-", 1)[1])  # noqa: E731
            else:
                key = lambda p: (  # noqa: E731
                    int(p["metadata"]["annotations"].get(DELETION_COST, "0")),
                    p["metadata"]["name"],
                )
            for pod in sorted(mine, key=key)[: len(mine) - replicas]:
                self.delete_pod(pod["metadata"]["name"])
        for n in range(len(mine), replicas):
            ordinal = n if w.resource == "statefulsets" else w.serial
            w.serial += 1
            suffix = str(ordinal) if w.resource == "statefulsets" else f"7d9f-{ordinal:03d}"
            self.add_pod(f"{w.name}-{suffix}", ip=f"10.0.1.{n + 1}", labels=dict(w.labels))
        w.replicas = replicas

    # -- the HTTP side --------------------------------------------------------------------------

    async def _handle(self, request: Request) -> Response:
        body = await request.body()
        path, query = request.url.path, dict(request.query_params)
        self.requests.append(
            Recorded(request.method, path, query, json.loads(body) if body else None)
        )
        if self.fail_next:
            code = self.fail_next.pop(0)
            return JSONResponse(_status(code, "injected"), status_code=code)
        pods = f"/api/v1/namespaces/{self.namespace}/pods"
        apps = f"/apis/apps/v1/namespaces/{self.namespace}/"
        if path == pods and request.method == "GET":
            if query.get("watch") == "true":
                return self._watch(query)
            selector = query.get("labelSelector", "")
            items = [copy.deepcopy(p) for p in self.pods.values()
                     if _matches(p["metadata"]["labels"], selector)]  # fmt: skip
            return JSONResponse({"kind": "PodList", "apiVersion": "v1", "items": items,
                                 "metadata": {"resourceVersion": str(self.rv)}})  # fmt: skip
        if path.startswith(pods + "/") and request.method == "PATCH":
            name = path.rsplit("/", 1)[1]
            if name not in self.pods:
                return JSONResponse(_status(404, f'pods "{name}" not found'), status_code=404)
            patch = json.loads(body)
            annotations = self.pods[name]["metadata"]["annotations"]
            for key, value in patch["metadata"]["annotations"].items():
                if value is None:  # JSON merge patch: null removes the key
                    annotations.pop(key, None)
                else:
                    annotations[key] = value
            self._event("MODIFIED", self.pods[name])
            return JSONResponse(copy.deepcopy(self.pods[name]))
        if path.startswith(apps):
            parts = path.removeprefix(apps).split("/")
            w = self.workloads.get((parts[0], parts[1])) if len(parts) >= 2 else None
            if w is not None:
                return self._workload(w, parts[2:], request.method, body)
        return JSONResponse(_status(404, f"no route {request.method} {path}"), status_code=404)

    def _workload(self, w: Workload, rest: list[str], method: str, body: bytes) -> Response:
        scale = {"kind": "Scale", "metadata": {"name": w.name, "resourceVersion": str(self.rv)},
                 "spec": {"replicas": w.replicas}}  # fmt: skip
        if rest == [] and method == "GET":
            ready = sum(1 for p in self.pods.values()
                        if p["metadata"]["labels"].get("app") == w.name)  # fmt: skip
            return JSONResponse({"metadata": {"name": w.name},
                                 "spec": {"replicas": w.replicas,
                                          "selector": {"matchLabels": dict(w.labels)}},
                                 "status": {"readyReplicas": ready}})  # fmt: skip
        if rest == ["scale"] and method == "GET":
            return JSONResponse(scale)
        if rest == ["scale"] and method == "PATCH":
            self._scale(w, int(json.loads(body)["spec"]["replicas"]))
            scale["spec"] = {"replicas": w.replicas}
            return JSONResponse(scale)
        return JSONResponse(_status(404, "no such subresource"), status_code=404)

    def _watch(self, query: dict[str, str]) -> Response:
        selector = query.get("labelSelector", "")
        since = int(query.get("resourceVersion") or self.rv)
        timeout = float(query.get("timeoutSeconds", "1800"))
        queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
        if since < self.oldest_rv:
            queue.put_nowait(("ERROR", _status(410, f"too old resource version: {since}")))
        else:
            for rv, kind, pod in self.history:
                if rv > since:
                    queue.put_nowait((kind, pod))
        self._watchers.add(queue)
        bookmarks = query.get("allowWatchBookmarks") == "true"

        async def lines() -> Any:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), deadline - loop.time())
                    except TimeoutError:
                        return
                    if item is None:
                        return
                    kind, obj = item
                    if kind == "BOOKMARK" and not bookmarks:
                        continue
                    if kind not in ("ERROR", "BOOKMARK") and not _matches(
                        obj["metadata"]["labels"], selector
                    ):
                        continue
                    yield json.dumps({"type": kind, "object": obj}) + "\n"
                    if kind == "ERROR":
                        return
            finally:
                self._watchers.discard(queue)

        return StreamingResponse(lines(), media_type="application/json")

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        route = Route("/{path:path}", self._handle, methods=["GET", "PATCH"])
        config = uvicorn.Config(
            Starlette(routes=[route]), host="127.0.0.1", port=self.port,
            log_level="warning", lifespan="off",
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise RuntimeError("the fake API server exited at start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """End every open watch (cleanly, as a server going away does) and stop listening."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            while not self._task.done():  # a watch may start on a kept-alive connection meanwhile
                for queue in list(self._watchers):
                    queue.put_nowait(None)
                await asyncio.wait([self._task], timeout=0.05)
            await self._task
        self._server = self._task = None

    @property
    def open_watches(self) -> int:
        return len(self._watchers)


__all__ = ["NS", "FakeKube", "Recorded", "Workload"]
