"""least_loaded: the replica with the least outstanding work, counted in tokens.

Algorithm: for each ready replica estimate outstanding work = uncached prompt tokens still to
prefill + output tokens still to decode (controlplane.routing.load: this router's exact
reservations plus the scraped metrics for traffic it does not know); pick the minimum. Replicas
tied at the minimum are split by a hash of the request id (a deterministic power-of-two-choices
among equals). O(R).

Tokens, not requests: one 30k-token document is not the same load as one 200-token chat turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from controlplane.routing.interfaces import PolicyBase
from controlplane.routing.load import outstanding_tokens
from controlplane.routing.policies.common import rank_by
from controlplane.types import Decision, DecisionReason, FleetSnapshot, PrefixMatch, RoutingRequest


class LeastLoaded(PolicyBase):
    name: ClassVar[str] = "least_loaded"

    def choose(
        self, request: RoutingRequest, snapshot: FleetSnapshot, matches: Mapping[str, PrefixMatch]
    ) -> Decision:
        ready = snapshot.routable()
        if not ready:
            return Decision.none_healthy()
        chosen, ranked, scores = rank_by(request, ready, outstanding_tokens)
        return Decision(
            replica_id=chosen, reason=DecisionReason.LEAST_LOADED, ranked=ranked, scores=scores
        )
