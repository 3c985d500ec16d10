"""What every engine replica on Ray Serve does, whatever the engine: `EngineServer`.

A subclass builds its engine and the engine's own ASGI app in its (async) constructor and then
calls `await self._serve(app)` (the app's lifespan starts the engine) and `self._ready(kv
endpoints)`. From there on the replica:

- `handle(method, path, headers, body, routing=None)` (call it with `stream=True`): runs one
  HTTP request through the engine's app in process (`asgi.asgi_request`) and yields a
  `ResponseHead` dict `{"status", "headers"}` first, then the body's bytes chunks: the same status,
  headers and bytes the engine's HTTP server sends (error JSON, usage, SSE events one by one).
  `routing` is what our RequestRouter decided for this request (router/serve/request_router.py
  sets it); it comes back as the `x-cp-decision` response header (the standalone router's, same
  format), so a caller can see why its request landed here;
- `record_routing_stats()`: `router.serve.stats.EngineStats` as a dict (running, waiting, KV
  usage, prefix-cache queries and hits, block size, blocks, roofline keys, KV-event endpoints,
  load time); Serve polls it and gives it to the routers;
- follows its own engine's KV events into the shared Redis prefix index with the project's
  follower (`controlplane.kvevents.service.EventIndexer`), when `redis_url` is set: one follower
  per engine, started with it and gone with it, so the index's owner of a replica's entries is
  always that replica's live follower (the endpoints are also announced in the stats, for an
  external `controlplane indexer`);
- `check_health()` raises when the engine is not healthy (Serve restarts the replica);
- reports its load time (constructor start to the engine answering), in the stats and its log;
- `open_http()`: also serves the same app over HTTP (uvicorn, a free loopback port, in the
  replica's process and loop), so the very same engine can be called directly or from the
  standalone router (bench/ray_serve_bench.py compares the paths on one set of engines).

The engine's KV blocks are indexed under the Serve replica's unique id, the id the routers see
(`RunningReplica.replica_id.unique_id`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp

from controlplane.kvevents.config import ReplicaSource
from controlplane.kvevents.service import EventIndexer
from controlplane.prefix.redis_index import RedisPrefixIndex
from deploy.engines.asgi import Lifespan, ResponseHead, asgi_request
from router.serve.stats import EngineStats
from router.telemetry import DECISION_HEADER, decision_header_value

log = logging.getLogger("controlplane.engines")


class EngineArgs(BaseModel):
    """What every engine deployment takes (the engine's own knobs are in its subclass)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = Field(default="tiny-llama", description="Served model name.")
    model_dir: str | None = Field(
        default=None, description="Model directory (weights, config.json, tokenizer)."
    )
    block_size: int = Field(default=32, ge=1, description="KV block size in tokens.")
    gpu: str = Field(default="cpu", description="Roofline key of the replica's hardware.")
    roofline_model: str = Field(default="tiny-llama", description="Roofline key of the model.")
    redis_url: str | None = Field(
        default=None,
        description="Redis of the shared prefix index: each replica follows its engine's KV "
        "events into it. None: no follower (the events are still announced in the stats).",
    )
    key_prefix: str = Field(default="rtr:pidx", description="Prefix-index key prefix.")
    hash_secret_env: str = Field(
        default="CP_HASH_SECRET", description="Environment variable of the block-hash secret."
    )
    redis_password_env: str = Field(
        default="CP_REDIS_PASSWORD", description="Environment variable of the Redis password."
    )
    kv_topic: str = Field(default="", description="Topic of the engine's KV-event messages.")


def node_address() -> str:
    """This node's address for other nodes to connect to (Ray's, else the host's)."""
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:
        return socket.gethostbyname(socket.gethostname())


def connectable(endpoint: str | None) -> str | None:
    """A bound ZMQ endpoint (`tcp://0.0.0.0:P`, `tcp://*:P`) as others connect to it."""
    if not endpoint:
        return None
    for wildcard in ("0.0.0.0", "*"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{node_address()}:")
    return endpoint


def serve_replica_rank() -> int:
    """The Serve replica's rank in its deployment (0 outside Serve)."""
    try:
        from ray import serve

        return int(serve.get_replica_context().rank.rank)
    except Exception:
        return 0


def serve_replica_id() -> str:
    """The Serve replica's unique id (the routers' `ReplicaID.unique_id`); outside Serve, the
    host and pid."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return f"{socket.gethostname()}-{os.getpid()}"


class EngineServer:
    """The engine-independent half of an engine replica (see the module docstring)."""

    engine: ClassVar[str] = "engine"

    def _begin(self, args: EngineArgs) -> None:
        """First thing in the subclass's constructor: the load clock starts."""
        self.args = args
        self.started_at = time.time()
        self.replica_id = serve_replica_id()
        self.ready_at = 0.0
        self.lifespan: Lifespan | None = None
        self.app: ASGIApp | None = None
        self.index: RedisPrefixIndex | None = None
        self.follower: EventIndexer | None = None
        self.kv_events: str | None = None
        self.kv_replay: str | None = None
        self.http: Any = None  # the uvicorn server of open_http()
        self.http_task: Any = None

    async def _serve(self, app: ASGIApp) -> None:
        """Start the engine app's lifespan (the engine starts with it)."""
        self.lifespan = Lifespan(app)
        await self.lifespan.start()
        self.app = app

    def _ready(self, kv_events: str | None = None, kv_replay: str | None = None) -> None:
        """The engine answers: announce its KV-event endpoints, follow them; the load ends."""
        self.kv_events, self.kv_replay = connectable(kv_events), connectable(kv_replay)
        self._follow()
        self.ready_at = time.time()
        log.info(
            "%s engine replica %s ready in %.1f s (model %s, KV events %s)",
            self.engine,
            self.replica_id,
            self.ready_at - self.started_at,
            self.args.model_name,
            self.kv_events or "off",
        )

    def _follow(self) -> None:
        args = self.args
        if not (args.redis_url and self.kv_events):
            return
        self.index = RedisPrefixIndex(
            args.redis_url,
            key_prefix=args.key_prefix,
            password=os.environ.get(args.redis_password_env) or None,
            client_name="cp-kv-indexer",
        )
        source = ReplicaSource(
            replica_id=self.replica_id,
            events=self.kv_events,
            replay=self.kv_replay,
            topic=args.kv_topic,
            model=args.model_name,
            block_size=args.block_size,
        )
        secret = os.environ.get(args.hash_secret_env, "").encode()
        self.follower = EventIndexer([source], self.index, secret=secret)
        self.follower.start()

    # -- what a subclass provides ----------------------------------------------------------------
    async def _engine_figures(self) -> dict[str, Any]:
        """running, waiting, kv_usage, prefix_cache_queries, prefix_cache_hits, num_gpu_blocks,
        max_model_len: the engine's own numbers now."""
        raise NotImplementedError

    def _healthy(self) -> bool:
        raise NotImplementedError

    async def _close_engine(self) -> None:
        return None

    # -- the Serve surface -----------------------------------------------------------------------
    async def handle(
        self,
        method: str,
        path: str,
        headers: Sequence[Sequence[str]],
        body: bytes = b"",
        routing: dict[str, Any] | None = None,
    ) -> AsyncIterator[ResponseHead | bytes]:
        """One HTTP request through the engine's app: the head, then the body chunks."""
        assert self.app is not None and self.lifespan is not None, "the engine is not ready"
        parts = asgi_request(self.app, method, path, headers, body, state=self.lifespan.state)
        try:
            async for part in parts:
                if isinstance(part, dict) and routing is not None:
                    value = decision_header_value(
                        str(routing.get("arm", "")),
                        self.replica_id,
                        str(routing.get("reason", "")),
                        int(routing.get("predicted_hit_tokens", 0)),
                    )
                    part["headers"].append([DECISION_HEADER, value])
                yield part
        finally:
            await parts.aclose()

    async def stats(self) -> EngineStats:
        args = self.args
        return EngineStats(
            engine=self.engine,
            model=args.model_name,
            replica_id=self.replica_id,
            block_size=args.block_size,
            gpu=args.gpu,
            roofline_model=args.roofline_model,
            kv_events=self.kv_events,
            kv_replay=self.kv_replay,
            kv_topic=args.kv_topic,
            kv_follower=self.follower is not None,
            started_at=self.started_at,
            ready_at=self.ready_at,
            load_s=self.ready_at - self.started_at if self.ready_at else 0.0,
            reported_at=time.time(),
            **await self._engine_figures(),
        )

    async def record_routing_stats(self) -> dict[str, Any]:
        return (await self.stats()).to_dict()

    async def follower_status(self) -> list[dict[str, Any]]:
        """The KV-event follower's row (`ReplicaStatus` as a dict); empty without one."""
        import dataclasses

        if self.follower is None:
            return []
        return [dataclasses.asdict(row) for row in self.follower.status()]

    async def process_ids(self) -> dict[str, Any]:
        """This replica's id, its process and every process below it (vLLM's EngineCore and
        workers): what must be gone once Serve stopped the replica (tests check it)."""
        from deploy.processes import descendants

        return {"replica_id": self.replica_id, "pids": [os.getpid(), *descendants(os.getpid())]}

    async def open_http(self, host: str = "127.0.0.1") -> dict[str, Any]:
        """Serve the engine's app over HTTP too (idempotent): {replica_id, url, kv_events,
        kv_replay}. Requests get the lifespan's state, as through `handle`."""
        import asyncio

        import uvicorn

        from deploy.redis_local import free_port

        assert self.app is not None and self.lifespan is not None, "the engine is not ready"
        if self.http is None:
            app, state = self.app, self.lifespan.state

            async def with_state(scope: Any, receive: Any, send: Any) -> None:
                if scope["type"] == "http":
                    scope = {**scope, "state": dict(state)}
                await app(scope, receive, send)

            config = uvicorn.Config(
                with_state, host=host, port=free_port(), lifespan="off", log_level="warning",
                access_log=False,
            )  # fmt: skip
            self.http = uvicorn.Server(config)
            self.http_task = asyncio.get_running_loop().create_task(self.http.serve())
            while not self.http.started:
                if self.http_task.done():
                    self.http_task.result()  # raises what failed
                await asyncio.sleep(0.05)
        port = self.http.config.port
        return {
            "replica_id": self.replica_id,
            "url": f"http://{host}:{port}",
            "kv_events": self.kv_events,
            "kv_replay": self.kv_replay,
        }

    async def check_health(self) -> None:
        if not self._healthy():
            raise RuntimeError(f"{self.engine} engine of replica {self.replica_id} is unhealthy")

    async def aclose(self) -> None:
        if self.http is not None:
            self.http.should_exit = True
            try:
                await self.http_task
            except Exception:  # the rest must still close
                log.exception("the engine's HTTP server of open_http() failed")
            self.http = None
        if self.follower is not None:
            await self.follower.close()
            self.follower = None
        if self.index is not None:
            await self.index.aclose(flush_timeout_s=2.0)
            self.index = None
        if self.lifespan is not None:
            await self.lifespan.stop()
            self.lifespan = None
        await self._close_engine()

    async def __del__(self) -> None:
        await self.aclose()


__all__ = [
    "EngineArgs",
    "EngineServer",
    "connectable",
    "node_address",
    "serve_replica_id",
    "serve_replica_rank",
]
