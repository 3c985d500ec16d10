"""Simulator speed: how many times faster than real time a trace replays, on one core.

Replays the Mooncake synthetic trace (3,993 requests, 1,022 s) through 8 simulated H100
replicas of Llama-3.1-8B with every routing policy, at vLLM's default block size (16) and at 64
(the block size of Dynamo's and llm-d's published benchmarks), best of three runs each. Then
shows how the wall time grows with the fleet (1, 8, 32 replicas, the arrival rate scaled with the
fleet so each replica sees the same load) and with the trace length (the trace repeated 1x, 4x,
16x back to back, content ids kept distinct). Speed-up = simulated trace span / CPU seconds of
the replay, block ids included.

Last, the loads where policies differ: every workload of the routing matrix
(`controlplane.sim.matrix`) at its saturated load (1.5x the knee; the knees come from
a routing matrix JSON under out/bench run over the same 300 s of arrivals, such as
`bench/routing_matrix.py --full`'s, else they are searched)
on 8 replicas with `prefix_affinity`, and on 32 replicas (four superposed copies) for the
workloads named by `--wide` (default: mooncake; `--wide all` for every one), reported as replica
x simulated seconds per CPU second. At 8 replicas each workload is also replayed with every
output cut to one token: no decode at all, so its speed-up bounds what any faster decode loop
could reach (the per-request work: hashing, index lookups, the policy, admission, prefill and
the block pool).

Writes out/bench/sim_speed.json; with `--native`, the same on the simulator compiled with mypyc
(`controlplane.sim.native`, replays bit-identical) into out/bench/sim_speed_native.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from common import NATIVE_HELP, console, out_dir, print_table, run_compiled, write_json

from controlplane.roofline import profile
from controlplane.routing.policies import POLICIES, make_policy
from controlplane.sim import fleet
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.ids import dense_block_ids
from controlplane.sim.matrix import LOADS, SPAN_S, WORKLOADS, find_knee, workload
from controlplane.sim.native import is_compiled
from controlplane.traces import load_trace, repeat, scale_rate
from controlplane.traces.model import Trace


def run_once(
    trace: Trace, replicas: int, block_size: int, policy: str, repeats: int = 1
) -> dict[str, float]:
    """Best of `repeats` replays (CPU seconds, block ids included): the machine's noise floor."""
    prof = profile("h100", "llama-3.1-8b", block_size=block_size)
    best_cpu = best_wall = float("inf")
    for _ in range(repeats):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        ids, floor = dense_block_ids(trace, block_size)
        sim = FleetSim(FleetConfig(profile=prof, replicas=replicas), lambda: make_policy(policy))
        result = sim.run(trace, block_ids=ids, id_floor=floor)
        best_cpu = min(best_cpu, time.process_time() - cpu0)
        best_wall = min(best_wall, time.perf_counter() - wall0)
    cpu, wall = best_cpu, best_wall
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


def saturated(wide: list[str]) -> tuple[dict[str, object], dict[str, object]]:
    """Each matrix workload at its saturated load: 8 replicas, and 32 for those in `wide`."""
    # knees searched over the span replayed here (a 120 s matrix's knees are not this one's)
    knees: dict[str, float] = {}
    for path in sorted(out_dir().glob("routing_matrix*.json")):
        data = json.loads(path.read_text())
        if data.get("span_s") == SPAN_S:
            knees = {**data.get("knees", {}), **knees}
    rows8: dict[str, object] = {}
    rows32: dict[str, object] = {}
    for name in WORKLOADS:
        knee = knees.get(f"{name} x8") or find_knee(name, 8)
        for replicas in (8, 32) if name in wide else (8,):
            trace = workload(name, 0, replicas, knee * LOADS["saturated"])
            row = run_once(trace, replicas, 16, "prefix_affinity")
            row["load_multiple"] = knee * LOADS["saturated"]
            row["replica_seconds_per_cpu_s"] = replicas * trace.duration_s / row["cpu_s"]
            if replicas == 8:  # the same arrivals without decode: the per-request floor
                cut = [dataclasses.replace(r, output_tokens=1) for r in trace.requests]
                floor = run_once(trace.with_requests(cut), replicas, 16, "prefix_affinity")
                row["one_token_speedup"] = trace.duration_s / floor["cpu_s"]
                row["one_token_us_per_request"] = 1e6 * floor["cpu_s"] / len(trace)
            (rows8 if replicas == 8 else rows32)[name] = row
    return rows8, rows32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="skip the 16x length run")
    parser.add_argument("--wide", default="mooncake", help="workloads to run on 32 replicas")
    parser.add_argument("--native", action="store_true", help=NATIVE_HELP)
    args = parser.parse_args()
    if args.native:
        run_compiled(__file__)
    compiled = is_compiled(fleet)
    tag = " (compiled, mypyc)" if compiled else ""
    base = load_trace("mooncake")
    headline = []
    for block in (16, 64):
        for policy in POLICIES:
            row = run_once(base, 8, block, policy, repeats=3)
            row["policy"] = policy  # type: ignore[assignment]
            headline.append(row)
    print_table(
        f"Mooncake synthetic ({len(base)} requests, {base.duration_s:.0f} s) on 8 x H100, "
        f"best of 3{tag}",
        ["policy", "block", "CPU s", "speed-up vs real time"],
        [(h["policy"], h["block_size"], h["cpu_s"], f"{h['speedup']:.0f}x") for h in headline],
    )
    by_replicas = [run_once(scale_rate(base, n / 8), n, 16, "prefix_affinity") for n in (1, 8, 32)]
    lengths = (1, 4) if args.quick else (1, 4, 16)
    by_length = [run_once(repeat(base, k), 8, 16, "prefix_affinity") for k in lengths]
    print_table(
        f"wall time vs fleet size (rate scaled with the fleet) and trace length (block 16){tag}",
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
    wide = list(WORKLOADS) if args.wide == "all" else [w for w in args.wide.split(",") if w]
    sat8, sat32 = saturated(wide)
    print_table(
        f"the routing matrix's workloads at their saturated load (prefix_affinity, block 16){tag}",
        [
            "workload",
            "replicas",
            "requests",
            "span s",
            "CPU s",
            "speed-up",
            "replica-s/CPU s",
            "1-token outputs",
        ],
        [
            (
                name,
                r["replicas"],
                r["requests"],
                r["trace_span_s"],
                r["cpu_s"],
                f"{r['speedup']:.0f}x",
                f"{r['replica_seconds_per_cpu_s']:.0f}",
                f"{r['one_token_speedup']:.0f}x" if "one_token_speedup" in r else "",
            )
            for rows in (sat8, sat32)
            for name, r in rows.items()
            if isinstance(r, dict)
        ],
    )
    console.print(
        "speed-up = trace span / CPU seconds (one core); 1-token outputs: the same arrivals "
        "with no decode (the bound a faster decode loop could reach)"
    )
    write_json(
        "sim_speed_native.json" if compiled else "sim_speed.json",
        {
            "compiled": compiled,
            "headline": headline,
            "by_replicas": by_replicas,
            "by_length": by_length,
            "saturated": sat8,
            "saturated_32": sat32,
        },
    )


if __name__ == "__main__":
    main()
