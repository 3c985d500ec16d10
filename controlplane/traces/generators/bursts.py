"""A base Poisson load with burst episodes (rate multiplied for a while).

Algorithm:

1. Burst episodes start at the points of a Poisson process with mean spacing `burst_every`
   seconds over `[0, duration)` (stream `Random(f"{seed}:episodes")`); each lasts
   `burst_duration` seconds (clipped at `duration`). Overlapping episodes merge into one.
2. The arrival rate is `rate` outside episodes and `rate * multiplier` inside: a
   piecewise-constant-rate Poisson process, sampled segment by segment (stream
   `Random(f"{seed}:arrivals")`).
3. Each request draws lognormal prompt and output lengths (means `prompt` / `output`, CVs
   `prompt_cv` / `output_cv`; stream `Random(f"{seed}:lengths")`) and fresh content ids: nothing
   is shared between requests (ids exist so that `transform.repeat(distinct_ids=False)` replays
   the same content).

`meta["episodes"]` lists the merged `(start_s, end_s)` bursts, so a test or a plot can mark them.
Azure's code trace has bursts of median ~30 s, max ~80 s (numbers.md section 7.2): the defaults
(30 s at 5x every ~120 s on average) are of that kind.
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
    piecewise_poisson,
    renewal_times,
)
from controlplane.traces.model import Trace, TraceRequest


def burst_episodes(
    rng: random.Random, duration: float, every: float, length: float
) -> list[tuple[float, float]]:
    """Merged `(start, end)` episodes: Poisson starts of mean spacing `every`, each `length` s."""
    episodes: list[tuple[float, float]] = []
    for start in renewal_times(rng, 1.0 / every, duration=duration):
        end = min(duration, start + length)
        if episodes and start <= episodes[-1][1]:
            episodes[-1] = (episodes[-1][0], max(episodes[-1][1], end))
        else:
            episodes.append((start, end))
    return episodes


def rate_segments(
    duration: float, rate: float, multiplier: float, episodes: list[tuple[float, float]]
) -> list[tuple[float, float, float]]:
    """`(start, end, rate)` segments covering `[0, duration)`."""
    segments: list[tuple[float, float, float]] = []
    t = 0.0
    for a, b in episodes:
        segments.append((t, a, rate))
        segments.append((a, b, rate * multiplier))
        t = b
    segments.append((t, duration, rate))
    return [s for s in segments if s[1] > s[0]]


def bursty(
    *,
    rate: float = 2.0,
    duration: float = 600.0,
    multiplier: float = 5.0,
    burst_duration: float = 30.0,
    burst_every: float = 120.0,
    prompt: float = 2000.0,
    output: float = 200.0,
    prompt_cv: float = 1.0,
    output_cv: float = 1.0,
    seed: int = 0,
    block: int = DEFAULT_ID_BLOCK,
    namespace: int = 0,
) -> Trace:
    """Poisson at `rate` with episodes at `rate * multiplier` (see the module docstring)."""
    check_positive(
        rate=rate,
        duration=duration,
        burst_duration=burst_duration,
        burst_every=burst_every,
        prompt=prompt,
        output=output,
    )
    check_block(block)
    if multiplier < 0:
        raise ConfigError(f"multiplier must be non-negative, got {multiplier}")
    episodes = burst_episodes(
        random.Random(f"{seed}:episodes"), duration, burst_every, burst_duration
    )
    segments = rate_segments(duration, rate, multiplier, episodes)
    arrivals = piecewise_poisson(random.Random(f"{seed}:arrivals"), segments)
    lengths = random.Random(f"{seed}:lengths")
    ids = allocator("bursty", seed, namespace)
    reqs: list[TraceRequest] = []
    for t in arrivals:
        p = lognormal_int(lengths, prompt, prompt_cv)
        o = lognormal_int(lengths, output, output_cv)
        reqs.append(
            TraceRequest(
                arrival_s=t,
                prompt_tokens=p,
                output_tokens=o,
                content_ids=ids.take(blocks_for(p, block)),
                id_block_tokens=block,
            )
        )
    meta: dict[str, object] = {
        "generator": "bursty",
        "params": {
            "rate": rate,
            "duration": duration,
            "multiplier": multiplier,
            "burst_duration": burst_duration,
            "burst_every": burst_every,
            "prompt": prompt,
            "output": output,
            "prompt_cv": prompt_cv,
            "output_cv": output_cv,
            "seed": seed,
            "block": block,
        },
        "episodes": episodes,
        "id_namespace": ids.namespace,
    }
    return make_trace(f"bursty-s{seed}", reqs, meta)
