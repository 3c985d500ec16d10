"""The whole application on Ray Serve: OpenAI ingress + engine deployment + our RequestRouter
+ the headroom autoscaler.

    serve run deploy/ray/sim_fleet.yaml            # a local Ray cluster and the application
    serve build deploy.ray.apps:sim_fleet -o x.yaml   # a Serve config (KubeRay serveConfigV2)

`build_fleet(args)` is the Serve application builder (`import_path: deploy.ray.fleet:build_fleet`
with `args:`, a `FleetArgs`):

    ingress   (`ingress_replicas`)   the standalone router's app over a handle of the engines
              (deploy/ray/ingress.py); its settings are `router` (inline, router/config.py's
              layout) over CP_* over `router_config`, resolved once here, without `replicas`
    engines   (`engine`: sim | vllm) one replica per engine (deploy/engines/), selected by our
              RequestRouter (`IngressRequestRouter`) with the router settings' policy, model,
              tokenizer and Redis; `request_router` adds/overrides its kwargs
    scaling   `autoscaling` set: the engines' `autoscaling_config.policy` is our adapter
              running `policy` (headroom) on the demand the INGRESS replicas measure
              (autoscaler/hosts/ray_ingress.py), Ray's delays 0 and factors 1; the ingress keeps
              `ingress_replicas` replicas; unset: `engine_replicas` fixed replicas
    draining  a replica Serve removes first leaves every router's candidates (Serve's replica
              updates), then finishes its requests: Serve waits for its in-flight requests,
              checking every `graceful_shutdown_wait_loop_s`, up to `graceful_shutdown_timeout_s`

The engines' model, its directory and the prefix index follow the router settings
(`served_model`, `tokenizer` when it is a directory, `redis.url`, `redis.key_prefix`) unless
`engine_args` names them. Relative paths are the current directory's (where `serve run` was
started: a local cluster's workers inherit it). Our RequestRouter's kwargs are the router
settings' as written in `args` (a config that `serve build` writes carries them): what `args`
leaves out (Redis) it reads from the CP_* environment where it runs, as the ingress does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig

from autoscaler.hosts.ray_ingress import ingress_autoscaling_config
from autoscaler.hosts.ray_serve import autoscaling_config
from controlplane.errors import ConfigError
from deploy.app import validate_args
from deploy.engines.deployment import STATS_PERIOD_S, engine_deployment
from deploy.ray.ingress import INGRESS_DEPLOYMENT, IngressDeployment
from router.config import RouterSettings, load_settings
from router.serve.ingress import check_settings
from router.serve.ingress_router import INGRESS_ROUTER

ENGINE_DEPLOYMENT = "engine"


class EngineAutoscaling(BaseModel):
    """The engine deployment's autoscaling (`autoscaler.hosts.ray_serve.RayPolicyConfig`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=0, description="Fewest engine replicas.")
    max_replicas: int = Field(default=4, ge=1, description="Most engine replicas.")
    initial_replicas: int | None = Field(default=None, ge=0, description="Replicas at start.")
    policy: str = Field(default="headroom", description="Policy name or `module:factory`.")
    policy_params: dict[str, Any] = Field(default_factory=dict, description="Its kwargs.")
    tick_s: float = Field(default=10.0, gt=0, description="Seconds between two decisions.")
    load_time_s: float = Field(
        default=240.0, gt=0, description="Engine start-to-ready time until one is measured."
    )
    ingress_stale_s: float = Field(
        default=30.0, gt=0, description="Ingress demand older than this is no data (hold)."
    )


