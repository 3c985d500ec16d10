"""HTTP handlers: the OpenAI endpoints (`relay.py` does the per-request work), ops, admin."""

from __future__ import annotations

import hmac
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from controlplane.errors import AuthError, ConfigError, NotFoundError, RequestError
from router.config import ReplicaConfig, RouterSettings
from router.openai_api import ChatCompletionRequest, CompletionRequest
from router.relay import serve_request
from router.runtime import RouterRuntime

openai_routes = APIRouter()
ops_routes = APIRouter()
admin_routes = APIRouter(prefix="/admin")


def _rt(request: Request) -> RouterRuntime:
    rt: RouterRuntime = request.app.state.runtime
    return rt


@openai_routes.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    return await serve_request(_rt(request), request, body, "/v1/chat/completions")


@openai_routes.post("/v1/completions", response_model=None)
async def completions(request: Request, body: CompletionRequest) -> Response:
    return await serve_request(_rt(request), request, body, "/v1/completions")


@openai_routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    settings: RouterSettings = request.app.state.settings
    return {
        "object": "list",
        "data": [
            {
                "id": settings.served_model,
                "object": "model",
                "created": int(_rt(request).started_wall_s),
                "owned_by": "controlplane",
            }
        ],
    }


@ops_routes.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@ops_routes.get("/ready")
async def ready(request: Request) -> JSONResponse:
    rt = _rt(request)
    reasons = rt.degraded_reasons()
    serving = rt.fleet.ready_count() > 0
    body = {
        "status": "ready" if not reasons else "degraded",
        "reasons": reasons,
        "ready_replicas": rt.fleet.ready_count(),
        "index": rt.index.kind,
    }
    return JSONResponse(body, status_code=200 if serving else 503)


@ops_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    rt = _rt(request)
    rt.refresh_gauges()
    data, content_type = rt.metrics.render()
    return Response(data, media_type=content_type)


# -- admin ----------------------------------------------------------------------------------------
def _admin(request: Request) -> RouterRuntime:
    settings: RouterSettings = request.app.state.settings
    if settings.admin_key is None:
        raise NotFoundError("the admin API is disabled (no admin key configured)")
    given = request.headers.get("authorization", "")
    want = "Bearer " + settings.admin_key.get_secret_value()
    if not hmac.compare_digest(given.encode(), want.encode()):
        raise AuthError("a valid admin key is required (Authorization: Bearer ...)")
    return _rt(request)


@admin_routes.get("/replicas")
async def list_replicas(request: Request) -> dict[str, Any]:
    rt = _admin(request)
    return {"replicas": rt.fleet.status(), "at": time.time()}


@admin_routes.post("/replicas", status_code=201)
async def add_replica(request: Request, replica: ReplicaConfig) -> dict[str, Any]:
    rt = _admin(request)
    try:
        rt.add_replica(replica)
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    return {"added": replica.id}


@admin_routes.post("/replicas/{replica_id}/drain")
async def drain_replica(request: Request, replica_id: str) -> dict[str, Any]:
    rt = _admin(request)
    rt.fleet.get(replica_id)  # 404 when unknown
    rt.fleet.drain(replica_id)
    return {"draining": replica_id, "in_flight": rt.ledger.view(replica_id).requests}


@admin_routes.delete("/replicas/{replica_id}")
async def remove_replica(request: Request, replica_id: str) -> dict[str, Any]:
    rt = _admin(request)
    rt.fleet.get(replica_id)
    await rt.remove_replica(replica_id)
    return {"removed": replica_id}
