"""The standalone host: the controller loop in front of Kubernetes, in one of three modes.

- `kubernetes`: the target becomes `spec.replicas` of a Deployment or StatefulSet through its
  scale subresource (`autoscaler/hosts/kube_scaler.py`): a scale-up PATCHes it at once; a
  scale-down first picks its victims (a StatefulSet's top ordinals, a Deployment's pods with the
  least in-flight and cached work), drains them through the `Drainer` (`autoscaler/victims.py`),
  sets `controller.kubernetes.io/pod-deletion-cost` on a Deployment's victims, and only then
  PATCHes. The drainer is `build(..., drainer=...)`'s, else, when `admin_key_env` names the
  variable holding the routers' admin key, a `RouterDrainer` over the routers' admin API
  (`autoscaler/hosts/router_drainer.py`, the `routers` scraped), else `NoDrainer` (warned once:
  no load known, nothing waited on, so a Deployment's victims are its not-Ready pods, then by
  name, and their requests in flight are cut). 429/5xx/transport errors are retried with
  backoff, a 409 re-reads; anything else (401/403/404/422) raises `KubernetesApiError` with the
  API's own message. The controller logs and counts the error and tries again next tick.
- `advisory`: reads the fleet if a Deployment/StatefulSet is named (GETs only), never PATCHes;
  each decision is one JSON log line.
- `keda`: publishes the target as `cp_autoscaler_target_replicas{model}` on `/metrics` and as
  `{"target": N}` on `/keda` (KEDA's metrics-api scaler, `valueLocation: target`). Use it with
  `metricType: AverageValue` and target 1, so the HPA's `ceil(total / 1)` is our target; set the
  HPA's `behavior.scaleDown.stabilizationWindowSeconds: 0` (and a tolerance of 0 where
  available) so the HPA adds no second hysteresis on top of the policy's.

Credentials (`controlplane/kube/api.py`): the in-cluster service account or a configured
`api_url` / `token` / `ca_file`. RBAC: `get` on the deployment (or statefulset), `get`, `patch`
on its `/scale` subresource, and for a Deployment's drained scale-down `list`, `patch` on `pods`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from autoscaler.controller import (
    AutoscalerSettings,
    Controller,
    ControllerMetrics,
    RouterScraper,
    load_policy,
)
from autoscaler.hosts import FleetObservation
from autoscaler.hosts.kube_scaler import KubernetesScaler, ScalerSettings
from autoscaler.hosts.router_drainer import DrainerSettings, RouterDrainer
from autoscaler.types import ScaleDecision, ScalingPolicy
from autoscaler.victims import Drainer, NoDrainer
from controlplane.errors import ConfigError, KubernetesApiError
from controlplane.tracing import Exporter, OtlpEndpoint, setup_tracing

log = logging.getLogger("controlplane.autoscaler.kubernetes")


class HostSettings(AutoscalerSettings, ScalerSettings, DrainerSettings):
    """The standalone host: the controller's settings plus where the target goes."""

    listen_host: str = Field(default="0.0.0.0", description="Interface of /metrics and /keda.")
    listen_port: int = Field(default=9464, ge=0, description="Port of /metrics and /keda.")
    otel_exporter: Exporter = Field(
        default="none",
        description="Where the decision spans (cp.autoscaler.decide) go: none (off), console "
        "(stdout) or otlp (OTLP/HTTP to otlp_endpoint; OTEL_EXPORTER_OTLP_* for the rest).",
    )
    otlp_endpoint: OtlpEndpoint = Field(
        default=None,
        description="The collector's OTLP/HTTP traces URL for otel_exporter=otlp (a URL without "
        "a path gets /v1/traces); None: the OTEL_EXPORTER_OTLP_* variables decide.",
    )
    service_name: str = Field(
        default="controlplane-autoscaler",
        min_length=1,
        description="The spans' service.name resource attribute.",
    )


