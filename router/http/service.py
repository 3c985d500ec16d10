"""The router's ASGI service (FastAPI): OpenAI endpoints in front of the fleet.

    POST /v1/chat/completions, /v1/completions   route + proxy (streaming and not)
    GET  /v1/models                               the served model
    GET  /health                                  alive
    GET  /ready                                   200 ready | 200 degraded (Redis down: load-based
                                                  routing) | 503 degraded (no ready replica)
                                                  | 503 draining (shutting down)
    GET  /metrics                                 Prometheus (cp_*)
    /admin/replicas[...]                          list, add, drain, remove (admin key)
    GET  /admin/status, /status                   the fleet's status: JSON and its web page
                                                  (router/http/status_routes.py: access rule)

One request: `RouterCore.build` (validate, tokenize, hash) -> `RouterCore.route` (decide, reserve,
speculate) -> `Proxy.open` (first chunk; one transparent retry if the replica never accepted it)
-> relay -> `RouterCore.finish` exactly once, whatever happened. `X-Request-Id` is echoed and
forwarded, W3C trace context forwarded; every refusal is an OpenAI error body with its status.
Handlers live in `router/http/endpoints.py`; this module assembles the app and its lifespan.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.errors import ControlPlaneError
from router.config import RouterSettings
from router.http.endpoints import admin_routes, openai_routes, ops_routes
from router.http.hot import FastLane
from router.http.limits import BodyLimitMiddleware
from router.http.openai_api import error_body, error_of, validation_message
from router.http.status_routes import status_routes
from router.runtime import RouterRuntime

log = logging.getLogger("controlplane.router")


def create_app(settings: RouterSettings, runtime: RouterRuntime | None = None) -> FastAPI:
    """The router app. `runtime` (fleet, index, core, proxy) is built at startup unless given."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime or RouterRuntime(settings)
        app.state.runtime = rt
        await rt.start()
        try:
            yield
        finally:
            await rt.aclose()

    app = FastAPI(
        title="vLLM fleet control plane router",
        version="0.1.0",
        description="OpenAI-compatible router in front of a vLLM fleet.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.include_router(openai_routes)
    app.include_router(ops_routes)
    app.include_router(admin_routes)
    app.include_router(status_routes)
    # the hot endpoints' fast lane (router/http/hot.py), inside the body limit
    app.add_middleware(FastLane)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.limits.max_body_bytes,
        timeout_s=settings.limits.body_timeout_s,
    )

    @app.exception_handler(ControlPlaneError)
    async def _cp_error(request: Request, exc: ControlPlaneError) -> JSONResponse:
        status, body = error_of(exc)
        if status >= 500:
            log.warning("request failed: %s", exc)
        headers = {**_rid(request), **exc.response_headers()}  # e.g. 429: Retry-After
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, bytes | bytearray):  # a body FastAPI did not parse as JSON
            ctype = request.headers.get("content-type") or "none"
            message = f"Content-Type must be application/json, not {ctype}"
            body = error_body(415, message, code="unsupported_media_type")
            return JSONResponse(body, status_code=415, headers=_rid(request))
        message, param = validation_message(list(exc.errors()))
        body = error_body(400, message, param=param, code="invalid_request")
        return JSONResponse(body, status_code=400, headers=_rid(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(exc.status_code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a bug: still an OpenAI error body (the server logs the traceback, re-raised after this)
        body = error_body(500, "internal error in the router", code="internal_error")
        return JSONResponse(body, status_code=500, headers=_rid(request))

    return app


def _rid(request: Request) -> dict[str, str]:
    rid = getattr(request.state, "request_id", None)
    return {"x-request-id": rid} if rid else {}
