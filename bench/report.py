"""Render the benchmark JSON under out/bench into the marked tables of docs/benchmarks.md.

Every table in the doc between `<!-- BEGIN name -->` and `<!-- END name -->` is regenerated
from the latest run, and the plots are copied to docs/img/, so the prose can be read against
figures that came out of `make bench`, never typed in by hand.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from controlplane.sim.matrix import near_best

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
PLOTS = (
    "roofline_vidur.png",
    "routing_ablation.png",
    "demo_load.png",
    "router_overhead.png",
    "ray_serve.png",
    "live_quality.png",
    "fairness.png",
    "routing_matrix_goodput_rps.png",
    "routing_matrix_ttft_p99.png",
    "routing_matrix_full_x8_goodput_rps.png",
    "routing_matrix_full_x8_ttft_p99.png",
    "routing_matrix_full_x32_goodput_rps.png",
    "routing_matrix_full_x32_ttft_p99.png",
)


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return f"{v:,.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def roofline(data: Any) -> str:
    rows = [
        (
            a["setting"],
            a["quantity"],
            a["unit"],
            a["measured"],
            a["model"],
            f"{a['error']:+.1%}",
            a["role"],
        )
        for a in data["anchors"]
    ]
    return md_table(["setting", "quantity", "unit", "published", "model", "error", "role"], rows)


def exact_ceiling(data: Any) -> str:
    rows = [
        (
            e["block_size"],
            f"{e['ceiling_hit_tokens']:,}",
            f"{e['simulated_hit_tokens']:,}",
            f"{e['ceiling_hit_rate']:.2%}",
            "yes" if e["exact"] else "**no**",
        )
        for e in data["exact_ceiling"]
    ]
    return md_table(
        ["engine block", "ceiling hit tokens", "simulated hit tokens", "hit rate", "exact"], rows
    )


def orderings(data: Any) -> str:
    rows = [
        (
            f"{int(cap):,}",
            f"{v['one_replica']:.1%}",
            f"{v['one_replica_8x']:.1%}",
            f"{v['round_robin_8']:.1%}",
            f"{v['affinity_8']:.1%}",
        )
        for cap, v in data["lru_orderings"].items()
    ]
    return md_table(
        ["KV tokens per replica", "1 replica", "1 replica, 8x KV", "8 round-robin", "8 affinity"],
        rows,
    )


def speed(data: Any) -> str:
    rows = [
        (h["policy"], h["block_size"], f"{h['cpu_s']:.2f}", f"{h['speedup']:,.0f}x")
        for h in data["headline"]
    ]
    return md_table(["policy", "block size", "CPU s", "faster than real time"], rows)


def scaling(data: Any) -> str:
    rows = [
        (
            f"{r['replicas']} replicas",
            f"{r['requests']:,}",
            f"{r['trace_span_s']:,.0f}",
            f"{r['cpu_s']:.2f}",
            f"{r['speedup']:,.0f}x",
        )
        for r in data["by_replicas"]
    ]
    rows += [
        (
            f"{r['requests'] // data['by_length'][0]['requests']}x length",
            f"{r['requests']:,}",
            f"{r['trace_span_s']:,.0f}",
            f"{r['cpu_s']:.2f}",
            f"{r['speedup']:,.0f}x",
        )
        for r in data["by_length"]
    ]
    return md_table(["run", "requests", "trace span s", "CPU s", "faster than real time"], rows)


def demo(data: Any) -> str:
    rep = data["demo_load"]["replay"]
    ceiling = rep["pooled_prefix_hit_rate"]
    rows = []
    for name, s in rep["policies"].items():
        rows.append(
            (
                f"`{name}`",
                f"{s['ttft_p50_s']:.2f} / {s['ttft_p90_s']:.2f} / {s['ttft_p99_s']:.3f}",
                f"{s['tpot_p50_s'] * 1e3:.0f} / {s['tpot_p99_s'] * 1e3:.0f}",
                f"{s['e2e_p50_s']:.1f} / {s['e2e_p99_s']:.1f}",
                f"{s['prefix_hit_rate']:.1%}",
                f"{s['prefix_hit_rate'] / ceiling:.0%}",
                f"{s['goodput_rps']:.2f}",
                f"{s['output_tokens_per_s']:.0f}",
                f"{s['load_imbalance']:.2f}",
                s["preemptions"],
            )
        )
    table = md_table(
        [
            "policy",
            "TTFT p50/p90/p99 s",
            "TPOT p50/p99 ms",
            "E2E p50/p99 s",
            "prefix hit",
            "of ceiling",
            "goodput req/s",
            "output tok/s",
            "imbalance",
            "preemptions",
        ],
        rows,
    )
    return table + f"\n\nPooled-cache ceiling: **{ceiling:.1%}**."


def ablation(data: Any) -> str:
    rows = []
    for variant, rep in data["ablations"].items():
        for name, s in rep["policies"].items():
            reasons = ", ".join(
                f"{k} {v}" for k, v in sorted(s["reasons"].items()) if k != "no_healthy_replica"
            )
            rows.append(
                (
                    variant,
                    f"`{name}`",
                    f"{s['ttft_p99_s']:.2f}",
                    f"{s['prefix_hit_rate']:.1%}",
                    f"{s['goodput_rps']:.2f}",
                    reasons,
                )
            )
    return md_table(
        ["variant", "policy", "TTFT p99 s", "prefix hit", "goodput req/s", "decisions"], rows
    )


def index(data: Any) -> str:
    rows = [
        (
            "lookup p50 / p99, sequential",
            f"{data['lookup_p50_ms']} / {data['lookup_p99_ms']} ms",
            "p99 < 2 ms",
        ),
        ("server time per lookup", f"{data['server_us_per_lookup']:.0f} us", ""),
        ("round trips per lookup", data["round_trips_per_lookup"], "1"),
        ("lookups/s, one router process", f"{data['lookups_per_s']:,.0f}", ""),
        (
            "at 50% of that rate: p50 / p99, unknown",
            f"{data['at_50pct_load_p50_ms']} / {data['at_50pct_load_p99_ms']} ms, "
            f"{data['at_50pct_load_unknown']:.2%}",
            "",
        ),
        (
            "at 80% of that rate: p50 / p99, unknown",
            f"{data['at_80pct_load_p50_ms']} / {data['at_80pct_load_p99_ms']} ms, "
            f"{data['at_80pct_load_unknown']:.2%}",
            "",
        ),
        (
            "one holder of the full prompt: p50 / p99",
            f"{data['one_holder_p50_ms']} / {data['one_holder_p99_ms']} ms",
            "",
        ),
        (
            "eight long holders: p50 / p99",
            f"{data['eight_long_holders_p50_ms']} / {data['eight_long_holders_p99_ms']} ms",
            "",
        ),
        (
            "Redis memory per 1M confirmed blocks",
            f"{data['redis_bytes_per_million_blocks'] / 1e6:.0f} MB",
            "",
        ),
        (
            "Redis memory per 1M speculative blocks",
            f"{data['speculative_bytes_per_million_blocks'] / 1e6:.0f} MB",
            "",
        ),
        ("confirmed blocks written/s", f"{data['confirmed_blocks_written_per_s']:,}", ""),
    ]
    return md_table(
        [
            f"{data['prompt_tokens']:,}-token prompt, {data['replicas']} replicas",
            "measured",
            "target",
        ],
        rows,
    )


def index_faults(data: Any) -> str:
    w = data["worst"]

    def ms(key: str) -> str:
        return f"{w[key] * 1e3:.1f} ms"

    def us(key: str) -> str:
        return f"{w[key] * 1e6:.1f} us"

    budget = f"{w['budget_s'] * 1e3:.0f} ms"
    rows = [
        ("dead Redis: the 3 lookups that open the breaker, slowest", ms("opening_lookup_max_s"),
         "< 250 ms"),
        ("breaker open: per lookup (no I/O)", us("open_lookup_mean_s"), "< 1 ms"),
        ("breaker open: per write (dropped, counted)", us("open_write_mean_s"), ""),
        (f"hung Redis: lookup, budget {budget} (min / max)",
         f"{ms('hung_lookup_min_s')} / {ms('hung_lookup_max_s')}", "the budget"),
        ("hung Redis: a write (queued)", us("hung_write_s"), ""),
        ("answers again after SIGCONT (cool-down 0.2 s)", ms("recovery_after_resume_s"), "< 2 s"),
        ("answers again after a restart (cool-down 0.2 s)", ms("recovery_after_restart_s"),
         "< 2 s"),
        ("close with Redis hung (flush timeout 0.2 s)", ms("aclose_hung_s"), "< 1 s"),
    ]  # fmt: skip
    return md_table([f"worst of {len(data['rounds'])} rounds", "measured", "target"], rows)


def router_overhead(data: Any) -> str:
    start = min((r["rate"] for r in data["ramp"]), default=0)
    by_rate = data.get("by_rate") or {
        f"{data['rate_rps']:g}": {
            "ttft_at_rate_ms": data["ttft_at_rate_ms"],
            "cpu_ms_per_request": data["cpu_ms_per_request"],
            **{k: data[k] for k in ("router", "vllm_router_round_robin") if k in data},
            "vllm_router_cache_aware": data["vllm_router"],
        }
    }
    rates = sorted(by_rate, key=float)

    def max_rps(t: str, value: float | None) -> str:
        if value is None:
            return "not measured"
        if not value:
            return f"< {start:g}"  # not even the first step
        return f">= {value:g}" if t in data["max_rps_capped"] else f"{value:g}"  # ramp's top

    labels = (
        ("direct", "direct to the replicas"),
        ("router", f"our router (`{data['setup']['our_policy']}`)"),
        ("router_two_workers", "our router, 2 worker processes"),
        ("vllm_router_round_robin", "vllm-router `round_robin`"),
        ("vllm_router_cache_aware", "vllm-router `cache_aware`"),
        ("sglang_router", "sglang-router `cache_aware`"),
    )
    rows = []
    for key, label in labels:
        if key not in data["ttft_at_rate_ms"]:
            continue
        row: list[object] = [label]
        for rate in rates:
            t = by_rate[rate]["ttft_at_rate_ms"][key]
            entry = by_rate[rate].get(key) if key != "direct" else None
            added = (
                f"{entry['added_ttft_p50_ms']:+.2f} / {entry['added_ttft_p99_ms']:+.2f}"
                if entry
                else f"({t['ttft_p50_ms']:.2f} / {t['ttft_p99_ms']:.2f})"
            )
            cpu = by_rate[rate]["cpu_ms_per_request"][key]
            row += [added, f"{cpu['router_process']:.2f}" if "router_process" in cpu else ""]
        top = data.get(key, {}).get("max_rps") if key != "direct" else data["direct"]["max_rps"]
        if key == "vllm_router_cache_aware":
            top = data["vllm_router"]["max_rps"]
        errors = sum(by_rate[r]["ttft_at_rate_ms"][key]["errors"] for r in rates)
        rows.append((*row, max_rps(key, top), errors))
    header: list[str] = ["streaming req/s:"]
    for rate in rates:
        header += [f"{rate}: added TTFT p50 / p99 ms", f"{rate}: router CPU ms/req"]
    table = md_table([*header, "max sustained req/s", "errors"], rows)
    goals = data.get("goals_vs_vllm_router_cache_aware") or {}
    verdict = ", ".join(f"{k} {'met' if v else '**not met**'}" for k, v in goals.items())
    met = data["targets_met"]
    old = ", ".join(
        f"{name} {'met' if met[key] else '**not met**'}"
        for name, key in (("p50 < 2 ms", "added_ttft_p50"), ("p99 < 10 ms", "added_ttft_p99"))
    )
    setup = data["setup"]
    return (
        table + "\n\n(direct: the TTFT p50 / p99 itself.) "
        f"Goals against vllm-router `cache_aware` in the same run: {verdict or 'not measured'}. "
        f"Targets at {data['rate_rps']:g} req/s: {old}. Ceiling: {data['ceiling']}. "
        f"{data['cores']} cores shared by the client, the routers and the replicas; "
        f"our router's index: {setup['our_index']}, "
        f"{setup.get('tenants', 0)} tenants with quotas ({setup.get('quotas', 'none')}), "
        f"fair queue {setup.get('fair_queue', 'on')}."
    )


def ray_serve(data: Any) -> str:
    labels = {
        "default": "Serve 2.60 defaults",
        "throughput_optimized": "`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, proxy kept",
        "direct_ingress": "`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, direct ingress (no proxy hop)",
    }
    rows = []
    for v, r in data["variants"].items():
        d = r["direct"]
        for t, label in (("serve_path", "Serve path"), ("standalone", "standalone router")):
            x = r[t]
            rows.append(
                (
                    f"{label} ({labels.get(v, v)})",
                    f"+{x['added_ttft_p50_ms']:.1f} / +{x['added_ttft_p99_ms']:.1f}",
                    f"{x['cpu_ms_per_request']:.2f}"
                    + (
                        f" (proxy {x['cpu_ms_per_request_proxy']:.1f}, "
                        f"ingress {x['cpu_ms_per_request_ingress']:.1f})"
                        if "cpu_ms_per_request_proxy" in x
                        else ""
                    ),
                    f"{d['ttft_p50_ms']:.1f} / {d['ttft_p99_ms']:.1f}",
                    x["errors"],
                )
            )
    over = md_table(
        ["path (cluster variant)", "added TTFT p50 / p99 ms", "CPU ms/req",
         "direct TTFT p50 / p99 ms (same run)", "errors"],
        rows,
    )  # fmt: skip
    names = {
        "ours": "our RequestRouter (`prefix_affinity`)",
        "pow2": "Serve's default (`PowerOfTwoChoicesRequestRouter`)",
        "ray_prefix_cache_affinity": "Ray's `PrefixCacheAffinityRouter`",
    }
    q = md_table(
        ["router", "engine prefix hit rate", "TTFT p50 ms", "TTFT p99 ms"],
        [
            (names[k], f"{r['engine_prefix_hit_rate']:.1%}", f"{r['ttft_p50_s'] * 1e3:.1f}",
             f"{r['ttft_p99_s'] * 1e3:.1f}")
            for k, r in data["quality"].items()
        ],
    )  # fmt: skip
    load = data["load"]
    src = data["quality"]["ray_prefix_cache_affinity"]["source"]
    return (
        over + f"\n\n{load['rate_rps']:g} streaming req/s, {load['rounds']} rounds of "
        f"{load['phase_s']:g} s phases per target, engines at speed {load['speed']:g}; "
        f"`serve_path` in the JSON: the `{data['serve_path']['variant']}` variant.\n\n"
        + q
        + f"\n\nRay's router: `{src}` (the ray wheel's class, through the adapter)."
    )


def live_quality(data: Any) -> str:
    rows = []
    for key, label in (
        ("prefix_affinity", "our router, `prefix_affinity` (live)"),
        ("vllm_router_cache_aware", "vllm-router, `cache_aware` (live)"),
        ("simulated_prediction", "simulator, `prefix_affinity`"),
        ("simulated_sglang_cache_aware", "simulator, `sglang_cache_aware`"),
        ("simulated_round_robin", "simulator, `round_robin` (reference)"),
    ):
        r = data[key]
        rows.append(
            (
                label,
                f"{r['engine_prefix_hit_rate']:.1%}",
                f"{r['ttft_p50_s'] * 1e3:.1f}",
                f"{r['ttft_p99_s'] * 1e3:.1f}",
                r["errors"],
            )
        )
    w = data["workload"]
    table = md_table(
        ["run", "engine prefix-cache hit rate", "TTFT p50 ms", "TTFT p99 ms", "errors"], rows
    )
    text = (
        table
        + f"\n\n{w['requests']} requests at {w['rate_rps']:g} req/s, {w['groups']} documents, "
        f"prompts of {w['prompt_tokens_mean']:.0f} tokens on average, {w['max_tokens']} output "
        f"tokens, 2 replicas x {w['kv_blocks']} blocks of {w['block_size']} tokens; our router's "
        f"index: {w['our_index']}. Pooled-cache ceiling: "
        f"**{data['pooled_prefix_hit_rate']:.1%}**."
    )
    d = data["prefix_affinity"].get("decisions", {})
    if d.get("tokens:prompt"):
        text += (
            f" Our router expected the replicas it chose to hold "
            f"{d['tokens:predicted_hit'] / d['tokens:prompt']:.1%} of the prompt tokens; they "
            f"reported {d['tokens:engine_cached'] / d['tokens:prompt']:.1%} cached."
        )
    return text


def fairness(data: Any) -> str:
    """Section 10: the long-document scenario and the batch flood (fairness_bench.py)."""
    if "long_documents" not in data:
        return "Not measured: run `bench/fairness_bench.py`."
    docs, flood = data["long_documents"], data["batch_flood"]
    rows = []
    for name, run in docs["runs"].items():
        for t in ("A", "B"):
            d = run["tenants"][t]
            rows.append(
                (
                    name if t == "A" else "",
                    t,
                    f"{d['weight']:g}",
                    f"{d['work_share']:.1%} ({d['target_share']:.0%})",
                    f"{d['dispatched_share']:.1%}",
                    f"{d['ttft_p99_s']:.2f}",
                    f"{d['tpot_p99_s'] * 1e3:.0f}",
                    f"{run['jain_index']:.3f}" if t == "A" else "",
                )
            )
    head = ["run", "tenant", "weight", "GPU work (weight)", "dispatched"]
    table1 = md_table([*head, "TTFT p99 s", "TPOT p99 ms", "Jain"], rows)
    vr, lt = docs["vtc_roofline"], docs["b_within_share"]
    alone = flood["interactive_alone"]
    frows = [("interactive alone", f"{alone['tpot_p99_s'] * 1e3:.1f}", "1.00x", "", "")]
    for name, r in flood["runs"].items():
        frows.append(
            (
                f"+ batch, {name}",
                f"{r['interactive']['tpot_p99_s'] * 1e3:.1f}",
                f"{r['tpot_p99_ratio']:.2f}x",
                f"{r['batch_output_tokens_per_s']:,.0f}",
                f"{r['batch']['queue_p99_s']:.0f}",
            )
        )
    table2 = md_table(
        ["run", "interactive TPOT p99 ms", "vs alone", "batch out tok/s", "batch queue p99 s"],
        frows,
    )
    met = ", ".join(
        f"{k.replace('_', ' ')}: {'met' if v else '**not met**'}"
        for k, v in docs["targets"].items()
    )
    basis = vr.get("B_ttft_p99_basis") or (
        f"light variant (B {lt['chat_rate']:g} chats/s), "
        f"long_prefill_token_threshold={vr.get('long_prefill_token_threshold', 0)}"
    )
    b = (
        f"B's TTFT p99 under `vtc-roofline`, {basis}: {vr['B_ttft_p99_s'] * 1e3:.1f} ms vs "
        f"{vr['B_alone_ttft_p99_s'] * 1e3:.1f} ms for B alone on the same fleet "
        f"(**{vr['B_ttft_p99_ratio_vs_alone']:.2f}x**)."
    )
    light = (
        f"With vLLM's default chunking (no threshold), B at {lt['chat_rate']:g} chats/s, inside "
        f"its share ({lt['B_share']:.0%} of the work): TTFT p99 {lt['B_ttft_p99_s'] * 1e3:.1f} ms "
        f"vs {lt['B_alone_ttft_p99_s'] * 1e3:.1f} ms alone "
        f"(**{lt['B_ttft_p99_ratio_vs_alone']:.1f}x**; router queue p99 "
        f"{lt['B_queue_p99_s'] * 1e3:.1f} ms), TPOT p99 {lt['B_tpot_p99_s'] * 1e3:.1f} vs "
        f"{lt['B_alone_tpot_p99_s'] * 1e3:.1f} ms."
    )
    sweep = _threshold_table(docs.get("long_prefill_threshold"))
    cap = (
        f"Batch KV cap: {flood['batch_kv_share']:.1%} of each replica's KV, sized for "
        f"interactive TPOT p99 <= {flood['scenario']['slowdown_target']}x alone. With it, "
        f"interactive TPOT p99 is **{flood['tpot_p99_ratio_with_cap']:.2f}x** alone; without "
        f"it, **{flood['tpot_p99_ratio_without_cap']:.2f}x**. Bench wall time "
        f"{data.get('fairness_wall_seconds', 0):.0f} s."
    )
    return f"{table1}\n\n{b} {light} Targets: {met}.\n\n{sweep}{table2}\n\n{cap}"


def _threshold_table(th: Any) -> str:
    """The light variant by long_prefill_token_threshold, and the gate diagnostic (or nothing)."""
    if not th or "light_sweep" not in th:
        return ""
    base = th["light_sweep"].get("0", {}).get("A", {}).get("prompt_tokens_per_s") or 0.0

    def row(label: str, r: Any) -> tuple[object, ...]:
        b, a = r["B"], r["A"]
        tps = a["prompt_tokens_per_s"]
        return (
            label,
            f"{b['ttft_p99_s'] * 1e3:.1f}",
            f"{r['B_ttft_p99_ratio_vs_alone']:.2f}",
            f"{b['router_queue_p99_s'] * 1e3:.1f}",
            f"{b['engine_p50_s'] * 1e3:.1f}",
            f"{b['engine_p99_s'] * 1e3:.1f}",
            f"{b['tpot_p99_s'] * 1e3:.1f}",
            f"{r['A_share']:.1%} / {r['B_share']:.1%}",
            f"{tps / 1e3:.1f}",
            f"{tps / base - 1:+.0%}" if base else "",
        )

    rows = []
    for t, r in th["light_sweep"].items():
        label = "off (8,192)" if t == "0" else t
        if int(t) == th["threshold"]:
            label = f"**{t} (roofline)**"
        elif int(t) == th.get("threshold_without_documents_decoding"):
            label = f"{t} (roofline without A's decodes)"
        rows.append(row(label, r))
    g = th.get("gate_diagnostic")
    if g:
        if g.get("long_prefills", 1) == 0:
            label = f"{g['threshold']}, gate without the long-prefill rule (diagnostic)"
        else:
            label = f"{g['threshold']}, gate at {g['prefill_steps']:g} steps (diagnostic)"
        rows.append(row(label, g))
    head = ["threshold", "B TTFT p99 ms", "x alone", "B router queue p99 ms", "B engine p50 ms"]
    more = ["B engine p99 ms", "B TPOT p99 ms", "work A / B", "A prompt ktok/s", "A vs off"]
    alone = th["light"]["B_alone"]["ttft_p99_s"] * 1e3
    return (
        f"Light variant by `long_prefill_token_threshold` (B alone: TTFT p99 {alone:.1f} ms):\n\n"
        f"{md_table([*head, *more], rows)}\n\n"
    )


def saturated(data: Any) -> str:
    rows = [
        (
            name,
            r["replicas"],
            f"{r['load_multiple']:.2f}",
            f"{r['requests']:,}",
            f"{r['trace_span_s']:,.0f}",
            f"{r['cpu_s']:.1f}",
            f"{r['speedup']:,.0f}x",
            f"{r['replica_seconds_per_cpu_s']:,.0f}",
            f"{r['one_token_speedup']:,.0f}x" if "one_token_speedup" in r else "",
        )
        for key in ("saturated", "saturated_32")
        for name, r in data.get(key, {}).items()
    ]
    header = ["workload", "replicas", "load", "requests", "span s", "CPU s", "speed-up"]
    return md_table([*header, "replica-s per CPU s", "1-token outputs"], rows)


def matrix_summary(data: Any) -> str:
    rows = [
        (
            name,
            f"{s['best_or_within_2pct_goodput']} / {s['cells']}",
            f"{s['best_or_within_2pct_ttft_p99']} / {s['cells']}",
        )
        for name, s in data["summary"].items()
    ]
    return md_table(["policy", "goodput: best or within 2%", "TTFT p99: best or within 2%"], rows)


def matrix_cells(data: Any) -> str:
    def best(pols: Any, key: str, higher: bool, fmt: str) -> str:
        values = {n: p[key] for n, p in pols.items()}
        top = max(values, key=values.__getitem__) if higher else min(values, key=values.__getitem__)
        near = len(near_best(values, higher_is_better=higher))
        return f"{top} {values[top]:{fmt}}" + (f" (+{near - 1} within 2%)" if near > 1 else "")

    rows = []
    for c in data["cells"]:
        pols = c["policies"]
        pf, pa = pols["predicted_finish"], pols["prefix_affinity"]
        hit = pa["hit_of_ceiling"]
        rows.append(
            (
                f"{c['trace']} {c['load']} (x{c['load_multiple']:.2f}) s{c['seed']}",
                c["replicas"],
                best(pols, "goodput_rps", True, ".2f"),
                f"{pf['goodput_rps']:.2f}",
                best(pols, "ttft_p99_s", False, ".3f"),
                f"{pf['ttft_p99_s']:.3f}",
                f"{c['pooled_ceiling']:.0%}",
                "-" if hit is None else f"{hit:.0%}",
            )
        )
    header = ["cell", "replicas", "best goodput", "pf goodput", "best TTFT p99 s", "pf TTFT p99"]
    return md_table([*header, "pooled ceiling", "prefix_affinity / ceiling"], rows)


SECTIONS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "roofline": ("roofline_fidelity.json", roofline),
    "exact_ceiling": ("sim_fidelity.json", exact_ceiling),
    "orderings": ("sim_fidelity.json", orderings),
    "speed": ("sim_speed.json", speed),
    "scaling": ("sim_speed.json", scaling),
    "demo": ("routing_quality.json", demo),
    "ablation": ("routing_quality.json", ablation),
    "index": ("index.json", index),
    "index_faults": ("index_faults.json", index_faults),
    "router_overhead": ("router_overhead.json", router_overhead),
    "ray_serve": ("ray_serve.json", ray_serve),
    "live_quality": ("live_quality.json", live_quality),
    "fairness": ("fairness.json", fairness),
    "sim_saturated": ("sim_speed.json", saturated),
    "sim_saturated_native": ("sim_speed_native.json", saturated),
    "matrix_summary": ("routing_matrix.json", matrix_summary),
    "matrix_cells": ("routing_matrix.json", matrix_cells),
    "matrix_heldout_summary": ("routing_matrix_heldout.json", matrix_summary),
    "matrix_full_summary": ("routing_matrix_full_x8.json", matrix_summary),
    "matrix_full_cells": ("routing_matrix_full_x8.json", matrix_cells),
    "matrix_full_heldout_summary": ("routing_matrix_full_x8_heldout.json", matrix_summary),
    "matrix_full_fresh_summary": ("routing_matrix_full_x8_fresh.json", matrix_summary),
    "matrix_full32_summary": ("routing_matrix_full_x32.json", matrix_summary),
    "matrix_full32_cells": ("routing_matrix_full_x32.json", matrix_cells),
    "matrix_x32_s12_summary": ("routing_matrix_x32_s12.json", matrix_summary),
}


def _fill(body: str, m: re.Match[str]) -> str:
    return m.group(1) + body + "\n" + m.group(2)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "out" / "bench"
    text = DOC.read_text()
    for name, (source, render) in SECTIONS.items():
        path = out / source
        if not path.exists():
            print(f"skip {name}: {path} missing")
            continue
        body = render(json.loads(path.read_text()))
        pattern = re.compile(rf"(<!-- BEGIN {name} -->\n)(?:.*?\n)?(<!-- END {name} -->)", re.S)
        text, n = pattern.subn(functools.partial(_fill, body), text)
        if not n:
            print(f"warning: no {name} section in {DOC}")
    DOC.write_text(text)
    IMG.mkdir(parents=True, exist_ok=True)
    for plot in PLOTS:
        if (out / plot).exists():
            shutil.copy(out / plot, IMG / plot)
    print(f"updated {DOC}")


if __name__ == "__main__":
    main()
