"""Routing quality, live: a shared-prefix workload through our router and through vllm-router.

The workload: `--groups` documents of about `--doc-tokens` tokens each (random words of the tiny
model's corpus), and `--requests` requests, each one document (drawn with Zipf popularity,
exponent `--zipf`) followed by its own question of about `--question-words` words, asking for
`--max-tokens` output tokens, streamed, on /v1/completions. Arrivals are Poisson at `--rate`.

The same requests, at the same times, are replayed in real time through
  (a) our router (`controlplane serve`, `prefix_affinity`, KV events followed, a private Redis as
      the shared index when `redis-server` exists), and
  (b) `vllm-router --policy cache_aware`,
each in front of a FRESH pair of simulated replicas (empty prefix caches; GPU "cpu", model
"tiny-llama", block 32, `--kv-blocks` KV blocks each, which is fewer than the documents need
together, so a policy that spreads a document over both replicas evicts; `--speed`).

Reported for each: the engines' own prefix-cache hit rate, delta of
`vllm:prefix_cache_hits_total` / delta of `vllm:prefix_cache_queries_total` summed over the
replicas' /metrics (tokens), and TTFT p50/p99 measured by the client (send to first content).

The simulator's prediction: the same requests (token ids from the replicas' own /tokenize,
chained per 32-token block into content ids), the same arrival times and the same fleet shape
(profile, KV blocks, max_num_seqs, max_model_len) through `controlplane.sim` with
`prefix_affinity` (and, as extras, `sglang_cache_aware`, the simulator's model of the policy
vllm-router's cache_aware derives from, and cache-blind `round_robin` as a reference: how much
of the hit rate is routing's doing). The simulator runs roofline time; a live replica runs
it `--speed` times faster, so arrivals are stretched by `speed` and TTFTs divided by it. The
live router's defaults are mirrored: speculative entries for 10 s, scrapes every 0.5 s.

Writes out/bench/live_quality.json and live_quality.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from common import console, out_dir, print_table, save_figure, write_json
from live_stack import (
    MODEL,
    OurRouter,
    Result,
    VllmRouter,
    counter_by_label,
    engine_counters,
    metrics_text,
    new_client,
    quantile,
    sim_fleet,
    stream_one,
    vllm_router_binary,
)
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from controlplane.roofline import profile
from controlplane.sim.fleet import FleetConfig
from controlplane.sim.replay import replay, with_policy
from controlplane.traces.model import Trace
from controlplane.traces.tokens import token_trace
from deploy.redis_local import RedisServer, available
from deploy.tiny_model import CORPUS

BLOCK = 32
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 64
SCRAPE_S = 0.5  # the live router's health.scrape_interval_s default
SPECULATIVE_TTL_S = 60.0  # its policy.speculative_ttl_s default
RETRACT_GRACE_S = 1.0  # its policy.retract_grace_s default


def workload(args: argparse.Namespace) -> list[tuple[float, int, str]]:
    """(arrival s, group, prompt text) per request, in arrival order."""
    rng = random.Random(args.seed)
    words = sorted({w.strip(".,;:!?()'\"").lower() for w in CORPUS.split()} - {""})
    words = [w for w in words if w.isalpha()]
    # about 3 tokens per word for random words of this corpus under the tiny BPE tokenizer
    doc_words = max(1, round(args.doc_tokens / 3.0))
    docs = [
        f"Document {g}. " + " ".join(rng.choice(words) for _ in range(doc_words))
        for g in range(args.groups)
    ]
    weights = [1.0 / (g + 1) ** args.zipf for g in range(args.groups)]
    out: list[tuple[float, int, str]] = []
    t = 0.0
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        g = rng.choices(range(args.groups), weights)[0]
        question = " ".join(rng.choice(words) for _ in range(args.question_words))
        out.append((t, g, f"{docs[g]}\n\nQuestion {i}: {question}?\nAnswer:"))
    return out


def body_of(prompt: str, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


def tokenize(url: str, prompts: list[str]) -> list[list[int]]:
    """The replica's own token ids for each prompt (what its prefix cache hashes)."""
    out = []
    with httpx.Client(timeout=10.0) as client:
        for prompt in prompts:
            resp = client.post(f"{url}/tokenize", json={"model": MODEL, "prompt": prompt})
            resp.raise_for_status()
            out.append(list(resp.json()["tokens"]))
    return out


