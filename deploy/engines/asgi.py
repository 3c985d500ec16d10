"""An engine's own ASGI app, called in process: one HTTP request in, its response out in pieces.

    async for part in asgi_request(app, "POST", "/v1/chat/completions", headers, body):
        part is first a `ResponseHead` dict {"status": int, "headers": [[name, value], ...]},
        then the body as `bytes` chunks, exactly as the app sent them (SSE events one by one)

Algorithm: build the HTTP scope the way an ASGI server would (method, path and query split,
lower-case header names, the lifespan's state), run the app in a task of its own, hand it the
body as one `http.request` message, and pass on what it sends through a queue. When the caller
stops reading (the generator is closed: the client went away, or Serve cancelled the call), the
app's next `receive()` answers `http.disconnect` (so a streaming engine aborts the request, as it
does when an HTTP client disconnects), what it still sends is dropped (as uvicorn drops it), and
the task is cancelled if it has not ended `DISCONNECT_GRACE_S` later.

`Lifespan` runs the app's lifespan protocol (startup before the first request, shutdown at the
end), as uvicorn does with `lifespan="on"`; its state dict goes into every request's scope.
The response bytes are the app's own: what an HTTP server adds on the wire (`date`, `server`,
chunked framing) is the only difference.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any, TypedDict

from starlette.types import ASGIApp, Message

# an app that neither sends nor ends within this long after the caller left is cancelled
DISCONNECT_GRACE_S = 5.0


class ResponseHead(TypedDict):
    """The first item a streamed engine call yields."""

    status: int
    headers: list[list[str]]


class EngineCallError(RuntimeError):
    """The app broke the ASGI protocol (ended without a response, or failed before it)."""


def _scope(
    method: str, path: str, headers: Sequence[Sequence[str]], state: dict[str, Any]
) -> dict[str, Any]:
    path_only, _, query = path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method.upper(),
        "scheme": "http",
        "path": path_only,
        "raw_path": path_only.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
        # a copy per request, as uvicorn gives (the lifespan's values are shared, the dict not)
        "state": dict(state),
    }


async def asgi_request(
    app: ASGIApp,
    method: str,
    path: str,
    headers: Sequence[Sequence[str]],
    body: bytes,
    *,
    state: dict[str, Any] | None = None,
) -> AsyncGenerator[ResponseHead | bytes, None]:
    """Run one request through `app`; yield its head, then its body chunks (see module doc)."""
    sent: asyncio.Queue[Message | BaseException | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            return  # as uvicorn does once the client is gone: the app winds down on its own
        await sent.put(message)

    async def run() -> None:
        try:
            await app(_scope(method, path, headers, state or {}), receive, send)
        except Exception as exc:
            await sent.put(exc)
        finally:
            await sent.put(None)

    task = asyncio.get_running_loop().create_task(run(), name=f"asgi {method} {path}")
    started = False
    try:
        while True:
            item = await sent.get()
            if item is None:
                if not started:
                    raise EngineCallError(f"{method} {path}: the app ended without a response")
                return
            if isinstance(item, BaseException):
                raise EngineCallError(f"{method} {path}: {item!r}") from item
            kind = item["type"]
            if kind == "http.response.start":
                started = True
                yield ResponseHead(
                    status=int(item["status"]),
                    headers=[
                        [k.decode("latin-1"), v.decode("latin-1")]
                        for k, v in item.get("headers", [])
                    ],
                )
            elif kind == "http.response.body":
                chunk = bytes(item.get("body", b""))
                if chunk:
                    yield chunk
                if not item.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class Lifespan:
    """The app's lifespan: `await start()` before requests, `await stop()` at the end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self.state}
        try:
            await self.app(scope, self._inbox.get, self._outbox.put)
        except Exception as exc:
            await self._outbox.put({"type": "lifespan.failed", "message": repr(exc)})

    async def _step(self, kind: str) -> None:
        await self._inbox.put({"type": f"lifespan.{kind}"})
        reply = await self._outbox.get()
        if reply["type"] != f"lifespan.{kind}.complete":
            raise EngineCallError(f"lifespan {kind} failed: {reply.get('message', reply)}")

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="asgi lifespan")
        await self._step("startup")

    async def stop(self) -> None:
        if self._task is None:
            return
        task, self._task = self._task, None
        if not task.done():
            await self._step("shutdown")
        await task


__all__ = ["EngineCallError", "Lifespan", "ResponseHead", "asgi_request"]
