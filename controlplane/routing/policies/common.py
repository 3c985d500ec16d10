"""Helpers shared by policies: candidate sets and deterministic tie-breaking."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controlplane.routing.interfaces import stable_hash
from controlplane.types import ReplicaState, RoutingRequest


def pick_tied(request: RoutingRequest, tied: Sequence[str]) -> str:
    """Choose among equally good replicas by a hash of the request id.

    Deterministic (replays are reproducible) yet spread: requests that tie on the same set land on
    different members, which is what a random tie-break buys without hidden state.
    """
    if len(tied) == 1:
        return tied[0]
    ordered = sorted(tied)
    return ordered[stable_hash(request.request_id) % len(ordered)]


def rank_by(
    request: RoutingRequest,
    replicas: Sequence[ReplicaState],
    key: Callable[[ReplicaState], float],
    *,
    tolerance: float = 1e-9,
) -> tuple[str, tuple[str, ...], dict[str, float]]:
    """Lowest `key` first; ties within `tolerance` broken by `pick_tied`."""
    scores = {r.replica_id: key(r) for r in replicas}
    best = min(scores.values())
    tied = [rid for rid, s in scores.items() if s <= best + tolerance]
    chosen = pick_tied(request, tied)
    rest = sorted((s, rid) for rid, s in scores.items() if rid != chosen)
    return chosen, (chosen, *(rid for _, rid in rest)), scores


def usable_hit_blocks(request: RoutingRequest, matched_blocks: int, block_size: int) -> int:
    """Blocks vLLM can actually reuse: at most (N - 1) // B, the last token is recomputed."""
    return min(matched_blocks, max(0, request.prompt_tokens - 1) // block_size)
