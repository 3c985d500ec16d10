"""Replay one trace through the router-side tenant queue once per fairness mode, side by side.

The library call behind `controlplane replay --fairness` and `bench/fairness_bench.py`. Every
mode sees the same trace, fleet and routing policy; the fleet's `fairness` is a `FairnessConfig`
with that mode, the tenants' weights and the batch class's KV share. Each result gets a
`TenantFairness` (controlplane.sim.fairness): work shares in roofline units whatever the mode
charged, Jain's index, TTFT/TPOT p99 per tenant and per class.

`parse_weights("A=1,B=3")` reads the CLI's weights; `batch_share_for_trace` sizes the batch
class's KV share from an interactive TPOT target (absolute, or a slowdown of the interactive
load's own TPOT) with `tenancy.classes.batch_kv_share`, taking the interactive load per replica
from the trace by Little's law:

    sequences = interactive requests/s * mean output tokens * TPOT target / replicas
    context   = mean interactive prompt + mean output / 2
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from statistics import fmean

from controlplane.errors import ConfigError
from controlplane.routing.policies import make_policy
from controlplane.sim.fairness import tenant_fairness
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.ids import dense_block_ids
from controlplane.sim.replay import ReplayReport, with_policy
from controlplane.tenancy.classes import ClassLoad, batch_kv_share, interactive_tpot
from controlplane.tenancy.config import FairnessConfig
from controlplane.tenancy.work import WorkMode, WorkModel
from controlplane.traces.model import Trace
from controlplane.types import PriorityClass


def parse_weights(spec: str) -> dict[str, float]:
    """`A=1,B=3` -> {"A": 1.0, "B": 3.0}; every weight must be positive."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not name.strip() or weight <= 0:
            raise ConfigError(f"tenant weights look like A=1,B=3 (positive), got {part!r}")
        out[name.strip()] = weight
    return out


def parse_modes(spec: str) -> list[WorkMode]:
    try:
        return [WorkMode(m.strip()) for m in spec.split(",") if m.strip()]
    except ValueError:
        known = ", ".join(m.value for m in WorkMode)
        raise ConfigError(f"--fairness takes modes from {known}, got {spec!r}") from None


def class_load(trace: Trace, config: FleetConfig, tpot_s: float) -> ClassLoad:
    """The per-replica interactive and batch load of `trace` (see the module docstring)."""
    inter = [r for r in trace if r.priority is PriorityClass.INTERACTIVE]
    batch = [r for r in trace if r.priority is PriorityClass.BATCH]
    span = max(1e-9, trace.duration_s)
    out_i = fmean(r.output_tokens for r in inter) if inter else 1.0
    return ClassLoad(
        interactive_sequences=len(inter) / span * out_i * tpot_s / max(1, config.replicas),
        interactive_context=(fmean(r.prompt_tokens for r in inter) + out_i / 2) if inter else 0.0,
        interactive_output=out_i,
        batch_prompt=fmean(r.prompt_tokens for r in batch) if batch else 1000.0,
        batch_output=fmean(r.output_tokens for r in batch) if batch else 500.0,
    )


def batch_share_for_trace(
    trace: Trace, config: FleetConfig, *, tpot_target_s: float = 0.0, slowdown: float = 0.0
) -> tuple[float, dict[str, float]]:
    """The batch KV share for `trace` on `config`'s fleet, for an absolute interactive TPOT
    target or a `slowdown` of the interactive load's own TPOT (both estimated with the
    roofline), and the figures it was sized from."""
    if (tpot_target_s > 0) == (slowdown > 0):
        raise ConfigError("give either an interactive TPOT target or a slowdown")
    alone = 0.0
    if slowdown > 0:
        # the interactive TPOT sets the concurrency (Little) that sets the TPOT: iterate
        alone = 0.01
        for _ in range(20):
            alone = interactive_tpot(config.profile, class_load(trace, config, alone))
        tpot_target_s = slowdown * alone
    load = class_load(trace, config, tpot_target_s)
    share = batch_kv_share(config.profile, tpot_target_s, load)
    return share, {
        "tpot_target_s": tpot_target_s,
        "interactive_tpot_alone_s": alone,
        **{k: float(v) for k, v in asdict(load).items()},
    }


def fair_replay(
    trace: Trace,
    config: FleetConfig,
    modes: Sequence[WorkMode | str],
    *,
    policy: str = "least_loaded",
    weights: Mapping[str, float] | None = None,
    batch_kv_share: float = 1.0,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.1,
    labels: Sequence[str] | None = None,
    on_start: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Run `trace` once per fairness mode (results keyed by mode, or by `labels`)."""
    wall0 = time.perf_counter()
    make_policy(policy)  # fail fast on a bad name
    weights = dict(weights or {})
    bs = config.profile.resolved_block_size
    ids, floor = dense_block_ids(trace, bs)
    report = ReplayReport(trace.name, config, slo_ttft_s, slo_tpot_s)
    measure = WorkModel.build(WorkMode.VTC_ROOFLINE, config.profile)
    names = list(labels) if labels is not None else [str(WorkMode(m)) for m in modes]
    for name, mode in zip(names, modes, strict=True):
        if on_start is not None:
            on_start(name)
        queue = FairnessConfig(mode=WorkMode(mode).value, batch_kv_share=batch_kv_share)
        run = replace(config, fairness=queue, tenant_weights=tuple(sorted(weights.items())))
        sim = FleetSim(with_policy(run, name=policy, params={}, arms=[]))
        result = sim.run(trace, block_ids=ids, id_floor=floor, progress=progress)
        report.results[name] = result
        report.fairness[name] = tenant_fairness(result, measure, weights)
    report.wall_s = time.perf_counter() - wall0
    return report


__all__ = [
    "batch_share_for_trace",
    "class_load",
    "fair_replay",
    "parse_modes",
    "parse_weights",
]
