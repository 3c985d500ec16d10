"""What a request costs the GPU, in the units a fair queue charges.

Three modes (`WorkMode`), one interface (`WorkModel.prefill`, `.decode`, `.refund_cached`):

- `request`: every request costs 1 at admission, tokens cost nothing (request-fair).
- `vtc`: a token is a token: prefill and decode tokens each cost 1 (VTC's unweighted counter).
- `vtc-roofline`: roofline seconds of GPU time (`controlplane.roofline`), so a long document
  costs what it costs the GPU:

      prefill of n tokens on top of c tokens already in KV (compute-bound, additive per token):
          P(n, c) = (comp_per_token * n + comp_per_pair * (n c + n (n + 1) / 2)) * other_ops
              = sum over j < n of `prefill_seconds_per_token(profile, c + j)`
      decode of one token whose sequence holds c tokens (a share of a batched decode step):
          D(c)    = decode_step_time(B, B c) / B = `decode_seconds_per_token(profile, B, c)`
      decode of n tokens from context c: n * D(c + (n - 1) / 2)   (midpoint rule; D is affine
          in c up to the roofline's smooth knee, so the error is far below 0.1%)

  `B` is a reference decode batch, `min(64, ceiling / 2)` with the binding concurrency ceiling
  at a 2,048-token context: the charge must not depend on who else happens to share the step
  (that would make the order depend on the schedule it produces). Decode cost grows with the
  context (the KV read), so a 16k-token document costs about 21x a 200/200 chat turn on an
  H100 with Llama-3.1-8B (40x in plain tokens, 1x in requests).

Cached prompt tokens: a queue charges the whole prompt at admission (it cannot know the hit yet)
and refunds `refund_cached(k)` = P(k, 0) at finish when the replica reports k cached tokens;
P is additive, so P(n, 0) - P(k, 0) = P(n - k, k), exactly the prefill that was computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from controlplane.roofline.capacity import concurrency_ceilings
from controlplane.roofline.profile import EngineProfile
from controlplane.roofline.step import StepCostModel

MAX_REFERENCE_BATCH = 64
REFERENCE_CONTEXT = 2048


class WorkMode(StrEnum):
    REQUEST = "request"
    VTC = "vtc"
    VTC_ROOFLINE = "vtc-roofline"


def reference_batch(prof: EngineProfile) -> int:
    """The decode batch a decode token's charge assumes (see the module docstring)."""
    ceiling = concurrency_ceilings(prof, REFERENCE_CONTEXT).sequences
    return max(1, min(MAX_REFERENCE_BATCH, ceiling // 2))


@dataclass(frozen=True, slots=True)
class WorkModel:
    """Pure cost functions for one mode; build with `WorkModel.build(mode, profile)`."""

    mode: WorkMode
    cost: StepCostModel | None = None
    batch: int = 1

    @classmethod
    def build(
        cls, mode: WorkMode | str, prof: EngineProfile | None = None, *, batch: int = 0
    ) -> WorkModel:
        """`vtc-roofline` needs the replicas' profile; the other modes ignore it."""
        m = WorkMode(mode)
        if m is not WorkMode.VTC_ROOFLINE:
            return cls(m)
        if prof is None:
            raise ValueError("vtc-roofline work needs an engine profile")
        return cls(m, StepCostModel.from_profile(prof), batch or reference_batch(prof))

    @property
    def unit(self) -> str:
        return {"request": "requests", "vtc": "tokens", "vtc-roofline": "GPU-seconds"}[self.mode]

    def prefill(self, tokens: int, context: int = 0) -> float:
        """Work of `tokens` prompt tokens computed on top of `context` tokens already in KV."""
        if self.mode is WorkMode.REQUEST:
            return 1.0
        if tokens <= 0:
            return 0.0
        if self.cost is None:
            return float(tokens)
        c = self.cost
        pairs = tokens * context + tokens * (tokens + 1) / 2
        return (c.comp_per_token_s * tokens + c.comp_per_pair_s * pairs) * c.other_factor

    def decode_token(self, context: float) -> float:
        """Work of one decode token whose sequence already holds `context` tokens."""
        if self.mode is WorkMode.REQUEST:
            return 0.0
        if self.cost is None:
            return 1.0
        b = self.batch
        return self.cost.decode_step_time(b, b * context) / b

    def decode(self, tokens: int, context: int) -> float:
        """Work of `tokens` decode tokens, the first at `context` tokens, the next one more each."""
        if tokens <= 0 or self.mode is WorkMode.REQUEST:
            return 0.0
        if self.cost is None:
            return float(tokens)
        return tokens * self.decode_token(context + (tokens - 1) / 2)

    def refund_cached(self, cached_tokens: int) -> float:
        """What to give back when `cached_tokens` of a charged prompt were prefix-cache hits."""
        if self.mode is WorkMode.REQUEST or cached_tokens <= 0:
            return 0.0
        return self.prefill(cached_tokens, 0)

    def request(self, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> float:
        """Whole work of a finished request: the uncached prefill, then its decode tokens.

        The prefill step yields the first output token; output token i >= 2 comes from a decode
        step of a sequence holding prompt + i - 2 tokens in KV."""
        cached = max(0, min(cached_tokens, prompt_tokens - 1))
        prefill = self.prefill(prompt_tokens - cached, cached)
        return prefill + self.decode(output_tokens - 1, prompt_tokens)


__all__ = ["MAX_REFERENCE_BATCH", "WorkMode", "WorkModel", "reference_batch"]
