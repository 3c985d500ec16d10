"""Priority classes: how much of a replica's KV the batch class may hold.

Interactive requests are always dispatched before batch ones (`vtc.pick`), but a batch sequence
that is already running slows every interactive token on its replica: each decode step reads the
whole KV of every running sequence, and each batch request's prompt is computed inside some
step. So the batch class may hold at most a share `s` of each replica's KV (prompt + expected
output, reserved at dispatch), sized from the interactive TPOT target with the roofline. With
n_i interactive sequences of c_i tokens (o_i output tokens each) and K_b tokens of batch KV in
n_b = K_b / (p_b + o_b / 2) sequences of p_b prompt and o_b output tokens:

    decode(K_b)  = step_time(n_i + n_b decodes reading n_i (c_i + 1) + K_b + n_b KV tokens)
    prefills     a batch sequence is replaced every o_b steps, so r = n_b / o_b batch prompts
                 land per step; one costs the step delta = step_time(... + p_b prompt tokens)
                 - decode(K_b); over its o_i tokens an interactive request meets m = r o_i of
                 them (Poisson), m + z sqrt(m) at its p99 (z = 2.33)
    tpot99(K_b)  = decode(K_b) + (m + z sqrt(m)) delta / o_i
    s            = max K_b / kv_capacity  such that  tpot99(K_b) <= tpot_target
                   (bisection: tpot99 increases with K_b)

`interactive_tpot` is the same estimate with no batch (K_b = 0): the reference a slowdown
target (`target = 1.2 * interactive_tpot(...)`) is taken from. The live router and the simulator
both call `batch_kv_share`; 1.0 means no cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controlplane.roofline.profile import EngineProfile
from controlplane.roofline.step import StepCostModel

P99_Z = 2.33


@dataclass(frozen=True, slots=True)
class ClassLoad:
    """The load a batch share is sized for, per replica."""

    interactive_sequences: float
    interactive_context: float
    interactive_output: float = 250.0
    batch_prompt: float = 1000.0
    batch_output: float = 500.0


def tpot_with_batch(prof: EngineProfile, batch_kv_tokens: float, load: ClassLoad) -> float:
    """Interactive TPOT p99 estimate with `batch_kv_tokens` of batch KV on the replica."""
    cost = StepCostModel.from_profile(prof)
    p_b, o_b = load.batch_prompt, max(1.0, load.batch_output)
    n_b = batch_kv_tokens / max(1.0, p_b + o_b / 2)
    n_i, c_i = load.interactive_sequences, load.interactive_context
    n = max(1.0, n_i + n_b)
    reads = n_i * (c_i + 1) + batch_kv_tokens + n_b
    decode = cost.step_time(n, reads, reads, n)
    with_prefill = cost.step_time(n + p_b, reads + p_b, reads + p_b * (p_b + 1) / 2, n)
    o_i = max(1.0, load.interactive_output)
    met = n_b / o_b * o_i
    return decode + (met + P99_Z * math.sqrt(met)) * (with_prefill - decode) / o_i


def interactive_tpot(prof: EngineProfile, load: ClassLoad) -> float:
    """The same estimate for the interactive load alone."""
    return tpot_with_batch(prof, 0.0, load)


def batch_kv_share(prof: EngineProfile, tpot_target_s: float, load: ClassLoad) -> float:
    """Largest share of a replica's KV the batch class may hold so the interactive TPOT p99
    stays within `tpot_target_s` (see the module docstring); 0 when the interactive load alone
    misses the target, 1 when the whole free KV is fine."""
    capacity = float(prof.kv_capacity_tokens)
    free = max(0.0, capacity - load.interactive_sequences * load.interactive_context)
    if tpot_with_batch(prof, 0.0, load) > tpot_target_s:
        return 0.0
    if tpot_with_batch(prof, free, load) <= tpot_target_s:
        return 1.0
    lo, hi = 0.0, free
    for _ in range(60):
        mid = (lo + hi) / 2
        if tpot_with_batch(prof, mid, load) <= tpot_target_s:
            lo = mid
        else:
            hi = mid
    return lo / capacity


__all__ = ["P99_Z", "ClassLoad", "batch_kv_share", "interactive_tpot", "tpot_with_batch"]
