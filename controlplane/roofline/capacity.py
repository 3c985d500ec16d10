"""How many sequences a replica can usefully run at once, and what a token costs.

Three ceilings bound decode concurrency; the lowest one binds:

1. `max_num_seqs`: the scheduler never runs more sequences.
2. KV capacity: `kv_tokens / mean_context` sequences fit in the paged KV cache.
3. Compute ridge: the batch at which a decode step turns compute-bound. Below it, adding a
   sequence costs only its KV reads; above it, every sequence slows all others. Solving
   `mem(n) = comp(n)` for n sequences of context c:

       n* = mem_base / (comp_per_seq(c) - mem_per_seq(c))

   When KV reads grow faster than compute (long contexts), decode never turns compute-bound and
   this ceiling is infinite.

Per-token costs: a prefill token costs its compute (prefill is compute-bound beyond the knee); a
decode token costs the step time divided by the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from controlplane.roofline.profile import EngineProfile
from controlplane.roofline.step import StepCostModel


class CeilingKind(StrEnum):
    MAX_NUM_SEQS = "max_num_seqs"
    KV_CAPACITY = "kv_capacity"
    COMPUTE_RIDGE = "compute_ridge"


@dataclass(frozen=True, slots=True)
class Ceiling:
    kind: CeilingKind
    sequences: float


@dataclass(frozen=True, slots=True)
class Ceilings:
    """All three ceilings and the binding (lowest) one."""

    max_num_seqs: Ceiling
    kv_capacity: Ceiling
    compute_ridge: Ceiling

    @property
    def binding(self) -> Ceiling:
        return min(
            (self.max_num_seqs, self.kv_capacity, self.compute_ridge), key=lambda c: c.sequences
        )

    @property
    def sequences(self) -> int:
        value = self.binding.sequences
        return int(value) if math.isfinite(value) else 2**31


def compute_ridge_batch(prof: EngineProfile, context: float) -> float:
    """Decode batch at which a step turns compute-bound, for sequences of `context` tokens."""
    cost = StepCostModel.from_profile(prof)
    reads = context + 1
    comp_per_seq = cost.comp_per_token_s + cost.comp_per_sample_s + cost.comp_per_pair_s * reads
    mem_per_seq = cost.mem_per_kv_token_s * reads
    if comp_per_seq <= mem_per_seq:
        return math.inf
    return cost.mem_base_s / (comp_per_seq - mem_per_seq)


def concurrency_ceilings(prof: EngineProfile, mean_context: float) -> Ceilings:
    """The three ceilings for sequences whose context averages `mean_context` tokens."""
    kv = prof.num_gpu_blocks * prof.resolved_block_size / max(1.0, mean_context)
    return Ceilings(
        max_num_seqs=Ceiling(CeilingKind.MAX_NUM_SEQS, float(prof.resolved_max_num_seqs)),
        kv_capacity=Ceiling(CeilingKind.KV_CAPACITY, kv),
        compute_ridge=Ceiling(CeilingKind.COMPUTE_RIDGE, compute_ridge_batch(prof, mean_context)),
    )


def prefill_seconds_per_token(prof: EngineProfile, context: float = 0.0) -> float:
    """Marginal compute time of one prefill token attending to `context` earlier tokens."""
    cost = StepCostModel.from_profile(prof)
    return (cost.comp_per_token_s + cost.comp_per_pair_s * (context + 1)) * cost.other_factor


def decode_seconds_per_token(prof: EngineProfile, batch: int, context: float) -> float:
    """Step time of `batch` decodes at `context` tokens each, divided by the batch."""
    cost = StepCostModel.from_profile(prof)
    return cost.decode_step_time(batch, batch * context) / max(1, batch)


def decode_throughput(prof: EngineProfile, batch: int, context: float) -> float:
    """Output tokens per second of a replica running `batch` decodes at `context` tokens."""
    cost = StepCostModel.from_profile(prof)
    return batch / cost.decode_step_time(batch, batch * context)
