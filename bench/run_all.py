"""Run every benchmark in order; each prints its table and writes its JSON under --out.

An entry may carry arguments: the routing matrix runs on the compiled simulator (`--native`,
bit-identical replays, falls back to pure Python where mypyc or a C compiler is missing), and
the simulator's speed is measured on both.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

BENCHES = (
    "roofline_fidelity.py",
    "sim_fidelity.py",
    "routing_quality.py",
    "routing_matrix.py --native",
    # saturated loads: the knees of a 300 s matrix JSON under out/bench, else searched
    "sim_speed.py",
    "sim_speed.py --native",
    "sim_native.py",
    "index_bench.py",
    "index_faults.py",
    "router_overhead.py",
    "live_quality.py",
    "serve_engines_bench.py",
    # after serve_engines_bench: it reads out/bench/serve_engines.json for the routers' quality
    "ray_serve_bench.py",
    "quota_bench.py",
    # after quota_bench: both write out/bench/fairness.json, this one merges into it
    "fairness_bench.py",
    "autoscale_bench.py",
    # after autoscale_bench: it reads out/bench/autoscale.json for the policies' points
    "autoscale_oracle.py",
    "autoscale_hpa.py",
    "autoscale_light.py",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="out/bench", help="output folder for JSON and plots")
    parser.add_argument("--only", default="", help="comma-separated subset of benchmark names")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    env = {**os.environ, "CP_BENCH_OUT": args.out}
    only = args.only.split(",")
    chosen = [b for b in BENCHES if not args.only or b.split()[0].removesuffix(".py") in only]
    failed = []
    for bench in chosen:
        print(f"\n=== {bench}", flush=True)
        t0 = time.perf_counter()
        script, *extra = bench.split()
        rc = subprocess.call([sys.executable, str(here / script), *extra], env=env, cwd=here.parent)
        print(
            f"=== {bench}: {'ok' if rc == 0 else f'FAILED ({rc})'} in "
            f"{time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        if rc:
            failed.append(bench)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
    if not args.only:
        subprocess.check_call([sys.executable, str(here / "report.py"), args.out], cwd=here.parent)


if __name__ == "__main__":
    main()
