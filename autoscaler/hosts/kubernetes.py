"""The standalone host: the controller loop in front of Kubernetes, in one of three modes.

- `kubernetes`: the target becomes `spec.replicas` of a Deployment or StatefulSet through its
  scale subresource. Read: `GET .../{deployments|statefulsets}/{name}/scale` (spec, the
  `resourceVersion`) and `GET .../{name}` (`status.readyReplicas`); loading = spec - ready.
  Write (only when the target differs): `PATCH .../scale` with the JSON merge patch
  `{"metadata": {"resourceVersion": rv}, "spec": {"replicas": N}}`; a 409 (someone changed the
  object since the GET) re-reads and retries with the fresh version; 429/5xx/transport errors are
  retried with backoff; anything else (401/403/404/422) raises `KubernetesApiError` at once with
  the API's own message. The controller logs and counts the error and tries again next tick.
- `advisory`: reads the fleet if a Deployment/StatefulSet is named (GETs only), never PATCHes;
  each decision is one JSON log line.
- `keda`: publishes the target as `cp_autoscaler_target_replicas{model}` on `/metrics` and as
  `{"target": N}` on `/keda` (KEDA's metrics-api scaler, `valueLocation: target`). Use it with
  `metricType: AverageValue` and target 1, so the HPA's `ceil(total / 1)` is our target; set the
  HPA's `behavior.scaleDown.stabilizationWindowSeconds: 0` (and a tolerance of 0 where
  available) so the HPA adds no second hysteresis on top of the policy's.

Credentials: the in-cluster service account (API `https://$KUBERNETES_SERVICE_HOST:PORT`, token
and CA under /var/run/secrets/kubernetes.io/serviceaccount; the token file is re-read per
request, it rotates) or a configured `api_url` / `token` / `ca_file`. RBAC: `get` on the
deployment (or statefulset) and `get`, `patch` on its `/scale` subresource.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field, SecretStr
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
from autoscaler.types import ScaleDecision, ScalingPolicy
from controlplane.errors import ConfigError, ControlPlaneError

log = logging.getLogger("controlplane.autoscaler.kubernetes")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
RETRIABLE = {429, 500, 502, 503, 504}


class KubernetesApiError(ControlPlaneError):
    """A Kubernetes API call that failed (after its retries)."""


class HostSettings(AutoscalerSettings):
    """The standalone host: the controller's settings plus where the target goes."""

    mode: Literal["advisory", "kubernetes", "keda"] = Field(
        default="advisory", description="advisory: log only; kubernetes: PATCH scale; keda: metric."
    )
    namespace: str = Field(default="", description="Namespace ('' = the service account's).")
    deployment: str = Field(default="", description="Deployment to scale (or `statefulset`).")
    statefulset: str = Field(default="", description="StatefulSet to scale (or `deployment`).")
    api_url: str = Field(default="", description="API server URL ('' = in-cluster).")
    token: SecretStr | None = Field(default=None, description="Bearer token (None = SA token).")
    token_file: Path = Field(default=SA_DIR / "token", description="Service account token file.")
    ca_file: Path = Field(default=SA_DIR / "ca.crt", description="CA bundle of the API server.")
    insecure_skip_tls_verify: bool = Field(default=False, description="Do not verify TLS.")
    request_timeout_s: float = Field(default=5.0, gt=0, description="Timeout of one API call.")
    retries: int = Field(default=3, ge=0, description="Retries of a 409/429/5xx/transport error.")
    retry_backoff_s: float = Field(default=0.5, ge=0, description="First backoff, doubled.")
    listen_host: str = Field(default="0.0.0.0", description="Interface of /metrics and /keda.")
    listen_port: int = Field(default=9464, ge=0, description="Port of /metrics and /keda.")

    def target_ref(self) -> tuple[str, str] | None:
        """(resource, name) of the scaled object; None when none is named."""
        if self.deployment and self.statefulset:
            raise ConfigError("name a --deployment or a --statefulset, not both")
        if self.deployment:
            return "deployments", self.deployment
        if self.statefulset:
            return "statefulsets", self.statefulset
        if self.mode == "kubernetes":
            raise ConfigError("kubernetes mode needs a --deployment or a --statefulset to scale")
        return None


def _api_url(s: HostSettings) -> str:
    if s.api_url:
        return s.api_url.rstrip("/")
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
    )
    if not host:
        raise ConfigError("no Kubernetes API: set CP_AUTOSCALER_API_URL or run in a pod")
    return f"https://{host}:{port}"


def _namespace(s: HostSettings) -> str:
    if s.namespace:
        return s.namespace
    ns_file = SA_DIR / "namespace"
    return ns_file.read_text().strip() if ns_file.exists() else "default"


