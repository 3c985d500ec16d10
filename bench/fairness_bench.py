"""Tenant fairness in the simulator: the long-document scenario and the batch flood.

Fleet: 3 x H100 / Llama-3.1-8B, `least_loaded` routing, the router-side tenant queue
(`controlplane.sim.tenant_queue`) dispatching by the pure ordering in `controlplane.tenancy.vtc`.

Long documents (`gen:long-documents`, 60 s of arrivals): tenant A sends 16,000/300-token documents
at 8/s, tenant B 200/200 chats at 150/s; with both present each asks for more than half of the
GPU work, so both stay backlogged. Runs: request-fair (one unit per request), vtc (plain
tokens), vtc-roofline with equal weights and with A=1, B=3; B alone on the same arrivals.
Shares are GPU work in roofline units done while both tenants were backlogged
(`controlplane.sim.fairness`). A second, lighter variant
(B at 20 chats/s, well inside its share) shows B's latency when it is not itself overloaded.

Batch flood (`gen:batch-flood`, 60 s): an interactive chat tenant at 20/s and a batch tenant at
60/s of 1000/500-token requests (more than the fleet serves). Interactive alone; with the batch
class capped at the KV share sized for interactive TPOT p99 <= 1.2x alone
(`tenancy.classes.batch_kv_share`); without a cap.

Writes out/bench/fairness.json (merging: the `quota` key belongs to the quota benchmark and is kept)
and out/bench/fairness.png.
"""

from __future__ import annotations

import json
import time
from typing import Any

from common import console, machine, out_dir, print_table

from controlplane.roofline import profile
from controlplane.sim.fair_replay import batch_share_for_trace, fair_replay
from controlplane.sim.fairness import TenantFairness
from controlplane.sim.fleet import FleetConfig
from controlplane.traces.generators import batch_flood, long_documents

CONFIG = FleetConfig(profile=profile("h100", "llama-3.1-8b"), replicas=3)
DOCS = {"duration": 60.0, "doc_rate": 8.0, "chat_rate": 150.0}
LIGHT = {**DOCS, "chat_rate": 20.0}
FLOOD = {"duration": 60.0, "chat_rate": 20.0, "batch_rate": 60.0}
SLOWDOWN = 1.2


def _tenant(f: TenantFairness, t: str) -> dict[str, float]:
    return f.tenants[t]


