"""predicted_finish: the replica where this request is predicted to finish first.

Cache credit and load are different units (blocks vs queued tokens) in every other policy; here
both become seconds through the replica's roofline (controlplane.roofline), so no threshold has to
trade one against the other.

For each ready replica, from router.load's estimate (D sequences decoding over K context tokens,
Q uncached prompt tokens queued ahead) and this request (N prompt tokens, h usable cached blocks of
B tokens, predicted output O):

    U        = N - h * B                                   uncached prompt tokens
    P        = max(1, budget - D)                          prefill tokens per step beside decodes
    steps    = ceil((Q + U) / P), chunk = (Q + U) / steps  chunked prefill until our first token
    t_mix    = step_time(D + chunk tokens, reads K + D + chunk, pairs K + chunk * (h*B + chunk/2))
    TTFT     = steps * t_mix
    TPOT     = decode_step_time(D + 1 sequences, K + N context)
    finish   = ttft_weight * TTFT + (O - 1) * TPOT

and the minimum wins (ties by request hash). `budget` is the replica's max_num_batched_tokens.
When the KV cache cannot hold the request's uncached tokens, the request also waits for running
sequences to finish: `kv_wait = deficit / K * D_mean_remaining * TPOT`, a first-order estimate of
how long the decoders take to release that many tokens. O(R) per request.

Parameters: `ttft_weight` (default 1.0; raise it to favour time-to-first-token over completion).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

from controlplane.roofline.profile import EngineProfile
from controlplane.roofline.step import StepCostModel
from controlplane.types import (
    Decision,
    DecisionReason,
    FleetSnapshot,
    PrefixMatch,
    ReplicaState,
    RoutingRequest,
)
from router.interfaces import PolicyBase
from router.load import estimate
from router.policies.common import rank_by, usable_hit_blocks

_COSTS: dict[EngineProfile, StepCostModel] = {}


def cost_model(profile: EngineProfile) -> StepCostModel:
    cost = _COSTS.get(profile)
    if cost is None:
        cost = _COSTS[profile] = StepCostModel.from_profile(profile)
    return cost


def predict_ttft_tpot(
    request: RoutingRequest, replica: ReplicaState, matched_blocks: int
) -> tuple[float, float]:
    """Predicted (TTFT, TPOT) of `request` on `replica`, in seconds."""
    prof = replica.profile
    cost = cost_model(prof)
    est = estimate(replica)
    bs = replica.block_size
    hit_tokens = usable_hit_blocks(request, matched_blocks, bs) * bs
    uncached = request.prompt_tokens - hit_tokens
    decodes = est.decoding
    context = est.context_tokens
    per_step = max(1.0, prof.resolved_max_num_batched_tokens - decodes)
    total = est.prefill_tokens + uncached
    steps = max(1, math.ceil(total / per_step))
    chunk = total / steps
    t_mix = cost.step_time(
        decodes + chunk,
        context + decodes + chunk,
        context + chunk * (hit_tokens + chunk / 2),
        decodes + 1,
    )
    ttft = steps * t_mix
    tpot = cost.decode_step_time(int(decodes) + 1, context + request.prompt_tokens)
    capacity = replica.kv_capacity_tokens
    free = capacity - context
    deficit = uncached + request.predicted_output_tokens - free
    if deficit > 0 and decodes > 0:
        mean_remaining = est.decode_tokens / max(1.0, est.requests)
        ttft += min(1.0, deficit / max(1.0, context)) * mean_remaining * tpot
    return ttft, tpot


class PredictedFinish(PolicyBase):
    name: ClassVar[str] = "predicted_finish"

    def __init__(self, *, ttft_weight: float = 1.0) -> None:
        self.ttft_weight = ttft_weight

    def choose(
        self, request: RoutingRequest, snapshot: FleetSnapshot, matches: Mapping[str, PrefixMatch]
    ) -> Decision:
        ready = snapshot.routable()
        if not ready:
            return Decision.none_healthy()
        out = max(1, request.predicted_output_tokens)

        def finish(r: ReplicaState) -> float:
            m = matches.get(r.replica_id)
            ttft, tpot = predict_ttft_tpot(request, r, m.matched_blocks if m else 0)
            return self.ttft_weight * ttft + (out - 1) * tpot

        chosen, ranked, scores = rank_by(request, ready, finish)
        m = matches.get(chosen)
        block_size = next(r.block_size for r in ready if r.replica_id == chosen)
        return Decision(
            replica_id=chosen,
            reason=DecisionReason.PREDICTED_FINISH,
            ranked=ranked,
            scores=scores,
            expected_hit_blocks=usable_hit_blocks(request, m.matched_blocks, block_size)
            if m
            else 0,
        )
