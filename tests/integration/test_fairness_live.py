"""Weighted fairness across router processes on a live simulated fleet (issue 5, Done means).

    Redis + 2 simulated replicas (slow: the fleet saturates) + 2 router processes (`controlplane
    serve`) sharing the fair queue in Redis; tenant A (weight 1) sends long prompts, tenant B
    (weight 2) short ones, both from enough client tasks at every router to stay backlogged.

    window 1   the two routers: B's share of the work is 2/3 (within 10%, relative)
    then       a third router process joins; clients spread to it too
    window 2   the three routers: the shares still hold, and each router's clients are served
               alike (a tenant's requests leave in arrival order whichever router holds them)

Work = the tokens the replicas computed for each tenant, from the usage they return (prompt -
cached + completion; the queue runs in `vtc` mode, so this is what it charges), each token placed
in time where the client saw it (the prompt at the first chunk, each output token at its chunk),
so requests straddling a window's edges count only their part inside it. A request-fair queue
would give B about a quarter of the work here (its requests are about 4x smaller).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from quota_scenario import RouterProcess
from redis_server import RedisServer
from router_fixtures import MODEL, metric_value, sim_args
from sim_fleet import SimReplica

from controlplane.tenancy.fair_redis import SharedFairStore

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]

WEIGHTS = {"A": 1.0, "B": 2.0}
KEYS = {"A": "cpk-fairness-live-tenant-a", "B": "cpk-fairness-live-tenant-b"}
PROMPT_WORDS = {"A": 80, "B": 10}  # A's prompts are long, B's short
MAX_TOKENS = 16
CLIENTS_PER_TENANT_PER_ROUTER = 8  # > the fleet's slots: every tenant stays backlogged everywhere
SLOTS_PER_REPLICA = 3
WARMUP_S, WINDOW_S = 2.5, 10.0
WORDS = ("alpha", "beta", "gamma", "delta", "fair", "queue", "tenant", "router", "token", "work")


@dataclass
class Log:
    """Each tenant's work as (time, tokens) points; requests per router."""

    points: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: {t: [] for t in WEIGHTS}
    )
    served: list[tuple[float, str]] = field(default_factory=list)  # (finished at, router)
    errors: Counter[str] = field(default_factory=Counter)

    def share(self, start: float, end: float) -> dict[str, float]:
        work = {t: sum(w for at, w in pts if start <= at < end) for t, pts in self.points.items()}
        total = sum(work.values())
        return {t: w / total for t, w in work.items()} | {"tokens": total}

    def per_router(self, start: float, end: float) -> Counter[str]:
        return Counter(url for at, url in self.served if start <= at < end)


def router_config(
    model_dir: Path, sims: list[SimReplica], redis_url: str, tmp: Path
) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "served_model": MODEL,
        "tokenizer": str(model_dir),
        "replicas": [
            {"id": f"s{i}", "url": sim.url, "gpu": "cpu", "model": MODEL}
            for i, sim in enumerate(sims)
        ],
        "policy": {"name": "least_loaded"},
        "redis": {"url": redis_url, "ingest_events": False},
        "tenants": [
            {
                "id": tenant,
                "api_key_sha256": [hashlib.sha256(KEYS[tenant].encode()).hexdigest()],
                "weight": weight,
            }
            for tenant, weight in WEIGHTS.items()
        ],
        "fairness": {"mode": "vtc", "slots_per_replica": SLOTS_PER_REPLICA},
        "health": {"probe_interval_s": 0.5, "scrape_interval_s": 0.25},
        "timeouts": {"ttft_s": 60.0, "idle_s": 30.0},
        "telemetry": {"json_logs": True, "log_level": "WARNING"},
    }


async def one_request(
    client: httpx.AsyncClient, router: RouterProcess, tenant: str, rng: random.Random, log: Log
) -> None:
    words = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS[tenant]))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{rng.random()} {words}"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    url = f"{router.url}/v1/chat/completions"
    chunks: list[float] = []
    usage: dict[str, Any] | None = None
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            log.errors[str(r.status_code)] += 1
            await asyncio.sleep(0.05)
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices"):
                chunks.append(time.monotonic())
    if usage is None or not chunks:
        log.errors["no_usage"] += 1
        return
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    points = log.points[tenant]
    points.append((chunks[0], usage["prompt_tokens"] - cached))
    per_chunk = usage["completion_tokens"] / len(chunks)
    points.extend((at, per_chunk) for at in chunks)
    log.served.append((time.monotonic(), router.url))


