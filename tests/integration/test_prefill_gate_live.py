"""Live: a tenant's chats keep their first tokens while another tenant's long documents are
backlogged (the queue core's prefill gate and vLLM's long-prefill threshold, in the router).

    2 simulated replicas (H100 / Llama-3.1-8B roofline, at a quarter speed, block 16, vLLM's
    --long-prefill-token-threshold 224) + the router (tenants A, weight 1, and B, weight 2;
    the fair queue on)
    alone     B alone: 16 chats/s (200-token prompts as token ids, 16 output tokens), 10 s
    beside    A: 6 documents/s (6,000-token prompts, 64 output tokens), twice what the fleet
              prefills, so A's queue in the router grows; B as alone; after 10 s A's client
              leaves (its requests are released), and the next round starts
    5 rounds, B's TTFT after the first 3 s of each window; its p99 beside A is within 2x of its
    p99 alone in the median round (1.1-1.8x by round on this machine kind, 1.5-1.6x in the median).

A round is the unit because a shared CI box stalls now and then: one stall of a few hundred
milliseconds sets the p99 of the window it falls in and says nothing about the queue, so the
test reads the round in the middle, not the worst one (a queue that lets documents delay chats
moves every round).

B asks well inside its share of the fleet's work, even when the machine runs the simulated
replicas at half their configured speed (a busy CI box): otherwise B would be backlogged too,
and its TTFT would be its own queueing, which no ordering can bound (docs/benchmarks.md §10).
The simulator predicts 1.5-1.7x for this load (`controlplane.sim` with the same queue core). What
makes it hold: the router sends a replica at most one document in prefill at a time (vLLM's
max_long_partial_prefills, which its scheduler does not enforce) and never a prompt that would
wait behind more than two steps of prefill; vLLM chunks the document at the threshold, so a chat
joins the next step. TTFT is measured by the client, from the send to the first content event.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from quota_scenario import RouterProcess
from router_fixtures import MODEL, metric_value
from sim_fleet import SimReplica

THRESHOLD = 224
SPEED = 0.25
KEYS = {"A": "cpk-gate-live-a", "B": "cpk-gate-live-b"}
WEIGHTS = {"A": 1.0, "B": 2.0}
CHAT_RATE, DOC_RATE = 16.0, 6.0
ROUNDS, PHASE_S, WARMUP_S = 5, 10.0, 3.0

pytestmark = pytest.mark.timeout(300)


def token_ids(rng: random.Random, n: int) -> list[int]:
    """A prompt of `n` token ids (the tiny model's vocabulary: 512; ids past the specials)."""
    return [rng.randrange(300, 512) for _ in range(n)]


async def one(
    client: httpx.AsyncClient, tenant: str, prompt: list[int], max_tokens: int
) -> tuple[str, float | None]:
    """Send one streamed completion; (tenant, TTFT seconds or None when it failed)."""
    start = time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    ttft = None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return tenant, None
        async for line in r.aiter_lines():
            first = ttft is None and line.startswith("data: {")
            if first and json.loads(line[6:]).get("choices"):
                ttft = time.monotonic() - start
    return tenant, ttft


async def load(url: str, duration_s: float, docs: bool, seed: int) -> tuple[list[float], int]:
    """Open-loop Poisson arrivals of B's chats (and A's documents) for `duration_s`: B's TTFTs
    after the warm-up, and how many of A's documents were still waiting for their first token
    at the end. Those are abandoned (the client leaves, as a real one would): A only has to be
    there, backlogged, while B is measured."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, str]] = []
    for tenant, rate in (("B", CHAT_RATE), ("A", DOC_RATE if docs else 0.0)):
        t = 0.0
        while rate and (t := t + rng.expovariate(rate)) < duration_s:
            arrivals.append((t, tenant))
    arrivals.sort()
    prompts = {"A": [token_ids(rng, 6000) for _ in range(16)], "B": [token_ids(rng, 200)]}
    # idle connections close on our side before the server's keep-alive timeout (5 s) can
    limits = httpx.Limits(max_connections=1000, keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        t0 = time.monotonic()
        chats: list[tuple[float, asyncio.Task[tuple[str, float | None]]]] = []
        documents: list[asyncio.Task[tuple[str, float | None]]] = []
        for i, (at, tenant) in enumerate(arrivals):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            prompt = [300 + i % 200, *rng.choice(prompts[tenant])]  # distinct from the 1st block
            if tenant == "A":
                documents.append(asyncio.create_task(one(client, tenant, prompt, 64)))
            else:
                chats.append((at, asyncio.create_task(one(client, tenant, prompt, 16))))
        results = [(at, await task) for at, task in chats]
        waiting = sum(1 for task in documents if not task.done())
        for task in documents:
            task.cancel()
        await asyncio.gather(*documents, return_exceptions=True)
    assert all(ttft is not None for _, (_, ttft) in results), "a chat failed"
    return [ttft for at, (_, ttft) in results if ttft is not None and at >= WARMUP_S], waiting


def test_chats_keep_their_first_tokens_beside_a_backlogged_document_tenant(
    model_dir: Path,
) -> None:
    args = ["--model-dir", str(model_dir), "--gpu", "h100", "--model", "llama-3.1-8b"]
    args += ["--block-size", "16", "--speed", str(SPEED)]
    args += ["--long-prefill-token-threshold", str(THRESHOLD)]
    tenants = [
        {"id": t, "api_key_sha256": [hashlib.sha256(k.encode()).hexdigest()], "weight": WEIGHTS[t]}
        for t, k in KEYS.items()
    ]
    with SimReplica(*args) as r0, SimReplica(*args) as r1, tempfile.TemporaryDirectory() as tmp:
        replicas = [
            {"id": rid, "url": sim.url, "gpu": "h100", "model": "llama-3.1-8b"}
            | {"block_size": 16, "long_prefill_token_threshold": THRESHOLD}
            for rid, sim in (("r0", r0), ("r1", r1))
        ]
        config = {
            "host": "127.0.0.1",
            "served_model": MODEL,
            "tokenizer": str(model_dir),
            "replicas": replicas,
            "tenants": tenants,
            "telemetry": {"log_level": "INFO"},
        }
        # its own process, as in production: the client's work here takes no time from it
        router = RouterProcess(config, Path(tmp), 0)
        router.start()
        alone: list[list[float]] = []
        both: list[list[float]] = []
        backlog: list[int] = []
        try:
            router.wait_ready(2)
            for r in range(ROUNDS):  # interleaved: drift on the machine hits both alike
                alone.append(asyncio.run(load(router.url, PHASE_S, docs=False, seed=2 * r))[0])
                ttfts, waiting = asyncio.run(load(router.url, PHASE_S, docs=True, seed=2 * r + 1))
                both.append(ttfts)
                backlog.append(waiting)
            # the abandoned documents are released once the router sees their clients gone
            deadline = time.monotonic() + 15
            while True:
                text = httpx.get(f"{router.url}/metrics").text
                left = metric_value(text, "cp_inflight_requests")
                if left == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert left == 0, "requests left in flight"
            assert metric_value(text, "cp_in_flight_requests") == 0
        finally:
            router.stop()
    rounds = [
        (float(np.percentile(a, 99)) * 1e3, float(np.percentile(b, 99)) * 1e3)
        for a, b in zip(alone, both, strict=True)
    ]
    ratios = [b / a for a, b in rounds]
    table = ", ".join(f"{a:.0f}/{b:.0f} ms" for a, b in rounds)
    print(f"B TTFT p99 alone/beside A by round: {table}; {backlog=}")
    assert min(backlog) >= 10, "A was not backlogged"  # A asks more than the fleet prefills
    assert all(len(a) > 80 and len(b) > 80 for a, b in zip(alone, both, strict=True))
    assert float(np.median(ratios)) <= 2.0, table
