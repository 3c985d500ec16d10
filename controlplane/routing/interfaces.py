"""The routing-policy contract.

A policy ranks replicas for one request: `choose(request, snapshot, matches) -> Decision` reads only
its arguments and the policy's own state; it performs no I/O, reads no clock and mutates nothing.
Stateful policies (round-robin's cursor, a peer's approximate prefix tree) update their state in
the `on_routed` / `on_finished` hooks, which the router calls after the decision and when the
request ends. The simulator and the live router call the same objects in the same order:

    matches  = prefix_index.lookup(request.block_hashes, routable ids)      # data producer
    decision = policy.choose(request, snapshot, matches)                    # pure
    policy.on_routed(request, decision, snapshot)                           # policy state
    ledger.reserve(...); prefix_index.speculate(...)                        # router side effects
    policy.on_first_token(request, replica_id)                              # when streaming starts
    policy.on_finished(request, replica_id)                                 # exactly once
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol, runtime_checkable

from controlplane.types import Decision, FleetSnapshot, PrefixMatch, RoutingRequest


@runtime_checkable
class RoutingPolicy(Protocol):
    name: ClassVar[str]

    def choose(
        self,
        request: RoutingRequest,
        snapshot: FleetSnapshot,
        matches: Mapping[str, PrefixMatch],
    ) -> Decision: ...

    def on_routed(
        self, request: RoutingRequest, decision: Decision, snapshot: FleetSnapshot
    ) -> None: ...

    def on_first_token(self, request: RoutingRequest, replica_id: str) -> None: ...

    def on_finished(self, request: RoutingRequest, replica_id: str) -> None: ...


class PolicyBase:
    """No-op hooks for stateless policies."""

    name: ClassVar[str] = "base"

    def on_routed(
        self, request: RoutingRequest, decision: Decision, snapshot: FleetSnapshot
    ) -> None:
        return None

    def on_first_token(self, request: RoutingRequest, replica_id: str) -> None:
        return None

    def on_finished(self, request: RoutingRequest, replica_id: str) -> None:
        return None


def stable_hash(text: str) -> int:
    """A process-independent 64-bit hash for deterministic tie-breaks (FNV-1a)."""
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h