def long_document_runs() -> dict[str, Any]:
    trace = long_documents(**DOCS)  # type: ignore[arg-type]
    equal = fair_replay(trace, CONFIG, ["request", "vtc", "vtc-roofline"])
    weighted = fair_replay(
        trace, CONFIG, ["vtc-roofline"], weights={"A": 1.0, "B": 3.0}, labels=["vtc-roofline 1:3"]
    )
    alone = fair_replay(long_documents(**DOCS, tenants="B"), CONFIG, ["vtc-roofline"])  # type: ignore[arg-type]
    light = fair_replay(long_documents(**LIGHT), CONFIG, ["vtc-roofline"])  # type: ignore[arg-type]
    light_alone = fair_replay(long_documents(**LIGHT, tenants="B"), CONFIG, ["vtc-roofline"])  # type: ignore[arg-type]
    runs = {**equal.fairness, **weighted.fairness}
    b_alone = _tenant(alone.fairness["vtc-roofline"], "B")
    rows = []
    for name, f in runs.items():
        for t in ("A", "B"):
            d = _tenant(f, t)
            rows.append(
                (
                    name,
                    t,
                    f"{d['weight']:g}",
                    f"{d['work_share']:.1%}",
                    f"{d['dispatched_share']:.1%}",
                    f"{d['target_share']:.0%}",
                    d["ttft_p99_s"],
                    d["tpot_p99_s"] * 1e3,
                    f.jain,
                )
            )
    print_table(
        f"long documents: A 16k/300 at {DOCS['doc_rate']:g}/s, B 200/200 at "
        f"{DOCS['chat_rate']:g}/s, 3 x H100 (B alone: TTFT p99 {b_alone['ttft_p99_s']:.3f}s)",
        [
            "run",
            "tenant",
            "weight",
            "GPU work",
            "dispatched",
            "target",
            "TTFT p99 s",
            "TPOT p99 ms",
            "Jain",
        ],
        rows,
    )
    vr, wr = runs["vtc-roofline"], runs["vtc-roofline 1:3"]
    rf = runs["request"]
    light_b = _tenant(light.fairness["vtc-roofline"], "B")
    light_b_alone = _tenant(light_alone.fairness["vtc-roofline"], "B")
    ratio = _tenant(vr, "B")["ttft_p99_s"] / b_alone["ttft_p99_s"]
    light_ratio = light_b["ttft_p99_s"] / light_b_alone["ttft_p99_s"]
    targets = {
        "request_fair_a_share_about_96pct": abs(rf.share("A") - 0.96) <= 0.05,
        "vtc_roofline_within_5pp_equal": abs(vr.share("A") - 0.5) <= 0.05,
        "vtc_roofline_within_5pp_1_3": abs(wr.share("A") - 0.25) <= 0.05,
        "b_ttft_p99_within_2x_of_alone": ratio <= 2.0,
    }
    console.print(
        f"B TTFT p99 vs alone: {ratio:.0f}x backlogged; {light_ratio:.1f}x at "
        f"{LIGHT['chat_rate']:g} chats/s (queue p99 {light_b['queue_p99_s']:.2f}s, "
        f"TPOT p99 {light_b['tpot_p99_s'] * 1e3:.0f} vs {light_b_alone['tpot_p99_s'] * 1e3:.0f} ms)"
    )
    console.print(f"targets: {targets}")
    return {
        "request_fair": {
            "A_share": rf.share("A"),
            "B_share": rf.share("B"),
            "A_dispatched_share": _tenant(rf, "A")["dispatched_share"],
        },
        "vtc_roofline": {
            "A_share": vr.share("A"),
            "B_share": vr.share("B"),
            "B_ttft_p99_ratio_vs_alone": ratio,
            "B_ttft_p99_s": _tenant(vr, "B")["ttft_p99_s"],
            "B_alone_ttft_p99_s": b_alone["ttft_p99_s"],
        },
        "weights": {"A": 1.0, "B": 1.0},
        "vtc_roofline_weighted": {
            "weights": {"A": 1.0, "B": 3.0},
            "A_share": wr.share("A"),
            "B_share": wr.share("B"),
        },
        "vtc_tokens": {"A_share": runs["vtc"].share("A"), "B_share": runs["vtc"].share("B")},
        "b_within_share": {
            "chat_rate": LIGHT["chat_rate"],
            "B_share": light.fairness["vtc-roofline"].share("B"),
            "B_ttft_p99_s": light_b["ttft_p99_s"],
            "B_alone_ttft_p99_s": light_b_alone["ttft_p99_s"],
            "B_ttft_p99_ratio_vs_alone": light_ratio,
            "B_queue_p99_s": light_b["queue_p99_s"],
            "B_tpot_p99_s": light_b["tpot_p99_s"],
            "B_alone_tpot_p99_s": light_b_alone["tpot_p99_s"],
        },
        "scenario": {**DOCS, "fleet": "3 x H100 Llama-3.1-8B", "policy": "least_loaded"},
        "runs": {k: f.to_json() for k, f in runs.items()},
        "targets": targets,
    }


