"""`controlplane replay --router-config FILE`: replay what a router configuration deploys.

The router's settings file gives the arms (policy and parameters, or an A/B split with weights
and the sticky key), the books (reservations, speculation), the fair queue (mode, gates, batch
KV share) and the tenants (weights; each tenant's class replaces the trace's, since a router
takes it from the tenant); its replicas give the fleet (their count, the first one's GPU, model
and TP) unless the command's flags say otherwise. The same objects the router builds from that
file run in the simulator: `controlplane.sim.replay.replay_arms`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from controlplane.cli.common import build_profile, build_trace
from controlplane.cli.replay import out, progress_runs, write_report
from controlplane.errors import ConfigError
from controlplane.sim.fleet import FleetConfig
from controlplane.sim.replay import replay_arms
from controlplane.traces.model import Trace
from controlplane.types import PriorityClass
from router.config import RouterSettings, load_settings


def fleet_config(
    settings: RouterSettings,
    replicas: int | None,
    gpu: str | None,
    model: str | None,
    tp: int | None,
    block_size: int = 0,
) -> FleetConfig:
    """The simulated fleet a router configuration routes over (flags win over the file)."""
    first = settings.replicas[0] if settings.replicas else None
    prof = build_profile(
        gpu or (first.gpu if first else "h100"),
        model or (first.model if first else "llama-3.1-8b"),
        tp or (first.tp if first else 1),
        block_size or (first.block_size or 0 if first else 0),
        first.num_gpu_blocks or 0 if first else 0,
    )
    if first is not None and first.long_prefill_token_threshold:
        prof = prof.with_overrides(long_prefill_token_threshold=first.long_prefill_token_threshold)
    fair = settings.fairness
    return FleetConfig(
        profile=prof,
        replicas=replicas or len(settings.replicas) or 8,
        policy=settings.policy,
        scrape_interval_s=settings.health.scrape_interval_s,
        fairness=fair if fair.mode != "off" else None,
        tenant_weights=tuple((t.id, t.weight) for t in settings.tenants),
    )


def with_tenant_classes(trace: Trace, settings: RouterSettings) -> Trace:
    """Each configured tenant's requests in the tenant's class, as the router would see them."""
    classes = {t.id: PriorityClass(t.priority) for t in settings.tenants}
    if not classes:
        return trace
    reqs = tuple(
        dataclasses.replace(r, priority=classes[r.tenant]) if r.tenant in classes else r
        for r in trace.requests
    )
    return dataclasses.replace(trace, requests=reqs)


def replay_router_config(
    path: Path,
    *,
    trace: str,
    fleet: tuple[int | None, str | None, str | None, int | None, int],
    trace_options: dict[str, Any],
    slo: tuple[float, float],
    each_arm: bool,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    settings = load_settings(path)
    config = fleet_config(settings, *fleet)
    tr = with_tenant_classes(build_trace(trace, **trace_options), settings)
    if not len(tr):
        raise ConfigError("the trace has no requests")
    arms = (
        ", ".join(f"{a.name} ({a.policy}, weight {a.weight:g})" for a in settings.policy.arms)
        or settings.policy.name
    )
    queue = settings.fairness.mode if config.fairness is not None else "off"
    out.print(
        f"[bold]{tr.name}[/]: {len(tr)} requests over {tr.duration_s:.0f}s; {config.replicas} x "
        f"{config.profile.label}; router config {path}: arms {arms}, fair queue {queue}"
    )
    with progress_runs(len(tr)) as (start, advance):
        report = replay_arms(
            tr,
            config,
            each_arm=each_arm,
            slo_ttft_s=slo[0],
            slo_tpot_s=slo[1],
            on_run_start=start,
            progress=advance,
        )
    write_report(report, json_path, plot)


__all__ = ["fleet_config", "replay_router_config", "with_tenant_classes"]
