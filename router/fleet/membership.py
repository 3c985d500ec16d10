"""Fleet membership as its sources see it: the contract between discovery and the registry.

A *source* (the static configuration, the admin API, a headless service's DNS records, the
Kubernetes API, later Ray Serve) reports its whole current view as one call:

    await sink.set_members("k8s", [Member("vllm-0", "http://10.0.3.7:8000", ready=True), ...])

Each call replaces what that source said before (level-triggered, like a Kubernetes list): a
member the source no longer reports is gone *from that source*; the registry decides what that
means for the replica's lifecycle (it drains, then leaves). Sources never talk to each other and
never probe replicas: `ready` is the source's own view (a pod's Ready condition); the router
still probes and scrapes before it routes.

Every member's id and URL pass the replica guard (`router.fleet.urls`) in the registry, whatever
the source, so a source may report what it sees without judging it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Member:
    """One replica as a source reports it."""

    replica_id: str
    url: str
    # the source's readiness (Kubernetes: the pod's Ready condition; static/DNS/admin: True)
    ready: bool = True
    # the model group, when the source knows it (a label); else the replica says (/v1/models)
    model: str | None = None
    # the GPU kind of the replica's group (a label, annotation or setting), for the roofline
    gpu: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    # the router's other per-replica settings (`ReplicaConfig`: tp, block_size, kv_events, ...),
    # when the source has them (the static configuration, the admin API); JSON values
    options: Mapping[str, object] = field(default_factory=dict)


class MembershipSink(Protocol):
    """Where a source reports (the fleet registry)."""

    async def set_members(self, source: str, members: Sequence[Member]) -> None:
        """Replace everything `source` reported before with `members`."""
        ...
