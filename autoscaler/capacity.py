"""What one replica can serve within the SLO, and how busy it may run.

Work unit: the *replica-second at the SLO*. A replica that serves its requests within the SLO
does at most one replica-second of work per second, so demand in these units divided by the
utilization target is a replica count.

Decode. The goodput-maximising decode batch is the largest batch `b*` whose step time at the
reference context still meets the TPOT SLO, capped by the binding concurrency ceiling
(`max_num_seqs`, KV capacity, compute ridge):

    b* = max { b <= ceiling : decode_step_time(b, b * ctx_ref) <= tpot_slo * decode_share }

`decode_share` (< 1) keeps room in every step for the prefill chunks that chunked prefill
interleaves with decodes. One decode token of a sequence holding `c` tokens then costs
`decode_step_time(b*, b* c) / b*` replica-seconds (`WorkModel.decode` at batch `b*`): a replica
decoding `b*` sequences accrues exactly one replica-second per second.

Prefill. A prompt of `n` new tokens on top of `k` cached ones costs its compute (attention grows
with the context), its tensor-parallel all-reduce traffic, and its share of the per-step fixed
costs when it runs in `max_num_batched_tokens` chunks:

    P(n, k) = WorkModel.prefill(n, k) + n * (ar_per_token + (overhead + ar_fixed) / chunk)

Utilization target (M/G/c prefill queue). With mean prefill service `E[S]`, its squared
coefficient of variation `C2`, and `c` replicas behind one router (least-loaded routing
approximates a central queue), a request waits with probability `P_w = ErlangC(c, c rho)` and,
if it waits, roughly exponentially with mean `m = E[S] (1 + C2) / (2 c (1 - rho))` (Allen-Cunneen's
M/G/c correction of M/M/c), so `p99(W) = m ln(100 P_w)` (0 when `P_w <= 1%`). With `c = 1`,
`P_w = rho` and this is Kingman's M/G/1 tail. The TTFT SLO leaves a waiting budget
`ttft_slo - E[S]`; `rho*` is the largest utilization with `p99(W)` within it, found by
bisection (the left side grows with rho), then capped by `decode_ceiling` (decode needs slack
too) and floored at `min_utilization`. Pooling raises `rho*` with the fleet size; the headroom
policy adds the Poisson granularity (square-root staffing) and the burstiness of arrivals
(its burst factor) on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controlplane.errors import ConfigError
from controlplane.roofline.capacity import concurrency_ceilings
from controlplane.roofline.profile import EngineProfile
from controlplane.roofline.step import StepCostModel
from controlplane.tenancy.work import WorkMode, WorkModel

REFERENCE_CONTEXT = 2048
DECODE_SHARE = 0.8
DECODE_CEILING = 0.9
MIN_UTILIZATION = 0.2


def erlang_c(servers: int, rho: float) -> float:
    """Probability that an arrival waits in M/M/c at utilization `rho` (stable recursion
    through Erlang B)."""
    if rho <= 0:
        return 0.0
    if rho >= 1:
        return 1.0
    a = servers * rho
    b = 1.0
    for k in range(1, servers + 1):
        b = a * b / (k + a * b)
    return b / (1.0 - rho * (1.0 - b))


def p99_wait(mean_s: float, scv: float, rho: float, servers: int = 1) -> float:
    """p99 of the M/G/c waiting time (see the module docstring); c = 1 is Kingman's M/G/1."""
    if rho >= 1.0:
        return math.inf
    c = max(1, servers)
    p_wait = erlang_c(c, rho)
    if p_wait <= 0.01:
        return 0.0
    m = mean_s * (1.0 + scv) / (2.0 * c * (1.0 - rho))
    return m * math.log(100.0 * p_wait)


def kingman_p99_wait(mean_s: float, scv: float, rho: float) -> float:
    """p99 of the M/G/1 waiting time by Kingman's exponential tail (0 when rho <= 1%)."""
    return p99_wait(mean_s, scv, rho, 1)


