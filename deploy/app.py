"""The router on Ray Serve: N router replicas (one FastAPI ingress deployment) sharing Redis.

    serve run deploy/serve_config.yaml                        # a local Ray cluster, config file
    serve run deploy.app:build_app num_replicas=2 router_config=/abs/router.yaml

`build_app(args)` is the Serve application builder (`import_path: deploy.app:build_app`). Its args
(`ServeArgs`): `num_replicas` router replicas, each with `num_cpus` CPUs and at most
`max_ongoing_requests` requests in flight (Serve's default of 5 is far too low for a proxy of
long streams); the router settings come from `router` (inline, the YAML layout of
`router/config.py`) over `CP_*` environment variables over the `router_config` YAML file over the
defaults, the precedence of `router.config.load_settings`, resolved once by the builder.
`host`/`port` of the settings are not used: Serve's HTTP proxy listens (`http_options`). Set the
replica count with `num_replicas` here, not with a `deployments:` override in the Serve config,
which would bypass the Redis check below.

**One app, one runtime per replica.** Each Serve replica serves exactly the FastAPI app of
`router.http.service.create_app` (same endpoints, streaming, errors, `/metrics`). Serve 2.60 runs
the ASGI lifespan of an ingress app (uvicorn's `LifespanOn`: startup after the constructor, shutdown
from the replica's `__del__` on graceful stop), so the app's own lifespan builds and closes this
replica's `RouterRuntime` (fleet probes, index client, proxy, metrics) as under uvicorn. The app
is late-bound (`__serve_build_asgi_app__`) so that it is built inside the replica from the
deployment's settings. `ServeAdapter` (ASGI middleware) adds `x-cp-router: <Serve replica id>`
to every response, keeps one `x-request-id` (Serve's proxy adds it too) and turns a Serve race on
`receive()` (a Ray `TaskCancelledError` instead of `http.disconnect` once a request ends) into
the disconnect the ASGI spec prescribes.

**Shared state.** Router replicas share the prefix index in Redis (`redis.url`); more than one
replica without it is refused (`ConfigError`): each would route on a private index fed only by
its own traffic. Everything else is per replica: reservations and the in-flight ledger (each
replica sees only its own requests), health/ejection state, `/metrics` (a scrape through the
proxy answers from whichever replica got it, named by `x-cp-router`), and `/admin` fleet changes
(change the fleet by editing the config and redeploying, not through `/admin`).

**KV events: one follower.** With Redis and `redis.ingest_events: true` (the default) the app
adds one `kv_indexer` deployment (exactly one replica) that follows every replica's KV events
into Redis, and the router replicas run with `ingest_events` off (they read the index, write
speculative entries and clear a restarted replica's). One follower, not N: followers tag their
writes with an incarnation (their start time) and Redis keeps only the newest one's, so N
followers would not corrupt the index but would leave it owned by whichever router started
last, frozen if that one is scaled away. When Serve replaces the indexer, the new one (newer
incarnation) takes over and the old one's late writes are ignored. `redis.ingest_events: false`:
nobody in the app follows events; run `controlplane indexer` yourself. One router replica
without Redis follows its replicas' events into its in-memory index, as a standalone router
does.

Logs: each replica routes the router's logs (`telemetry.json_logs`, `log_level`) to its stderr,
which Ray keeps in the worker's `worker-*.err` file and `serve run` shows; Serve's own request
log (`replica_<app>_router_*.log`) names the request by its `x-request-id`.

Secrets (`CP_HASH_SECRET`, `CP_REDIS_PASSWORD`, `CP_ADMIN_KEY`, ...) are read from the
environment of the processes that need them: export them before `ray start` / `serve run` (a
local cluster's workers inherit it), or give them through the application's `runtime_env`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.errors import ConfigError
from controlplane.kvevents.config import ReplicaSource
from controlplane.kvevents.service import EventIndexer
from controlplane.prefix.redis_index import RedisPrefixIndex
from router.config import RouterSettings, load_settings
from router.http.service import create_app
from router.telemetry import configure_logging

log = logging.getLogger("controlplane.router.serve")

ROUTER_HEADER = "x-cp-router"
ROUTER_DEPLOYMENT = "router"
INDEXER_DEPLOYMENT = "kv_indexer"


M = TypeVar("M", bound=BaseModel)


class ServeArgs(BaseModel):
    """The arguments of `build_app` (the `args:` of an application in a Serve config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(default=2, ge=1, description="Router replicas (N > 1 needs Redis).")
    num_cpus: float = Field(default=1.0, gt=0, description="CPUs Ray reserves per router replica.")
    max_ongoing_requests: int = Field(
        default=256, ge=1, description="Requests in flight per router replica (queued beyond)."
    )
    indexer_num_cpus: float = Field(
        default=0.1, gt=0, description="CPUs Ray reserves for the KV-event indexer replica."
    )
    router_config: str | None = Field(
        default=None,
        description="YAML router configuration (router/config.py); relative paths are resolved "
        "against the current directory of the process that builds the app.",
    )
    router: dict[str, Any] = Field(
        default_factory=dict, description="Router settings, over CP_* env and router_config."
    )


def validate_args(model: type[M], args: dict[str, Any] | M | None, what: str) -> M:
    """A Serve builder's arguments as `model`; a ConfigError naming `what` when invalid."""
    if isinstance(args, model):
        return args
    try:
        return model.model_validate(args or {})
    except ValidationError as exc:
        raise ConfigError(f"invalid {what}:\n{exc}") from None


def parse_args(args: dict[str, Any] | ServeArgs | None) -> ServeArgs:
    return validate_args(ServeArgs, args, "Ray Serve application arguments")


def resolve_settings(args: ServeArgs) -> RouterSettings:
    """The router settings of every replica; refuses N > 1 replicas without Redis."""
    path = Path(args.router_config) if args.router_config else None
    settings = load_settings(path, **args.router)
    if args.num_replicas > 1 and not settings.redis.url:
        raise ConfigError(
            f"{args.num_replicas} router replicas need a shared prefix index: set redis.url "
            "(or CP_REDIS__URL); without it each replica would route on a private index"
        )
    return settings


def follows_in_indexer(settings: RouterSettings) -> bool:
    """Whether the app runs the one KV-event follower (`kv_indexer`) for its routers."""
    return bool(
        settings.redis.url
        and settings.redis.ingest_events
        and any(r.kv_events for r in settings.replicas)
    )


def router_settings(settings: RouterSettings) -> RouterSettings:
    """What the router replicas run: no KV-event following when the indexer does it."""
    if not follows_in_indexer(settings):
        return settings
    redis = settings.redis.model_copy(update={"ingest_events": False})
    return settings.model_copy(update={"redis": redis})


def event_sources(settings: RouterSettings) -> list[ReplicaSource]:
    """The replicas' KV-event sources, as `RouterRuntime` builds them for its own followers."""
    return [
        ReplicaSource(
            replica_id=r.id,
            events=r.kv_events,
            replay=r.kv_replay,
            topic=r.kv_topic,
            model=settings.served_model,
            block_size=r.block_size,
        )
        for r in settings.replicas
        if r.kv_events
    ]


class ServeAdapter:
    """ASGI middleware between Serve and the router app.

    - `x-cp-router: <Serve replica id>` on every response;
    - drops the router's `x-request-id` echo: Serve's proxy adds that header itself (the client's
      id, or the one it generated and handed to the router), so responses carry it once;
    - a `receive()` that fails with Ray's `TaskCancelledError` reads as `http.disconnect`. Serve
      2.60 fetches request messages from its proxy with a remote call that the proxy cancels when
      the request ends; when the cancellation lands first, `receive()` raises instead of answering
      the ASGI disconnect (only a `KeyError` is translated, ray-project/ray#44647). Starlette's
      `StreamingResponse` listens for the disconnect while it streams, so a stream the client read
      to the end would otherwise end in that exception, logged by Serve as "Task exception was
      never retrieved". (The other end of a stream under Serve: a client that closes as soon as
      it has `[DONE]` makes the proxy cancel the replica's task; `router/http/relay.py` counts such
      a stream as served, not `client_closed`.)
    """

    def __init__(self, app: ASGIApp, router_id: str) -> None:
        self.app = app
        self.router_id = router_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                del headers["x-request-id"]
                headers[ROUTER_HEADER] = self.router_id
            await send(message)

        await self.app(scope, receive_or_disconnect, send_named)


def _logging(settings: RouterSettings) -> None:
    """The router's logs (JSON or text, its level) on the replica's stderr, as standalone: Ray
    writes a worker's stderr to its `worker-*.err` file and `serve run` shows it. Serve's own
    loggers do not propagate to the root logger, so nothing is logged twice."""
    configure_logging(settings.telemetry.json_logs, settings.telemetry.log_level)


def _replica_id() -> str:
    return str(serve.get_replica_context().replica_id.unique_id)


class RouterReplica:
    """One router replica: `create_app(settings)`, whose lifespan owns the `RouterRuntime`."""

    def __init__(
        self, settings: RouterSettings, indexer: DeploymentHandle[Any] | None = None
    ) -> None:
        self.settings = settings
        _logging(settings)
        # held so that Serve deploys the indexer with the app; the routers never call it
        self.indexer = indexer
        self.router_id = _replica_id()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.settings)
        app.add_middleware(ServeAdapter, router_id=self.router_id)
        log.info(
            "router replica %s: %d replicas, index %s, follows KV events: %s",
            self.router_id,
            len(self.settings.replicas),
            "redis" if self.settings.redis.url else "memory",
            not self.settings.redis.url or self.settings.redis.ingest_events,
        )
        return app


