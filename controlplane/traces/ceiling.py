"""Prefix-reuse ceilings of a trace: how many prompt tokens a prefix cache could serve.

(a) `infinite_cache_ceiling(trace, B)`: one replica, unlimited KV, FCFS, no preemption, engine
block size B. Requests are taken in arrival order (stable). For a request with an N-token prompt
and engine block hashes h = `engine_block_hashes(B)` (the full blocks its ids describe):

    hit blocks = the longest run h[0..k) of hashes all in SEEN, with k <= (N - 1) // B
    hit tokens = B * hit blocks
    then SEEN += h[: (N + output - 1) // B]

and the ceiling is sum(hit tokens) / sum(N). This is exactly what the simulator's single
engine records (`prefix_hits / prefix_queries`): vLLM hashes a block as soon as it is scheduled,
FCFS admits a waiting request only after every earlier request's prompt is fully scheduled, so
at a request's admission every earlier request's prompt blocks are cached, and with unlimited KV
nothing is ever evicted. Blocks beyond the described content get per-request unique hashes and
never match. The `(N - 1) // B` cap is vLLM's: the last prompt token is always recomputed.

Generated blocks. A request whose ids describe part of its output (`id_tokens > prompt`, e.g.
multi-turn sessions) caches those blocks while decoding; the engine computes KV for all but the
last sampled token, so at most `(N + output - 1) // B` blocks. Counting them as cached for later
requests is exact when the earlier request has finished decoding by the time the later one is
admitted (a turn arriving after the previous answer); otherwise this is an upper bound.

Implementation: per content id we keep how many of its B-sub-blocks have been cached. Every
request caches a prefix of each id's sub-blocks (all `g // B` of them, or the first few for the
id that ends its described content), so "engine block j is cached" is
`cached_sub[ids[j // per]] > j % per`, and the scan is O(ids) per request, not O(blocks).
`naive_infinite_cache_ceiling` is the literal set-of-hashes version, kept for tests.

(b) `lru_ceiling(trace, capacity_tokens, replicas, routing)`: numbers.md section 8's model, for
orderings, not exact values. LRU over blocks, `capacity_tokens // granularity` blocks per
replica; requests in order; hit = leading blocks already present on the chosen replica; after
each request all its blocks are inserted (or refreshed) as most recently used. Granularity is
the trace's own ids, partial last id included (`block_size=None`, numbers.md's setting), or
engine blocks of `block_size` (full described blocks, hits capped at (N - 1) // B). Routing:
"round-robin" (request i -> replica i mod R) or "affinity" (the replica holding the longest
cached prefix, lowest index on ties; when the best holds <= 1 block, the replica picked by a
hash of the first two ids). Reported as the fraction of blocks hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from controlplane.errors import ConfigError
from controlplane.traces.model import Trace, TraceRequest

Routing = Literal["round-robin", "affinity"]


@dataclass(frozen=True, slots=True)
class Ceiling:
    """Prefix-cache hits a trace allows at an engine block size."""

    block_size: int
    hit_tokens: int
    prompt_tokens: int
    # hit blocks, and blocks a request could hit at most ((N - 1) // B each)
    hit_blocks: int
    lookup_blocks: int

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens served from cache (vLLM's prefix-cache hit rate)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


def _arrival_order(trace: Trace) -> list[TraceRequest]:
    return [r for _, r in sorted(enumerate(trace.requests), key=lambda p: (p[1].arrival_s, p[0]))]


def _check_block(req: TraceRequest, block_size: int) -> int:
    if block_size <= 0 or req.id_block_tokens % block_size:
        raise ConfigError(
            f"engine block size {block_size} does not divide the trace's "
            f"{req.id_block_tokens}-token content blocks"
        )
    return req.id_block_tokens // block_size


def infinite_cache_ceiling(trace: Trace, block_size: int) -> Ceiling:
    """Ceiling (a): exact single-replica, unlimited-KV FCFS hits (see the module docstring)."""
    cached_sub: dict[int, int] = {}  # content id -> leading sub-blocks cached
    hit_blocks = lookup_blocks = prompt_tokens = 0
    for req in _arrival_order(trace):
        n = req.prompt_tokens
        prompt_tokens += n
        max_hit = (n - 1) // block_size
        lookup_blocks += max_hit
        ids = req.content_ids
        if not ids:
            continue
        per = _check_block(req, block_size)
        known = min(req.described_tokens // block_size, len(ids) * per)
        # lookup: whole ids first, then the sub-blocks of the id where the run stops
        limit = min(known, max_hit)
        hit = 0
        while hit < limit:
            have = cached_sub.get(ids[hit // per], 0)
            want = min(per, limit - hit)
            if have >= want:
                hit += want
                continue
            hit += have
            break
        hit_blocks += hit
        # cache: the first (N + output - 1) // B known blocks
        stored = min(known, (n + req.output_tokens - 1) // block_size)
        full, rest = divmod(stored, per)
        for t in range(full):
            if cached_sub.get(ids[t], 0) < per:
                cached_sub[ids[t]] = per
        if rest and cached_sub.get(ids[full], 0) < rest:
            cached_sub[ids[full]] = rest
    return Ceiling(block_size, hit_blocks * block_size, prompt_tokens, hit_blocks, lookup_blocks)


def naive_infinite_cache_ceiling(trace: Trace, block_size: int) -> Ceiling:
    """Ceiling (a) computed literally on engine block hashes (slow; a reference for tests)."""
    seen: set[int] = set()
    hit_blocks = lookup_blocks = prompt_tokens = 0
    for req in _arrival_order(trace):
        n = req.prompt_tokens
        prompt_tokens += n
        max_hit = (n - 1) // block_size
        lookup_blocks += max_hit
        hashes = req.engine_block_hashes(block_size)
        hit = 0
        while hit < min(max_hit, len(hashes)) and hashes[hit] in seen:
            hit += 1
        hit_blocks += hit
        seen.update(hashes[: (n + req.output_tokens - 1) // block_size])
    return Ceiling(block_size, hit_blocks * block_size, prompt_tokens, hit_blocks, lookup_blocks)


@dataclass(frozen=True, slots=True)
class LruCeiling:
    """Result of the LRU model (b)."""

    hit_blocks: int
    blocks: int
    replicas: int
    routing: str
    capacity_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0


def _lru_blocks(req: TraceRequest, block_size: int | None) -> tuple[Sequence[int], int]:
    """(blocks, how many of them may hit) at the model's granularity."""
    if block_size is None:
        return req.content_ids, len(req.content_ids)
    hashes = req.engine_block_hashes(block_size)
    return hashes, min(len(hashes), (req.prompt_tokens - 1) // block_size)


def _leading(cache: OrderedDict[int, None], blocks: Sequence[int], limit: int) -> int:
    k = 0
    while k < limit and blocks[k] in cache:
        k += 1
    return k


def lru_ceiling(
    trace: Trace,
    capacity_tokens: int,
    *,
    replicas: int = 1,
    routing: Routing = "round-robin",
    block_size: int | None = None,
) -> LruCeiling:
    """Ceiling (b): LRU per replica, round-robin or affinity routing (see the module)."""
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    if routing not in ("round-robin", "affinity"):
        raise ConfigError(f"unknown routing {routing!r}")
    reqs = _arrival_order(trace)
    granularity = block_size or (reqs[0].id_block_tokens if reqs else 1)
    capacity = capacity_tokens // granularity
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
    hit_blocks = total = 0
    for i, req in enumerate(reqs):
        blocks, limit = _lru_blocks(req, block_size)
        total += len(blocks)
        if routing == "round-robin" or replicas == 1:
            target = i % replicas
        else:
            matches = [_leading(c, blocks, limit) for c in caches]
            best = max(matches)
            if best <= 1:
                key = hash(tuple(req.content_ids[:2])) if req.content_ids else i
                target = key % replicas
            else:
                target = matches.index(best)
        cache = caches[target]
        hit_blocks += _leading(cache, blocks, limit)
        for b in blocks:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return LruCeiling(hit_blocks, total, replicas, routing, capacity_tokens)
