"""The hot endpoints without a framework in between: `RouterApp`, FastAPI with a fast lane.

    POST /v1/chat/completions, POST /v1/completions
      body read under the body limit (BodyLimitMiddleware: 413, 408)
      Content-Type application/json and a plainly valid body (router/http/lean.py)
          -> relay.serve_request at once (it sends its own response, errors included)
      anything else
          -> the FastAPI app, with the body replayed: its validation words the refusal (400,
             415, ...) exactly as before, and a body it accepts after all is served by the
             same `serve_request`
    every other path and method -> the FastAPI app, untouched

The FastAPI routes of the hot endpoints stay registered (the OpenAPI schema, the slow lane);
the fast lane only skips what an accepted request does not need: routing by path through the
middleware stack, dependency resolution, pydantic models built and dumped, a Response object.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from router.http.lean import Endpoint, parse
from router.http.limits import BodyLimitMiddleware
from router.http.relay import serve_request
from router.runtime import RouterRuntime

HOT: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def _json_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bool(value.split(b";", 1)[0].strip().lower() == b"application/json")
    return False


class RouterApp(FastAPI):
    """FastAPI, whose hot endpoints take the fast lane (see the module docstring)."""

    def __init__(self, *args: Any, max_body_bytes: int, body_timeout_s: float, **kw: Any):
        super().__init__(*args, **kw)
        self._hot = BodyLimitMiddleware(
            self._hot_body, max_bytes=max_body_bytes, timeout_s=body_timeout_s
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in HOT:
            await self._hot(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _hot_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Called with the body read whole (the limiter replays it on the first receive)."""
        first = await receive()
        body: bytes = first.get("body", b"")
        runtime: RouterRuntime | None = getattr(self.state, "runtime", None)
        req = parse(body, HOT[scope["path"]]) if _json_body(scope) else None
        if req is not None and runtime is not None:
            await serve_request(runtime, scope, receive, send, req)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await super().__call__(scope, replay, send)


__all__ = ["HOT", "RouterApp"]
