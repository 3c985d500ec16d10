"""The routing matrix: every policy over workloads of different shape, at three loads, several
seeds and two fleet sizes, so a routing result is a count of cells and not one trace's figure.

Workloads (`WORKLOADS`; each a function of a seed and a load, the multiple of its base rate):

    mooncake            the Mooncake synthetic trace (long shared prompts, short outputs); other
                        seeds reshuffle its inter-arrival gaps (`traces.resample`); load
                        compresses time (`scale_rate`)
    azure-code          the Azure 2023 code trace (no content ids: no prefix reuse to find);
                        seeds and load as above
    conversations       generated multi-turn chats with long answers (every turn resends the
                        conversation; 600-token mean outputs, so decode dominates); load
                        multiplies the session rate and the session count (same span, real
                        think times)
    shared-prefix-zipf  generated questions over shared documents whose popularity is Zipf(1.1)
                        (a few hot documents, a long tail); load as for conversations

A fleet of `8 * k` replicas replays `k` superposed copies of the workload (seeds `seed`,
`seed + 1000`, ...; content ids distinct per copy), so each replica sees the same traffic per
second at either size over the same span.

Loads are found per workload and fleet size, not chosen: the knee is the load at which a neutral
probe policy (`least_loaded`: no cache awareness) reaches a TTFT p99 of the SLO's TTFT or a TPOT
p99 of the SLO's TPOT, or twice its unloaded value (at 1/8 of the base rate) when that is higher
(Mooncake's longest prompts miss a 2 s TTFT on an idle replica); it is found by bisection in log
scale. Light is half the knee and saturated 1.5x the knee.

A cell is (workload, load, seed, replicas); per cell and policy: TTFT p50/p99, TPOT p99, goodput
at the SLO and the prefix hit rate as a share of the pooled ceiling. `summarize` counts, per
policy, the cells where it is best or within 2% of the best on goodput and on TTFT p99.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from controlplane.roofline import profile
from controlplane.sim.fleet import FleetConfig
from controlplane.sim.replay import replay
from controlplane.traces import load_trace, multi_turn, scale_rate, shared_prefix
from controlplane.traces.model import Trace
from controlplane.traces.resample import reshuffle_gaps, superpose

SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.1
LOADS = {"light": 0.5, "knee": 1.0, "saturated": 1.5}
PROBE = "least_loaded"
# the load whose TTFT and TPOT p99 stand for an idle fleet
UNLOADED = 0.125
WITHIN = 0.02
BASE_REPLICAS = 8
# seconds of arrivals of a generated workload (the full matrix; `make bench` runs 120)
SPAN_S = 300.0


def _mooncake(seed: int, load: float, span_s: float) -> Trace:
    return scale_rate(reshuffle_gaps(load_trace("mooncake"), seed), load)


def _azure_code(seed: int, load: float, span_s: float) -> Trace:
    return scale_rate(reshuffle_gaps(load_trace("azure-code"), seed), load)


def _conversations(seed: int, load: float, span_s: float) -> Trace:
    rate = 2.0 * load
    return multi_turn(
        sessions=max(1, round(rate * span_s)),
        turns=4,
        system=400,
        first=800,
        message=200,
        output=600,
        think=10.0,
        rate=rate,
        seed=seed,
    )


def _shared_prefix_zipf(seed: int, load: float, span_s: float) -> Trace:
    rate = 10.0 * load
    return shared_prefix(
        groups=40,
        users=10,
        prefix=6000,
        question=800,
        output=400,
        rate=rate,
        requests=max(1, round(rate * span_s)),
        zipf=1.1,
        seed=seed,
    )


# (seed, load, span_s): a generated workload draws its sessions or documents for `span_s`
# seconds of arrivals at any load; a recorded trace is played whole
WORKLOADS: dict[str, Callable[[int, float, float], Trace]] = {
    "mooncake": _mooncake,
    "azure-code": _azure_code,
    "conversations": _conversations,
    "shared-prefix-zipf": _shared_prefix_zipf,
}


def workload(
    name: str, seed: int, replicas: int, load: float, *, span_s: float = SPAN_S, head: int = 0
) -> Trace:
    """The workload's trace for a fleet of `replicas` (a multiple of 8) at `load` x its rate."""
    make = WORKLOADS[name]
    wide = max(1, replicas // BASE_REPLICAS)
    parts = [make(seed + 1000 * k, load, span_s) for k in range(wide)]
    if head:
        parts = [p.with_requests(p.requests[:head]) for p in parts]
    return parts[0] if wide == 1 else superpose(parts, name=f"{name}-w{wide}")


def fleet(replicas: int) -> FleetConfig:
    return FleetConfig(profile=profile("h100", "llama-3.1-8b", block_size=16), replicas=replicas)


def probe(
    name: str, seed: int, replicas: int, load: float, *, span_s: float = SPAN_S, head: int = 0
) -> tuple[float, float]:
    """The probe policy's TTFT p99 and TPOT p99 on the workload at `load`."""
    trace = workload(name, seed, replicas, load, span_s=span_s, head=head)
    report = replay(trace, fleet(replicas), [PROBE], pooled=False)
    s = report.summaries()[PROBE]
    return s["ttft_p99_s"], s["tpot_p99_s"]


def find_knee(
    name: str,
    replicas: int,
    *,
    seed: int = 0,
    span_s: float = SPAN_S,
    head: int = 0,
    iterations: int = 5,
    on_probe: Callable[[float, float, float], None] | None = None,
) -> float:
    """The load at which the probe policy crosses the knee's thresholds (see module)."""

    def measure(load: float) -> tuple[float, float]:
        ttft, tpot = probe(name, seed, replicas, load, span_s=span_s, head=head)
        if on_probe is not None:
            on_probe(load, ttft, tpot)
        return ttft, tpot

    idle_ttft, idle_tpot = measure(UNLOADED)
    limits = max(SLO_TTFT_S, 2 * idle_ttft), max(SLO_TPOT_S, 2 * idle_tpot)

    def above(load: float) -> bool:
        ttft, tpot = measure(load)
        return ttft > limits[0] or tpot > limits[1]

    if above(1.0):  # bracket [lo, hi]: under the limits at lo, over them at hi
        hi, lo = 1.0, 0.5
        while lo > 1 / 64 and above(lo):
            hi, lo = lo, lo / 2
    else:
        lo, hi = 1.0, 2.0
        while hi < 64 and not above(hi):
            lo, hi = hi, hi * 2
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if above(mid) else (mid, hi)
    return math.sqrt(lo * hi)


@dataclass(frozen=True, slots=True)
class Cell:
    trace: str
    load: str
    seed: int
    replicas: int
    scale: float


def run_cell(
    cell: Cell, policies: Sequence[str], *, span_s: float = SPAN_S, head: int = 0
) -> dict[str, object]:
    """Replay every policy over one cell; the matrix JSON's cell record."""
    trace = workload(cell.trace, cell.seed, cell.replicas, cell.scale, span_s=span_s, head=head)
    report = replay(
        trace, fleet(cell.replicas), policies, slo_ttft_s=SLO_TTFT_S, slo_tpot_s=SLO_TPOT_S
    )
    ceiling = report.pooled_prefix_hit_rate
    rows: dict[str, dict[str, float | None]] = {}
    for name, s in report.summaries().items():
        rows[name] = {
            "ttft_p50_s": s["ttft_p50_s"],
            "ttft_p99_s": s["ttft_p99_s"],
            "tpot_p99_s": s["tpot_p99_s"],
            "goodput_rps": s["goodput_rps"],
            "hit_rate": s["prefix_hit_rate"],
            "hit_of_ceiling": s["prefix_hit_rate"] / ceiling if ceiling > 0 else None,
        }
    return {
        "trace": cell.trace,
        "load": cell.load,
        "seed": cell.seed,
        "replicas": cell.replicas,
        "load_multiple": cell.scale,
        "requests": len(trace),
        "span_s": trace.duration_s,
        "pooled_ceiling": ceiling,
        "wall_s": report.wall_s,
        "policies": rows,
    }


def near_best(values: Mapping[str, float], *, higher_is_better: bool) -> set[str]:
    """The policies best or within 2% of the best on one metric."""
    if higher_is_better:
        best = max(values.values())
        return {k for k, v in values.items() if v >= best * (1 - WITHIN)}
    best = min(values.values())
    return {k for k, v in values.items() if v <= best * (1 + WITHIN)}


def summarize(cells: Sequence[Mapping[str, object]]) -> dict[str, dict[str, int]]:
    """Per policy: in how many cells it is best or within 2% on goodput and on TTFT p99."""
    out: dict[str, dict[str, int]] = {}
    for cell in cells:
        pols: Mapping[str, Mapping[str, float]] = cell["policies"]  # type: ignore[assignment]
        good = near_best({k: v["goodput_rps"] for k, v in pols.items()}, higher_is_better=True)
        fast = near_best({k: v["ttft_p99_s"] for k, v in pols.items()}, higher_is_better=False)
        for name in pols:
            row = out.setdefault(
                name,
                {"best_or_within_2pct_goodput": 0, "best_or_within_2pct_ttft_p99": 0, "cells": 0},
            )
            row["cells"] += 1
            row["best_or_within_2pct_goodput"] += name in good
            row["best_or_within_2pct_ttft_p99"] += name in fast
    return out