class FleetArgs(BaseModel):
    """The arguments of `build_fleet` (the `args:` of the application in a Serve config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["sim", "vllm"] = Field(default="sim", description="Engine kind.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="The engine's args (SimEngineArgs / VllmEngineArgs)."
    )
    engine_replicas: int = Field(default=2, ge=1, description="Engine replicas (no autoscaling).")
    engine_num_cpus: float = Field(default=0.1, gt=0, description="CPUs per engine replica.")
    engine_max_ongoing_requests: int = Field(
        default=64, ge=1, description="Requests one engine replica takes at once."
    )
    autoscaling: EngineAutoscaling | None = Field(
        default=None, description="Autoscale the engines on the ingress's demand (None: fixed)."
    )
    request_router: dict[str, Any] = Field(
        default_factory=dict, description="Our RequestRouter's kwargs over the router settings'."
    )
    graceful_shutdown_timeout_s: float = Field(
        default=120.0, gt=0, description="Longest an engine replica drains before it is stopped."
    )
    graceful_shutdown_wait_loop_s: float = Field(
        default=0.5, gt=0, description="How often a draining engine replica checks it is idle."
    )
    ingress_replicas: int = Field(default=1, ge=1, description="OpenAI ingress replicas.")
    ingress_num_cpus: float = Field(default=0.1, gt=0, description="CPUs per ingress replica.")
    ingress_max_ongoing_requests: int = Field(
        default=256, ge=1, description="Requests in flight per ingress replica."
    )
    metrics_interval_s: float = Field(
        default=1.0, gt=0, description="How often ingress replicas report their demand."
    )
    engine_python: str | None = Field(
        default=None,
        description="vllm: the interpreter of the engine replicas (a venv with ray and vllm; "
        "None: $CONTROLPLANE_VLLM_RAY_VENV or .venv-vllm-ray, deploy/vllm_ray_env.py).",
    )
    router_config: str | None = Field(default=None, description="Router YAML (router/config.py).")
    router: dict[str, Any] = Field(
        default_factory=dict, description="Router settings, over CP_* env and router_config."
    )


def parse_args(args: dict[str, Any] | FleetArgs | None) -> FleetArgs:
    return validate_args(FleetArgs, args, "Ray Serve fleet arguments")


def _absolute(path: str) -> str:
    """A relative path that exists in the current directory, as an absolute one."""
    p = Path(path)
    return str(p.resolve()) if not p.is_absolute() and p.exists() else path


def ingress_settings(args: FleetArgs) -> RouterSettings:
    """The ingress replicas' router settings (refused: `replicas`, a `remote` tokenizer)."""
    path = Path(args.router_config) if args.router_config else None
    settings = load_settings(path, **args.router)
    if settings.tokenizer not in ("remote", "approx"):
        settings = settings.model_copy(update={"tokenizer": _absolute(settings.tokenizer)})
    check_settings(settings)
    return settings


def engine_args(args: FleetArgs, settings: RouterSettings) -> Any:
    """The engine's args: `engine_args` over what the router settings imply."""
    implied: dict[str, Any] = {
        "model_name": settings.served_model,
        "redis_url": settings.redis.url,
        "key_prefix": settings.redis.key_prefix,
    }
    if Path(settings.tokenizer).is_dir():
        implied["model_dir"] = settings.tokenizer
    given = dict(args.engine_args)
    if isinstance(given.get("model_dir"), str):
        given["model_dir"] = _absolute(given["model_dir"])
    try:
        if args.engine == "sim":
            from deploy.engines.sim import SimEngineArgs

            return SimEngineArgs(**{**implied, **given})
        from deploy.engines.vllm import VllmEngineArgs

        return VllmEngineArgs(**{**implied, **given})
    except ValidationError as exc:
        raise ConfigError(f"invalid engine_args:\n{exc}") from None


def router_kwargs(args: FleetArgs, settings: RouterSettings) -> dict[str, Any]:
    """Our RequestRouter's `initialize_state` kwargs: the router settings', `request_router`
    over them."""
    p = settings.policy
    kwargs: dict[str, Any] = {
        "policy": p.name,
        "policy_params": dict(p.params),
        "model": settings.served_model,
        # as written: a relative path is the workers' (the directory `serve run` started in)
        "tokenizer": args.router.get("tokenizer", settings.tokenizer),
        "hash_secret_env": settings.hash_secret_env,
        "reservations": p.reservations,
        "speculative": p.speculative,
        "speculative_ttl_s": p.speculative_ttl_s,
        "retract_grace_s": p.retract_grace_s,
    }
    # Redis only when the args name it: from the environment, the request router reads it
    # where it runs (a built config must not carry the building machine's CP_REDIS__URL)
    redis = args.router.get("redis") or {}
    if redis.get("url"):
        kwargs |= {"redis_url": settings.redis.url, "key_prefix": settings.redis.key_prefix}
    return {**kwargs, **args.request_router}