async def client_loop(
    client: httpx.AsyncClient, router: RouterProcess, tenant: str, seed: int, log: Log
) -> None:
    rng = random.Random(seed)
    while True:
        try:
            await one_request(client, router, tenant, rng, log)
        except httpx.HTTPError as exc:
            log.errors[type(exc).__name__] += 1
            await asyncio.sleep(0.05)


def spawn_clients(
    client: httpx.AsyncClient, router: RouterProcess, log: Log, seed: int
) -> list[asyncio.Task[None]]:
    return [
        asyncio.create_task(client_loop(client, router, tenant, seed * 1000 + i * 10 + j, log))
        for i in range(CLIENTS_PER_TENANT_PER_ROUTER)
        for j, tenant in enumerate(WEIGHTS)
    ]


async def shared_routers(redis_url: str) -> int:
    store = SharedFairStore(redis_url, key_prefix=f"cp:fair:{MODEL}", timeout_s=2.0)
    try:
        return len((await store.view()).routers)
    finally:
        await store._redis.aclose(close_connection_pool=True)


async def scenario(routers: list[RouterProcess], joiner: RouterProcess, redis_url: str) -> Any:
    log = Log()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=100)
    async with httpx.AsyncClient(limits=limits, timeout=60.0) as client:
        tasks = [t for i, r in enumerate(routers) for t in spawn_clients(client, r, log, i)]
        try:
            w1 = time.monotonic() + WARMUP_S
            await asyncio.sleep(WARMUP_S + WINDOW_S)
            first = log.share(w1, w1 + WINDOW_S)
            two = await shared_routers(redis_url)
            joiner.start()  # a third router process joins mid-run
            await asyncio.to_thread(joiner.wait_ready, 2)
            tasks += spawn_clients(client, joiner, log, len(routers))
            w2 = time.monotonic() + WARMUP_S
            await asyncio.sleep(WARMUP_S + WINDOW_S)
            second = log.share(w2, w2 + WINDOW_S)
            three = await shared_routers(redis_url)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return first, second, (two, three), log, log.per_router(w2, w2 + WINDOW_S)


def test_weighted_shares_hold_across_routers_and_a_joining_one(
    model_dir: Path, redis_server: RedisServer
) -> None:
    started = time.monotonic()
    sims = [SimReplica(*sim_args(model_dir, speed=0.3)) for _ in range(2)]
    procs: list[RouterProcess] = []
    with tempfile.TemporaryDirectory(prefix="fairness-live-") as tmp:
        try:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(SimReplica.start, sims))
            config = router_config(model_dir, sims, redis_server.url, Path(tmp))
            procs = [RouterProcess(config, Path(tmp), i) for i in range(3)]
            for p in procs[:2]:
                p.start()
            for p in procs[:2]:
                p.wait_ready(2)
            first, second, (two, three), log, served = asyncio.run(
                scenario(procs[:2], procs[2], redis_server.url)
            )
            calls = Counter[str]()
            for p in procs:
                text = httpx.get(f"{p.url}/metrics", timeout=5.0).text
                for outcome in ("granted", "turn", "order", "full", "unreachable"):
                    calls[outcome] += int(
                        metric_value(text, "cp_fair_shared_calls_total", outcome=outcome)
                    )
                ready = httpx.get(f"{p.url}/ready", timeout=5.0).json()
                assert ready["status"] == "ready", ready
        finally:
            codes = [p.stop() for p in procs]
            for sim in sims:
                sim.stop()
    print(
        f"\nfairness live: 2 routers {first}, 3 routers {second}, routers in Redis {two}->{three}"
        f", requests per router in window 2 {sorted(served.values())}, errors {dict(log.errors)}"
        f", shared calls {dict(calls)}, {time.monotonic() - started:.1f}s",
        file=sys.stderr,
    )
    assert all(c in (0, -15) for c in codes), codes
    assert (two, three) == (2, 3) and len(served) == 3
    # one FIFO per tenant across routers: the joining router's clients are served like the others
    assert min(served.values()) >= 0.6 * max(served.values()), served
    want = WEIGHTS["B"] / sum(WEIGHTS.values())
    for window in (first, second):
        assert abs(window["B"] - want) <= 0.1 * want, window