def to_trace(
    arrivals: list[float], tokens: list[list[int]], max_tokens: int, speed: float
) -> Trace:
    """Chained content ids per full 32-token block; arrivals in roofline time (x speed)."""
    return token_trace(
        "live-shared-prefix",
        [t * speed for t in arrivals],
        tokens,
        output_tokens=max_tokens,
        block=BLOCK,
    )


async def replay_live(
    url: str, arrivals: list[float], bodies: list[bytes], label: str
) -> list[Result]:
    """Send request i at arrivals[i] (seconds from now); wait for all of them."""
    results: list[Result] = []
    tasks: list[asyncio.Task[Result]] = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} sent"),
        TimeElapsedColumn(),
    )
    async with new_client(256) as client:
        for _ in range(3):  # warm up the connections (a short prompt nobody else shares)
            warm = Result("warm-up", time.perf_counter())
            await stream_one(client, f"{url}/v1/completions", body_of("Hello.", 2), warm)
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(label, total=len(bodies))
            start = time.perf_counter()
            for t, body in zip(arrivals, bodies, strict=True):
                due = start + t
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                res = Result(label, due)
                results.append(res)
                tasks.append(
                    asyncio.create_task(stream_one(client, f"{url}/v1/completions", body, res))
                )
                progress.advance(task)
            await asyncio.gather(*tasks)
    return results