# late-bound ingress: Serve calls `__serve_build_asgi_app__` in the replica, after `__init__`
RouterDeployment = serve.deployment(name=ROUTER_DEPLOYMENT)(serve.ingress()(RouterReplica))


class KVEventIndexerReplica:
    """The app's one KV-event follower: every replica's events into the shared Redis index."""

    async def __init__(self, settings: RouterSettings) -> None:  # type: ignore[misc]
        assert settings.redis.url
        _logging(settings)
        cfg = settings.redis
        self.index = RedisPrefixIndex(
            settings.redis.url,
            key_prefix=cfg.key_prefix,
            entry_ttl_s=cfg.entry_ttl_s,
            password=os.environ.get(cfg.password_env) or None,
            client_name="cp-kv-indexer",
        )
        secret = os.environ.get(settings.hash_secret_env, "").encode()
        self.indexer = EventIndexer(event_sources(settings), self.index, secret=secret)
        self.indexer.start()
        log.info("kv indexer following %d replica(s)", len(self.indexer.subscribers))

    async def status(self) -> list[dict[str, Any]]:
        """One row per followed replica (`ReplicaStatus` as a dict)."""
        return [dataclasses.asdict(row) for row in self.indexer.status()]

    async def __del__(self) -> None:
        await self.indexer.close()
        await self.index.aclose(flush_timeout_s=2.0)


KVEventIndexer = serve.deployment(name=INDEXER_DEPLOYMENT, num_replicas=1, max_ongoing_requests=8)(
    KVEventIndexerReplica
)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application builder (`import_path: deploy.app:build_app`)."""
    parsed = parse_args(args)
    settings = resolve_settings(parsed)
    indexer = None
    if follows_in_indexer(settings):
        indexer = KVEventIndexer.options(
            ray_actor_options={"num_cpus": parsed.indexer_num_cpus}
        ).bind(settings)
    router = RouterDeployment.options(
        num_replicas=parsed.num_replicas,
        max_ongoing_requests=parsed.max_ongoing_requests,
        ray_actor_options={"num_cpus": parsed.num_cpus},
    )
    app: serve.Application = router.bind(router_settings(settings), indexer)
    return app
