"""Traces of requests whose token ids are known (a live run replayed in the simulator).

The simulator keys prefixes by chained content ids per block, as the Mooncake traces do: block j
of a prompt gets the id of (block j - 1's id, its `block` tokens), so two prompts share an id
exactly where they share every token up to the end of that block. Only full blocks get ids (a
partial last block is never cached).
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.traces.model import Trace, TraceRequest


def token_trace(
    name: str,
    arrivals: Sequence[float],
    tokens: Sequence[Sequence[int]],
    *,
    output_tokens: int,
    block: int,
    request_ids: Sequence[str] | None = None,
) -> Trace:
    """One request per prompt, arriving at `arrivals[i]`, with chained content ids per `block`
    tokens; each produces `output_tokens` (its max_tokens)."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    reqs = []
    for i, (at, toks) in enumerate(zip(arrivals, tokens, strict=True)):
        chain: list[int] = []
        prev = -1
        for b in range(len(toks) // block):
            prev = ids.setdefault((prev, tuple(toks[b * block : (b + 1) * block])), len(ids))
            chain.append(prev)
        reqs.append(
            TraceRequest(
                arrival_s=at,
                prompt_tokens=len(toks),
                output_tokens=output_tokens,
                content_ids=tuple(chain),
                id_block_tokens=block,
                max_tokens=output_tokens,
                request_id=request_ids[i] if request_ids is not None else f"req-{i}",
            )
        )
    return Trace(name, tuple(reqs)).sorted()


__all__ = ["token_trace"]
