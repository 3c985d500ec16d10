"""Simulator speed: how many times faster than real time a trace replays, on one core.

Replays the Mooncake synthetic trace (3,993 requests, 1,022 s) through 8 simulated H100 replicas
of Llama-3.1-8B with `prefix_affinity`, at vLLM's default block size (16) and at 64 (the block
size of Dynamo's and llm-d's published benchmarks). Then shows how the wall time grows with the
fleet (1, 8, 32 replicas, the arrival rate scaled with the fleet so each replica sees the same
load) and with the trace length (the trace repeated 1x, 4x, 16x back to back, content ids kept
distinct). Speed-up = simulated trace span / CPU seconds of the replay (block hashes included).

Writes out/bench/sim_speed.json.
"""

from __future__ import annotations

import argparse
import time

from common import console, print_table, write_json

from controlplane.roofline import profile
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.traces import load_trace, repeat, scale_rate
from controlplane.traces.model import Trace
from router.policies import make_policy


def run_once(trace: Trace, replicas: int, block_size: int, policy: str) -> dict[str, float]:
    prof = profile("h100", "llama-3.1-8b", block_size=block_size)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    hashes = [r.engine_block_hashes(block_size) for r in trace.requests]
    sim = FleetSim(FleetConfig(profile=prof, replicas=replicas), lambda: make_policy(policy))
    result = sim.run(trace, block_hashes=hashes)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "requests": len(trace),
        "replicas": replicas,
        "block_size": block_size,
        "trace_span_s": trace.duration_s,
        "simulated_s": result.simulated_s,
        "cpu_s": cpu,
        "wall_s": wall,
        "speedup": trace.duration_s / cpu,
        "events": result.kv_events_applied,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="skip the 16x length run")
    args = parser.parse_args()
    base = load_trace("mooncake")
    headline = [run_once(base, 8, b, "prefix_affinity") for b in (16, 64)]
    headline.append(run_once(base, 8, 16, "round_robin"))
    print_table(
        f"Mooncake synthetic ({len(base)} requests, {base.duration_s:.0f} s) on 8 x H100",
        ["run", "block", "CPU s", "speed-up vs real time"],
        [
            (name, h["block_size"], h["cpu_s"], f"{h['speedup']:.0f}x")
            for name, h in zip(
                ("prefix_affinity", "prefix_affinity", "round_robin"), headline, strict=True
            )
        ],
    )
    by_replicas = [run_once(scale_rate(base, n / 8), n, 16, "prefix_affinity") for n in (1, 8, 32)]
    lengths = (1, 4) if args.quick else (1, 4, 16)
    by_length = [run_once(repeat(base, k), 8, 16, "prefix_affinity") for k in lengths]
    print_table(
        "wall time vs fleet size (rate scaled with the fleet) and trace length (block 16)",
        ["axis", "requests", "replicas", "trace span s", "CPU s", "speed-up"],
        [
            (
                f"{r['replicas']} replicas",
                r["requests"],
                r["replicas"],
                r["trace_span_s"],
                r["cpu_s"],
                f"{r['speedup']:.0f}x",
            )
            for r in by_replicas
        ]
        + [
            (
                f"{k}x length",
                r["requests"],
                r["replicas"],
                r["trace_span_s"],
                r["cpu_s"],
                f"{r['speedup']:.0f}x",
            )
            for k, r in zip(lengths, by_length, strict=True)
        ],
    )
    console.print("speed-up = trace span / CPU seconds (one core)")
    write_json(
        "sim_speed.json",
        {"headline": headline, "by_replicas": by_replicas, "by_length": by_length},
    )


if __name__ == "__main__":
    main()