def batch_flood_runs() -> dict[str, Any]:
    trace = batch_flood(**FLOOD)  # type: ignore[arg-type]
    alone = fair_replay(batch_flood(**FLOOD, tenants="interactive"), CONFIG, ["vtc-roofline"])  # type: ignore[arg-type]
    share, sized = batch_share_for_trace(trace, CONFIG, slowdown=SLOWDOWN)
    cap = fair_replay(trace, CONFIG, ["vtc-roofline"], batch_kv_share=share, labels=["cap"])
    nocap = fair_replay(trace, CONFIG, ["vtc-roofline"], labels=["no cap"])
    base = alone.fairness["vtc-roofline"].classes["interactive"]
    rows: list[tuple[object, ...]] = []
    out: dict[str, dict[str, Any]] = {}
    for name, rep in (("cap", cap), ("no cap", nocap)):
        f = rep.fairness[name]
        inter, batch = f.classes["interactive"], f.classes["batch"]
        res = rep.results[name]
        span = max(r.finish_s for r in res.records) or 1.0
        batch_tps = sum(r.output_tokens for r in res.records if r.priority == "batch") / span
        out[name] = {
            "interactive": inter,
            "batch": batch,
            "batch_output_tokens_per_s": batch_tps,
            "tpot_p99_ratio": inter["tpot_p99_s"] / base["tpot_p99_s"],
            "ttft_p99_ratio": inter["ttft_p99_s"] / base["ttft_p99_s"],
        }
        rows.append(
            (
                name,
                inter["tpot_p99_s"] * 1e3,
                out[name]["tpot_p99_ratio"],
                inter["ttft_p99_s"],
                batch["tpot_p99_s"] * 1e3,
                batch["queue_p99_s"],
                batch_tps,
            )
        )
    print_table(
        f"batch flood: interactive {FLOOD['chat_rate']:g}/s + batch {FLOOD['batch_rate']:g}/s; "
        f"interactive alone TPOT p99 {base['tpot_p99_s'] * 1e3:.1f} ms; cap = {share:.1%} of KV",
        [
            "batch KV",
            "inter TPOT p99 ms",
            "x alone",
            "inter TTFT p99 s",
            "batch TPOT p99 ms",
            "batch queue p99 s",
            "batch out tok/s",
        ],
        rows,
    )
    return {
        "tpot_p99_ratio_with_cap": out["cap"]["tpot_p99_ratio"],
        "tpot_p99_ratio_without_cap": out["no cap"]["tpot_p99_ratio"],
        "batch_kv_share": share,
        "sized_for": sized,
        "interactive_alone": base,
        "runs": out,
        "scenario": {**FLOOD, "fleet": "3 x H100 Llama-3.1-8B", "slowdown_target": SLOWDOWN},
        "targets": {"tpot_p99_within_1_2x_with_cap": out["cap"]["tpot_p99_ratio"] <= SLOWDOWN},
    }


def _plot(docs: dict[str, Any], flood: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    runs = docs["runs"]
    names = list(runs)
    a = [runs[n]["tenants"]["A"]["work_share"] for n in names]
    b = [runs[n]["tenants"]["B"]["work_share"] for n in names]
    ax1.bar(names, a, label="A (16k documents)")
    ax1.bar(names, b, bottom=a, label="B (200/200 chats)")
    for x, n in enumerate(names):
        target = runs[n]["tenants"]["A"]["target_share"]
        ax1.hlines(target, x - 0.4, x + 0.4, colors="k", linestyles="dashed")
    ax1.set_ylabel("share of GPU work while both backlogged")
    ax1.set_title("long documents: GPU work by tenant (dashed: A's weight)")
    ax1.legend(fontsize=8)
    base = flood["interactive_alone"]["tpot_p99_s"] * 1e3
    labels = ["interactive alone", "+ batch, KV cap", "+ batch, no cap"]
    vals = [
        base,
        flood["runs"]["cap"]["interactive"]["tpot_p99_s"] * 1e3,
        flood["runs"]["no cap"]["interactive"]["tpot_p99_s"] * 1e3,
    ]
    ax2.bar(labels, vals, color=["tab:green", "tab:blue", "tab:red"])
    ax2.axhline(base * SLOWDOWN, color="k", linestyle="dashed", label=f"{SLOWDOWN}x alone")
    ax2.set_ylabel("interactive TPOT p99 (ms)")
    ax2.set_title(f"batch flood: batch KV cap {flood['batch_kv_share']:.1%}")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir() / "fairness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"wrote {path}")


def write_merged(payload: dict[str, Any]) -> None:
    """Update our keys of fairness.json, keeping the others (the quota benchmark's)."""
    path = out_dir() / "fairness.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(payload)
    data["machine"] = machine()
    path.write_text(json.dumps(data, indent=2))
    console.print(f"wrote {path}")


def main() -> None:
    t0 = time.perf_counter()
    docs = long_document_runs()
    flood = batch_flood_runs()
    _plot(docs, flood)
    wall = time.perf_counter() - t0
    console.print(f"fairness bench: {wall:.0f}s")
    write_merged({"long_documents": docs, "batch_flood": flood, "fairness_wall_seconds": wall})


if __name__ == "__main__":
    main()
