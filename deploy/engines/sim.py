"""The simulated engine as a Ray Serve deployment: `controlplane.sim_replica` in each replica.

Each replica holds one `sim_replica.Replica` (the vLLM-faithful simulated engine, its metrics and
its KV-event publisher on free ports) and that replica's own Starlette app, the one
`controlplane sim-replica` serves over HTTP, so `handle()` answers byte for byte what the
simulated server answers. `load_time_s` holds the constructor that long before the engine
starts, as a model load would (the autoscaler's lead time, shortened for tests).

    app = sim_engine_app(SimEngineArgs(model_dir=..., redis_url=...), num_replicas=2,
                         request_router=serve_request_router(policy="prefix_affinity", ...))
    serve.run(app, name="engines", route_prefix=None)
    handle = serve.get_deployment_handle("sim_engine", app_name="engines")
    async for part in handle.options(stream=True).handle.remote("POST", "/v1/completions",
                                                                 headers, body): ...
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pydantic import Field
from ray import serve
from ray.serve.config import RequestRouterConfig

from controlplane.sim_replica.app import Replica, build_app
from controlplane.sim_replica.config import KVEventsSettings, ReplicaConfig
from deploy.engines.base import EngineArgs, EngineServer
from deploy.engines.deployment import engine_deployment

DEPLOYMENT = "sim_engine"


class SimEngineArgs(EngineArgs):
    speed: float = Field(default=1.0, gt=0, description="Wall step time = roofline step / speed.")
    num_gpu_blocks: int = Field(default=0, ge=0, description="KV blocks (0: the profile's).")
    max_model_len: int = Field(default=0, ge=0, description="Context length (0: the model's).")
    load_time_s: float = Field(default=0.0, ge=0, description="Simulated model load time.")
    hash_seed: str | None = Field(
        default=None, description="vLLM's NONE_HASH seed (None: PYTHONHASHSEED, else vLLM's)."
    )


class SimEngineReplica(EngineServer):
    engine = "sim"

    async def __init__(self, args: SimEngineArgs) -> None:  # type: ignore[misc]
        self._begin(args)
        if args.load_time_s > 0:
            await asyncio.sleep(args.load_time_s)
        config = ReplicaConfig(
            model_name=args.model_name,
            model_dir=Path(args.model_dir) if args.model_dir else None,
            gpu=args.gpu,
            model=args.roofline_model,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            max_model_len=args.max_model_len,
            speed=args.speed,
            hash_seed=args.hash_seed,
            kv_events=KVEventsSettings(
                endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic=args.kv_topic
            ),
        )
        self.replica = Replica(config)
        await self._serve(build_app(self.replica))
        # the publisher binds at the lifespan's startup: its endpoints are known only now
        pub = self.replica.publisher
        assert pub is not None
        self._ready(pub.endpoint, pub.replay_endpoint or None)

    async def _engine_figures(self) -> dict[str, Any]:
        g = self.replica.loop.gauges()
        return {
            "running": g.running,
            "waiting": g.waiting,
            "kv_usage": g.kv_usage,
            "prefix_cache_queries": g.prefix_queries,
            "prefix_cache_hits": g.prefix_hits,
            "num_gpu_blocks": self.replica.profile.num_gpu_blocks,
            "max_model_len": self.replica.max_model_len,
        }

    def _healthy(self) -> bool:
        return self.replica.healthy


def sim_engine_app(
    args: SimEngineArgs,
    *,
    num_replicas: int = 2,
    num_cpus: float = 0.1,
    max_ongoing_requests: int = 64,
    request_router: RequestRouterConfig | None = None,
    name: str = DEPLOYMENT,
) -> serve.Application:
    """The simulated-engine deployment, bound (no ingress: call it through a handle)."""
    deployment = engine_deployment(
        SimEngineReplica,
        name=name,
        num_replicas=num_replicas,
        num_cpus=num_cpus,
        max_ongoing_requests=max_ongoing_requests,
        request_router=request_router,
    )
    app: serve.Application = deployment.bind(args)
    return app


__all__ = ["DEPLOYMENT", "SimEngineArgs", "SimEngineReplica", "sim_engine_app"]
