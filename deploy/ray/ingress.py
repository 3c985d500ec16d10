"""The OpenAI ingress deployment: the standalone router's app, in front of an engine deployment.

Each replica serves `router.http.service.create_app(settings, IngressRuntime(...))`: the same
endpoints, request scope, errors and `/metrics` as `controlplane serve`, with the engine
deployment's handle as its upstream and our RequestRouter (in that handle, in this process)
choosing the engine replica (router/serve/ingress.py). `ServeAdapter` (deploy/app.py) names the
ingress replica in `x-cp-router` and leaves `x-request-id` to Serve's proxy, as for the router
app.

`record_autoscaling_stats` returns the replica's demand meter (`RouterDemand.stats()`: arrivals,
prefill and decode work at the SLO, backlog, in flight), which Serve collects because the
deployment has an `autoscaling_config` (`ingress_autoscaling_config`: a fixed replica count,
`IngressDemand` as its policy, which hands the figures to the engine deployment's headroom
policy: autoscaler/hosts/ray_ingress.py).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from deploy.app import ServeAdapter
from router.config import RouterSettings
from router.http.service import create_app
from router.serve.ingress import IngressRuntime
from router.serve.upstream import HandlePool
from router.telemetry import configure_logging

log = logging.getLogger("controlplane.router.serve")

INGRESS_DEPLOYMENT = "ingress"


class IngressReplica:
    """One ingress replica (late-bound ASGI app: built in the replica, after `__init__`)."""

    def __init__(self, settings: RouterSettings, engine: DeploymentHandle[Any]) -> None:
        configure_logging(settings.telemetry.json_logs, settings.telemetry.log_level)
        self.settings = settings
        self.router_id = str(serve.get_replica_context().replica_id.unique_id)
        self.runtime = IngressRuntime(
            settings, HandlePool(engine), app=engine.app_name, deployment=engine.deployment_name
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.settings, self.runtime)
        app.add_middleware(ServeAdapter, router_id=self.router_id)
        log.info(
            "ingress replica %s in front of %s/%s",
            self.router_id,
            self.runtime.app_name,
            self.runtime.deployment,
        )
        return app

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return self.runtime.demand.stats()


IngressDeployment = serve.deployment(name=INGRESS_DEPLOYMENT)(serve.ingress()(IngressReplica))

__all__ = ["INGRESS_DEPLOYMENT", "IngressDeployment", "IngressReplica"]
