"""Replay predicted_finish variants over chosen routing-matrix cells, against cached peers.

A cheap loop for tuning `predicted_finish`: every other policy of a cell (trace, load, seed,
fleet size) is replayed once and cached (policies replay independently, each on a fresh fleet,
so a cached peer is the figure routing_matrix.py would print), or read from a routing matrix
JSON (`--matrix`: its knees, span and every cell's peers, so no peer is replayed at all); each
variant (keyword parameters of `PredictedFinish`) is replayed alone and cached under its name.
Prints, per cell, the variant's TTFT p99 and goodput against the best of all policies, and
counts the cells where it is best or within 2% on each; `--json` writes the cells in
routing_matrix.json's shape, with the same heat maps beside it.

    PYTHONPATH=. python bench/pf_cells.py --knees K.json --seeds 0,1 \
        --cells conversations:light,conversations:knee --variant t02 '{"tpot_target_s": 0.2}'
    PYTHONPATH=. python bench/pf_cells.py --native --matrix out/bench/routing_matrix_full_x32.json \
        --replicas 32 --seeds 0,1,2 --variant t02 '{"tpot_target_s": 0.2}'

Caches under --cache (default out/pf_cells_cache): delete a variant's folder after changing the
policy's code. The traces come from the settings' data dir (CP_DATA_DIR): in a git worktree
outside the main checkout, point it at the shared data, or the Azure trace falls back to its
bundled excerpt and the azure-code cells are not the matrix's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from common import NATIVE_HELP, run_compiled
from routing_matrix import heat_maps

from controlplane.routing.policies import POLICIES
from controlplane.sim.matrix import (
    LOADS,
    SLO_TPOT_S,
    SLO_TTFT_S,
    WORKLOADS,
    fleet,
    summarize,
    workload,
)
from controlplane.sim.replay import replay

PF = "predicted_finish"


Row = dict[str, Any]


def rows(
    trace: str,
    seed: int,
    replicas: int,
    scale: float,
    span: float,
    names: list[str],
    params: dict[str, Any],
) -> Row:
    """Replay `names` over one cell; the figures per policy and the pooled ceiling."""
    tr = workload(trace, seed, replicas, scale, span_s=span)
    rep = replay(
        tr,
        fleet(replicas),
        names,
        slo_ttft_s=SLO_TTFT_S,
        slo_tpot_s=SLO_TPOT_S,
        policy_params={PF: params} if params else None,
        pooled=PF not in names or len(names) > 1,
    )
    ceiling = rep.pooled_prefix_hit_rate
    out: Row = {}
    for name, s in rep.summaries().items():
        out[name] = {
            "ttft_p50_s": s["ttft_p50_s"],
            "ttft_p99_s": s["ttft_p99_s"],
            "tpot_p99_s": s["tpot_p99_s"],
            "goodput_rps": s["goodput_rps"],
            "hit_rate": s["prefix_hit_rate"],
        }
    return {"ceiling": ceiling, "requests": len(tr), "policies": out}


def cached(path: Path, *cell: Any) -> Row:
    """`rows(*cell)`, read from `path` when an earlier run wrote it there."""
    if path.exists():
        data: Row = json.loads(path.read_text())
        return data
    data = rows(*cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--knees", type=Path, help="a routing matrix JSON whose knees to use")
    ap.add_argument(
        "--matrix", type=Path, help="a routing matrix JSON: its knees, span and peers' figures"
    )
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--span", type=float, default=120.0, help="seconds of arrivals")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--cells", default="", help="trace:load,... (default: all 12)")
    ap.add_argument("--variant", nargs=2, metavar=("NAME", "PARAMS_JSON"), default=("base", "{}"))
    ap.add_argument("--cache", type=Path, default=Path("out/pf_cells_cache"))
    ap.add_argument("--json", type=Path, help="write the cells in routing_matrix.json's shape")
    ap.add_argument("--peers-only", action="store_true", help="only replay and cache the peers")
    ap.add_argument("--variant-only", action="store_true", help="only replay and cache the variant")
    ap.add_argument("--native", action="store_true", help=NATIVE_HELP)
    args = ap.parse_args()
    if args.native:
        run_compiled(__file__)
    if (args.knees is None) == (args.matrix is None):
        ap.error("give --knees or --matrix")
    source = json.loads((args.matrix or args.knees).read_text())
    knees, span, size = source["knees"], args.span, args.replicas
    known: dict[tuple[str, str, int], Row] = {}
    if args.matrix is not None:
        span = source["span_s"]
        for c in source["cells"]:
            if c["replicas"] == size:
                peer = {k: v for k, v in c["policies"].items() if k != PF}
                row = {"ceiling": c["pooled_ceiling"], "requests": c["requests"], "policies": peer}
                known[(c["trace"], c["load"], c["seed"])] = row
    pairs = [tuple(c.split(":")) for c in args.cells.split(",") if c] or [
        (t, ld) for t in WORKLOADS for ld in LOADS
    ]
    seeds = [int(s) for s in args.seeds.split(",")]
    vname, vparams = args.variant[0], json.loads(args.variant[1])
    peers = [n for n in POLICIES if n != PF]
    cells: list[Row] = []
    lines: list[str] = []
    n_t = n_g = 0
    for trace, load in pairs:
        for seed in seeds:
            scale = knees[f"{trace} x{size}"] * LOADS[load]
            key = f"{trace}_{load}_{seed}_x{size}_{span:g}s.json"
            cell = (trace, seed, size, scale, span)
            if args.variant_only:  # fill the variant's cache while the peers' matrix runs
                cached(args.cache / "pf" / vname / key, *cell, [PF], vparams)
                continue
            peer = known.get((trace, load, seed)) or cached(
                args.cache / "peers" / key, *cell, peers, {}
            )
            if args.peers_only:
                continue
            mine = cached(args.cache / "pf" / vname / key, *cell, [PF], vparams)
            pols = dict(peer["policies"])
            pols[PF] = mine["policies"][PF]
            best_t = min(pols, key=lambda n: pols[n]["ttft_p99_s"])
            best_g = max(pols, key=lambda n: pols[n]["goodput_rps"])
            pf = pols[PF]
            ok_t = pf["ttft_p99_s"] <= pols[best_t]["ttft_p99_s"] * 1.02
            ok_g = pf["goodput_rps"] >= pols[best_g]["goodput_rps"] * 0.98
            n_t += ok_t
            n_g += ok_g
            lines.append(
                f"{trace:19s} {load:9s} s{seed}  ttft99 pf {pf['ttft_p99_s']:.4f} best "
                f"{best_t} {pols[best_t]['ttft_p99_s']:.4f} {'OK ' if ok_t else 'MISS'}  "
                f"good pf {pf['goodput_rps']:.2f} best {best_g} {pols[best_g]['goodput_rps']:.2f} "
                f"{'OK' if ok_g else 'MISS'}  tpot99 {pf['tpot_p99_s']:.4f}"
            )
            ceiling = peer["ceiling"]
            for r in pols.values():
                r["hit_of_ceiling"] = r["hit_rate"] / ceiling if ceiling > 0 else None
            cells.append(
                {
                    "trace": trace,
                    "load": load,
                    "seed": seed,
                    "replicas": size,
                    "load_multiple": scale,
                    "requests": peer["requests"],
                    "pooled_ceiling": ceiling,
                    "policies": {n: pols[n] for n in POLICIES},
                }
            )
    if args.peers_only or args.variant_only:
        return
    print("\n".join(lines))
    print(f"[{vname}] {vparams}: TTFT p99 {n_t}/{len(cells)}  goodput {n_g}/{len(cells)}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "cells": cells,
                    "summary": summarize(cells),
                    "knees": knees,
                    "span_s": span,
                }
            )
        )
        heat_maps(cells, args.json.parent, args.json.stem)  # as routing_matrix.py draws them


if __name__ == "__main__":
    main()
