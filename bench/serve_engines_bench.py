"""Engines on Ray Serve: our RequestRouter (prefix affinity) against Serve's default router.

Two simulated-engine replicas (deploy/engines/sim.py, speed 5, KV events into a private Redis)
on a local Ray cluster (2 CPUs), called through a handle from this process, once with
`PolicyRequestRouter` (router/serve/request_router.py, prefix_affinity) and once with Serve's
default `PowerOfTwoChoicesRequestRouter`, with the same load: GROUPS shared prefixes of about
PREFIX_WORDS words, REQUESTS_PER_GROUP requests each with their own question, shuffled,
CONCURRENCY at a time, streamed (after one warm-up request). Per router: the engines' own
prefix-cache hit rate (hits / queries, tokens, from the replicas' routing stats, over this load
only), the time to the first body chunk and to the end of the stream (p50, p99, as the caller
sees them through the handle), and the decision reasons (ours only: the `x-cp-decision` header).
Then the cost of our `choose_replicas` alone, in this process against the same Redis (tokenize,
hash, index lookup, policy, books, speculative write): what the router adds to each request
before Serve sends it. A third run uses our router with `least_loaded`: the router's whole path
without prefix affinity's gathering of each group on the replica that holds its prefix (where
its requests queue behind each other), to tell the router's cost from the policy's effect. A
fourth uses Ray's own `PrefixCacheAffinityRouter` (from the ray wheel, through the adapter in
deploy/engines/ray_prefix_router.py that hands it our calls' prompt text).

    python bench/serve_engines_bench.py            # writes out/bench/serve_engines.json
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import numpy as np
from common import console, print_table, write_json

from deploy.redis_local import RedisServer
from deploy.tiny_model import default_model_dir, make_tiny_model
from router.serve.stats import EngineStats
from router.telemetry import DECISION_HEADER, parse_decision_header

MODEL = "tiny-llama"
GROUPS = 16
REQUESTS_PER_GROUP = 8
PREFIX_WORDS = 120
CONCURRENCY = 4
SEED = 11


def prompts() -> list[str]:
    rng = random.Random(SEED)

    def words(n: int) -> str:
        letters = "abcdefghijklmnopqrstuvwxyz"
        return " ".join("".join(rng.choice(letters) for _ in range(6)) for _ in range(n))

    out = [f"{p} question {words(4)}" for p in (words(PREFIX_WORDS) for _ in range(GROUPS))
           for _ in range(REQUESTS_PER_GROUP)]  # fmt: skip
    rng.shuffle(out)
    return out


async def one(handle: Any, prompt: str, rid: str) -> tuple[float, float, str]:
    messages = [{"role": "user", "content": prompt}]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True})
    headers = [["content-type", "application/json"], ["x-request-id", rid]]
    t0 = time.perf_counter()
    first = 0.0
    reason = "-"
    call = handle.options(stream=True).handle
    async for part in call.remote("POST", "/v1/chat/completions", headers, body.encode()):
        if isinstance(part, dict):
            decision = dict(part["headers"]).get(DECISION_HEADER)
            reason = parse_decision_header(decision)["reason"] if decision else "-"
        elif not first:
            first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, reason


async def stats(handle: Any, n: int = 2) -> dict[str, EngineStats]:
    seen: dict[str, EngineStats] = {}
    while len(seen) < n:
        s = EngineStats.from_dict(await handle.record_routing_stats.remote())
        assert s is not None
        seen[s.replica_id] = s
    return seen


async def load(handle: Any) -> dict[str, Any]:
    # one request first, outside the figures: the router's Redis connection, the tokenizer
    await one(handle, "warm up", "warm-up")
    before = await stats(handle)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def limited(i: int, prompt: str) -> tuple[float, float, str]:
        async with gate:
            return await one(handle, prompt, f"b{i}")

    results = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts())))
    await asyncio.sleep(1.0)  # the stats period (0.5 s) twice: the last requests are counted
    after = await stats(handle)
    hits = sum(after[r].prefix_cache_hits - before[r].prefix_cache_hits for r in after)
    queries = sum(after[r].prefix_cache_queries - before[r].prefix_cache_queries for r in after)
    ttft = np.array([r[0] for r in results])
    e2e = np.array([r[1] for r in results])
    return {
        "requests": len(results),
        "engine_prefix_hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1000),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1000),
        "e2e_p50_ms": float(np.percentile(e2e, 50) * 1000),
        "reasons": dict(Counter(r[2] for r in results)),
    }


async def decide_cost(redis_url: str, tokenizer: str, n: int = 300) -> dict[str, float]:
    """p50/p99 milliseconds of `PolicyRequestRouter.choose_replicas` plus its hooks, in process."""
    from ray.serve._private.common import (
        DeploymentHandleSource,
        DeploymentID,
        ReplicaID,
        RequestMetadata,
    )
    from ray.serve.request_router import PendingRequest

    from router.serve.request_router import PolicyRequestRouter

    dep = DeploymentID(name="engine", app_name="bench")
    router = PolicyRequestRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(policy="prefix_affinity", tokenizer=tokenizer, redis_url=redis_url)

    class Replica:
        def __init__(self, uid: str) -> None:
            self.replica_id = ReplicaID(uid, dep)
            stats = EngineStats(engine="sim", model=MODEL, replica_id=uid, block_size=32)
            self.routing_stats = stats.to_dict()

    replicas = [Replica("a"), Replica("b")]
    texts = prompts()
    took = []
    for i in range(n):
        messages = [{"role": "user", "content": texts[i % len(texts)]}]
        body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8}).encode()
        pr = PendingRequest(
            args=["POST", "/v1/chat/completions", [], body],
            kwargs={},
            metadata=RequestMetadata(f"d{i}", f"d{i}", call_method="handle"),
        )
        t0 = time.perf_counter()
        tiers = await router.choose_replicas(replicas, pr)  # type: ignore[arg-type]
        chosen = tiers[0][0].replica_id
        router.on_request_routed(pr, chosen, None)
        router.on_request_completed(chosen, f"d{i}")
        took.append(time.perf_counter() - t0)
    await router.aclose()
    ms = np.array(took[20:]) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def main() -> None:
    import ray
    from ray import serve

    from deploy.engines.deployment import policy_router_config, stats_config
    from deploy.engines.ray_prefix_router import RAY_PREFIX_ROUTER
    from deploy.engines.sim import DEPLOYMENT, SimEngineArgs, sim_engine_app

    md = default_model_dir()
    make_tiny_model(md)
    results: dict[str, Any] = {}
    with RedisServer() as redis_server:
        args = SimEngineArgs(model_dir=str(md), speed=5.0, redis_url=redis_server.url)
        routers = {
            "ours_prefix_affinity": policy_router_config(
                policy="prefix_affinity", model=MODEL, tokenizer=str(md), redis_url=redis_server.url
            ),
            # the same router with a load-only policy: its overhead without the gathering
            "ours_least_loaded": policy_router_config(
                policy="least_loaded", model=MODEL, tokenizer=str(md), redis_url=redis_server.url
            ),
            "serve_pow2": None,
            "ray_prefix_cache_affinity": stats_config(request_router_class=RAY_PREFIX_ROUTER),
        }
        decide = asyncio.run(decide_cost(redis_server.url, str(md)))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for name, router in routers.items():
                serve.run(sim_engine_app(args, request_router=router), name=name, route_prefix=None)
                handle = serve.get_deployment_handle(DEPLOYMENT, app_name=name)
                results[name] = asyncio.run(load(handle))
                serve.delete(name)
        finally:
            serve.shutdown()  # type: ignore[no-untyped-call]
            ray.shutdown()
    print_table(
        "Engines on Ray Serve: our RequestRouter vs Serve's and Ray's (2 simulated engines)",
        ["router", "engine prefix hit rate", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms"],
        [
            [n, r["engine_prefix_hit_rate"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["e2e_p50_ms"]]
            for n, r in results.items()
        ],
    )
    for name in ("ours_prefix_affinity", "ours_least_loaded"):
        console.print(f"decision reasons ({name}): {results[name]['reasons']}")
    console.print(
        f"our choose_replicas + hooks, in process with Redis: p50 {decide['p50_ms']:.2f} ms, "
        f"p99 {decide['p99_ms']:.2f} ms"
    )
    load_desc = {"groups": GROUPS, "per_group": REQUESTS_PER_GROUP, "concurrency": CONCURRENCY}
    write_json("serve_engines.json", {"load": load_desc, "routers": results, "ours_decide": decide})


if __name__ == "__main__":
    main()
