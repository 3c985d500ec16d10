"""round_robin: each request goes to the next ready replica in id order.

Algorithm: keep the id of the last replica chosen; pick the smallest ready id greater than it,
wrapping around. Replicas that are loading, draining, dead or ejected are skipped, and replicas
joining or leaving never reset the rotation. O(R log R) per request.

The baseline every comparison starts from: it spreads requests evenly and ignores both load and
cache contents, so on shared-prefix traffic it stays at or below a single replica's hit rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from controlplane.routing.interfaces import PolicyBase
from controlplane.types import Decision, DecisionReason, FleetSnapshot, PrefixMatch, RoutingRequest


class RoundRobin(PolicyBase):
    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(
        self, request: RoutingRequest, snapshot: FleetSnapshot, matches: Mapping[str, PrefixMatch]
    ) -> Decision:
        ids = sorted(r.replica_id for r in snapshot.replicas if r.routable)
        if not ids:
            return Decision.none_healthy()
        start = 0
        if self._last is not None:
            start = next((i for i, rid in enumerate(ids) if rid > self._last), 0)
        ranked = tuple(ids[start:] + ids[:start])
        return Decision(replica_id=ranked[0], reason=DecisionReason.ROUND_ROBIN, ranked=ranked)

    def on_routed(
        self, request: RoutingRequest, decision: Decision, snapshot: FleetSnapshot
    ) -> None:
        if decision.replica_id is not None:
            self._last = decision.replica_id
