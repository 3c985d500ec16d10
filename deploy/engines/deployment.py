"""One Serve deployment per engine kind and model, with our RequestRouter when asked.

`engine_deployment(cls, ...)` wraps an `EngineServer` subclass in `serve.deployment` with the
options every engine needs: the replica count, the CPUs Ray reserves, how many requests a replica
takes at once (beyond: Serve queues them in the caller), the routing-stats period (how stale the
routers' view of `running`/`waiting` may get; our router's own books cover the gap), and the
graceful-shutdown wait that lets in-flight requests finish before Serve stops a replica.
`runtime_env` runs the replicas elsewhere than the driver's environment (vLLM's venv:
deploy/engines/vllm.py).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

# how often Serve asks every replica for its routing stats (Serve's default is 10 s)
STATS_PERIOD_S = 0.5


def stats_config(**fields: Any) -> RequestRouterConfig:
    """A `RequestRouterConfig` (Serve's router unless `request_router_class` is given) that
    polls the replicas' routing stats every `STATS_PERIOD_S`."""
    return RequestRouterConfig.model_validate(
        {"request_routing_stats_period_s": STATS_PERIOD_S, **fields}
    )


POLICY_ROUTER = "router.serve.request_router:PolicyRequestRouter"


def policy_router_config(**kwargs: Any) -> RequestRouterConfig:
    """Our RequestRouter (router/serve/request_router.py) with `initialize_state` kwargs:
    `policy`, `policy_params`, `model`, `tokenizer`, `redis_url`, `key_prefix`, ..."""
    return stats_config(request_router_class=POLICY_ROUTER, request_router_kwargs=kwargs)


def engine_deployment(
    cls: type,
    *,
    name: str,
    num_replicas: int,
    num_cpus: float,
    max_ongoing_requests: int,
    request_router: RequestRouterConfig | None = None,
    runtime_env: dict[str, Any] | None = None,
    graceful_shutdown_timeout_s: float = 30.0,
) -> serve.Deployment:
    actor_options: dict[str, Any] = {"num_cpus": num_cpus}
    if runtime_env:
        actor_options["runtime_env"] = runtime_env
    router = request_router or stats_config()
    deployment: serve.Deployment = serve.deployment(
        name=name,
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=actor_options,
        request_router_config=router,
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
    )(cls)
    return deployment


__all__ = [
    "POLICY_ROUTER",
    "STATS_PERIOD_S",
    "engine_deployment",
    "policy_router_config",
    "stats_config",
]
