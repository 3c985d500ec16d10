"""Reading pod objects: readiness, termination, paths and label selectors.

A pod is *ready* when its `Ready` condition is `"True"` and it has no `deletionTimestamp` (a
terminating pod keeps Ready for a moment but is on its way out). A label selector is the
equality form `k=v,k2=v2` of a `matchLabels` map (sorted, so the same map gives the same string).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# the cheapest a pod can be: the ReplicaSet controller removes it first on a scale-down
LOWEST_DELETION_COST = -(2**31)


def pods_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods"


def pod_terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The Ready condition is True and the pod is not terminating."""
    if pod_terminating(pod):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def match_labels_selector(match_labels: Mapping[str, str]) -> str:
    """`{"app": "vllm"}` -> `app=vllm` (the labelSelector query parameter)."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def deletion_cost_patch(cost: int | None) -> dict[str, Any]:
    """The merge patch that sets a pod's deletion cost (a string), or removes it (None)."""
    value = None if cost is None else str(cost)
    return {"metadata": {"annotations": {DELETION_COST: value}}}


__all__ = [
    "DELETION_COST",
    "LOWEST_DELETION_COST",
    "deletion_cost_patch",
    "match_labels_selector",
    "pod_ready",
    "pod_terminating",
    "pods_path",
]
