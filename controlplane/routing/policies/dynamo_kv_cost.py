"""dynamo_kv_cost: NVIDIA Dynamo's KV router cost function, as a baseline.

Reimplemented from its documented algorithm (default settings, temperature 0):

    raw_prefill(w)   = active_prefill_blocks(w) + ceil(isl / B)
    adjusted(w)      = max(raw_prefill(w) - overlap_credit * device_overlap_blocks(w), 0)
    decode(w)        = active_decode_blocks(w) + ceil(isl / B)
    cost(w)          = prefill_load_scale * adjusted(w) + decode(w)

and the lowest cost wins. Overlap comes from KV events only (confirmed blocks; Dynamo's default
mode subscribes to events and writes no speculative entries). Load is this router's own
accounting: a request's prompt blocks count as active prefill from routing to its first token and
as active decode blocks from routing to completion. Ties go to the worker with the smallest cache
(here: the lowest scraped KV usage), then by request hash.

Defaults: overlap_credit 1.0, prefill_load_scale 1.0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from controlplane.routing.interfaces import PolicyBase
from controlplane.routing.policies.common import pick_tied
from controlplane.types import Decision, DecisionReason, FleetSnapshot, PrefixMatch, RoutingRequest


class DynamoKvCost(PolicyBase):
    name: ClassVar[str] = "dynamo_kv_cost"

    def __init__(self, *, overlap_credit: float = 1.0, prefill_load_scale: float = 1.0) -> None:
        self.overlap_credit = overlap_credit
        self.prefill_load_scale = prefill_load_scale
        self._prefill_blocks: dict[str, int] = {}
        self._active_blocks: dict[str, int] = {}
        # request id -> (worker, prompt blocks, still in prefill)
        self._requests: dict[str, tuple[str, int, bool]] = {}

    def choose(
        self, request: RoutingRequest, snapshot: FleetSnapshot, matches: Mapping[str, PrefixMatch]
    ) -> Decision:
        ready = snapshot.routable()
        if not ready:
            return Decision.none_healthy()
        costs: dict[str, float] = {}
        usage: dict[str, float] = {}
        for r in ready:
            rid = r.replica_id
            blocks = -(-request.prompt_tokens // r.block_size)
            m = matches.get(rid)
            overlap = m.confirmed_blocks if m else 0
            raw = self._prefill_blocks.get(rid, 0) + blocks
            adjusted = max(raw - self.overlap_credit * overlap, 0.0)
            decode = self._active_blocks.get(rid, 0) + blocks
            costs[rid] = self.prefill_load_scale * adjusted + decode
            usage[rid] = r.metrics.kv_usage
        best = min(costs.values())
        tied = [rid for rid, c in costs.items() if c <= best + 1e-9]
        least_usage = min(usage[rid] for rid in tied)
        chosen = pick_tied(request, [rid for rid in tied if usage[rid] <= least_usage + 1e-12])
        ranked = (chosen, *sorted((r for r in costs if r != chosen), key=lambda r: costs[r]))
        m = matches.get(chosen)
        return Decision(
            chosen, DecisionReason.KV_COST, ranked, costs, m.confirmed_blocks if m else 0
        )

    def on_routed(
        self, request: RoutingRequest, decision: Decision, snapshot: FleetSnapshot
    ) -> None:
        rid = decision.replica_id
        if rid is None:
            return
        blocks = -(-request.prompt_tokens // request.block_size)
        self._requests[request.request_id] = (rid, blocks, True)
        self._prefill_blocks[rid] = self._prefill_blocks.get(rid, 0) + blocks
        self._active_blocks[rid] = self._active_blocks.get(rid, 0) + blocks

    def on_first_token(self, request: RoutingRequest, replica_id: str) -> None:
        entry = self._requests.get(request.request_id)
        if entry is None or not entry[2]:
            return
        rid, blocks, _ = entry
        self._requests[request.request_id] = (rid, blocks, False)
        self._prefill_blocks[rid] -= blocks

    def on_finished(self, request: RoutingRequest, replica_id: str) -> None:
        entry = self._requests.pop(request.request_id, None)
        if entry is None:
            return
        rid, blocks, in_prefill = entry
        if in_prefill:
            self._prefill_blocks[rid] -= blocks
        self._active_blocks[rid] -= blocks
