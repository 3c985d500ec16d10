"""Which replicas a scale-down removes, and the contract of whoever drains them.

A StatefulSet always removes its highest ordinals, so its victims are fixed: `{name}-{n}` for
`n` in `[target, current)`, highest first (reason TOP_ORDINAL). A Deployment removes the pods its
ReplicaSet ranks cheapest (lowest `controller.kubernetes.io/pod-deletion-cost` first), so the
autoscaler picks them and marks them. Candidates are the pods not already terminating, ranked:

    1. not Ready                          (NOT_READY: serves nothing, loses nothing)
    2. unknown to the router's registry   (UNKNOWN_TO_ROUTER: nothing routed there)
    3. least in-flight requests, then least cached KV blocks, then name   (LEAST_WORK)

and the first `current - target` are the victims. A `Drainer` (the fleet registry, in the router
process) supplies the load (`victim_info`), stops routing new work to the victims (`drain`) and
says when their in-flight requests are done (`wait_drained`, bounded by a timeout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class VictimReason(StrEnum):
    """Why a replica was chosen to go (metric label)."""

    TOP_ORDINAL = "top_ordinal"
    NOT_READY = "not_ready"
    UNKNOWN_TO_ROUTER = "unknown_to_router"
    LEAST_WORK = "least_work"


@dataclass(frozen=True, slots=True)
class VictimInfo:
    """The work a replica would lose: requests in flight and KV blocks cached."""

    replica_id: str
    in_flight: int
    cached_blocks: int


@dataclass(frozen=True, slots=True)
class PodState:
    """A pod of the scaled Deployment as the API reports it."""

    name: str
    ready: bool
    terminating: bool = False


@dataclass(frozen=True, slots=True)
class Victim:
    name: str
    reason: VictimReason


class Drainer(Protocol):
    """Who knows the replicas' work and can drain them (the fleet registry; ids = pod names)."""

    async def victim_info(self, ids: Sequence[str]) -> Mapping[str, VictimInfo]:
        """The load of each of `ids` the drainer knows (unknown ids are left out)."""
        ...

    async def drain(self, ids: Sequence[str]) -> None:
        """Route no new requests to `ids`."""
        ...

    async def wait_drained(self, ids: Sequence[str], timeout: float) -> bool:
        """Wait until `ids` have no request in flight; False when `timeout` ran out first."""
        ...


class NoDrainer:
    """No registry to ask: no load known, nothing to drain."""

    async def victim_info(self, ids: Sequence[str]) -> Mapping[str, VictimInfo]:
        return {}

    async def drain(self, ids: Sequence[str]) -> None:
        return None

    async def wait_drained(self, ids: Sequence[str], timeout: float) -> bool:
        return True


def statefulset_victims(name: str, current: int, target: int) -> tuple[Victim, ...]:
    """The ordinals a StatefulSet going from `current` to `target` removes, highest first."""
    return tuple(
        Victim(f"{name}-{n}", VictimReason.TOP_ORDINAL) for n in range(current - 1, target - 1, -1)
    )


def deployment_victims(
    pods: Sequence[PodState], info: Mapping[str, VictimInfo], count: int
) -> tuple[Victim, ...]:
    """The `count` cheapest pods to remove (fewer when fewer are candidates)."""

    def rank(pod: PodState) -> tuple[int, int, int, str]:
        load = info.get(pod.name)
        if not pod.ready:
            return (0, 0, 0, pod.name)
        if load is None:
            return (1, 0, 0, pod.name)
        return (2, load.in_flight, load.cached_blocks, pod.name)

    chosen = sorted((p for p in pods if not p.terminating), key=rank)[: max(0, count)]
    return tuple(Victim(p.name, _reason(p, info)) for p in chosen)


def _reason(pod: PodState, info: Mapping[str, VictimInfo]) -> VictimReason:
    if not pod.ready:
        return VictimReason.NOT_READY
    if pod.name not in info:
        return VictimReason.UNKNOWN_TO_ROUTER
    return VictimReason.LEAST_WORK


__all__ = [
    "Drainer",
    "NoDrainer",
    "PodState",
    "Victim",
    "VictimInfo",
    "VictimReason",
    "deployment_victims",
    "statefulset_victims",
]
