"""Replay one trace through a simulated fleet once per routing policy, side by side.

The library call behind `controlplane replay`, `make demo` and the benchmarks; `replay_arms`
replays a router configuration's A/B split as the router runs it (`replay --router-config`).
Every policy sees the same trace, the same engine profile and the same fleet settings; block
hashes are computed once and shared. The pooled-cache ceiling (controlplane.sim.pooled) is
computed alongside, so each policy's hit rate can be read as a fraction of what any policy could
reach.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from controlplane.routing.ab import arms_from_config
from controlplane.routing.policies import make_policy
from controlplane.sim.fairness import TenantFairness
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.ids import dense_block_ids
from controlplane.sim.pooled import pooled_hit_rate
from controlplane.sim.results import FleetResult
from controlplane.traces.model import Trace

SUMMARY_KEYS = (
    "requests",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "prefix_hit_rate",
    "goodput_rps",
    "output_tokens_per_s",
    "load_imbalance",
    "preemptions",
)


@dataclass(slots=True)
class ReplayReport:
    trace_name: str
    config: FleetConfig
    slo_ttft_s: float
    slo_tpot_s: float
    results: dict[str, FleetResult] = field(default_factory=dict)
    pooled_prefix_hit_rate: float = 0.0
    wall_s: float = 0.0
    # per run, with the router-side tenant queue (controlplane.sim.fair_replay)
    fairness: dict[str, TenantFairness] = field(default_factory=dict)

    def summaries(self) -> dict[str, dict[str, float]]:
        return {
            name: res.summary(self.slo_ttft_s, self.slo_tpot_s)
            for name, res in self.results.items()
        }

    def to_json(self) -> dict[str, object]:
        """The issue's machine-readable shape, plus extras under their own keys."""
        simulated = max((r.simulated_s for r in self.results.values()), default=0.0)
        policies: dict[str, object] = {}
        for name, summary in self.summaries().items():
            row: dict[str, object] = {k: summary[k] for k in SUMMARY_KEYS}
            row["requests"] = int(summary["requests"])
            row["preemptions"] = int(summary["preemptions"])
            row["completed"] = int(summary["completed"])
            row["slo_attainment"] = summary["slo_attainment"]
            row["wall_seconds"] = self.results[name].wall_s
            row["reasons"] = self.results[name].reasons()
            policies[name] = row
        cfg = self.config
        return {
            "trace": self.trace_name,
            "simulated_seconds": simulated,
            "wall_seconds": self.wall_s,
            "pooled_prefix_hit_rate": self.pooled_prefix_hit_rate,
            "slo": {"ttft_s": self.slo_ttft_s, "tpot_s": self.slo_tpot_s},
            "fleet": {
                "replicas": cfg.replicas,
                "routers": cfg.routers,
                "gpu": cfg.profile.gpu_key,
                "model": cfg.profile.model_key,
                "tp": cfg.profile.tp,
                "block_size": cfg.profile.resolved_block_size,
                "num_gpu_blocks": cfg.profile.num_gpu_blocks,
                "reservations": cfg.policy.reservations,
                "speculative": cfg.policy.speculative,
                "eviction_notice_delay_s": cfg.eviction_notice_delay_s,
                "kv_event_delay_s": cfg.kv_event_delay_s,
                "scrape_interval_s": cfg.scrape_interval_s,
            },
            "policies": policies,
            **(
                {"fairness": {k: f.to_json() for k, f in self.fairness.items()}}
                if self.fairness
                else {}
            ),
        }


def replay(
    trace: Trace,
    config: FleetConfig,
    policies: Sequence[str],
    *,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.1,
    policy_params: dict[str, dict[str, object]] | None = None,
    pooled: bool = True,
    on_policy_start: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Run every policy over `trace` on a fresh fleet; returns results keyed by policy name."""
    wall0 = time.perf_counter()
    params = policy_params or {}
    bs = config.profile.resolved_block_size
    ids, floor = dense_block_ids(trace, bs)
    report = ReplayReport(trace.name, config, slo_ttft_s, slo_tpot_s)
    for name in policies:
        make_policy(name, **params.get(name, {}))  # fail fast on a bad name before any run
    if pooled:
        report.pooled_prefix_hit_rate = pooled_hit_rate(
            trace, config.profile, config.replicas, ids, id_floor=floor
        )
    for name in policies:
        if on_policy_start is not None:
            on_policy_start(name)
        sim = FleetSim(with_policy(config, name=name, params=params.get(name, {}), arms=[]))
        report.results[name] = sim.run(trace, block_ids=ids, id_floor=floor, progress=progress)
    report.wall_s = time.perf_counter() - wall0
    return report


def replay_arms(
    trace: Trace,
    config: FleetConfig,
    *,
    each_arm: bool = False,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.1,
    pooled: bool = True,
    on_run_start: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Replay `trace` once with `config.policy` as a router runs it: its A/B arms split the
    requests by sticky key on one fleet (results "split", and "arm <name>" per arm); with
    `each_arm`, every arm's policy also runs alone on the whole trace ("<name> alone")."""
    wall0 = time.perf_counter()
    bs = config.profile.resolved_block_size
    ids, floor = dense_block_ids(trace, bs)
    report = ReplayReport(trace.name, config, slo_ttft_s, slo_tpot_s)
    arms = arms_from_config(config.policy)
    for arm in arms:
        make_policy(arm.policy, **arm.params)  # fail fast on a bad name or parameter
    if pooled:
        report.pooled_prefix_hit_rate = pooled_hit_rate(
            trace, config.profile, config.replicas, ids, id_floor=floor
        )
    runs = [("split", config)]
    if each_arm:
        runs += [
            (f"{a.name} alone", with_policy(config, name=a.policy, params=a.params, arms=[]))
            for a in arms
        ]
    for label, cfg in runs:
        if on_run_start is not None:
            on_run_start(label)
        result = FleetSim(cfg).run(trace, block_ids=ids, id_floor=floor, progress=progress)
        report.results[label] = result
        if label == "split" and len(arms) > 1:
            for arm in arms:
                report.results[f"arm {arm.name}"] = result.only_arm(arm.name)
    report.wall_s = time.perf_counter() - wall0
    return report


def with_fleet(config: FleetConfig, **changes: object) -> FleetConfig:
    return replace(config, **changes)  # type: ignore[arg-type]


def with_policy(config: FleetConfig, **changes: object) -> FleetConfig:
    """`config` with some `PolicyConfig` fields changed (e.g. `reservations=False`)."""
    return replace(config, policy=config.policy.model_copy(update=changes))