def engine_class(kind: str) -> type:
    if kind == "sim":
        from deploy.engines.sim import SimEngineReplica

        return SimEngineReplica
    from deploy.engines.vllm import VllmEngineReplica

    cls: type = VllmEngineReplica
    return cls


def engine_runtime_env(args: FleetArgs) -> dict[str, Any] | None:
    """vllm: the replicas run on an interpreter that has vLLM beside ray (`py_executable`)."""
    if args.engine != "vllm":
        return None
    if args.engine_python:
        return {"py_executable": _absolute(args.engine_python)}
    from deploy.vllm_ray_env import default_ray_venv

    return {"py_executable": str(default_ray_venv() / "bin" / "python")}


def build_fleet(args: dict[str, Any] | FleetArgs | None) -> serve.Application:
    """The Serve application builder (`import_path: deploy.ray.fleet:build_fleet`)."""
    parsed = parse_args(args)
    settings = ingress_settings(parsed)
    router = RequestRouterConfig.model_validate(
        {
            "request_router_class": INGRESS_ROUTER,
            "request_router_kwargs": router_kwargs(parsed, settings),
            "request_routing_stats_period_s": STATS_PERIOD_S,
        }
    )
    engine = engine_deployment(
        engine_class(parsed.engine),
        name=ENGINE_DEPLOYMENT,
        num_replicas=parsed.engine_replicas,
        num_cpus=parsed.engine_num_cpus,
        max_ongoing_requests=parsed.engine_max_ongoing_requests,
        request_router=router,
        runtime_env=engine_runtime_env(parsed),
        graceful_shutdown_timeout_s=parsed.graceful_shutdown_timeout_s,
    ).options(graceful_shutdown_wait_loop_s=parsed.graceful_shutdown_wait_loop_s)
    ingress = IngressDeployment.options(
        max_ongoing_requests=parsed.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": parsed.ingress_num_cpus},
    )
    scaling = parsed.autoscaling
    if scaling is None:
        ingress = ingress.options(num_replicas=parsed.ingress_replicas)
    else:
        if not scaling.min_replicas <= scaling.max_replicas:
            raise ConfigError("autoscaling: min_replicas must not exceed max_replicas")
        if not settings.demand.enabled:
            raise ConfigError(
                "autoscaling needs the ingress's demand meter: demand.enabled is off in the "
                "router settings (the engines would read zero demand and shrink)"
            )
        ray_fields: dict[str, Any] = {}
        if scaling.initial_replicas is not None:
            ray_fields["initial_replicas"] = scaling.initial_replicas
        engine = engine.options(
            autoscaling_config=autoscaling_config(
                scaling.policy,
                scaling.min_replicas,
                scaling.max_replicas,
                policy_params=scaling.policy_params,
                tick_s=scaling.tick_s,
                load_time_s=scaling.load_time_s,
                demand="ingress",
                ingress_deployment=INGRESS_DEPLOYMENT,
                ingress_stale_s=scaling.ingress_stale_s,
                **ray_fields,
            )
        )
        ingress = ingress.options(
            autoscaling_config=ingress_autoscaling_config(
                parsed.ingress_replicas, metrics_interval_s=parsed.metrics_interval_s
            )
        )
    app: serve.Application = ingress.bind(settings, engine.bind(engine_args(parsed, settings)))
    return app


__all__ = [
    "ENGINE_DEPLOYMENT",
    "EngineAutoscaling",
    "FleetArgs",
    "build_fleet",
    "engine_args",
    "ingress_settings",
    "parse_args",
    "router_kwargs",
]
