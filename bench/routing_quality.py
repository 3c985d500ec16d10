"""Routing quality at saturation, and the seed experiment (multi-router and stale-index ablations).

Part 1, the demo load: the Mooncake synthetic trace at 3x its rate (3,993 requests in 341 s)
through 8 x H100 / Llama-3.1-8B, all seven policies, against the pooled-cache ceiling. Checks the
quality targets: prefix_affinity >= 85% of the ceiling; predicted_finish with the lowest TTFT p99
and the highest goodput.

Part 2, the seed experiment on one burst (the densest 1,200 requests of the trace at 3x) with
round_robin, prefix_affinity and predicted_finish:
  baseline          1 router, reservations and speculative entries on, events delivered at once
  no reservations   the router sees only scraped metrics (every 0.5 s), not its own in-flight work
  4 routers         4 routers sharing the index, each with its own reservations
  4 routers, no reservations
  eviction notices delayed by 2 s (BlockRemoved reaches the index 2 s late)
  no speculative entries (the index learns only from KV events), with and without that delay

Writes out/bench/routing_quality.json, out/bench/demo_load.png and out/bench/routing_ablation.png.
"""

from __future__ import annotations

from dataclasses import replace

from common import console, out_dir, print_table, save_figure, write_json

from controlplane.roofline import profile
from controlplane.sim.fleet import FleetConfig
from controlplane.sim.plots import plot_replay
from controlplane.sim.replay import replay, with_policy
from controlplane.traces import densest_window, load_trace, scale_rate

SLO_TTFT, SLO_TPOT = 2.0, 0.1
ALL = (
    "round_robin",
    "least_loaded",
    "prefix_affinity",
    "predicted_finish",
    "sglang_cache_aware",
    "dynamo_kv_cost",
    "llm_d_weighted",
)
ABLATION = ("round_robin", "prefix_affinity", "predicted_finish")


def demo_load() -> dict[str, object]:
    trace = scale_rate(load_trace("mooncake"), 3.0)
    config = FleetConfig(profile=profile("h100", "llama-3.1-8b"), replicas=8)
    report = replay(trace, config, ALL, slo_ttft_s=SLO_TTFT, slo_tpot_s=SLO_TPOT)
    plot_replay(report, out_dir() / "demo_load.png")
    data = report.to_json()
    pols = data["policies"]
    assert isinstance(pols, dict)
    ceiling = report.pooled_prefix_hit_rate
    rows = []
    for name, s in pols.items():
        rows.append(
            (
                name,
                s["ttft_p50_s"],
                s["ttft_p99_s"],
                s["tpot_p99_s"],
                s["prefix_hit_rate"],
                f"{s['prefix_hit_rate'] / ceiling:.0%}",
                s["goodput_rps"],
                s["preemptions"],
            )
        )
    print_table(
        f"demo load: Mooncake 3x on 8 x H100 (pooled ceiling {ceiling:.1%})",
        [
            "policy",
            "TTFT p50",
            "TTFT p99",
            "TPOT p99",
            "hit rate",
            "of ceiling",
            "goodput",
            "preempt",
        ],
        rows,
    )
    best_ttft = min(pols, key=lambda n: pols[n]["ttft_p99_s"])
    best_goodput = max(pols, key=lambda n: pols[n]["goodput_rps"])
    targets = {
        "prefix_affinity_fraction_of_ceiling": pols["prefix_affinity"]["prefix_hit_rate"] / ceiling,
        "lowest_ttft_p99": best_ttft,
        "highest_goodput": best_goodput,
        "met": (
            pols["prefix_affinity"]["prefix_hit_rate"] >= 0.85 * ceiling
            and best_ttft == "predicted_finish"
            and best_goodput == "predicted_finish"
        ),
    }
    console.print(f"targets: {targets}")
    return {"replay": data, "targets": targets}


def ablations() -> dict[str, object]:
    trace = scale_rate(densest_window(load_trace("mooncake"), requests=1200), 3.0)
    base = FleetConfig(profile=profile("h100", "llama-3.1-8b"), replicas=8)
    variants = {
        "baseline": base,
        "no_reservations": with_policy(base, reservations=False),
        "4_routers": replace(base, routers=4),
        "4_routers_no_reservations": with_policy(replace(base, routers=4), reservations=False),
        "eviction_delay_2s": replace(base, eviction_notice_delay_s=2.0),
        "no_speculative": with_policy(base, speculative=False),
        "no_speculative_eviction_delay_2s": with_policy(
            replace(base, eviction_notice_delay_s=2.0), speculative=False
        ),
    }
    out: dict[str, object] = {}
    rows = []
    for label, cfg in variants.items():
        report = replay(trace, cfg, ABLATION, slo_ttft_s=SLO_TTFT, slo_tpot_s=SLO_TPOT)
        data = report.to_json()
        out[label] = data
        pols = data["policies"]
        assert isinstance(pols, dict)
        for name, s in pols.items():
            reasons = s["reasons"]
            rows.append(
                (
                    label,
                    name,
                    s["ttft_p99_s"],
                    s["prefix_hit_rate"],
                    s["goodput_rps"],
                    s["load_imbalance"],
                    s["preemptions"],
                    ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())),
                ),
            )
    print_table(
        f"seed experiment: densest {len(trace)} requests of Mooncake at 3x, 8 x H100",
        [
            "variant",
            "policy",
            "TTFT p99",
            "hit rate",
            "goodput",
            "imbalance",
            "preempt",
            "decisions",
        ],
        rows,
    )
    _plot(out)
    return out


def _plot(variants: dict[str, object]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = list(variants)
    width = 0.8 / len(ABLATION)
    for i, pol in enumerate(ABLATION):
        for ax, key in zip(axes, ("ttft_p99_s", "prefix_hit_rate", "goodput_rps"), strict=True):
            vals = [variants[v]["policies"][pol][key] for v in labels]  # type: ignore[index]
            ax.bar([x + i * width for x in range(len(labels))], vals, width=width, label=pol)
    for ax, title in zip(axes, ("TTFT p99 (s)", "prefix hit rate", "goodput (req/s)"), strict=True):
        ax.set_title(title)
        ax.set_xticks([x + width for x in range(len(labels))])
        ax.set_xticklabels([lbl.replace("_", "\n") for lbl in labels], fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("seed experiment: routers, reservations and stale eviction notices")
    save_figure(fig, out_dir() / "routing_ablation.png")


def main() -> None:
    write_json("routing_quality.json", {"demo_load": demo_load(), "ablations": ablations()})


if __name__ == "__main__":
    main()
