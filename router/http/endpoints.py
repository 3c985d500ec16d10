"""HTTP handlers: the OpenAI endpoints (`relay.py` does the per-request work), ops, admin.

The OpenAI endpoints here are the slow lane: a plainly valid body is served before FastAPI sees
it (`router/http/hot.py`); these validate the rest with the pydantic models (and give the OpenAPI
schema).

Admin (Authorization: Bearer <admin key>; 404 while no admin key is configured):

    GET    /admin/replicas              this router's replicas, and the fleet registry's view
    POST   /admin/replicas              add one as the `admin` source of the fleet registry (its
                                        URL and id must pass the replica guard, router/fleet/
                                        urls.py: 400 `invalid_replica` otherwise, also for an id
                                        the fleet has at another URL); adding it again is a no-op
    POST   /admin/replicas/{id}/drain   drain it fleet-wide: no new requests, in-flight ones finish
    DELETE /admin/replicas/{id}         drain it, wait up to `fleet.delete_wait_s` for it to
                                        leave: 200 gone, 202 still draining; 404 unknown or gone
                                        (replica changes reach every router sharing the registry)
    GET    /admin/tenants               every tenant: id, weight, class, limits, number of keys
    POST   /admin/tenants               add or replace one (a `TenantConfig`: keys as SHA-256
                                        digests; the old digests of a replaced tenant stop working)
    DELETE /admin/tenants/{id}          remove one (its requests in flight finish)

Tenant changes apply to this router process; no response ever holds a key, a digest or a salt.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from controlplane.errors import (
    AuthError,
    ConfigError,
    NotFoundError,
    RegistryUnavailableError,
    RequestError,
    UnknownReplicaError,
)
from router.config import ReplicaConfig, RouterSettings, TenantConfig
from router.fairness.tenants import tenant_of, tenant_view
from router.fleet.lifecycle import Lifecycle
from router.fleet.registry import Snapshot
from router.http.lean import OpenAIRequest, from_model
from router.http.openai_api import ChatCompletionRequest, CompletionRequest
from router.http.relay import serve_request
from router.runtime import RouterRuntime

openai_routes = APIRouter()
ops_routes = APIRouter()
admin_routes = APIRouter(prefix="/admin")


def _rt(request: Request) -> RouterRuntime:
    rt: RouterRuntime = request.app.state.runtime
    return rt


class Served(Response):
    """The response of a request the full validation accepted: `serve_request` sends it."""

    def __init__(self, runtime: RouterRuntime, req: OpenAIRequest) -> None:
        super().__init__()
        self.runtime = runtime
        self.req = req

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_request(self.runtime, scope, receive, send, self.req)


async def _served(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Served:
    # the slow lane (router/http/hot.py): the body as received still goes upstream
    raw = await request.body()
    return Served(_rt(request), from_model(body, raw, json.loads(raw)))


@openai_routes.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    return await _served(request, body)


@openai_routes.post("/v1/completions", response_model=None)
async def completions(request: Request, body: CompletionRequest) -> Response:
    return await _served(request, body)


@openai_routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The union of the models the fleet's replicas serve (router/fleet/groups.py), each with
    the context length its group's replicas report."""
    rt = _rt(request)
    cards = []
    for name in rt.core.served_models():
        group = rt.fleet.groups.get(name)
        card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": int(rt.started_wall_s),
            "owned_by": "controlplane",
        }
        if group is not None and group.max_model_len is not None:
            card["max_model_len"] = group.max_model_len
        cards.append(card)
    return {"object": "list", "data": cards}


@ops_routes.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@ops_routes.get("/ready")
async def ready(request: Request) -> JSONResponse:
    rt = _rt(request)
    if getattr(request.app.state, "draining", False):
        # shutting down (router/http/shutdown.py): still serving, but take it out of rotation
        draining = {"status": "draining", "reasons": ["shutting_down"]}
        return JSONResponse(draining, status_code=503)
    reasons = rt.degraded_reasons()
    serving = rt.ready_count() > 0
    body = {
        "status": "ready" if not reasons else "degraded",
        "reasons": reasons,
        "ready_replicas": rt.ready_count(),
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


# the admin check as a dependency runs before the body is validated: no schema hints without a key
_ADMIN = [Depends(_admin)]


@admin_routes.get("/replicas")
async def list_replicas(request: Request) -> dict[str, Any]:
    rt = _admin(request)
    body: dict[str, Any] = {"replicas": rt.fleet.status(), "at": time.time()}
    try:
        body["fleet"] = rt.registry.fleet_view(await rt.fleet_records())
    except RegistryUnavailableError as exc:  # the shared registry is down: this router's only
        body["fleet_error"] = str(exc)
    return body


@admin_routes.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """Each model group: members, reference configuration, drifted members and what differs."""
    rt = _admin(request)
    groups = rt.fleet.groups
    return {"models": [g.status() for g in groups.groups.values()], "at": time.time()}


@admin_routes.post("/replicas", status_code=201, dependencies=_ADMIN)
async def add_replica(request: Request, replica: ReplicaConfig) -> dict[str, Any]:
    # ReplicaRefusedError is a 400 of its own (param and code: which field was refused)
    await _rt(request).add_replica(replica)
    return {"added": replica.id}


def _known(snap: Snapshot, replica_id: str) -> None:
    rec = snap.records.get(replica_id)
    if rec is None or rec.state is Lifecycle.GONE:
        raise UnknownReplicaError(f"unknown replica {replica_id!r}")


@admin_routes.post("/replicas/{replica_id}/drain")
async def drain_replica(request: Request, replica_id: str) -> dict[str, Any]:
    rt = _admin(request)
    _known(await rt.fleet_records(), replica_id)
    await rt.drain_replica(replica_id)
    return {"draining": replica_id, "in_flight": rt.ledger.view(replica_id).requests}


@admin_routes.delete("/replicas/{replica_id}", response_model=None)
async def remove_replica(request: Request, replica_id: str) -> JSONResponse:
    rt = _admin(request)
    _known(await rt.fleet_records(), replica_id)
    if await rt.retire_replica(replica_id, rt.settings.fleet.delete_wait_s):
        return JSONResponse({"removed": replica_id})
    return JSONResponse({"draining": replica_id}, status_code=202)


@admin_routes.get("/tenants", dependencies=_ADMIN)
async def list_tenants(request: Request) -> dict[str, Any]:
    ring = _rt(request).tenancy
    return {"open_mode": ring.open_mode, "tenants": [tenant_view(ring, t) for t in ring.tenants()]}


@admin_routes.post("/tenants", status_code=201, dependencies=_ADMIN)
async def put_tenant(request: Request, tenant: TenantConfig) -> dict[str, Any]:
    ring = _rt(request).tenancy
    replaced = ring.get(tenant.id) is not None
    try:
        stored = ring.put(tenant_of(tenant), tenant.api_key_sha256)
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    return {"tenant": tenant_view(ring, stored), "replaced": replaced}


@admin_routes.delete("/tenants/{tenant_id}", dependencies=_ADMIN)
async def remove_tenant(request: Request, tenant_id: str) -> dict[str, Any]:
    if _rt(request).tenancy.remove(tenant_id) is None:
        raise NotFoundError(f"no tenant {tenant_id!r}")
    return {"removed": tenant_id}
