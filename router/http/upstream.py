"""What the proxy needs of an upstream HTTP client, and the two clients that provide it.

    pool.request(method, path, headers, body) -> response     once the response head is here
    response.status, response.header(name)
    await response.next_chunk(idle_s) -> bytes | None          body bytes as they come; None: end;
                                                                TimeoutError after idle_s silent
    await response.read() -> bytes                              the rest of the body
    await response.aclose()                                     done (idempotent; before the end
                                                                it closes the connection)
    ConnectFailed: the replica never saw the request; UpstreamBroken: it broke afterwards

Production: `router.http.h1.H1Pool`, a lean keep-alive HTTP/1.1 client (one per replica).
`HttpxPool` runs the same calls over an `httpx.AsyncClient`; the replica's client uses it when
the runtime was given an httpx transport (tests pass an `httpx.MockTransport` fleet), so such a
test exercises everything above the HTTP client exactly as production runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

import httpx

from router.http.h1 import ConnectFailed, Header, UpstreamBroken


class UpstreamResponse(Protocol):
    status: int

    def header(self, name: bytes, default: bytes = b"") -> bytes: ...

    async def next_chunk(self, idle_s: float | None = None) -> bytes | None: ...

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class UpstreamPool(Protocol):
    on_send: list[Callable[[bytes, str], None]]

    async def request(
        self, method: bytes, path: str, headers: Sequence[Header], body: bytes
    ) -> UpstreamResponse: ...

    def close(self) -> None: ...


class HttpxResponse:
    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status = resp.status_code
        self._chunks = resp.aiter_raw()
        self._closed = False

    def header(self, name: bytes, default: bytes = b"") -> bytes:
        value = self._resp.headers.get(name.decode("latin-1"))
        return default if value is None else value.encode("latin-1")

    async def next_chunk(self, idle_s: float | None = None) -> bytes | None:
        try:
            async with asyncio.timeout(idle_s):
                chunk = await anext(self._chunks, None)
        except httpx.HTTPError as exc:
            raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from exc
        if chunk is None:
            await self.aclose()
        return chunk

    async def read(self) -> bytes:
        try:
            return await self._resp.aread()  # also a body httpx holds already (mock responses)
        except httpx.HTTPError as exc:
            raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from exc
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                await self._resp.aclose()


class HttpxPool:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.on_send: list[Callable[[bytes, str], None]] = []

    async def request(
        self, method: bytes, path: str, headers: Sequence[Header], body: bytes
    ) -> UpstreamResponse:
        hdrs = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers]
        req = self.client.build_request(method.decode(), path, content=body, headers=hdrs)
        for hook in self.on_send:
            hook(method, path)
        try:
            resp = await self.client.send(req, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ConnectFailed(str(exc)) from exc
        except httpx.HTTPError as exc:
            raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from exc
        return HttpxResponse(resp)

    def close(self) -> None:
        return None  # the client belongs to the replica


__all__ = ["HttpxPool", "UpstreamPool", "UpstreamResponse"]
