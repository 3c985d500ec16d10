"""`controlplane autoscale run`: the standalone autoscaler (advisory, Kubernetes or KEDA)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Annotated, Any

import typer
from rich.console import Console

from autoscaler.hosts.kubernetes import HostSettings, serve
from controlplane.cli.autoscale import autoscale_app
from controlplane.errors import ConfigError

out = Console(stderr=True)


def _params(items: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--policy-param expects KEY=VALUE, got {item!r}")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return params


@autoscale_app.command("run")
def run_cmd(
    routers: Annotated[
        str, typer.Option(help="Router base URLs, comma-separated (their /metrics are summed).")
    ],
    mode: Annotated[
        str, typer.Option(help="advisory (log only), kubernetes (PATCH scale) or keda (metric).")
    ] = "advisory",
    namespace: Annotated[str, typer.Option(help="Namespace ('' = the pod's).")] = "",
    deployment: Annotated[str, typer.Option(help="Deployment to scale.")] = "",
    statefulset: Annotated[str, typer.Option(help="StatefulSet to scale.")] = "",
    policy: Annotated[str, typer.Option(help="Policy name or module:factory.")] = "headroom",
    policy_param: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE (JSON value), repeatable.")
    ] = None,
    model: Annotated[str, typer.Option(help="Served model to scale ('' = all).")] = "",
    tick_s: Annotated[float, typer.Option(help="Seconds between decisions.")] = 10.0,
    load_time_s: Annotated[float, typer.Option(help="Load time until one is measured.")] = 120.0,
    min_replicas: Annotated[int, typer.Option(help="Lower bound of the target.")] = 1,
    max_replicas: Annotated[int, typer.Option(help="Upper bound of the target.")] = 64,
    api_url: Annotated[str, typer.Option(help="Kubernetes API URL ('' = in-cluster).")] = "",
    listen_port: Annotated[int, typer.Option(help="Port of /metrics and /keda.")] = 9464,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Scrape the routers every tick, decide with the policy, actuate through MODE."""
    logging.basicConfig(level=log_level.upper(), format="%(message)s")
    explicit: dict[str, Any] = {
        "routers": [u.strip() for u in routers.split(",") if u.strip()],
        "mode": mode, "namespace": namespace, "deployment": deployment,
        "statefulset": statefulset, "policy": policy, "model": model, "tick_s": tick_s,
        "load_time_s": load_time_s, "min_replicas": min_replicas, "max_replicas": max_replicas,
        "listen_port": listen_port,
    }  # fmt: skip
    if policy_param:
        explicit["policy_params"] = _params(policy_param)
    if api_url:
        explicit["api_url"] = api_url
    try:
        settings = HostSettings(**explicit)
    except ValueError as exc:
        raise ConfigError(f"invalid autoscaler settings:\n{exc}") from None
    out.print(
        f"autoscaler: mode [bold]{settings.mode}[/], policy {settings.policy}, "
        f"{len(settings.routers)} router(s), /metrics on :{settings.listen_port}"
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))


__all__ = ["run_cmd"]