def live_run(
    args: argparse.Namespace,
    which: str,
    arrivals: list[float],
    prompts: list[str],
    tokens: list[list[int]] | None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """One live run on a fresh fleet; returns its figures and the prompts' token ids."""
    redis = RedisServer() if which == "router" and not args.no_redis and available() else None
    fleet = None
    router: OurRouter | VllmRouter | None = None
    try:
        if redis is not None:
            redis.start()
        fleet = sim_fleet(
            2,
            speed=args.speed,
            num_gpu_blocks=args.kv_blocks,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            block_size=BLOCK,
        )
        if tokens is None:
            tokens = tokenize(fleet.urls[0], prompts)
        if which == "router":
            router = OurRouter(
                fleet, policy="prefix_affinity", redis_url=redis.url if redis else None
            )
        else:
            router = VllmRouter(fleet.urls, "cache_aware")
        router.start()
        bodies = [body_of(p, args.max_tokens) for p in prompts]
        label = "our router, prefix_affinity" if which == "router" else "vllm-router cache_aware"
        # warm-up happens inside replay_live; count the engines' tokens from here on
        before = engine_counters(fleet.urls)
        results = asyncio.run(replay_live(router.url, arrivals, bodies, label))
        after = engine_counters(fleet.urls)
        decisions: dict[str, float] = {}
        if which == "router":  # why our router sent each request where it did
            text = metrics_text(router.url)
            decisions = counter_by_label(text, "cp_requests_total", "reason")
            fallbacks = counter_by_label(text, "cp_routing_fallbacks_total", "reason")
            decisions.update({f"fallback:{k}": v for k, v in fallbacks.items() if v})
            # what the router expected the chosen replicas to hold vs what they reported
            for key, metric in (
                ("tokens:prompt", "cp_prompt_tokens_total"),
                ("tokens:predicted_hit", "cp_predicted_prefix_hit_tokens_total"),
                ("tokens:engine_cached", "cp_engine_cached_tokens_total"),
            ):
                decisions[key] = sum(counter_by_label(text, metric, "policy").values())
    finally:
        if router is not None:
            router.stop()
        if fleet is not None:
            fleet.stop()
        if redis is not None:
            redis.stop()
    hits, queries = after[0] - before[0], after[1] - before[1]
    served = [b - a for a, b in zip(before[2], after[2], strict=True)]
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    prompt_tokens = sum(len(t) for t, r in zip(tokens, results, strict=True) if r.ok)
    cached = sum(max(0, r.cached_tokens) for r in ok)
    figures = {
        "engine_prefix_hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        # extras
        "ttft_p90_s": quantile(ttft, 0.9),
        "requests": len(results),
        "errors": len(results) - len(ok),
        "usage_cached_token_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "engine_prefix_queries": queries,
        "engine_prefix_hits": hits,
        "replica_share": [round(x / max(1.0, sum(served)), 3) for x in served],
        **({"decisions": {k: int(v) for k, v in sorted(decisions.items())}} if decisions else {}),
        "ttft_samples_s": sorted(round(x, 5) for x in ttft),
    }
    return figures, tokens


def simulate(
    args: argparse.Namespace, arrivals: list[float], tokens: list[list[int]]
) -> dict[str, Any]:
    trace = to_trace(arrivals, tokens, args.max_tokens, args.speed)
    prof = profile(
        "cpu",
        "tiny-llama",
        block_size=BLOCK,
        num_gpu_blocks_override=args.kv_blocks,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
    )
    config = FleetConfig(profile=prof, replicas=2)
    config = with_policy(
        replace(config, scrape_interval_s=SCRAPE_S * args.speed),
        speculative_ttl_s=SPECULATIVE_TTL_S * args.speed,
        retract_grace_s=RETRACT_GRACE_S * args.speed,
    )
    policies = ("prefix_affinity", "sglang_cache_aware", "round_robin")
    rep = replay(trace, config, policies)
    out: dict[str, Any] = {"pooled_prefix_hit_rate": rep.pooled_prefix_hit_rate}
    for name in policies:
        res = rep.results[name]
        queries = sum(s.prefix_queries for s in res.replicas)
        hits = sum(s.prefix_hits for s in res.replicas)
        ttft = [r.ttft_s / args.speed for r in res.completed()]
        per_replica = [
            sum(1 for r in res.records if r.replica == rep.replica_id) for rep in res.replicas
        ]
        out[name] = {
            "engine_prefix_hit_rate": hits / queries if queries else 0.0,
            "ttft_p50_s": quantile(ttft, 0.5),
            "ttft_p99_s": quantile(ttft, 0.99),
            "ttft_p90_s": quantile(ttft, 0.9),
            "requests": len(res.records),
            "errors": len(res.records) - len(ttft),
            "replica_share": [round(x / max(1, len(res.records)), 3) for x in per_replica],
            "decisions": res.reasons(),
            "ttft_samples_s": sorted(round(x, 5) for x in ttft),
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {
        "live: ours\nprefix_affinity": result["prefix_affinity"],
        "live: vllm-router\ncache_aware": result["vllm_router_cache_aware"],
        "sim\nprefix_affinity": result["simulated_prediction"],
        "sim: sglang\ncache_aware": result["simulated_sglang_cache_aware"],
        "sim\nround_robin": result["simulated_round_robin"],
    }
    samples = result.pop("_samples")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    labels = list(rows)
    xs = range(len(labels))
    axes[0].bar(xs, [r["engine_prefix_hit_rate"] for r in rows.values()], color="C0")
    axes[0].axhline(result["pooled_prefix_hit_rate"], color="grey", ls="--", lw=1)
    axes[0].set_title("engine prefix-cache hit rate (dashed: pooled ceiling)")
    width = 0.4
    axes[1].bar(
        [x - width / 2 for x in xs],
        [r["ttft_p50_s"] * 1e3 for r in rows.values()],
        width,
        label="p50",
    )
    axes[1].bar(
        [x + width / 2 for x in xs],
        [r["ttft_p99_s"] * 1e3 for r in rows.values()],
        width,
        label="p99",
    )
    axes[1].set_title("TTFT (ms)")
    axes[1].legend(fontsize=8)
    for ax in axes[:2]:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    for name, xs_ in samples.items():
        if xs_:
            axes[2].plot(
                [x * 1e3 for x in xs_], [(i + 1) / len(xs_) for i in range(len(xs_))], label=name
            )
    axes[2].set_xscale("log")
    axes[2].set_xlabel("TTFT (ms, log)")
    axes[2].set_ylabel("fraction of requests")
    axes[2].set_title("TTFT distribution")
    axes[2].grid(True, alpha=0.3)
    axes[2].legend(fontsize=8)
    w = result["workload"]
    fig.suptitle(
        f"live routing quality: {w['requests']} requests, {w['groups']} shared documents of "
        f"~{w['doc_tokens']} tokens, {w['rate_rps']:g} req/s, 2 simulated replicas x "
        f"{w['kv_blocks']} KV blocks"
    )
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16, help="shared documents")
    parser.add_argument("--doc-tokens", type=int, default=640, help="tokens per document")
    parser.add_argument("--question-words", type=int, default=16, help="words per question")
    parser.add_argument("--zipf", type=float, default=0.8, help="document popularity exponent")
    parser.add_argument("--requests", type=int, default=240, help="requests per run")
    parser.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--kv-blocks", type=int, default=128, help="KV blocks per replica")
    parser.add_argument("--speed", type=float, default=1.0, help="sim replicas' speed-up")
    parser.add_argument("--no-redis", action="store_true", help="our router: in-memory index")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    if vllm_router_binary() is None:
        raise SystemExit("vllm-router is not installed (pip install vllm-router)")
    t0 = time.perf_counter()
    work = workload(args)
    arrivals = [t for t, _, _ in work]
    prompts = [p for _, _, p in work]
    console.print(
        f"{len(work)} requests over {arrivals[-1]:.0f} s, {args.groups} documents; "
        "our router on fresh replicas ..."
    )
    ours, tokens = live_run(args, "router", arrivals, prompts, None)
    console.print("vllm-router cache_aware on fresh replicas ...")
    peer, _ = live_run(args, "vllm_router", arrivals, prompts, tokens)
    sim = simulate(args, arrivals, tokens)
    samples = {
        "our router, prefix_affinity": ours.pop("ttft_samples_s"),
        "vllm-router cache_aware": peer.pop("ttft_samples_s"),
        "simulator, prefix_affinity": sim["prefix_affinity"].pop("ttft_samples_s"),
    }
    sim["sglang_cache_aware"].pop("ttft_samples_s")
    sim["round_robin"].pop("ttft_samples_s")
    lengths = [len(t) for t in tokens]
    result: dict[str, Any] = {
        "prefix_affinity": ours,
        "vllm_router_cache_aware": peer,
        "simulated_prediction": sim["prefix_affinity"],
        # extras
        "simulated_sglang_cache_aware": sim["sglang_cache_aware"],
        "simulated_round_robin": sim["round_robin"],
        "pooled_prefix_hit_rate": sim["pooled_prefix_hit_rate"],
        "workload": {
            "requests": args.requests,
            "groups": args.groups,
            "doc_tokens": args.doc_tokens,
            "prompt_tokens_mean": sum(lengths) / len(lengths),
            "prompt_tokens_max": max(lengths),
            "question_words": args.question_words,
            "zipf": args.zipf,
            "rate_rps": args.rate,
            "max_tokens": args.max_tokens,
            "kv_blocks": args.kv_blocks,
            "block_size": BLOCK,
            "speed": args.speed,
            "replicas": 2,
            "gpu": "cpu",
            "model": "tiny-llama",
            "endpoint": "/v1/completions",
            "seed": args.seed,
            "our_index": "in-memory" if args.no_redis or not available() else "redis",
        },
        "wall_s": round(time.perf_counter() - t0, 1),
        "_samples": samples,
    }
    plot(result, out_dir() / "live_quality.png")
    rows = []
    for label, key in (
        ("our router, prefix_affinity", "prefix_affinity"),
        ("vllm-router, cache_aware", "vllm_router_cache_aware"),
        ("simulator, prefix_affinity", "simulated_prediction"),
        ("simulator, sglang_cache_aware", "simulated_sglang_cache_aware"),
        ("simulator, round_robin (reference)", "simulated_round_robin"),
    ):
        r = result[key]
        rows.append(
            (
                label,
                f"{r['engine_prefix_hit_rate']:.1%}",
                f"{r['ttft_p50_s'] * 1e3:.1f}",
                f"{r['ttft_p99_s'] * 1e3:.1f}",
                r["errors"],
            )
        )
    print_table(
        f"live routing quality ({args.requests} requests, pooled ceiling "
        f"{result['pooled_prefix_hit_rate']:.1%})",
        ["run", "engine prefix hit", "TTFT p50 ms", "TTFT p99 ms", "errors"],
        rows,
    )
    console.print(f"wall {result['wall_s']} s")
    write_json("live_quality.json", result)


if __name__ == "__main__":
    main()
