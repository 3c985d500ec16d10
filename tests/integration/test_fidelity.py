"""Fidelity: the simulated replica caches, evicts and reports like real vLLM, block for block.

One real vLLM CPU replica and one simulated replica, configured alike (the tiny model, 32-token
blocks, 64 KV blocks, `max_num_seqs` 16, `max_num_batched_tokens` 2048), receive the same
requests: 250 one at a time, then 50 overlapping (sent 2 ms apart, so both engines see the same
arrival order but batch them by their own step times). Prompts are token ids built from a dozen
shared prefixes of 2-11 blocks, with exact repeats and block-aligned prompts (the last block is
recomputed), so a 64-block cache keeps evicting.

Asserted:
- the sequential part's KV events, flattened to one entry per block, are identical: every
  `BlockStored` block (hash, parent, tokens) and every `BlockRemoved` hash, in the same order;
- the sequential part's `vllm:prefix_cache_hits_total` / `queries_total` are equal;
- after the overlapping part, both counters agree within 2%.

Both replicas start once per module (real vLLM takes about a minute).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import zmq
from vllm_fleet import decode_payload, metric, replay, scrape, vllm_missing_reason

from deploy.local_fleet import ENGINES, Engine, FleetSpec, LocalFleet

_MISSING = vllm_missing_reason()
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]

MODEL = "tiny-llama"
BLOCK = 32
NUM_BLOCKS = 64
SEQUENTIAL = 250
OVERLAPPING = 50
TOLERANCE = 0.02
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"

#: one entry per block: ("stored", hash, parent, tokens) or ("removed", hash)
BlockEvent = tuple[Any, ...]


def workload(seed: int = 7) -> tuple[list[list[int]], list[list[int]]]:
    """(sequential prompts, overlapping prompts) as token ids of the tiny model's vocabulary."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(n)]

    prefixes = [toks(BLOCK * rng.randrange(2, 12)) for _ in range(12)]
    sequential: list[list[int]] = []
    for _ in range(SEQUENTIAL):
        prefix = prefixes[min(int(rng.paretovariate(1.0)) - 1, len(prefixes) - 1)]
        kind = rng.random()
        if kind < 0.1 and sequential:
            sequential.append(list(rng.choice(sequential)))  # an exact repeat
        elif kind < 0.2:
            sequential.append(list(prefix))  # block-aligned: its last block is recomputed
        else:
            sequential.append(prefix + toks(rng.randrange(1, 80)))
    overlapping = [rng.choice(prefixes) + toks(rng.randrange(1, 80)) for _ in range(OVERLAPPING)]
    return sequential, overlapping


@dataclass
class Run:
    engine: Engine
    sequential_events: list[BlockEvent]
    sequential_counters: tuple[float, float]  # (hits, queries)
    final_counters: tuple[float, float]


def flatten(payloads: list[tuple[int, bytes]]) -> list[BlockEvent]:
    out: list[BlockEvent] = []
    for _, payload in payloads:
        for ev in decode_payload(payload):
            kind = ev.get("type")
            if kind == "BlockStored":
                parent, tokens = ev["parent_block_hash"], list(ev["token_ids"])
                for i, h in enumerate(ev["block_hashes"]):
                    out.append(("stored", h, parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK])))
                    parent = h
            elif kind == "BlockRemoved":
                out.extend(("removed", h) for h in ev["block_hashes"])
            else:
                out.append((kind,))
    return out


def settled_events(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> list[BlockEvent]:
    """Everything the replica published so far, once two replays 0.5 s apart agree."""
    last = replay(ctx, endpoint, 0, timeout_s=20.0)
    while True:
        time.sleep(0.5)
        now = replay(ctx, endpoint, 0, timeout_s=20.0)
        if len(now) == len(last):
            return flatten(now)
        last = now


def counters(url: str) -> tuple[float, float]:
    with httpx.Client(timeout=10.0) as client:
        samples = scrape(client, url)
    return metric(samples, HITS), metric(samples, QUERIES)


async def send(client: httpx.AsyncClient, prompt: list[int]) -> None:
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    resp.raise_for_status()
    assert resp.json()["usage"]["prompt_tokens"] == len(prompt)


async def overlapped(url: str, prompts: list[list[int]]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(client, prompt)))
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)


async def one_by_one(url: str, prompts: list[list[int]]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        for prompt in prompts:
            await send(client, prompt)


def drive(engine: Engine) -> Run:
    spec = FleetSpec(
        replicas=1,
        engine=engine,
        base_port=0,
        model_name=MODEL,
        block_size=BLOCK,
        num_gpu_blocks=NUM_BLOCKS,
        max_num_seqs=16,
        max_model_len=1024,
        speed=5.0,  # the simulator's CPU roofline is ~5x slower than this machine's real steps
        python_hash_seed="0",
        extra_args=("--max-num-batched-tokens", "2048"),
        startup_timeout_s=420.0,
    )
    sequential, overlapping_prompts = workload()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with LocalFleet(spec) as fleet:
            url, endpoint = fleet.urls[0], fleet.replicas[0].launch.replay_connect
            asyncio.run(one_by_one(url, sequential))
            events = settled_events(ctx, endpoint)
            mid = counters(url)
            asyncio.run(overlapped(url, overlapping_prompts))
            return Run(engine, events, mid, counters(url))
    finally:
        ctx.term()


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[Engine, Run]]:
    yield {engine: drive(engine) for engine in ENGINES}


def test_the_workload_forces_evictions(runs: dict[Engine, Run]) -> None:
    real = runs["vllm"]
    removed = sum(1 for ev in real.sequential_events if ev[0] == "removed")
    assert removed >= 200, f"only {removed} evictions: the cache is not under pressure"
    hits, queries = real.sequential_counters
    assert 0.3 < hits / queries < 0.95, "the prefixes should both hit and miss"


def test_sequential_event_streams_are_identical(runs: dict[Engine, Run]) -> None:
    sim, real = runs["sim"].sequential_events, runs["vllm"].sequential_events
    first = next(
        (i for i, (a, b) in enumerate(zip(sim, real, strict=False)) if a != b),
        min(len(sim), len(real)),
    )
    assert sim == real, (
        f"streams differ at block event {first} (sim {len(sim)}, vLLM {len(real)} in all):\n"
        f"  sim:  {sim[first : first + 4]}\n  vLLM: {real[first : first + 4]}"
    )


def test_sequential_prefix_cache_counters_are_equal(runs: dict[Engine, Run]) -> None:
    assert runs["sim"].sequential_counters == runs["vllm"].sequential_counters


@pytest.mark.parametrize("which", [HITS, QUERIES])
def test_counters_agree_within_two_percent_after_overlap(
    runs: dict[Engine, Run], which: str
) -> None:
    i = 0 if which == HITS else 1
    sim, real = runs["sim"].final_counters[i], runs["vllm"].final_counters[i]
    assert real > runs["vllm"].sequential_counters[i], "the overlapping part added nothing"
    assert abs(sim - real) <= TOLERANCE * real, f"{which}: sim {sim} vs vLLM {real}"
