"""Simulator fidelity: exact reuse ceiling, published cache orderings, step-time anchors.

1. One replica with (effectively) unlimited KV replays the Mooncake trace; its prefix-cache hits
   must equal the trace's infinite-cache ceiling at the engine block size exactly (the simulator
   caches blocks as they are scheduled, and admits a waiting request only after every earlier one
   is fully scheduled, so "every earlier request's blocks" is exactly what it holds).
2. The LRU model reproduces the orderings of numbers.md section 8 (8 replicas with affinity
   approach one pooled cache; round-robin stays at or below one replica).
3. The roofline anchors (see bench/roofline_fidelity.py for the full table) summarised.

Writes out/bench/sim_fidelity.json.
"""

from __future__ import annotations

import time

from common import console, print_table, write_json

from controlplane.roofline import profile
from controlplane.roofline.calibration import anchors
from controlplane.routing.policies import make_policy
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.traces import infinite_cache_ceiling, load_trace, lru_ceiling


def exact_ceiling(block_size: int) -> dict[str, object]:
    trace = load_trace("mooncake")
    prof = profile(
        "h100",
        "llama-3.1-8b",
        block_size=block_size,
        num_gpu_blocks_override=80_000_000 // block_size,
        max_model_len=200_000,
    )
    t0 = time.perf_counter()
    sim = FleetSim(FleetConfig(profile=prof, replicas=1), lambda: make_policy("round_robin"))
    result = sim.run(trace)
    wall = time.perf_counter() - t0
    ceiling = infinite_cache_ceiling(trace, block_size)
    sim_hits = sum(r.cached_tokens for r in result.records if r.completed)
    engine_hits = result.replicas[0].prefix_hits
    return {
        "block_size": block_size,
        "requests": len(trace),
        "ceiling_hit_tokens": ceiling.hit_tokens,
        "simulated_hit_tokens": sim_hits,
        "engine_prefix_cache_hits": engine_hits,
        "prompt_tokens": ceiling.prompt_tokens,
        "ceiling_hit_rate": ceiling.hit_rate,
        "exact": sim_hits == ceiling.hit_tokens,
        "wall_s": wall,
    }


def orderings() -> dict[str, dict[str, float]]:
    trace = load_trace("mooncake")
    out: dict[str, dict[str, float]] = {}
    for cap in (400_000, 840_000):
        out[str(cap)] = {
            "one_replica": lru_ceiling(trace, cap).hit_rate,
            "one_replica_8x": lru_ceiling(trace, 8 * cap).hit_rate,
            "round_robin_8": lru_ceiling(trace, cap, replicas=8, routing="round-robin").hit_rate,
            "affinity_8": lru_ceiling(trace, cap, replicas=8, routing="affinity").hit_rate,
        }
    return out


def main() -> None:
    rows = []
    exact = [exact_ceiling(b) for b in (16, 64)]
    for e in exact:
        rows.append(
            (
                f"B={e['block_size']}",
                e["ceiling_hit_tokens"],
                e["simulated_hit_tokens"],
                f"{e['ceiling_hit_rate']:.4f}",
                "yes" if e["exact"] else "NO",
                f"{e['wall_s']:.1f}s",
            )
        )
    print_table(
        "one replica, unlimited KV, Mooncake synthetic: simulator vs reuse ceiling",
        ["engine block", "ceiling hit tokens", "simulated hit tokens", "hit rate", "exact", "wall"],
        rows,
    )
    order = orderings()
    print_table(
        "LRU orderings at 512-token blocks (numbers.md section 8)",
        ["cap/replica", "1 replica", "1 replica 8x cap", "8 RR", "8 affinity"],
        [
            (
                cap,
                f"{v['one_replica']:.3f}",
                f"{v['one_replica_8x']:.3f}",
                f"{v['round_robin_8']:.3f}",
                f"{v['affinity_8']:.3f}",
            )
            for cap, v in order.items()
        ],
    )
    held = [a for a in anchors() if not a.held_out]
    worst = max(abs(a.error()) for a in held)
    console.print(f"roofline: {len(held)} calibration anchors, worst error {worst:.1%}")
    write_json(
        "sim_fidelity.json",
        {"exact_ceiling": exact, "lru_orderings": order, "roofline_worst_error": worst},
    )


if __name__ == "__main__":
    main()
