"""Pod objects read as fleet members and readiness (table-driven), and the watch stream's
error events, over httpx's mock transport."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from controlplane.errors import KubernetesApiError, ResourceGoneError
from controlplane.kube.api import KubeClient, KubeConnection
from controlplane.kube.pods import match_labels_selector, pod_ready
from router.fleet.discovery.kubernetes import KubernetesDiscoveryConfig, pod_member
from router.fleet.membership import Member

CFG = KubernetesDiscoveryConfig(
    api_url="http://api", label_selector="app=vllm", model_key="model", gpu_key="gpu"
)


def pod(
    *, ip: str | None = "10.0.0.1", ready: str = "True", ports: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": "p", "labels": labels or {}, "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    containers = [{"name": "c", "ports": ports if ports is not None else []}]
    return {"metadata": meta, "spec": {"containers": containers}, "status": status}


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (pod(), Member("p", "http://10.0.0.1:8000", True, labels={})),
        (pod(ip=None), None),
        (pod(ready="False"), Member("p", "http://10.0.0.1:8000", False, labels={})),
        (pod(deleting=True), Member("p", "http://10.0.0.1:8000", False, labels={})),
        (pod(ports=[{"name": "metrics", "containerPort": 9000},
                    {"name": "http", "containerPort": 8080}]),
         Member("p", "http://10.0.0.1:8080", True, labels={})),
        (pod(ip="fd00::1"), Member("p", "http://[fd00::1]:8000", True, labels={})),
        # model from a label, gpu from an annotation; a label wins over an annotation
        (pod(labels={"model": "llama", "app": "vllm"},
             annotations={"gpu": "h100", "model": "other"}),
         Member("p", "http://10.0.0.1:8000", True, "llama", "h100",
                {"model": "llama", "app": "vllm"})),
    ],
)  # fmt: skip
def test_pod_member(obj: dict[str, Any], expected: Member | None) -> None:
    assert pod_member(obj, CFG) == expected


def test_no_port_is_no_member() -> None:
    cfg = CFG.model_copy(update={"port": None})
    assert pod_member(pod(), cfg) is None


@pytest.mark.parametrize(
    ("conditions", "ready"),
    [([], False), ([{"type": "Ready", "status": "True"}], True),
     ([{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "Unknown"}], False)],
)  # fmt: skip
def test_pod_ready(conditions: list[dict[str, str]], ready: bool) -> None:
    assert pod_ready({"status": {"conditions": conditions}}) is ready


def test_selector_is_sorted() -> None:
    assert match_labels_selector({"b": "2", "a": "1"}) == "a=1,b=2"


def stream_client(lines: list[dict[str, Any]], status: int = 200) -> KubeClient:
    body = "".join(json.dumps(x) + "\n" for x in lines).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    client = httpx.AsyncClient(transport=transport, base_url="http://api")
    return KubeClient(KubeConnection(api_url="http://api"), client=client)


async def collect(api: KubeClient) -> list[dict[str, Any]]:
    try:
        return [e async for e in api.watch("/pods", {}, read_timeout_s=5)]
    finally:
        await api.aclose()


async def test_watch_yields_events_until_a_410_error_event() -> None:
    added = {"type": "ADDED", "object": {"metadata": {"name": "p"}}}
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
    api = stream_client([added, gone])
    seen: list[dict[str, Any]] = []
    with pytest.raises(ResourceGoneError, match="too old"):
        async for event in api.watch("/pods", {}, read_timeout_s=5):
            seen.append(event)
    await api.aclose()
    assert seen == [added]


@pytest.mark.parametrize(
    ("lines", "status", "error", "code"),
    [
        ([{"kind": "Status", "code": 403, "message": "forbidden"}], 403, KubernetesApiError, 403),
        ([{"kind": "Status", "code": 410, "message": "gone"}], 410, ResourceGoneError, 410),
        ([{"type": "ERROR", "object": {"code": 500, "message": "etcd"}}], 200,
         KubernetesApiError, 500),
    ],
)  # fmt: skip
async def test_watch_errors(
    lines: list[dict[str, Any]], status: int, error: type[Exception], code: int
) -> None:
    with pytest.raises(error) as raised:
        await collect(stream_client(lines, status))
    assert isinstance(raised.value, KubernetesApiError) and raised.value.status == code
