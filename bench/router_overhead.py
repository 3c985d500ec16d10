"""Router overhead on a live simulated fleet over loopback, beside vllm-router and sglang-router.

Setup: two simulated vLLM replicas (`controlplane sim-replica`, KV events on, `--speed` 50 so a
12-word chat prompt with 8 output tokens costs the engine well under a millisecond), and in front
of the same two replicas at once: our router as its own process in its production setup
(`controlplane serve --config`, `prefix_affinity`, a private Redis as the shared index fed by the
router's own KV-event followers, `--tenants` tenants with API keys and hard token quotas in Redis,
the fair queue shared in Redis, JSON logs at WARNING, the local tokenizer), the same router with
two worker processes on one port (`--workers 2`, its Redis state under other key prefixes), the
Rust `vllm-router` twice (`round_robin`, `cache_aware`) and the Rust `sglang-router` (`launch
--policy cache_aware`). The load generator (asyncio + one httpx AsyncClient) sends open-loop
Poisson arrivals of streaming chat requests, each with its own short prompt and one of the
tenants' keys (to every target alike); TTFT is measured from a request's *scheduled* send time
to the first SSE event with content.

Added latency: at each of `--rates` (50 and 100 requests/s) the targets take turns in short
phases (`--phase-s`), in a fresh random order every round (`--rounds`), so machine drift hits all
of them alike; added TTFT at a quantile = quantile(target) - quantile(direct), over all of a
target's requests at that rate. Targets: p50 < 2 ms, p99 < 10 ms for our router; goals: CPU per
request, added p50 and p99 no worse than vllm-router `cache_aware`'s in the same run, and a max
sustained rate at least its own (`goals_vs_vllm_router_cache_aware`).

Highest sustained rate: every target is ramped through open-loop rates `--ramp-start` x
`--ramp-factor`^k (targets interleaved at each step, `--step-s` per step). A step is *sustained*
when (1) no request failed, (2) achieved throughput (completed requests / time from the first
scheduled send to the last completion) is at least 95% of the offered rate (requests / span of
their scheduled sends), and (3) p99 TTFT <= `--p99-bound-ms` (200 ms). A failed step is retried
once (the machine is shared); `max_rps` is the highest offered rate sustained before a target's
first twice-failed step (so its resolution is the ramp factor, 25% by default).

The generator, the routers and the replicas share this machine's cores (`cores` in the JSON: 2 on
the CI machine kind), so every figure is a co-located one: a router process's CPU is taken from
the replicas and the client. "direct" shows what the client and fleet sustain without a router;
when a router reaches it, the ceiling measured is the fleet's, not the router's (`ceiling`).

JSON: the top-level keys are at `--rate` (100); `by_rate` holds the same per-target figures at
each rate.

Writes out/bench/router_overhead.json and router_overhead.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from common import console, out_dir, phase_columns, print_table, save_figure, write_json
from live_stack import (
    MODEL,
    OurRouter,
    Phase,
    Result,
    SglangRouter,
    VllmRouter,
    bench_tenants,
    cpu_s,
    metrics_text,
    new_client,
    open_loop,
    quantile,
    sglang_router_binary,
    sim_fleet,
    vllm_router_binary,
)
from rich.progress import Progress

from deploy.redis_local import RedisServer, available
from deploy.tiny_model import CORPUS

# every distinct word of the tiny model's corpus: random prompts share little beyond the template
WORDS = sorted({w.strip(".,;:!?()'\"").lower() for w in CORPUS.split()} - {""})
WORDS = [w for w in WORDS if w.isalpha()]
TARGETS = (
    "direct",
    "router",
    "router_two_workers",
    "vllm_router_round_robin",
    "vllm_router_cache_aware",
    "sglang_router",
)
ROUTERS = TARGETS[1:]


def chat_body(rng: random.Random, words: int, max_tokens: int) -> bytes:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()


def served_counts(urls: list[str]) -> list[float]:
    """Requests each replica has finished so far (vllm:request_success_total, all reasons)."""
    from controlplane.metrics_scrape import parse_metrics

    return [
        sum(parse_metrics(metrics_text(u), model_name=MODEL).request_success.values()) for u in urls
    ]


def summarize(results: list[Result]) -> dict[str, float]:
    ttft = [r.ttft for r in results if r.ok]
    return {
        "requests": len(results),
        "errors": sum(not r.ok for r in results),
        "ttft_p50_ms": quantile(ttft, 0.50) * 1e3,
        "ttft_p90_ms": quantile(ttft, 0.90) * 1e3,
        "ttft_p99_ms": quantile(ttft, 0.99) * 1e3,
    }


def judge(phase: Phase, p99_bound_s: float) -> dict[str, Any]:
    res = phase.results
    ok = [r for r in res if r.ok]
    first = min((r.scheduled for r in res), default=0.0)
    span = max((r.scheduled for r in res), default=0.0) - first
    offered = (len(res) - 1) / span if span > 0 and len(res) > 1 else float("nan")
    last_done = max((r.done for r in ok), default=first)
    achieved = (len(ok) - 1) / (last_done - first) if last_done > first and ok else 0.0
    p99 = quantile([r.ttft for r in ok], 0.99)
    errors = len(res) - len(ok)
    sustained = errors == 0 and achieved >= 0.95 * offered and p99 <= p99_bound_s
    return {
        "rate": phase.rate,
        "offered_rps": round(offered, 1),
        "achieved_rps": round(achieved, 1),
        "ttft_p50_ms": round(quantile([r.ttft for r in ok], 0.5) * 1e3, 2),
        "ttft_p99_ms": round(p99 * 1e3, 2),
        "errors": errors,
        "generator_late_p99_ms": round(quantile(phase.late_s, 0.99) * 1e3, 2),
        "sustained": bool(sustained),
    }


def cpu_costs(
    phases: list[tuple[str, int, float, dict[str, float]]], targets: list[str]
) -> dict[str, dict[str, float]]:
    """CPU ms per request of the client, the fleet and the target's own router process, from
    (target, requests, wall s, CPU s by component) per phase; a router process's background CPU
    (probes, scrapes, event following: its rate while other targets were measured) is taken
    out of its own phases."""
    out: dict[str, dict[str, float]] = {}
    for t in targets:
        mine = [p for p in phases if p[0] == t]
        n = sum(p[1] for p in mine) or 1
        row = {
            "client": sum(p[3]["client"] for p in mine) / n * 1e3,
            "fleet": sum(p[3]["fleet"] for p in mine) / n * 1e3,
        }
        if t != "direct":
            others = [p for p in phases if p[0] != t]
            idle_rate = sum(p[3][t] for p in others) / max(1e-9, sum(p[2] for p in others))
            busy = sum(p[3][t] for p in mine) - idle_rate * sum(p[2] for p in mine)
            row["router_process"] = busy / n * 1e3
            row["router_idle_cpu_pct"] = idle_rate * 100
        out[t] = {k: round(v, 3) for k, v in row.items()}
    return out


async def measure(
    args: argparse.Namespace,
    urls: dict[str, list[str]],
    pgids: dict[str, list[int]],
    headers: list[dict[str, str]],
) -> dict[str, Any]:
    rng = random.Random(args.seed)

    def cpu_now() -> dict[str, float]:
        return {"client": time.process_time(), **{k: cpu_s(v) for k, v in pgids.items()}}

    fleet_urls = urls["direct"]
    shares = {t: [0.0] * len(fleet_urls) for t in urls}  # requests each replica served
    counters = dict.fromkeys(urls, 0)

    def requester(target: str) -> Callable[[int], tuple[str, str, bytes, Mapping[str, str]]]:
        def make(_i: int) -> tuple[str, str, bytes, Mapping[str, str]]:
            pool = urls[target]
            n = counters[target]
            counters[target] += 1
            body = chat_body(rng, args.prompt_words, args.max_tokens)
            url = f"{pool[n % len(pool)]}/v1/chat/completions"
            return target, url, body, headers[n % len(headers)]

        return make

    targets = list(urls)
    ramp_rates: list[float] = []
    rate = args.ramp_start
    while rate <= args.ramp_max and not args.no_ramp:
        ramp_rates.append(round(rate))
        rate *= args.ramp_factor
    rates = args.rates
    phases_total = len(targets) * (1 + args.rounds * len(rates)) + len(targets) * len(ramp_rates)
    cpu_phases: dict[float, list[tuple[str, int, float, dict[str, float]]]] = {r: [] for r in rates}
    at_rate: dict[float, dict[str, list[Result]]] = {r: {t: [] for t in targets} for r in rates}
    late: dict[str, list[float]] = {t: [] for t in targets}
    ramp: list[dict[str, Any]] = []
    max_rps: dict[str, float] = dict.fromkeys(targets, 0.0)  # 0: not even the first step
    columns = phase_columns()
    async with new_client() as client:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("warm-up", total=phases_total)
            for t in targets:  # warm-up: connections, tokenizer, caches; not counted
                await open_loop(client, max(rates), 1.0, requester(t), rng)
                progress.advance(task)
            last = await asyncio.to_thread(served_counts, fleet_urls)
            for rate in rates:
                for rnd in range(args.rounds):
                    order = targets.copy()
                    rng.shuffle(order)
                    for t in order:
                        progress.update(task, description=f"{rate:g} req/s, round {rnd + 1}: {t}")
                        c0, w0 = cpu_now(), time.perf_counter()
                        phase = await open_loop(client, rate, args.phase_s, requester(t), rng)
                        c1, w1 = cpu_now(), time.perf_counter()
                        served = await asyncio.to_thread(served_counts, fleet_urls)
                        new = zip(shares[t], served, last, strict=True)
                        shares[t] = [have + (now - before) for have, now, before in new]
                        last = served
                        used = {k: c1[k] - c0[k] for k in c0}
                        cpu_phases[rate].append((t, len(phase.results), w1 - w0, used))
                        at_rate[rate][t] += phase.results
                        late[t] += phase.late_s
                        progress.advance(task)
            active = targets.copy()
            last_ok: dict[str, float] = dict.fromkeys(targets, 0.0)
            for rate in ramp_rates:
                rng.shuffle(active)
                for t in list(active):
                    progress.update(task, description=f"ramp {rate:g} req/s: {t}")
                    for attempt in (1, 2):
                        phase = await open_loop(
                            client, rate, args.step_s, requester(t), rng, drain_s=3.0
                        )
                        row = {"target": t, "attempt": attempt, **judge(phase, args.p99_bound)}
                        ramp.append(row)
                        if row["sustained"]:
                            last_ok[t] = rate
                            break
                    else:
                        active.remove(t)
                        max_rps[t] = last_ok[t]
                    progress.advance(task)
                await asyncio.sleep(0.5)  # let stragglers of a failed step clear
            for t in active:  # never failed within the ramp: at least its top rate
                max_rps[t] = last_ok[t]
    main = args.rate
    return {
        "at_rate": {t: summarize(at_rate[main][t]) for t in targets},
        "cpu_ms_per_request": cpu_costs(cpu_phases[main], targets),
        "by_rate": {
            r: {
                "at_rate": {t: summarize(at_rate[r][t]) for t in targets},
                "cpu_ms_per_request": cpu_costs(cpu_phases[r], targets),
            }
            for r in rates
        },
        "replica_share": {
            t: [round(x / max(1.0, sum(v)), 3) for x in v] for t, v in shares.items()
        },
        "generator_late_p99_ms": {t: quantile(late[t], 0.99) * 1e3 for t in targets},
        "ramp": ramp,
        "max_rps": max_rps,
        "capped": sorted(active),
        "ramp_top": ramp_rates[-1] if ramp_rates else float("nan"),
        "ttft_samples_ms": {
            t: sorted(round(r.ttft * 1e3, 3) for r in at_rate[main][t] if r.ok) for t in targets
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if vllm_router_binary() is None:
        raise SystemExit("vllm-router is not installed (pip install vllm-router)")
    if sglang_router_binary() is None:
        raise SystemExit("sglang-router is not installed (pip install sglang-router)")
    use_redis = not args.no_redis and available()
    redis = RedisServer() if use_redis else None
    fleet = None
    procs: list[OurRouter | VllmRouter | SglangRouter] = []
    tenants, headers = bench_tenants(args.tenants)
    t0 = time.perf_counter()
    try:
        if redis is not None:
            redis.start()
        console.print(
            f"starting {args.replicas} simulated replicas (speed {args.speed:g}), our router "
            f"({'Redis' if redis else 'in-memory'} index, {args.tenants} tenants with quotas), "
            "the same with two workers, vllm-router x 2 and sglang-router ..."
        )
        fleet = sim_fleet(args.replicas, speed=args.speed, max_num_seqs=256)
        url = redis.url if redis else None
        ours = OurRouter(fleet, policy=args.policy, redis_url=url, extra={"tenants": tenants})
        # the two-worker router keeps its Redis state apart from the one-worker router's
        apart = {
            "tenants": tenants,
            "redis": {"url": url, "key_prefix": "rtr2:pidx"},
            "fairness": {"key_prefix": "cp2:fair"},
            "quota": {"key_prefix": "cp2:quota"},
        }
        two = OurRouter(fleet, policy=args.policy, redis_url=url, extra=apart, workers=2)
        rr = VllmRouter(fleet.urls, "round_robin")
        ca = VllmRouter(fleet.urls, "cache_aware")
        sg = SglangRouter(fleet.urls, "cache_aware")
        started: dict[str, OurRouter | VllmRouter | SglangRouter] = {
            "router": ours,
            "vllm_router_round_robin": rr,
            "vllm_router_cache_aware": ca,
            "sglang_router": sg,
        }
        if use_redis:  # several workers share their state through Redis
            started["router_two_workers"] = two
        for p in started.values():
            procs.append(p)
            p.start(timeout_s=120.0)
        urls: dict[str, list[str]] = {"direct": fleet.urls}
        pgids: dict[str, list[int]] = {"fleet": fleet.pgids()}
        for name in ROUTERS:
            if name in started:
                child = started[name].child
                assert child is not None
                urls[name] = [started[name].url]
                pgids[name] = [child.pgid]
        data = asyncio.run(measure(args, urls, pgids, headers))
    finally:
        for p in reversed(procs):
            p.stop()
        if fleet is not None:
            fleet.stop()
        if redis is not None:
            redis.stop()
    data["wall_s"] = time.perf_counter() - t0
    data["index"] = "redis" if use_redis else "in-memory"
    return data


def report(args: argparse.Namespace, data: dict[str, Any]) -> dict[str, object]:
    at = data["at_rate"]
    base = at["direct"]
    # None: the ramp was skipped (--no-ramp)
    mx: dict[str, float | None] = {
        t: None if args.no_ramp else v for t, v in data["max_rps"].items()
    }

    present = [t for t in ROUTERS if t in at]

    def added(rate_at: dict[str, dict[str, float]], t: str) -> dict[str, float]:
        direct = rate_at["direct"]
        return {
            "added_ttft_p50_ms": round(rate_at[t]["ttft_p50_ms"] - direct["ttft_p50_ms"], 3),
            "added_ttft_p99_ms": round(rate_at[t]["ttft_p99_ms"] - direct["ttft_p99_ms"], 3),
        }

    def entry(t: str) -> dict[str, float | None]:
        return {**added(at, t), "max_rps": mx[t]}

    by_rate: dict[str, Any] = {}
    for rate, d in data["by_rate"].items():
        rate_at = d["at_rate"]
        per_target = {t: {**added(rate_at, t), "max_rps": mx[t]} for t in present}
        by_rate[f"{rate:g}"] = {
            **per_target,
            # the same key as at the top level: vllm-router `cache_aware`
            "vllm_router": per_target["vllm_router_cache_aware"],
            "ttft_at_rate_ms": {
                t: {k: round(v, 3) for k, v in row.items()} for t, row in rate_at.items()
            },
            "cpu_ms_per_request": d["cpu_ms_per_request"],
        }

    def goals() -> dict[str, bool]:
        """This router against vllm-router cache_aware in the same run (the issue's goals)."""
        ca, ours = "vllm_router_cache_aware", "router"
        out: dict[str, bool] = {}
        for rate, row in by_rate.items():
            cpu = row["cpu_ms_per_request"]
            out[f"cpu_at_{rate}"] = cpu[ours]["router_process"] <= cpu[ca]["router_process"]
            for q in ("p50", "p99"):
                key = f"added_ttft_{q}_ms"
                out[f"added_ttft_{q}_at_{rate}"] = row[ours][key] <= row[ca][key]
        if not args.no_ramp:
            best = max(data["max_rps"][t] for t in ("router", "router_two_workers") if t in at)
            out["max_rps"] = best >= data["max_rps"][ca]
            out["max_rps_one_process"] = data["max_rps"][ours] >= data["max_rps"][ca]
        return out

    fleet_bound = [t for t in present if data["max_rps"][t] >= data["max_rps"]["direct"]]
    result: dict[str, object] = {
        "router": entry("router"),
        "vllm_router": entry("vllm_router_cache_aware"),
        "rate_rps": args.rate,
        "cores": os.cpu_count(),
        # extras
        **{t: entry(t) for t in present if t not in ("router", "vllm_router_cache_aware")},
        "direct": {"max_rps": mx["direct"]},
        "ttft_at_rate_ms": {t: {k: round(v, 3) for k, v in s.items()} for t, s in at.items()},
        "cpu_ms_per_request": data["cpu_ms_per_request"],
        "by_rate": by_rate,
        "goals_vs_vllm_router_cache_aware": goals(),
        "replica_share_at_rate": data["replica_share"],
        "generator_late_p99_ms": {t: round(v, 3) for t, v in data["generator_late_p99_ms"].items()},
        "targets": {"added_ttft_p50_ms": 2.0, "added_ttft_p99_ms": 10.0},
        "targets_met": {
            "added_ttft_p50": at["router"]["ttft_p50_ms"] - base["ttft_p50_ms"] < 2.0,
            "added_ttft_p99": at["router"]["ttft_p99_ms"] - base["ttft_p99_ms"] < 10.0,
        },
        "ceiling": (
            "not measured (--no-ramp)"
            if args.no_ramp
            else f"fleet/client: {', '.join(fleet_bound)} sustained as much as direct"
            if fleet_bound
            else "each router sustained less than the fleet did directly"
        ),
        "ramp": data["ramp"],
        "ramp_top_rps": data["ramp_top"],
        "max_rps_capped": data["capped"],
        "sustained_criterion": {
            "no_errors": True,
            "achieved_over_offered_min": 0.95,
            "ttft_p99_max_ms": args.p99_bound * 1e3,
            "retries_per_step": 1,
            "ramp_factor": args.ramp_factor,
        },
        "setup": {
            "replicas": args.replicas,
            "engine": "sim",
            "gpu": "cpu",
            "model": MODEL,
            "speed": args.speed,
            "prompt_words": args.prompt_words,
            "max_tokens": args.max_tokens,
            "stream": True,
            "endpoint": "/v1/chat/completions",
            "our_policy": args.policy,
            "our_index": data["index"],
            "tenants": args.tenants,
            "quotas": "hard, in Redis" if data["index"] == "redis" else "hard, in memory",
            "fair_queue": "shared in Redis" if data["index"] == "redis" else "local",
            "rates": args.rates,
            "phase_s": args.phase_s,
            "rounds": args.rounds,
            "step_s": args.step_s,
            "seed": args.seed,
        },
        "wall_s": round(data["wall_s"], 1),
    }
    return result


def plot(result: dict[str, Any], samples: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    for t in TARGETS:
        xs = samples[t]
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=t)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT at {result['rate_rps']:g} streaming req/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ramp = result["ramp"]
    for t in TARGETS:
        rows = {r["rate"]: r for r in ramp if r["target"] == t}  # the last attempt per rate
        if not rows:
            continue
        rates = sorted(rows)
        axes[1].plot(rates, [rows[r]["ttft_p99_ms"] for r in rates], marker="o", label=t)
        axes[2].plot(rates, [rows[r]["achieved_rps"] for r in rates], marker="o", label=t)
    bound = result["sustained_criterion"]["ttft_p99_max_ms"]
    axes[1].axhline(bound, color="grey", ls="--", lw=1, label=f"bound {bound:g} ms")
    axes[1].set_yscale("log")
    axes[1].set_title("ramp: p99 TTFT")
    axes[1].set_ylabel("ms (log)")
    top = max((r["rate"] for r in ramp), default=1)
    axes[2].plot([0, top], [0, top], color="grey", ls="--", lw=1, label="offered")
    axes[2].set_title("ramp: achieved throughput")
    axes[2].set_ylabel("req/s")
    for ax in axes[1:]:
        ax.set_xlabel("offered req/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"router overhead: {result['setup']['replicas']} simulated replicas, loopback, "
        f"{result['cores']} cores shared by client, routers and replicas"
    )
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", default="50,100", help="req/s at which the added TTFT is measured (comma list)"
    )
    parser.add_argument(
        "--rate", type=float, default=100.0, help="the rate of the top-level JSON figures"
    )
    parser.add_argument("--rounds", type=int, default=8, help="rounds of phases per rate")
    parser.add_argument("--tenants", type=int, default=4, help="tenants with keys and quotas")
    parser.add_argument("--phase-s", type=float, default=1.5, help="seconds per target phase")
    parser.add_argument("--ramp-start", type=float, default=100.0, help="first ramp rate")
    parser.add_argument("--ramp-factor", type=float, default=1.25, help="ramp step factor")
    parser.add_argument("--ramp-max", type=float, default=1000.0, help="highest ramp rate")
    parser.add_argument("--step-s", type=float, default=2.0, help="seconds per ramp step")
    parser.add_argument(
        "--p99-bound-ms", type=float, default=200.0, help="p99 TTFT a sustained step stays under"
    )
    parser.add_argument("--no-ramp", action="store_true", help="skip the max-rate ramp")
    parser.add_argument("--speed", type=float, default=50.0, help="sim replicas' speed-up")
    parser.add_argument("--replicas", type=int, default=2, help="simulated replicas (<= 3)")
    parser.add_argument("--prompt-words", type=int, default=12, help="words per prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--policy", default="prefix_affinity", help="our router's policy")
    parser.add_argument("--no-redis", action="store_true", help="our router: in-memory index")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not 1 <= args.replicas <= 3:
        parser.error("--replicas: 1 to 3 (the machine is shared)")
    args.p99_bound = args.p99_bound_ms / 1e3
    args.rates = sorted({float(r) for r in args.rates.split(",")} | {args.rate})
    data = run(args)
    result = report(args, data)
    for rate, d in data["by_rate"].items():
        at = d["at_rate"]
        rows: list[list[object]] = []
        for t in TARGETS:
            if t not in at:
                continue
            s = at[t]
            added = (
                "" if t == "direct" else
                f"{s['ttft_p50_ms'] - at['direct']['ttft_p50_ms']:+.2f} / "
                f"{s['ttft_p99_ms'] - at['direct']['ttft_p99_ms']:+.2f}"
            )  # fmt: skip
            mx = data["max_rps"][t]
            cpu = d["cpu_ms_per_request"][t]
            rows.append(
                [
                    t,
                    s["requests"],
                    s["errors"],
                    f"{s['ttft_p50_ms']:.2f} / {s['ttft_p99_ms']:.2f}",
                    added,
                    (
                        "-"
                        if args.no_ramp
                        else f"< {args.ramp_start:g}"
                        if not mx
                        else f">= {mx:g}"
                        if t in data["capped"]
                        else f"{mx:g}"
                    ),
                    f"{cpu.get('router_process', 0.0):.2f}" if t != "direct" else "",
                    f"{cpu['fleet']:.2f} / {cpu['client']:.2f}",
                ]
            )
        print_table(
            f"router overhead at {rate:g} streaming req/s, {args.replicas} simulated replicas, "
            f"{os.cpu_count()} cores shared (targets: +2 ms p50, +10 ms p99)",
            [
                "target",
                "requests",
                "errors",
                "TTFT p50 / p99 ms",
                "added p50 / p99 ms",
                "max req/s",
                "router CPU ms/req",
                "fleet / client CPU ms/req",
            ],
            rows,
        )
    goals = result["goals_vs_vllm_router_cache_aware"]
    console.print(f"goals against vllm-router cache_aware: {goals}")
    console.print(f"ceiling: {result['ceiling']}; wall {result['wall_s']} s")
    plot(result, data["ttft_samples_ms"], out_dir() / "router_overhead.png")
    write_json("router_overhead.json", result)


if __name__ == "__main__":
    main()
