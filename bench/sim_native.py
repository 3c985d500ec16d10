"""The simulator compiled with mypyc against the pure-Python one, on the same replays.

Builds the compiled tree into out/native (`controlplane.sim.native.build`, about a minute),
then replays each case once per tree in a fresh interpreter (the tree first on `sys.path`) and
reports CPU seconds, the speed-up over real time and whether the two replays match bit for bit
(sha256 of every request's id, replica, TTFT and end). Cases: the Mooncake synthetic trace at
1x on 8 x H100 at block 16 (`sim_speed.py`'s headline) with `prefix_affinity` and
`predicted_finish`, and the conversations workload at its saturated load (1.5x the knee of
7.42x) on 8 replicas, its first 200 s. Prints a table and writes out/bench/sim_native.json.

    PYTHONPATH=. python bench/sim_native.py
"""

from __future__ import annotations

from pathlib import Path

from common import console, out_dir, print_table, write_json

from controlplane.sim.native import ensure_built, package_root, replay_in

# (label, workload, policy, load multiple, span s: 0 = whole trace)
CASES: tuple[tuple[str, str, str, float, float], ...] = (
    ("mooncake 1x", "mooncake", "prefix_affinity", 1.0, 0.0),
    ("mooncake 1x", "mooncake", "predicted_finish", 1.0, 0.0),
    ("conversations saturated, 200 s", "conversations", "prefix_affinity", 7.42 * 1.5, 200.0),
)


def replay(root: Path, case: tuple[str, str, str, float, float]) -> dict[str, object]:
    _, name, policy, load, span = case
    return replay_in(root, name, policy, load, span, 8)


def main() -> None:
    with console.status("building the compiled simulator (mypyc)"):
        tree = ensure_built(out_dir() / "native")
    rows, cases = [], []
    for case in CASES:
        with console.status(f"{case[0]}, {case[2]}: pure Python, then compiled"):
            pure, comp = replay(package_root(), case), replay(tree, case)
        span = float(pure["span_s"])  # type: ignore[arg-type]
        p_cpu, c_cpu = float(pure["cpu_s"]), float(comp["cpu_s"])  # type: ignore[arg-type]
        same = pure["digest"] == comp["digest"]
        cases.append(
            {
                "case": case[0],
                "policy": case[2],
                "requests": pure["requests"],
                "span_s": span,
                "python_cpu_s": p_cpu,
                "compiled_cpu_s": c_cpu,
                "python_speedup": span / p_cpu,
                "compiled_speedup": span / c_cpu,
                "bit_identical": same,
                "compiled": comp["compiled"],
            }
        )
        rows.append(
            (
                case[0],
                case[2],
                pure["requests"],
                f"{p_cpu:.2f}",
                f"{c_cpu:.2f}",
                f"{span / p_cpu:.0f}x",
                f"{span / c_cpu:.0f}x",
                f"{p_cpu / c_cpu:.2f}x",
                "yes" if same else "NO",
            )
        )
    print_table(
        "the simulator compiled with mypyc vs pure Python (8 replicas, block 16, one core)",
        [
            "case",
            "policy",
            "requests",
            "Python CPU s",
            "compiled CPU s",
            "Python vs real time",
            "compiled vs real time",
            "gain",
            "bit-identical",
        ],
        rows,
    )
    write_json("sim_native.json", {"cases": cases})


if __name__ == "__main__":
    main()
