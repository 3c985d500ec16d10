"""Time of one vLLM engine step, from a roofline with a smooth knee.

For a step that schedules T tokens (decode sequences contribute 1 each, prefill chunks n_j each),
TP-sharded:

    mem   = (W_read + kv * [sum_decode (ctx_i + 1) + sum_prefill (c_j + n_j)]) / TP / (eta_bw * BW)
    comp  = (2 P_body T + 2 V d S + 4 L d_attn * pairs) / TP / (eta_c * F)
            pairs = sum_decode (ctx_i + 1) + sum_prefill (n_j c_j + n_j (n_j + 1) / 2)
            S     = sequences that sample a token this step
    core  = (mem^p + comp^p)^(1/p)                      # p = 1.5: a smooth roofline
    t     = core * (1 + f_other) + 2 L * AR(TP, T d 2 B) + t_cpu

A hard `max(mem, comp)` misses the knee: vidur's H100 profile reaches only 40% of peak FLOP/s at
256 tokens, where both terms are comparable. The p-norm with p = 1.5 follows the 7-8B profiles
within 15% at every batch size from 1 to 4,096 tokens (see calibration.py), and tends to the hard
roofline away from the knee. `f_other` (norms, rotary, activation, residual adds) is 0.14, the
median ratio of vidur's non-linear to linear time. `t_cpu` is fitted per (model, TP) to vLLM's
nightly latency runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.roofline.profile import EngineProfile

SMOOTH_P = 1.5
OTHER_OPS_FRACTION = 0.14


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Precomputed per-profile coefficients; `step_time` is plain arithmetic."""

    mem_base_s: float
    mem_per_kv_token_s: float
    comp_per_token_s: float
    comp_per_sample_s: float
    comp_per_pair_s: float
    other_factor: float
    ar_fixed_s: float
    ar_per_token_s: float
    overhead_s: float
    p: float = SMOOTH_P

    @classmethod
    def from_profile(cls, prof: EngineProfile) -> StepCostModel:
        g, m, tp = prof.gpu, prof.model, prof.tp
        bw = g.eta_bw * g.bandwidth_bps
        fl = g.eta_compute * g.flops_bf16
        ar_calls = 2 * m.layers if tp > 1 else 0
        ar = g.all_reduce
        key = tp if tp in ar.latency_s else max(ar.latency_s)
        return cls(
            mem_base_s=m.weight_bytes_read_per_step / tp / bw,
            mem_per_kv_token_s=prof.kv_bytes_per_token_per_gpu / bw,
            comp_per_token_s=m.body_flops_per_token / tp / fl,
            comp_per_sample_s=m.lm_head_flops_per_sample / tp / fl,
            comp_per_pair_s=m.attn_flops_per_pair / tp / fl,
            other_factor=1.0 + OTHER_OPS_FRACTION,
            ar_fixed_s=ar_calls * ar.latency_s[key] if tp > 1 else 0.0,
            ar_per_token_s=(
                ar_calls * m.hidden * m.dtype_bytes / ar.bandwidth_bps[key] if tp > 1 else 0.0
            ),
            overhead_s=prof.resolved_step_overhead_s,
        )

    def step_time(self, tokens: float, kv_read: float, pairs: float, samples: float) -> float:
        """Seconds for one step; all arguments are batch totals (see the module docstring)."""
        if tokens <= 0:
            return 0.0
        mem = self.mem_base_s + self.mem_per_kv_token_s * kv_read
        comp = (
            self.comp_per_token_s * tokens
            + self.comp_per_sample_s * samples
            + self.comp_per_pair_s * pairs
        )
        p = self.p
        core: float = (mem**p + comp**p) ** (1.0 / p)
        return (
            core * self.other_factor
            + self.ar_fixed_s
            + self.ar_per_token_s * tokens
            + (self.overhead_s)
        )

    def decode_step_time(self, batch: int, context_sum: float) -> float:
        """A step of `batch` decodes whose contexts (tokens already in KV) sum to `context_sum`."""
        reads = context_sum + batch
        return self.step_time(batch, reads, reads, batch)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prefill of `new_tokens` on top of `cached_tokens` of cached context, alone."""
        n, c = new_tokens, cached_tokens
        return self.step_time(n, c + n, n * c + n * (n + 1) / 2, 1)
