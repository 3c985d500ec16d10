"""The engine deployment's demand, measured by the OpenAI ingress replicas (Ray 2.60).

On Ray Serve requests arrive at the ingress deployment: its replicas run the router's request
scope, whose demand meter (`router/telemetry/demand.py`) prices every admitted request. The
engine deployment's autoscaling policy (`ServeAutoscaler`) is handed an `AutoscalingContext`
holding its OWN replicas' metrics only, so the ingress's meters reach it through the Serve
controller, where every deployment's policy runs:

    ingress replica   record_autoscaling_stats() -> DemandTotals.stats()     every
                      metrics_interval_s (the ingress deployment has an autoscaling_config:
                      Ray collects custom metrics only from autoscaling deployments)
    controller        the ingress's policy, `IngressDemand`, called with the ingress's context
                      each control-loop step: posts `ctx.raw_metrics` (per ingress replica, the
                      reported series) on this process's `BOARD` under (app, ingress deployment)
                      and keeps the ingress at its replica count (min_replicas = max_replicas)
    controller        the engine's policy, `ServeAutoscaler(demand="ingress",
                      ingress_deployment=...)`, reads that entry at its decisions and turns it
                      into a `DemandSample` exactly as it would its own replicas' counters
                      (per-replica deltas since the last decision, gauges summed)

Ray 2.60 calls every deployment's policy from the controller's control loop (one process, one
thread; `ApplicationState.autoscale` calls an application's deployments in turn), so the board
is a plain dict: no I/O, no lock on the control loop. An entry older than `stale_s` (the ingress
is gone, or reports nothing) is no data: the engine's policy holds its target rather than read
silence as zero demand.

Serve pickles each policy's module by value when the application is deployed: the policies reach
the board through `board()`, which imports it in the controller, never through a module-level
name (that would travel as a copy, one per policy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.errors import ConfigError

INGRESS_ADAPTER = "autoscaler.hosts.ray_ingress:IngressDemand"


@dataclass(frozen=True, slots=True)
class Posted:
    """One ingress deployment's reported metrics, as its policy last saw them."""

    raw: dict[str, dict[Any, Any]]
    at_s: float


class DemandBoard:
    """(app, ingress deployment) -> its replicas' latest reported metrics."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], Posted] = {}

    def post(self, app: str, deployment: str, raw: dict[str, dict[Any, Any]], now: float) -> None:
        self.entries[(app, deployment)] = Posted(raw, now)

    def read(
        self, app: str, deployment: str, now: float, stale_s: float
    ) -> dict[str, dict[Any, Any]] | None:
        """The entry's metrics; None when there is none or it is older than `stale_s`."""
        posted = self.entries.get((app, deployment))
        if posted is None or now - posted.at_s > stale_s:
            return None
        return posted.raw

    def drop(self, app: str, deployment: str) -> None:
        self.entries.pop((app, deployment), None)


# the Serve controller's board: both policies live in the controller's process
BOARD = DemandBoard()


def board() -> DemandBoard:
    """This process's `BOARD`. Serve ships a policy's module by value (cloudpickle), so a
    policy that named the module-level `BOARD` would carry a copy of it: import it where the
    policy runs."""
    from autoscaler.hosts.ray_ingress import BOARD

    return BOARD


class IngressDemandConfig(BaseSettings):
    """`policy_kwargs` of the ingress deployment's policy."""

    model_config = SettingsConfigDict(env_prefix="CP_AUTOSCALER_INGRESS_", extra="forbid")

    replicas: int | None = Field(
        default=None,
        ge=1,
        description="Ingress replicas to keep (None: Ray's current target, within its bounds).",
    )


def _now(ctx: Any) -> float:
    return float(ctx.current_time if ctx.current_time is not None else time.time())


class IngressDemand:
    """The ingress deployment's `autoscaling_config.policy.policy_function`: posts the ingress
    replicas' reported demand on `BOARD` and keeps the ingress's replica count."""

    def __init__(self, **kwargs: Any) -> None:
        try:
            self.config = IngressDemandConfig(**kwargs)
        except ValidationError as exc:
            raise ConfigError(f"invalid ingress demand policy kwargs:\n{exc}") from None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        board().post(str(ctx.app_name), str(ctx.deployment_name), ctx.raw_metrics or {}, _now(ctx))
        target = self.config.replicas or int(ctx.target_num_replicas)
        lo, hi = int(ctx.capacity_adjusted_min_replicas), int(ctx.capacity_adjusted_max_replicas)
        return max(lo, min(hi, target)), dict(ctx.policy_state)


def ingress_autoscaling_config(replicas: int, *, metrics_interval_s: float = 1.0) -> dict[str, Any]:
    """The ingress deployment's `autoscaling_config`: `replicas` replicas (fixed), each pushing
    its `record_autoscaling_stats` every `metrics_interval_s`, and `IngressDemand` as the policy.
    Ray's delays are 0: the count never changes, nothing to delay."""
    if replicas < 1 or metrics_interval_s <= 0:
        raise ConfigError(
            f"need replicas >= 1 and metrics_interval_s > 0: {replicas}, {metrics_interval_s}"
        )
    return {
        "min_replicas": replicas,
        "max_replicas": replicas,
        "initial_replicas": replicas,
        "metrics_interval_s": metrics_interval_s,
        "look_back_period_s": max(2.0, 2 * metrics_interval_s),
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {"policy_function": INGRESS_ADAPTER, "policy_kwargs": {"replicas": replicas}},
    }


__all__ = [
    "BOARD",
    "INGRESS_ADAPTER",
    "DemandBoard",
    "IngressDemand",
    "IngressDemandConfig",
    "board",
    "ingress_autoscaling_config",
]
