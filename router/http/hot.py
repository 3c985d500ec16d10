"""The hot endpoints without the framework in between: `FastLane`, the innermost middleware.

    POST /v1/chat/completions, POST /v1/completions
      (outer middleware as added: BodyLimitMiddleware reads the body under the limit, 413/408;
       a host's own, e.g. Ray Serve's adapter, runs for both lanes alike)
      Content-Type application/json and a plainly valid body (router/http/lean.py)
          -> relay.serve_request at once (it sends its own response, errors included)
      anything else
          -> the FastAPI app below, with the body replayed: its validation words the refusal
             (400, 415, ...) exactly as before, and a body it accepts after all is served by the
             same `serve_request`
    every other path and method -> the FastAPI app below, untouched

The FastAPI routes of the hot endpoints stay registered (the OpenAPI schema, the slow lane);
the fast lane only skips what an accepted request does not need: routing by path, dependency
resolution, exception middleware, pydantic models built and dumped, a Response object.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from router.http.lean import Endpoint, parse
from router.http.limits import replaying
from router.http.relay import serve_request
from router.runtime import RouterRuntime

HOT: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def _json_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bool(value.split(b";", 1)[0].strip().lower() == b"application/json")
    return False


class FastLane:
    """ASGI middleware: the hot endpoints' fast lane (see the module docstring). Add it before
    the body limit, so that it runs inside it with the body read whole."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in HOT:
            await self.app(scope, receive, send)
            return
        first = await receive()  # the whole body (the limiter outside buffered it)
        body: bytes = first.get("body", b"")
        app = scope.get("app")
        runtime: RouterRuntime | None = getattr(getattr(app, "state", None), "runtime", None)
        req = parse(body, HOT[scope["path"]]) if _json_body(scope) else None
        if req is not None and runtime is not None:
            await serve_request(runtime, scope, receive, send, req)
            return
        await self.app(scope, replaying(first, receive), send)


__all__ = ["HOT", "FastLane"]
