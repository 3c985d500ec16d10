"""sglang_cache_aware: SGLang's gateway / vllm-router `cache_aware` policy, as a baseline.

Reimplemented from its documented algorithm (no code copied), with the CLI defaults:

- State: an approximate prefix tree per worker built from the router's *own* decisions (it never
  sees evictions), and per-worker in-flight request counts (+1 at dispatch, -1 at completion).
  The original matches raw request characters; here the tree holds the request's block hashes,
  the same information at block granularity.
- Imbalanced (judged fleet-wide) iff `max_load - min_load > balance_abs_threshold` and
  `max_load > balance_rel_threshold * min_load`: route to the least-loaded worker.
- Balanced: the worker with the longest prefix match; if `matched / total > cache_threshold`
  take it, otherwise take the worker with the *smallest tree* (most free cache).
- The chosen worker's tree receives the request's blocks either way; every `eviction_interval_s`
  each tree is trimmed to its `max_tree_blocks` most recently used blocks.

Defaults: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5,
eviction_interval_s 120, max tree 2^26 characters (about 2^26 / 4 tokens; in blocks of 16: 2^20).
Known weaknesses it keeps on purpose: the fleet-wide gate, and the smallest-tree fallback that
ignores compute load.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import takewhile
from typing import ClassVar

from controlplane.routing.interfaces import PolicyBase
from controlplane.routing.policies.common import pick_tied, usable_hit_blocks
from controlplane.types import Decision, DecisionReason, FleetSnapshot, PrefixMatch, RoutingRequest


class SglangCacheAware(PolicyBase):
    name: ClassVar[str] = "sglang_cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_blocks: int = 2**20,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_blocks = max_tree_blocks
        self._trees: dict[str, dict[int, float]] = {}
        self._inflight: dict[str, int] = {}
        self._routed: dict[str, str] = {}  # request id -> worker
        self._last_eviction_s = 0.0

    def choose(
        self, request: RoutingRequest, snapshot: FleetSnapshot, matches: Mapping[str, PrefixMatch]
    ) -> Decision:
        ready = [r.replica_id for r in snapshot.replicas if r.routable]
        if not ready:
            return Decision.none_healthy()
        loads = {rid: float(self._inflight.get(rid, 0)) for rid in ready}
        low, high = min(loads.values()), max(loads.values())
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            chosen = pick_tied(request, [rid for rid in ready if loads[rid] == low])
            return self._decision(chosen, DecisionReason.IMBALANCED, ready, loads)
        hashes = request.block_hashes
        trees = self._trees
        matched = {  # leading blocks in the tree (the list is built at C speed)
            rid: len(list(takewhile(trees[rid].__contains__, hashes))) if rid in trees else 0
            for rid in ready
        }
        best = max(matched.values())
        rate = best / len(hashes) if hashes else 0.0
        if best and rate > self.cache_threshold:
            chosen = pick_tied(request, [rid for rid in ready if matched[rid] == best])
            hit = usable_hit_blocks(request, best, request.block_size)
            return self._decision(chosen, DecisionReason.CACHE_MATCH, ready, loads, hit)
        sizes = {rid: len(self._trees.get(rid, {})) for rid in ready}
        smallest = min(sizes.values())
        chosen = pick_tied(request, [rid for rid in ready if sizes[rid] == smallest])
        hit = usable_hit_blocks(request, matched[chosen], request.block_size)
        return self._decision(chosen, DecisionReason.SMALLEST_TREE, ready, loads, hit)

    def _decision(
        self,
        chosen: str,
        reason: DecisionReason,
        ready: list[str],
        loads: dict[str, float],
        hit_blocks: int = 0,
    ) -> Decision:
        ranked = (chosen, *sorted((r for r in ready if r != chosen), key=lambda r: loads[r]))
        return Decision(chosen, reason, ranked, dict(loads), hit_blocks)

    def on_routed(
        self, request: RoutingRequest, decision: Decision, snapshot: FleetSnapshot
    ) -> None:
        rid = decision.replica_id
        if rid is None:
            return
        now = request.arrival_s
        self._routed[request.request_id] = rid
        self._inflight[rid] = self._inflight.get(rid, 0) + 1
        self._trees.setdefault(rid, {}).update(dict.fromkeys(request.block_hashes, now))
        if now - self._last_eviction_s >= self.eviction_interval_s:
            self._last_eviction_s = now
            for tree in self._trees.values():
                excess = len(tree) - self.max_tree_blocks
                if excess > 0:
                    for h, _ in sorted(tree.items(), key=lambda kv: kv[1])[:excess]:
                        del tree[h]

    def on_finished(self, request: RoutingRequest, replica_id: str) -> None:
        rid = self._routed.pop(request.request_id, None)
        if rid is not None:
            self._inflight[rid] -= 1
