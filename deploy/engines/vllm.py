"""The real vLLM engine as a Ray Serve deployment: `AsyncLLM` and vLLM's own OpenAI app in process.

Each replica does in its constructor what vLLM's API server does before it listens
(`vllm.entrypoints.launchers.api_server.entry.build_and_serve`): parse the server's command line
(the same options `deploy.local_fleet` starts HTTP replicas with: prefix caching, prompt-token
details, forced usage, request-id headers, KV events on two free ports), build the engine
client (`build_async_engine_client`: `AsyncLLM`, whose EngineCore runs in a child process), then
the FastAPI app (`build_app`) and its state (`init_app_state`), and start the app's lifespan.
`handle()` then answers with vLLM's own routes, errors and SSE. The engine figures come from the
app's own `/metrics` (vLLM's Prometheus names, parsed by `controlplane.metrics_scrape`).

vLLM is imported only inside the replica: the driver builds the deployment without it. The
replicas run on `.venv-vllm-ray`'s interpreter (deploy/vllm_ray_env.py) through
`runtime_env={"py_executable": ...}`; the environment vLLM needs on CPU (`PYTHONHASHSEED`,
`VLLM_CPU_KVCACHE_SPACE`, offline hub, OpenMP binding spread by the replica's rank) is set in the
replica's process before vLLM is imported, from `deploy.local_fleet.vllm_env`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from pydantic import Field
from ray import serve
from ray.serve.config import RequestRouterConfig

from controlplane.metrics_scrape import parse_metrics
from deploy.engines.asgi import asgi_request
from deploy.engines.base import EngineArgs, EngineServer, serve_replica_rank
from deploy.engines.deployment import engine_deployment

DEPLOYMENT = "vllm_engine"


class VllmEngineArgs(EngineArgs):
    max_model_len: int = Field(default=1024, ge=1, description="vLLM --max-model-len.")
    max_num_seqs: int = Field(default=64, ge=1, description="vLLM --max-num-seqs.")
    kv_cache_gib: int = Field(default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE (GiB).")
    num_gpu_blocks: int | None = Field(
        default=None, description="vLLM --num-gpu-blocks-override (None: from the KV space)."
    )
    python_hash_seed: str = Field(
        default="0", description="PYTHONHASHSEED of the engine (vLLM's NONE_HASH seed)."
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class VllmEngineReplica(EngineServer):
    engine = "vllm"

    async def __init__(self, args: VllmEngineArgs) -> None:  # type: ignore[misc]
        from deploy.local_fleet import FleetSpec, ReplicaLaunch, vllm_argv, vllm_env

        self._begin(args)
        assert args.model_dir is not None, "the vLLM engine needs model_dir"
        spec = FleetSpec(
            replicas=1,
            engine="vllm",
            model_dir=Path(args.model_dir),
            model_name=args.model_name,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            kv_cache_gib=args.kv_cache_gib,
            num_gpu_blocks=args.num_gpu_blocks,
            topic=args.kv_topic,
            python_hash_seed=args.python_hash_seed,
        )
        spec.validate()
        launch = ReplicaLaunch(
            index=serve_replica_rank(),
            name=self.replica_id,
            host="127.0.0.1",
            port=0,  # nothing listens: requests come through handle()
            events_port=free_port(),
            replay_port=free_port(),
            spec=spec,
            model_dir=Path(args.model_dir),
        )
        os.environ.update(vllm_env(launch))
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # the server's own options, without the interpreter and module
        argv = vllm_argv(launch, Path("python"))[3:]
        self._engine_cm: Any = None
        self.engine_client: Any = None
        await self._start_engine(argv)
        self._ready(launch.events_bind, launch.replay_bind)

    async def _start_engine(self, argv: list[str]) -> None:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(ns)
        self._engine_cm = build_async_engine_client(ns)
        self.engine_client = await self._engine_cm.__aenter__()
        supported = await self.engine_client.get_supported_tasks()
        app = build_app(ns, supported, self.engine_client.model_config)
        await init_app_state(self.engine_client, app.state, ns, supported)
        await self._serve(app)

    async def _engine_figures(self) -> dict[str, Any]:
        assert self.app is not None and self.lifespan is not None
        text = b""
        async for part in asgi_request(
            self.app, "GET", "/metrics", [], b"", state=self.lifespan.state
        ):
            if isinstance(part, bytes):
                text += part
        m = parse_metrics(text.decode(), model_name=self.args.model_name)
        args = self.args
        assert isinstance(args, VllmEngineArgs)
        return {
            "running": m.engine.running,
            "waiting": m.engine.waiting,
            "kv_usage": m.engine.kv_usage,
            "prefix_cache_queries": int(m.prefix_cache_queries),
            "prefix_cache_hits": int(m.prefix_cache_hits),
            "num_gpu_blocks": (m.cache.num_gpu_blocks if m.cache else None) or 0,
            "max_model_len": args.max_model_len,
        }

    def _healthy(self) -> bool:
        client = self.engine_client
        return client is not None and not client.errored

    async def _close_engine(self) -> None:
        cm, self._engine_cm = self._engine_cm, None
        if cm is not None:
            await cm.__aexit__(None, None, None)


def vllm_engine_app(
    args: VllmEngineArgs,
    *,
    python: Path,
    num_replicas: int = 2,
    num_cpus: float = 0.5,
    max_ongoing_requests: int = 64,
    request_router: RequestRouterConfig | None = None,
    name: str = DEPLOYMENT,
) -> serve.Application:
    """The vLLM engine deployment, bound; its replicas run on `python` (a venv with both ray
    and vllm: `deploy.vllm_ray_env`)."""
    deployment = engine_deployment(
        VllmEngineReplica,
        name=name,
        num_replicas=num_replicas,
        num_cpus=num_cpus,
        max_ongoing_requests=max_ongoing_requests,
        request_router=request_router,
        runtime_env={"py_executable": str(python)},
    )
    app: serve.Application = deployment.bind(args)
    return app


__all__ = ["DEPLOYMENT", "VllmEngineArgs", "VllmEngineReplica", "vllm_engine_app"]
