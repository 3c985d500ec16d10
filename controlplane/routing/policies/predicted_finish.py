"""predicted_finish: the replica where this request is predicted to finish first.

Cache credit and load are different units (blocks vs queued tokens) in every other policy; here
both become seconds through the replica's roofline (controlplane.roofline), so no threshold has to
trade one against the other.

For each ready replica, from controlplane.routing.load's estimate (D sequences decoding over K
context tokens, Q uncached prompt tokens queued ahead) and this request (N prompt tokens, h
usable cached blocks of B tokens, predicted output O):

    U        = N - h * B                                   uncached prompt tokens
    P        = max(1, budget - D)                          prefill tokens per step beside decodes
    steps    = ceil((Q + U) / P), chunk = (Q + U) / steps  chunked prefill until our first token
    pairs    = U * (h*B + U/2) + Q * L/2                   attention: ours, and queued prompts of
                                                           mean length L (this router's ledger)
    t_mix    = step_time(D + chunk tokens, reads K + D + chunk, pairs K + pairs / steps)
    TTFT     = steps * t_mix (+ a KV wait when the cache cannot hold the request, below)
    TPOT     = decode_step_time(D + 1 sequences, K + N context)
    work     = prefill time of the U uncached tokens alone on that replica
    c        = congestion_weight * (1 + q + decode_weight * d)   q, d: fleet means of requests
                                                                 waiting for prefill / decoding
    decode   = (O - 1) * TPOT * min(1, TPOT / tpot_target)
    score    = ttft_weight * TTFT + decode + c * work

and the lowest score wins (ties by request hash). `budget` is max_num_batched_tokens. When the KV
cache cannot hold the request's uncached tokens, it also waits for decoders to finish:
`kv_wait = deficit / K * mean remaining decode tokens * TPOT`.

Why the `work` term. A purely greedy "my own finish" choice sends a request away from the
replica holding its prefix as soon as that replica's queue exceeds the prefill the cache would
save. It then recomputes the prefix elsewhere: every second of that duplicated prefill is a
second the new replica's stream of later requests waits. Charging each request the replica time
it consumes (its own finish plus the GPU seconds it takes from everyone behind it) keeps prefixes
where they are cached under load and still spreads cold requests by queue length. On the
saturated Mooncake replay this moved the policy from the worst TTFT tail of the cache-aware
policies to the best (docs/benchmarks.md).

Why the decode term is scaled by TPOT / tpot_target. Summed over a long answer, a TPOT
difference a streaming reader never notices (9.0 vs 9.4 ms at light load) outweighs the TTFT a
cached history saves, so the plain sum (O - 1) * TPOT moved later turns of conversations off
the replica holding their history and doubled the TTFT tail there. A TPOT far under the SLO
costs no one anything; near it, every step counts. Weighting the decode time by how close the
replica's TPOT is to the target keeps decode balance where it decides goodput (near the target
the full term counts) and lets cache and queue decide below it. Across the routing matrix
(docs/benchmarks.md section 12) this took the cells where the policy is best or within 2% on
TTFT p99 from 25 to 29 of 36 (seeds 0-2, which it was tuned on), with the same goodput cells;
on seeds 3-4, drawn after, it is 17 of 24 on TTFT p99 and 22 of 24 on goodput.

Why the target defaults to 0.3 s, three times the usual 0.1 s TPOT SLO. With 0.1 s the term
still sent questions away from the replica holding their 6,000-token document, to save a few
milliseconds of TPOT far under the SLO (32 replicas at light load: TTFT p99 2.8x
prefix_affinity's, the recomputed documents); 0.2 s fixed that. 0.3 s then kept more later
turns of conversations on their history at light load and the knee, where TPOT is 15-30 ms:
over the full matrix at 8 replicas (300 s), cells best or within 2% on TTFT p99 went from 29 to
31 of 36 on seeds 0-2 (chosen there), 19 to 20 of 24 on seeds 3-4 and 18 to 20 of 24 on seeds
5-6 (drawn after), with the same goodput cells. 0.5 s lost the shared-document cells at light
load, where decode balance is what keeps the tail short (docs/benchmarks.md section 12).

Parameters: `ttft_weight` (default 1.0), `congestion_weight` (default 1.0; 0 = purely greedy),
`decode_weight` (default 0.25), `tpot_target_s` (default 0.3: the TPOT at which the decode term
counts in full; three times the SLO the fleet is run to, as `demand.tpot_slo_s`). O(R) per
request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from controlplane.errors import ConfigError
from controlplane.roofline.profile import EngineProfile
from controlplane.roofline.step import StepCostModel
from controlplane.routing.interfaces import PolicyBase
from controlplane.routing.load import estimate
from controlplane.routing.policies.common import rank_by, usable_hit_blocks
from controlplane.types import (
    Decision,
    DecisionReason,
    FleetSnapshot,
    PrefixMatch,
    ReplicaState,
    RoutingRequest,
)

_COSTS: dict[EngineProfile, StepCostModel] = {}


def cost_model(profile: EngineProfile) -> StepCostModel:
    cost = _COSTS.get(profile)
    if cost is None:
        cost = _COSTS[profile] = StepCostModel.from_profile(profile)
    return cost


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: float
    tpot_s: float
    # replica time this request's uncached prefill takes, alone
    work_s: float


def predict(request: RoutingRequest, replica: ReplicaState, matched_blocks: int) -> Prediction:
    """Predicted TTFT, TPOT and prefill work of `request` on `replica`, in seconds."""
    prof = replica.profile
    cost = cost_model(prof)
    est = estimate(replica)
    bs = replica.block_size
    hit_tokens = usable_hit_blocks(request, matched_blocks, bs) * bs
    uncached = request.prompt_tokens - hit_tokens
    decodes = est.decoding
    context = est.context_tokens
    per_step = max(1.0, prof.resolved_max_num_batched_tokens - decodes)
    queued = est.prefill_tokens
    total = queued + uncached
    steps = max(1, math.ceil(total / per_step))
    chunk = total / steps
    # attention work of the prefills: ours attends to its cached prefix and its own earlier
    # tokens; a queued prompt of mean length L attends to about L / 2 earlier tokens per token
    led = replica.ledger
    waiting = max(1, led.requests - led.decoding)
    mean_prompt = led.pending_prompt_tokens / waiting if led.pending_prompt_tokens else chunk
    pairs = uncached * (hit_tokens + uncached / 2) + queued * mean_prompt / 2
    t_mix = cost.step_time(
        decodes + chunk,
        context + decodes + chunk,
        context + pairs / steps,
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
    per_token = cost.comp_per_token_s + cost.comp_per_pair_s * (hit_tokens + uncached / 2)
    return Prediction(ttft, tpot, uncached * per_token * cost.other_factor)


class PredictedFinish(PolicyBase):
    name: ClassVar[str] = "predicted_finish"

    def __init__(
        self,
        *,
        ttft_weight: float = 1.0,
        congestion_weight: float = 1.0,
        decode_weight: float = 0.25,
        tpot_target_s: float = 0.3,
    ) -> None:
        if not tpot_target_s > 0:
            raise ConfigError("predicted_finish needs tpot_target_s > 0")
        self.tpot_target_s = tpot_target_s
        self.ttft_weight = ttft_weight
        self.congestion_weight = congestion_weight
        self.decode_weight = decode_weight

    def choose(
        self, request: RoutingRequest, snapshot: FleetSnapshot, matches: Mapping[str, PrefixMatch]
    ) -> Decision:
        ready = snapshot.routable()
        if not ready:
            return Decision.none_healthy()
        out = max(1, request.predicted_output_tokens)
        # requests waiting for prefill per replica, fleet-wide: how many a wasted second delays
        ests = [estimate(r) for r in ready]
        queued = sum(max(0.0, e.requests - e.decoding) for e in ests) / len(ready)
        decoding = sum(e.decoding for e in ests) / len(ready)
        congestion = self.congestion_weight * (1.0 + queued + self.decode_weight * decoding)

        def finish(r: ReplicaState) -> float:
            m = matches.get(r.replica_id)
            p = predict(request, r, m.matched_blocks if m else 0)
            decode = (out - 1) * p.tpot_s * min(1.0, p.tpot_s / self.tpot_target_s)
            return self.ttft_weight * p.ttft_s + decode + congestion * p.work_s

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
