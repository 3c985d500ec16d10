"""Body size limit, enforced before a body is read whole, and a deadline for reading it.

A declared `Content-Length` over the limit is refused at once; otherwise the body is read up to
the limit (plus one byte) and refused the moment it passes it, so an oversize body never sits in
memory (a chunked body is cut off as soon as it passes the limit, whatever would follow). A body
that does not arrive whole within `timeout_s` (a `Content-Length` larger than what the client
sends, a stalled upload) is refused with 408 instead of holding the request forever. The buffered
body is then replayed to the app, and later `receive` calls go to the client (so disconnects are
still seen). Refusals are OpenAI error bodies and close the connection.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.http.openai_api import error_body


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float = 60.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _refuse(send, 400, "invalid Content-Length header", "bad_content_length")
                    return
        if declared is not None and declared > self.max_bytes:
            await _refuse(send, 413, self._message(), "body_too_large")
            return
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                outcome = await self._read(receive, chunks)
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout_s:g} s"
            await _refuse(send, 408, message, "body_timeout")
            return
        if outcome == "disconnect":
            return  # the client left before sending its body: nothing to answer
        if outcome == "too_large":
            await _refuse(send, 413, self._message(), "body_too_large")
            return
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replaying(body, receive), send)

    async def _read(self, receive: Receive, chunks: list[bytes]) -> str:
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return "disconnect"
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return "too_large"
            chunks.append(body)
            if not msg.get("more_body", False):
                return "complete"

    def _message(self) -> str:
        return f"request body exceeds this router's limit of {self.max_bytes} bytes"


def replaying(first: Message, receive: Receive) -> Receive:
    """A `receive` that returns the already-read `first` message once, then reads on (so the
    app sees the body, and later calls still see the client's disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return first
        return await receive()

    return replay


async def _refuse(send: Send, status: int, message: str, code: str = "invalid_request") -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
