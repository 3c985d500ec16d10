"""Room on a replica: may the tenant queue send it one more request now? Pure books, no I/O.

A replica takes a request (prompt p, reserved KV r = prompt + predicted output, of a tenant and
a class) when all of these hold, counting the requests this queue placed there plus `others`
(what the replica reports that this queue did not send: other routers' traffic):

  slots      n + 1 <= the lowest of the roofline's three concurrency ceilings (max_num_seqs,
             KV capacity, compute ridge) at the mean reserved context of its n + 1 requests
             (`slots_per_replica` when set);
  headroom   the last `headroom` of those slots and of its KV only for tenants holding at most
             their weighted share of the fleet's KV (a tenant whose long documents fill every
             replica cannot make a light tenant's next chat wait for one to finish);
  batch KV   a batch request keeps the batch class within `batch_kv_share` of the replica's KV
             (unless no batch request holds any there, so one cannot starve);
  prefill    the prefill gate: what delays a new request's first chunk is the prompt tokens vLLM
             schedules per step ahead of it. Per prefilling request (placed, no first token yet)
             that is min(prompt, threshold) with vLLM's long_prefill_token_threshold set, its
             whole prompt when it is 0 (`prefill_per_step`). The sum plus the new request's own
             must stay within `prefill_steps` x max_num_batched_tokens (always when nothing is
             ahead), and a prompt longer than the threshold (a long prefill) also needs fewer
             than `long_prefills` long prefills in progress there: vLLM's own
             max_long_partial_prefills, which its V1 scheduler does not enforce. Short prompts
             are never held by that rule, so a chat joins the next step while documents
             prefill one at a time per replica; one 32k-token prompt cannot stall every other
             request's first token.

The router sees no prefill progress before the first token, so a prompt stands for its remaining
prompt. Why the rules are what they are, with the benchmark behind them: docs/benchmarks.md §10.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from controlplane.roofline.capacity import concurrency_ceilings
from controlplane.roofline.profile import EngineProfile

# mean contexts are rounded up to this many tokens before the ceilings are looked up
CONTEXT_BUCKET = 64


def prefill_per_step(prompt: int, threshold: int) -> int:
    """Prompt tokens a prefilling request takes from each step's budget until its first token:
    its chunk, at most `threshold` (vLLM's long_prefill_token_threshold; 0: off) tokens."""
    return min(prompt, threshold) if threshold > 0 else prompt


def is_long_prefill(prompt: int, threshold: int) -> bool:
    """Whether vLLM chunks this prompt at the threshold (a long prefill; never when it is 0)."""
    return 0 < threshold < prompt


def prefill_gate(
    ahead: int,
    long_ahead: int,
    prompt: int,
    *,
    threshold: int,
    budget: int,
    steps: float,
    long_prefills: int,
) -> bool:
    """Whether a replica may take a new `prompt` while its prefilling requests take `ahead`
    prompt tokens per step (`prefill_per_step` summed), `long_ahead` of them long prefills:
    within `steps` x `budget` (max_num_batched_tokens) counting the new request's own per-step
    tokens (always when nothing is ahead; no limit when steps is 0), and, for a long prefill,
    fewer than `long_prefills` long ones ahead (no limit when 0)."""
    if steps > 0 and ahead > 0 and ahead + prefill_per_step(prompt, threshold) > steps * budget:
        return False
    return not (
        long_prefills > 0 and long_ahead >= long_prefills and is_long_prefill(prompt, threshold)
    )


@functools.lru_cache(maxsize=4096)
def ceiling(prof: EngineProfile, context_bucket: int) -> int:
    """Concurrent sequences the replica sustains at a mean context of `context_bucket` buckets."""
    return concurrency_ceilings(prof, max(1, context_bucket * CONTEXT_BUCKET)).sequences


@dataclass(slots=True)
class ReplicaBooks:
    """What the queue placed on one replica and has not seen finish."""

    requests: int = 0
    reserved: int = 0
    batch_reserved: int = 0
    # prompt tokens per step its prefilling requests take (`prefill_per_step` summed)
    prefill: int = 0
    # how many of them are long prefills (`is_long_prefill`)
    long_prefill: int = 0


@dataclass(frozen=True, slots=True)
class RoomRules:
    """The knobs of `has_room` (from `FairnessConfig`)."""

    slots_per_replica: int | None = None
    mean_context_tokens: int = 2048
    headroom: float = 0.1
    prefill_steps: float = 2.0
    long_prefills: int = 1


def slots(rules: RoomRules, prof: EngineProfile, books: ReplicaBooks, reserved: int) -> int:
    """The replica's request slots at the mean reserved context of its requests and a new one
    reserving `reserved` (`mean_context_tokens` when nothing is reserved)."""
    if rules.slots_per_replica:
        return rules.slots_per_replica
    total = books.reserved + reserved
    if total <= 0:
        return ceiling(prof, -(-rules.mean_context_tokens // CONTEXT_BUCKET))
    return ceiling(prof, -(-total // ((books.requests + 1) * CONTEXT_BUCKET)))


def has_room(
    rules: RoomRules,
    prof: EngineProfile,
    books: ReplicaBooks,
    *,
    prompt: int,
    reserved: int,
    batch: bool,
    batch_share: float,
    under_share: bool,
    others: int = 0,
) -> bool:
    """Whether the replica takes one more request now (see the module docstring)."""
    n = books.requests + others + 1
    limit = slots(rules, prof, books, reserved)
    if n > limit:
        return False
    threshold = prof.long_prefill_token_threshold
    if not prefill_gate(
        books.prefill,
        books.long_prefill,
        prompt,
        threshold=threshold,
        budget=prof.resolved_max_num_batched_tokens,
        steps=rules.prefill_steps,
        long_prefills=rules.long_prefills,
    ):
        return False
    kv = prof.num_gpu_blocks * prof.resolved_block_size
    fill = 1.0 - rules.headroom
    crowded = n > fill * limit or books.reserved + reserved > fill * kv
    if rules.headroom > 0 and crowded and not under_share:
        return False
    if batch and books.batch_reserved and batch_share < 1.0:
        return books.batch_reserved + reserved <= batch_share * kv
    return True


__all__ = [
    "CONTEXT_BUCKET",
    "ReplicaBooks",
    "RoomRules",
    "ceiling",
    "has_room",
    "is_long_prefill",
    "prefill_gate",
    "prefill_per_step",
    "slots",
]
