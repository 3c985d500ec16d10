"""prefix_affinity: send a request where its prefix is cached, unless that replica is overloaded.

Algorithm, per request:
1. For each ready replica take its prefix match (confirmed or speculative blocks), capped at what
   vLLM can reuse, (N - 1) // B blocks.
2. If no replica holds at least `min_match_blocks`: a *miss*. Go to the least-loaded replica
   (outstanding tokens, controlplane.routing.load), never "the first replica" or "the smallest
tree". 3. Otherwise the *preferred* replica is the one with the longest match; among equally long
   matches, the least loaded.
4. Load gate, judged per request against the preferred replica (not fleet-wide): override to the
   least-loaded replica when

       load(preferred) - load(least) > max(imbalance_abs_tokens, credit_factor * saved_tokens)

   where saved_tokens = matched blocks * B is the prefill the cache would save. A long match is
   worth waiting for; a one-block match is not worth a queue.

Parameters (defaults): `min_match_blocks` 1, `imbalance_abs_tokens` 16384 (about two saturated
steps of an 8B model on an H100), `credit_factor` 2.0. O(R) per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from controlplane.errors import ConfigError
from controlplane.routing.interfaces import PolicyBase
from controlplane.routing.load import outstanding_tokens
from controlplane.routing.policies.common import pick_tied, rank_by, usable_hit_blocks
from controlplane.types import Decision, DecisionReason, FleetSnapshot, PrefixMatch, RoutingRequest


class PrefixAffinity(PolicyBase):
    name: ClassVar[str] = "prefix_affinity"

    def __init__(
        self,
        *,
        min_match_blocks: int = 1,
        imbalance_abs_tokens: float = 16384.0,
        credit_factor: float = 2.0,
    ) -> None:
        if min_match_blocks < 1:
            raise ConfigError("prefix_affinity needs min_match_blocks >= 1")
        self.min_match_blocks = min_match_blocks
        self.imbalance_abs_tokens = imbalance_abs_tokens
        self.credit_factor = credit_factor

    def choose(
        self, request: RoutingRequest, snapshot: FleetSnapshot, matches: Mapping[str, PrefixMatch]
    ) -> Decision:
        ready = snapshot.routable()
        if not ready:
            return Decision.none_healthy()
        least, ranked, loads = rank_by(request, ready, outstanding_tokens)
        hits = {
            r.replica_id: usable_hit_blocks(
                request, matches[r.replica_id].matched_blocks, r.block_size
            )
            for r in ready
            if r.replica_id in matches
        }
        best = max(hits.values(), default=0)
        if best < self.min_match_blocks:
            return Decision(
                replica_id=least,
                reason=DecisionReason.MISS_LEAST_LOADED,
                ranked=ranked,
                scores=loads,
            )
        longest = [rid for rid, h in hits.items() if h == best]
        low = min(loads[rid] for rid in longest)
        preferred = pick_tied(request, [rid for rid in longest if loads[rid] <= low + 1e-9])
        block_size = next(r.block_size for r in ready if r.replica_id == preferred)
        saved_tokens = best * block_size
        gap = loads[preferred] - loads[least]
        if gap > max(self.imbalance_abs_tokens, self.credit_factor * saved_tokens):
            return Decision(
                replica_id=least,
                reason=DecisionReason.LOAD_OVERRIDE,
                ranked=ranked,
                scores=loads,
                expected_hit_blocks=hits.get(least, 0),
            )
        order = (preferred, *(rid for rid in ranked if rid != preferred))
        return Decision(
            replica_id=preferred,
            reason=DecisionReason.PREFIX_HIT,
            ranked=order,
            scores=loads,
            expected_hit_blocks=best,
        )
