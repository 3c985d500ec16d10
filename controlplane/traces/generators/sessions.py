"""Multi-turn chat sessions whose every turn re-sends the whole conversation so far.

Algorithm, per session (sessions are independent; each uses its own random stream
`Random(f"{seed}:session:{i}")`, so adding sessions never changes earlier ones):

1. The session starts at a Poisson arrival (`rate` sessions/s). Turn 1's prompt is a shared
   system prompt of `system` tokens plus a first user message (lognormal, mean `first`).
2. Turn t > 1 arrives `output_{t-1} * decode_s_per_token + Exp(mean think)` seconds after turn
   t - 1: an estimate of how long the previous answer took to stream, then the user's think
   time. Its prompt is

       prompt_t = prompt_{t-1} + output_{t-1} + message_t        (message_t lognormal, mean message)

   Output lengths are lognormal with mean `output`. The session ends after `turns` turns or
   before a turn whose prompt + output would exceed `max_context`.
3. Content ids: each turn describes its prompt *and* its output, `id_tokens = prompt + output`,
   so the blocks the engine fills while generating get shared ids and the next turn's prompt
   hits them. The session keeps one growing id list covering `ceil(id_tokens / block)` blocks;
   a turn appends fresh ids for the blocks it adds. The last id of a turn usually covers a
   partial block, and the next turn keeps it: its content on the tokens both turns describe is
   the same, and a linear session never branches, so no other request ever describes that
   block differently. The first `system // block` ids are shared by all sessions.

`session_key` is `s<index>`; the exact-reuse ceiling (`ceiling.infinite_cache_ceiling`) counts a
turn's generated blocks as cached for the next turn, which assumes the previous turn finished
before the next one is admitted (true when the think time exceeds the previous turn's latency).
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
    lognormal_int,
    make_trace,
    renewal_times,
)
from controlplane.traces.model import Trace, TraceRequest


def multi_turn(
    *,
    sessions: int = 100,
    turns: int = 5,
    system: int = 0,
    first: int = 500,
    message: int = 150,
    output: int = 200,
    length_cv: float = 0.5,
    think: float = 10.0,
    decode_s_per_token: float = 0.02,
    rate: float = 1.0,
    max_context: int = 32768,
    seed: int = 0,
    block: int = DEFAULT_ID_BLOCK,
    namespace: int = 0,
) -> Trace:
    """`sessions` conversations of up to `turns` turns each (see the module docstring)."""
    check_positive(
        sessions=sessions, turns=turns, first=first, message=message, output=output, rate=rate
    )
    check_block(block)
    if system < 0 or think < 0 or decode_s_per_token < 0 or length_cv < 0:
        raise ConfigError("system, think, decode_s_per_token and length_cv must be >= 0")
    ids = allocator("multi-turn", seed, namespace)
    system_ids = ids.take(system // block)
    starts = renewal_times(random.Random(seed), rate, count=sessions)
    reqs: list[TraceRequest] = []
    for i, start in enumerate(starts):
        rng = random.Random(f"{seed}:session:{i}")
        content: list[int] = list(system_ids)
        prompt = system + lognormal_int(rng, first, length_cv)
        t = start
        for _ in range(turns):
            out = lognormal_int(rng, output, length_cv)
            described = prompt + out
            if described > max_context:
                break
            content.extend(ids.take(blocks_for(described, block) - len(content)))
            reqs.append(
                TraceRequest(
                    arrival_s=t,
                    prompt_tokens=prompt,
                    output_tokens=out,
                    content_ids=tuple(content),
                    id_block_tokens=block,
                    id_tokens=described,
                    session_key=f"s{i}",
                )
            )
            t += out * decode_s_per_token + (rng.expovariate(1.0 / think) if think > 0 else 0.0)
            prompt = described + lognormal_int(rng, message, length_cv)
    meta: dict[str, object] = {
        "generator": "multi-turn",
        "params": {
            "sessions": sessions,
            "turns": turns,
            "system": system,
            "first": first,
            "message": message,
            "output": output,
            "length_cv": length_cv,
            "think": think,
            "decode_s_per_token": decode_s_per_token,
            "rate": rate,
            "max_context": max_context,
            "seed": seed,
            "block": block,
        },
        "id_namespace": ids.namespace,
    }
    return make_trace(f"multi-turn-s{seed}", reqs, meta)