class KubernetesScaler:
    """Reads and sets the replicas of one Deployment/StatefulSet (an `Actuator`)."""

    def __init__(
        self,
        settings: HostSettings,
        *,
        client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        ref = settings.target_ref()
        if ref is None:
            raise ConfigError("no Deployment or StatefulSet named")
        resource, name = ref
        self.settings = settings
        self.mode: str = settings.mode
        self.path = f"/apis/apps/v1/namespaces/{_namespace(settings)}/{resource}/{name}"
        self.what = f"{resource[:-1]} {_namespace(settings)}/{name}"
        verify: Any = True
        if settings.insecure_skip_tls_verify:
            verify = False
        elif settings.ca_file.exists():
            verify = str(settings.ca_file)
        self.client = client or httpx.AsyncClient(
            base_url=_api_url(settings), verify=verify, timeout=settings.request_timeout_s
        )
        self.sleep = sleep

    def _headers(self) -> dict[str, str]:
        s = self.settings
        if s.token is not None:
            token = s.token.get_secret_value()
        elif s.token_file.exists():
            token = s.token_file.read_text().strip()
        else:
            return {}
        return {"Authorization": f"Bearer {token}"}

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """One API call with retries of 429/5xx/transport errors; 409 is raised to the caller."""
        headers = self._headers()
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        delay = self.settings.retry_backoff_s
        for attempt in range(self.settings.retries + 1):
            last = attempt == self.settings.retries
            try:
                resp = await self.client.request(method, path, headers=headers, json=body)
            except httpx.TransportError as exc:
                if last:
                    raise KubernetesApiError(f"{method} {self.what}: {exc!r}") from None
            else:
                if resp.status_code < 300:
                    result: dict[str, Any] = resp.json()
                    return result
                if resp.status_code not in RETRIABLE or last:
                    raise KubernetesApiError(self._message(method, resp))
            await self.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def _message(self, method: str, resp: httpx.Response) -> str:
        try:
            detail = resp.json().get("message", resp.text)
        except ValueError:
            detail = resp.text
        hint = {401: " (token rejected)", 403: " (RBAC: needs get/patch on the scale subresource)",
                404: " (no such object: check namespace and name)"}  # fmt: skip
        code = resp.status_code
        return f"{method} {self.what}: HTTP {code}{hint.get(code, '')}: {detail}"

    async def observe(self) -> FleetObservation:
        scale = await self._call("GET", f"{self.path}/scale")
        obj = await self._call("GET", self.path)
        spec = int(scale.get("spec", {}).get("replicas", 0))
        ready = int(obj.get("status", {}).get("readyReplicas", 0) or 0)
        return FleetObservation(spec=spec, ready=ready)

    async def set_replicas(self, target: int) -> None:
        """PATCH the scale subresource at the version just read; a 409 re-reads and retries."""
        for attempt in range(self.settings.retries + 1):
            scale = await self._call("GET", f"{self.path}/scale")
            rv = scale.get("metadata", {}).get("resourceVersion")
            patch: dict[str, Any] = {"spec": {"replicas": target}}
            if rv:
                patch["metadata"] = {"resourceVersion": rv}
            try:
                await self._call("PATCH", f"{self.path}/scale", patch)
                return
            except KubernetesApiError as exc:
                if "HTTP 409" not in str(exc) or attempt == self.settings.retries:
                    raise
                log.info("%s changed under us (409), re-reading", self.what)

    async def apply(self, target: int, decision: ScaleDecision, fleet: FleetObservation) -> bool:
        if self.mode != "kubernetes":
            return False  # advisory/keda: read only
        if target != fleet.spec:
            await self.set_replicas(target)
            log.info("%s: replicas %d -> %d (%s)", self.what, fleet.spec, target, decision.reason)
        return True

    async def aclose(self) -> None:
        await self.client.aclose()


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
) -> tuple[Controller, KubernetesScaler | ObserveOnly, httpx.AsyncClient]:
    """The controller for `settings` (and what to close: the actuator, the scrape client)."""
    if not settings.routers:
        raise ConfigError("no routers to scrape: give --routers URL[,URL]")
    if settings.min_replicas > settings.max_replicas:
        raise ConfigError("min_replicas is above max_replicas")
    policy = policy or load_policy(settings.policy, settings.policy_params)
    actuator: KubernetesScaler | ObserveOnly
    if settings.target_ref() is None:
        actuator = ObserveOnly(settings.mode)
    else:
        actuator = KubernetesScaler(settings, client=kube_client, sleep=sleep)
    scrape_client = httpx.AsyncClient(timeout=settings.scrape_timeout_s)
    scraper = RouterScraper(settings.routers, settings.model, scrape_client)
    kwargs: dict[str, Any] = {"clock": clock} if clock is not None else {}
    controller = Controller(
        settings, policy, actuator, scraper, metrics=ControllerMetrics(), **kwargs
    )
    return controller, actuator, scrape_client


async def serve(settings: HostSettings) -> None:
    """Run the loop and the /metrics + /keda endpoint until interrupted."""
    import uvicorn

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


__all__ = [
    "HostSettings",
    "KubernetesApiError",
    "KubernetesScaler",
    "ObserveOnly",
    "build",
    "metrics_app",
    "serve",
]
