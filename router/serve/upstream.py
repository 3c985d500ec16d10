"""The router's upstream client over a Ray Serve deployment handle (the Serve ingress's transport).

    pool = HandlePool(handle)          a DeploymentHandle of an engine deployment (deploy/engines/)
    resp = await pool.request(b"POST", "/v1/chat/completions", headers, body)
    resp.status, resp.header(b"content-type"), await resp.next_chunk(idle_s), await resp.aclose()

The same calls as `router.http.upstream.UpstreamPool` (what `router.http.proxy.Proxy` drives), made
as one streaming call of the engine replicas' `handle(method, path, headers, body)`: its first
item is the response head `{"status", "headers"}`, the next ones the body's bytes as the engine's
own app sent them. Which replica serves it is the handle's request router's choice (ours:
router/serve/), not this client's.

Errors, as the proxy expects them:

    Serve refuses the call (BackPressureError: every replica and the caller's queue are full)
        -> a 503 head with no body: the proxy's "the replica never accepted it" path
    the replica's actor died or became unavailable before the head  -> ConnectFailed
    anything else before the head, or any failure mid-body          -> UpstreamBroken
    `aclose()` before the end cancels the call (the engine's app sees a disconnect and aborts)

Ray is imported when a request is made, so the router package does not need it installed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.http.h1 import ConnectFailed, Header, UpstreamBroken
from router.http.upstream import UpstreamResponse

# the engine replicas' streaming method (deploy/engines/base.py EngineServer.handle)
ENGINE_METHOD = "handle"


class HandleResponse:
    """One engine call's response: its head, then its body chunks as they come."""

    def __init__(self, parts: Any, head: Mapping[str, Any]) -> None:
        self._parts = parts
        self.status = int(head["status"])
        self._headers = {
            str(k).lower().encode("latin-1"): str(v).encode("latin-1")
            for k, v in head.get("headers", ())
        }
        self._done = False

    def header(self, name: bytes, default: bytes = b"") -> bytes:
        return self._headers.get(name.lower(), default)

    async def next_chunk(self, idle_s: float | None = None) -> bytes | None:
        if self._done:
            return None
        try:
            async with asyncio.timeout(idle_s):
                chunk = await anext(self._parts, None)
        except TimeoutError:
            raise
        except Exception as exc:
            self._done = True
            raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from exc
        if chunk is None:
            self._done = True
            return None
        return bytes(chunk)

    async def read(self) -> bytes:
        try:
            parts = []
            while (chunk := await self.next_chunk()) is not None:
                parts.append(chunk)
            return b"".join(parts)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            with contextlib.suppress(Exception):
                self._parts.cancel()


class _Refused:
    """Serve's backpressure as the head of a busy replica: 503, no body."""

    status = 503

    def header(self, name: bytes, default: bytes = b"") -> bytes:
        return default

    async def next_chunk(self, idle_s: float | None = None) -> bytes | None:
        return None

    async def read(self) -> bytes:
        return b""

    async def aclose(self) -> None:
        return None


def _wire_headers(headers: Sequence[Header]) -> list[list[str]]:
    return [[n.decode("latin-1"), v.decode("latin-1")] for n, v in headers]


class HandlePool:
    """`UpstreamPool` over a Serve deployment handle (see the module docstring)."""

    def __init__(self, handle: Any, *, method: str = ENGINE_METHOD) -> None:
        self.handle = handle.options(stream=True)
        self.method = method
        self.on_send: list[Callable[[bytes, str], None]] = []

    def call(self, method: bytes, path: str, headers: Sequence[Header], body: bytes) -> Any:
        """The streaming call (a `DeploymentResponseGenerator`)."""
        remote = getattr(self.handle, self.method).remote
        return remote(method.decode("latin-1"), path, _wire_headers(headers), body)

    async def request(
        self, method: bytes, path: str, headers: Sequence[Header], body: bytes
    ) -> UpstreamResponse:
        from ray.exceptions import ActorDiedError, ActorUnavailableError
        from ray.serve.exceptions import BackPressureError

        for hook in self.on_send:
            hook(method, path)
        parts = self.call(method, path, headers, body)
        try:
            head = await anext(parts)
        except BackPressureError:
            return _Refused()
        except (ActorDiedError, ActorUnavailableError) as exc:
            raise ConnectFailed(f"the engine replica is gone: {exc}") from exc
        except StopAsyncIteration:
            raise UpstreamBroken("the engine ended the call without a response") from None
        except BaseException as exc:
            with contextlib.suppress(Exception):
                parts.cancel()
            if isinstance(exc, Exception):
                raise UpstreamBroken(f"{type(exc).__name__}: {exc}") from exc
            raise
        if not isinstance(head, Mapping) or "status" not in head:
            parts.cancel()
            raise UpstreamBroken(f"the engine's first item is not a response head: {head!r:.80}")
        return HandleResponse(parts, head)

    def close(self) -> None:
        return None


__all__ = ["ENGINE_METHOD", "HandlePool", "HandleResponse"]
