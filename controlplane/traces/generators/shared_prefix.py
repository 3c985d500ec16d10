"""Shared-prefix groups: many users asking questions about a few long shared documents.

Modelled on llm-d's / inference-perf's "shared prefix" B2B workload (e.g. 150 groups x 5 users,
a 6000-token shared system/document prefix, a 1200-token question, 1000 output tokens).

Algorithm:

1. Build the prompt pool: `groups` x `users` prompts. Prompt (g, u) is group g's prefix of
   `prefix` tokens followed by user u's own question of `question` tokens, so every prompt has
   `prefix + question` tokens. Group g owns `prefix // block` content ids shared by its users;
   each prompt owns fresh ids for the rest (`ceil((prefix + question) / block) - prefix // block`,
   including the block that straddles prefix and question, whose content differs per user).
   Hence at engine block size B only `(prefix // block) * block` prefix tokens are shareable
   (5952 of 6000 at block 64); use `block=16` for B = 16 exactly.
2. The request sequence walks the pool in rounds; each round is a fresh shuffle of all prompts.
   `requests` defaults to one round (every prompt once); more rounds repeat prompts, and a
   repeated prompt shares its whole content with its earlier copy (identical request).
   With `zipf` = s > 0 the groups are not equally popular: each request draws group g with
   probability proportional to 1 / (g + 1)^s and one of its users uniformly (a few hot
   documents and a long tail; s = 1 is Zipf's law).
3. Arrivals are Poisson at `rate` requests/s from t = 0. Every request generates `output` tokens.
   `session_key` is `g<group>-u<user>` (one user = one session) and `tenant` is "default".
"""

from __future__ import annotations

import random

from controlplane.errors import ConfigError
from controlplane.traces.generators.common import (
    DEFAULT_ID_BLOCK,
    allocator,
    blocks_for,
    check_block,
    check_positive,
    make_trace,
    renewal_times,
)
from controlplane.traces.model import Trace, TraceRequest


def shared_prefix(
    *,
    groups: int = 150,
    users: int = 5,
    prefix: int = 6000,
    question: int = 1200,
    output: int = 1000,
    rate: float = 5.0,
    requests: int = 0,
    zipf: float = 0.0,
    seed: int = 0,
    block: int = DEFAULT_ID_BLOCK,
    namespace: int = 0,
) -> Trace:
    """`groups` x `users` prompts sharing per-group prefixes, Poisson at `rate` (see module)."""
    check_positive(groups=groups, users=users, question=question, output=output, rate=rate)
    check_block(block)
    if prefix < 0 or requests < 0 or zipf < 0:
        raise ConfigError("prefix, requests and zipf must be non-negative")
    rng = random.Random(seed)
    ids = allocator("shared-prefix", seed, namespace)
    prompt_tokens = prefix + question
    shared_blocks = prefix // block
    own_blocks = blocks_for(prompt_tokens, block) - shared_blocks
    pool: list[tuple[int, int, tuple[int, ...]]] = []
    for g in range(groups):
        group_ids = ids.take(shared_blocks)
        pool.extend((g, u, group_ids + ids.take(own_blocks)) for u in range(users))

    total = requests or len(pool)
    order: list[tuple[int, int, tuple[int, ...]]] = []
    if zipf > 0:
        weights = [1.0 / (g + 1) ** zipf for g in range(groups)]
        for g in rng.choices(range(groups), weights, k=total):
            order.append(pool[g * users + rng.randrange(users)])
    while len(order) < total:
        round_ = pool.copy()
        rng.shuffle(round_)
        order.extend(round_[: total - len(order)])
    arrivals = renewal_times(rng, rate, count=total)

    reqs = [
        TraceRequest(
            arrival_s=t,
            prompt_tokens=prompt_tokens,
            output_tokens=output,
            content_ids=content,
            id_block_tokens=block,
            session_key=f"g{g}-u{u}",
        )
        for t, (g, u, content) in zip(arrivals, order, strict=True)
    ]
    meta: dict[str, object] = {
        "generator": "shared-prefix",
        "params": {
            "groups": groups,
            "users": users,
            "prefix": prefix,
            "question": question,
            "output": output,
            "rate": rate,
            "requests": total,
            "zipf": zipf,
            "seed": seed,
            "block": block,
        },
        "id_namespace": ids.namespace,
        "shareable_prefix_tokens": shared_blocks * block,
    }
    return make_trace(f"shared-prefix-s{seed}", reqs, meta)
