"""`controlplane autoscale run`: the standalone autoscaler (advisory, Kubernetes or KEDA)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Annotated, Any

import typer
from rich.console import Console

from autoscaler.hosts.kubernetes import HostSettings, serve
from controlplane.cli.autoscale import autoscale_app, policy_params
from controlplane.errors import ConfigError

out = Console(stderr=True)


@autoscale_app.command("run")
def run_cmd(
    routers: Annotated[
        str | None,
        typer.Option(help="Router base URLs, comma-separated (their /metrics are summed)."),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(help="advisory (log only), kubernetes (PATCH scale) or keda (metric)."),
    ] = None,
    namespace: Annotated[str | None, typer.Option(help="Namespace ('' = the pod's).")] = None,
    deployment: Annotated[str | None, typer.Option(help="Deployment to scale.")] = None,
    statefulset: Annotated[str | None, typer.Option(help="StatefulSet to scale.")] = None,
    policy: Annotated[str | None, typer.Option(help="Policy name or module:factory.")] = None,
    policy_param: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE (JSON value), repeatable.")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Served model to scale ('' = all).")] = None,
    tick_s: Annotated[float | None, typer.Option(help="Seconds between decisions.")] = None,
    load_time_s: Annotated[
        float | None, typer.Option(help="Load time until one is measured (default 240).")
    ] = None,
    min_replicas: Annotated[int | None, typer.Option(help="Lower bound of the target.")] = None,
    max_replicas: Annotated[int | None, typer.Option(help="Upper bound of the target.")] = None,
    api_url: Annotated[
        str | None, typer.Option(help="Kubernetes API URL ('' = in-cluster).")
    ] = None,
    listen_port: Annotated[int | None, typer.Option(help="Port of /metrics and /keda.")] = None,
    drain_timeout_s: Annotated[
        float | None, typer.Option(help="Longest wait for scale-down victims to drain.")
    ] = None,
    admin_key_env: Annotated[
        str | None,
        typer.Option(
            help="Environment variable holding the routers' admin key: scale-down victims are "
            "drained through the routers first ('' = removed without a drain)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Scrape the routers every tick, decide with the policy, actuate through MODE.

    Flags override `CP_AUTOSCALER_*` environment variables, which override the defaults."""
    logging.basicConfig(level=log_level.upper(), format="%(message)s")
    given: dict[str, Any] = {
        "mode": mode, "namespace": namespace, "deployment": deployment,
        "statefulset": statefulset, "policy": policy, "model": model, "tick_s": tick_s,
        "load_time_s": load_time_s, "min_replicas": min_replicas, "max_replicas": max_replicas,
        "listen_port": listen_port, "api_url": api_url, "drain_timeout_s": drain_timeout_s,
        "admin_key_env": admin_key_env,
    }  # fmt: skip
    explicit = {k: v for k, v in given.items() if v is not None}
    if routers is not None:
        explicit["routers"] = [u.strip() for u in routers.split(",") if u.strip()]
    if policy_param:
        explicit["policy_params"] = policy_params(policy_param, strings=True)
    try:
        settings = HostSettings(**explicit)
    except ValueError as exc:
        raise ConfigError(f"invalid autoscaler settings:\n{exc}") from None
    if not settings.routers:
        raise ConfigError("no routers to scrape: pass --routers or set CP_AUTOSCALER_ROUTERS")
    out.print(
        f"autoscaler: mode [bold]{settings.mode}[/], policy {settings.policy}, "
        f"{len(settings.routers)} router(s), /metrics on :{settings.listen_port}, "
        + (f"drain through the routers (key in ${settings.admin_key_env})"
           if settings.admin_key_env else "[yellow]scale-down without drain[/]")
    )  # fmt: skip
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))


__all__ = ["run_cmd"]
