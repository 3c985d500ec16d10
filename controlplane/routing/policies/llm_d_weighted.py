"""llm_d_weighted: llm-d's default endpoint picker (weighted scorers + max-score picker).

Reimplemented from its documented algorithm and default configuration:

    total(e) = 2 * queue(e) + 2 * kv_util(e) + 3 * prefix(e)      each score clamped to [0, 1]
    queue(e)   = (max_q - q_e) / (max_q - min_q), 1 when all equal   q = scraped waiting requests
    kv_util(e) = 1 - scraped KV usage
    prefix(e)  = matched_blocks(e) / total_blocks                     approximate index

The approximate prefix index is llm-d's `approx-prefix-cache-producer`: the router's own routing
decisions, at most 256 blocks hashed per request, one LRU per endpoint holding at most that
endpoint's `num_gpu_blocks` hashes; the chosen endpoint is recorded after the decision. A lookup
walks the request's blocks and stops at the first block no endpoint holds. The max-score picker
breaks ties at random (here: by request hash). Scores use only scraped metrics, so they are as
stale as the last scrape.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from itertools import takewhile
from typing import ClassVar

from controlplane.routing.interfaces import PolicyBase
from controlplane.routing.policies.common import pick_tied, usable_hit_blocks
from controlplane.types import Decision, DecisionReason, FleetSnapshot, PrefixMatch, RoutingRequest

MAX_HASHED_BLOCKS = 256


class LlmDWeighted(PolicyBase):
    name: ClassVar[str] = "llm_d_weighted"

    def __init__(
        self, *, queue_weight: float = 2.0, kv_weight: float = 2.0, prefix_weight: float = 3.0
    ) -> None:
        self.weights = (queue_weight, kv_weight, prefix_weight)
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def choose(
        self, request: RoutingRequest, snapshot: FleetSnapshot, matches: Mapping[str, PrefixMatch]
    ) -> Decision:
        ready = snapshot.routable()
        if not ready:
            return Decision.none_healthy()
        hashes = request.block_hashes[:MAX_HASHED_BLOCKS]
        # the walk stops at the first block no endpoint holds, so each endpoint's match is its
        # own leading run of held blocks (the longest run is where the walk stops)
        matched: dict[str, int] = {}
        for r in ready:
            held = self._lru.get(r.replica_id)
            matched[r.replica_id] = len(list(takewhile(held.__contains__, hashes))) if held else 0
        queues = {r.replica_id: float(r.metrics.waiting) for r in ready}
        qmin, qmax = min(queues.values()), max(queues.values())
        wq, wk, wp = self.weights
        totals: dict[str, float] = {}
        for r in ready:
            rid = r.replica_id
            queue = 1.0 if qmax == qmin else (qmax - queues[rid]) / (qmax - qmin)
            kv = min(1.0, max(0.0, 1.0 - r.metrics.kv_usage))
            prefix = matched[rid] / len(hashes) if hashes else 0.0
            totals[rid] = wq * queue + wk * kv + wp * prefix
        best = max(totals.values())
        chosen = pick_tied(request, [rid for rid, t in totals.items() if t >= best - 1e-12])
        ranked = (chosen, *sorted((r for r in totals if r != chosen), key=lambda r: -totals[r]))
        hit = usable_hit_blocks(request, matched[chosen], request.block_size)
        return Decision(chosen, DecisionReason.WEIGHTED_SCORE, ranked, totals, hit)

    def on_routed(
        self, request: RoutingRequest, decision: Decision, snapshot: FleetSnapshot
    ) -> None:
        rid = decision.replica_id
        if rid is None:
            return
        for r in snapshot.replicas:
            self._capacity[r.replica_id] = r.profile.num_gpu_blocks
        lru = self._lru.setdefault(rid, OrderedDict())
        hashes = request.block_hashes[:MAX_HASHED_BLOCKS]
        # add the new ones, then move every one to the end in order (the most recent last)
        lru.update(dict.fromkeys(hashes))
        deque(map(lru.move_to_end, hashes), maxlen=0)
        capacity = self._capacity.get(rid, 1 << 30)
        while len(lru) > capacity:
            lru.popitem(last=False)