class ObserveOnly:
    """advisory/keda without a named object: the fleet is not observable (None)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def observe(self) -> FleetObservation | None:
        return None

    async def apply(self, target: int, decision: ScaleDecision, fleet: FleetObservation) -> bool:
        return True  # the assumed fleet follows the target

    async def aclose(self) -> None:
        return None


def metrics_app(controller: Controller) -> Starlette:
    """`/metrics` (the controller's registry), `/keda` (`{"target": N}`), `/healthz`."""

    async def metrics(_: Request) -> Response:
        body = generate_latest(controller.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def keda(_: Request) -> Response:
        if controller.decision is None:
            return JSONResponse({"error": "no decision yet"}, status_code=503)
        return JSONResponse({"target": controller.decision.target, "model": controller.label})

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok", "mode": controller.actuator.mode})

    routes = [Route("/metrics", metrics), Route("/keda", keda), Route("/healthz", healthz)]
    return Starlette(routes=routes)


def build(
    settings: HostSettings,
    *,
    policy: ScalingPolicy[Any] | None = None,
    clock: Callable[[], float] | None = None,
    kube_client: httpx.AsyncClient | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    drainer: Drainer | None = None,
) -> tuple[Controller, KubernetesScaler | ObserveOnly, httpx.AsyncClient]:
    """The controller for `settings` (and what to close: the actuator, the scrape client)."""
    if not settings.routers:
        raise ConfigError("no routers to scrape: give --routers URL[,URL]")
    if settings.min_replicas > settings.max_replicas:
        raise ConfigError("min_replicas is above max_replicas")
    policy = policy or load_policy(settings.policy, settings.policy_params)
    metrics = ControllerMetrics()
    actuator: KubernetesScaler | ObserveOnly
    if settings.target_ref() is None:
        actuator = ObserveOnly(settings.mode)
        scrape_client = httpx.AsyncClient(timeout=settings.scrape_timeout_s)
    else:
        key = settings.admin_key()  # before anything is opened: a ConfigError leaks nothing
        actuator = KubernetesScaler(
            settings, drainer=drainer, registry=metrics.registry, client=kube_client, sleep=sleep
        )
        scrape_client = httpx.AsyncClient(timeout=settings.scrape_timeout_s)
        if drainer is None:  # the admin calls share the scrape client (closed with it)
            actuator.drainer = router_drainer(settings, key, scrape_client, sleep)
    scraper = RouterScraper(settings.routers, settings.model, scrape_client)
    kwargs: dict[str, Any] = {"clock": clock} if clock is not None else {}
    controller = Controller(settings, policy, actuator, scraper, metrics=metrics, **kwargs)
    return controller, actuator, scrape_client


def router_drainer(
    settings: HostSettings,
    admin_key: str | None,
    client: httpx.AsyncClient,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Drainer:
    """The drainer over the routers' admin API when an admin key is configured; else
    `NoDrainer`, with a warning in kubernetes mode (scale-down removes pods without a drain)."""
    if admin_key is None:
        if settings.mode == "kubernetes":
            log.warning(
                "no admin_key_env (CP_AUTOSCALER_ADMIN_KEY_ENV): scale-down without drain, "
                "the removed pods' requests in flight are cut"
            )
        return NoDrainer()
    return RouterDrainer(
        settings.routers, admin_key, poll_s=settings.drain_poll_s,
        timeout_s=settings.admin_timeout_s, client=client, sleep=sleep,
    )  # fmt: skip


async def serve(settings: HostSettings) -> None:
    """Run the loop and the /metrics + /keda endpoint until interrupted."""
    import uvicorn

    provider = setup_tracing(
        settings.otel_exporter, settings.service_name, otlp_endpoint=settings.otlp_endpoint
    )
    controller, actuator, scrape_client = build(settings)
    stop = asyncio.Event()
    config = uvicorn.Config(
        metrics_app(controller), host=settings.listen_host, port=settings.listen_port,
        log_level="warning",
    )  # fmt: skip
    server = uvicorn.Server(config)
    log.info(json.dumps({"event": "autoscaler_start", "mode": settings.mode,
                         "routers": settings.routers, "policy": settings.policy}))  # fmt: skip
    loop_task = asyncio.create_task(controller.run(stop))
    try:
        await server.serve()
    finally:
        stop.set()
        await loop_task
        await actuator.aclose()
        await scrape_client.aclose()
        if provider is not None:  # the last decisions' spans leave before the process does
            provider.shutdown()


__all__ = [
    "HostSettings",
    "KubernetesApiError",
    "KubernetesScaler",
    "ObserveOnly",
    "ScalerSettings",
    "build",
    "metrics_app",
    "router_drainer",
    "serve",
]