def max_utilization(mean_s: float, scv: float, wait_budget_s: float, servers: int = 1) -> float:
    """Largest rho with `p99_wait(mean_s, scv, rho, servers) <= wait_budget_s` (bisection)."""
    if wait_budget_s <= 0 or mean_s <= 0:
        return 0.01 if wait_budget_s <= 0 else 0.999
    lo, hi = 0.01, 0.999
    if p99_wait(mean_s, scv, hi, servers) <= wait_budget_s:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if p99_wait(mean_s, scv, mid, servers) <= wait_budget_s:
            lo = mid
        else:
            hi = mid
    return lo


def slo_decode_batch(
    cost: StepCostModel, ceiling: int, tpot_slo_s: float, context: float, share: float
) -> int:
    """The largest decode batch whose step meets `tpot_slo_s * share` (at least 1)."""
    budget = tpot_slo_s * share
    if cost.decode_step_time(1, context) > budget:
        return 1
    lo, hi = 1, max(1, ceiling)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost.decode_step_time(mid, mid * context) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class SloCapacity:
    """Per-request work in replica-seconds at the SLO, and the utilization target."""

    ttft_slo_s: float
    tpot_slo_s: float
    decode_batch: int
    work: WorkModel
    prefill_extra_per_token_s: float
    decode_ceiling: float = DECODE_CEILING
    min_utilization: float = MIN_UTILIZATION

    @classmethod
    def build(
        cls,
        profile: EngineProfile,
        ttft_slo_s: float,
        tpot_slo_s: float,
        *,
        reference_context: int = REFERENCE_CONTEXT,
        decode_share: float = DECODE_SHARE,
    ) -> SloCapacity:
        if ttft_slo_s <= 0 or tpot_slo_s <= 0:
            raise ConfigError("the TTFT and TPOT SLOs must be positive")
        cost = StepCostModel.from_profile(profile)
        ceiling = concurrency_ceilings(profile, reference_context).sequences
        batch = slo_decode_batch(cost, ceiling, tpot_slo_s, reference_context, decode_share)
        chunk = max(1, profile.resolved_max_num_batched_tokens)
        extra = cost.ar_per_token_s + (cost.overhead_s + cost.ar_fixed_s) / chunk
        work = WorkModel(WorkMode.VTC_ROOFLINE, cost, batch)
        return cls(ttft_slo_s, tpot_slo_s, batch, work, extra)

    def prefill_work(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Replica-seconds to prefill a prompt of which `cached_tokens` are prefix-cache hits."""
        cached = max(0, min(cached_tokens, prompt_tokens - 1))
        new = max(0, prompt_tokens - cached)
        return self.work.prefill(new, cached) + new * self.prefill_extra_per_token_s

    def decode_work(self, output_tokens: int, prompt_tokens: int) -> float:
        """Replica-seconds to decode `output_tokens` (the first comes with the prefill)."""
        return self.work.decode(output_tokens - 1, prompt_tokens)

    def request_work(self, prompt_tokens: int, output_tokens: int) -> float:
        return self.prefill_work(prompt_tokens) + self.decode_work(output_tokens, prompt_tokens)

    def utilization_target(
        self, prefill_mean_s: float, prefill_scv: float, replicas: int = 1
    ) -> float:
        """rho*: the busiest `replicas` pooled replicas may run and still meet the TTFT SLO at
        p99 (1 replica: the conservative M/G/1 figure)."""
        if prefill_mean_s <= 0:
            return self.decode_ceiling
        budget = self.ttft_slo_s - prefill_mean_s
        rho = max_utilization(prefill_mean_s, max(0.0, prefill_scv), budget, max(1, replicas))
        return max(self.min_utilization, min(self.decode_ceiling, rho))


__all__ = [
    "SloCapacity",
    "erlang_c",
    "kingman_p99_wait",
    "max_utilization",
    "p99_wait",
    "slo_decode_batch",
]
