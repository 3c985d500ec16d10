"""What a router can estimate about a replica's outstanding work.

Two sources, never the engine's internals:

- the replica's scraped metrics (running, waiting, KV usage), shared truth but up to one scrape
  interval old, and counting every router's requests;
- this router's ledger: its own in-flight requests with their exact sizes, fresh.

Requests the metrics count but the ledger does not know (other routers' traffic, or everything
when reservations are off) are valued at the mean of the requests the ledger knows, or at the
priors below when it knows none:

    own_visible = ledger.requests - ledger.unscraped_requests
    others      = max(0, running + waiting - own_visible)
    prefill     = ledger.prefill_tokens + others_waiting * mean_prefill
    decode      = ledger.decode_tokens  + others * mean_decode
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.types import ReplicaState

PRIOR_PREFILL_TOKENS = 2048.0
PRIOR_DECODE_TOKENS = 256.0


@dataclass(frozen=True, slots=True)
class LoadEstimate:
    requests: float
    prefill_tokens: float  # uncached prompt tokens not yet computed
    decode_tokens: float  # output tokens still to be generated
    decoding: float  # sequences in decode
    context_tokens: float  # tokens in KV held by running sequences

    @property
    def outstanding_tokens(self) -> float:
        return self.prefill_tokens + self.decode_tokens


def estimate(r: ReplicaState) -> LoadEstimate:
    """The replica's load as this router sees it (memoized on the immutable state)."""
    memo = r._memo
    if isinstance(memo, LoadEstimate):
        return memo
    est = _estimate(r)
    object.__setattr__(r, "_memo", est)
    return est


def _estimate(r: ReplicaState) -> LoadEstimate:
    m, led = r.metrics, r.ledger
    own_visible = led.requests - led.unscraped_requests
    others = max(0, m.running + m.waiting - own_visible)
    others_waiting = min(others, m.waiting)
    prefilling = led.requests - led.decoding
    mean_prefill = led.prefill_tokens / prefilling if prefilling else PRIOR_PREFILL_TOKENS
    mean_decode = led.decode_tokens / led.requests if led.requests else PRIOR_DECODE_TOKENS
    kv_context = m.kv_usage * r.kv_capacity_tokens
    return LoadEstimate(
        requests=led.requests + others,
        prefill_tokens=led.prefill_tokens + others_waiting * mean_prefill,
        decode_tokens=led.decode_tokens + others * mean_decode,
        decoding=led.decoding + max(0, others - others_waiting),
        context_tokens=max(kv_context, float(led.context_tokens)),
    )


def outstanding_tokens(r: ReplicaState) -> float:
    return estimate(r).outstanding_tokens
