"""The upstream call: send a routed request to its replica and relay the answer.

    attempt(replica):
      send the request, wait for the response head and the first body chunk within `ttft_s`
      connect refused/timeout, or a 503 head      -> the replica never accepted it: retry once on
                                                     another replica if the retry budget allows
      any other failure before the first chunk    -> 502/504 (the replica may have started it)
      a 4xx/5xx head                              -> relayed as is (the replica's own error)
      the replica ejected (or DOWN) meanwhile     -> cancelled (the replica aborts it) and sent
                                                     once to another replica, whatever the budget
    stream: chunks relayed as they come; a gap over `idle_s` or a broken connection ends the
            stream with an SSE error event and no `[DONE]`; never a retry after the first byte
    usage:  the router asks for the final usage chunk (`stream_options.include_usage`) and drops
            it again when the client did not ask for it

Retry budget: every request deposits `retry_budget` tokens (at most 10 banked, 3 to start);
a retry spends one, so retries stay a bounded fraction of traffic when a whole fleet fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from controlplane.errors import UpstreamError, UpstreamTimeoutError
from router.fleet.health import FailureReason, SlowReason
from router.fleet.live_fleet import LiveFleet
from router.http.ejection import Ejected, EjectionGuard
from router.http.h1 import ConnectFailed, Header, UpstreamBroken
from router.http.upstream import UpstreamPool, UpstreamResponse


class RetryBudget:
    def __init__(self, ratio: float, *, initial: float = 3.0, cap: float = 10.0) -> None:
        self.ratio = ratio
        self.tokens = initial
        self.cap = cap

    def deposit(self) -> None:
        self.tokens = min(self.cap, self.tokens + self.ratio)

    def available(self) -> bool:
        return self.tokens >= 1.0

    def spend(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def of(cls, data: Any) -> Usage | None:
        if not isinstance(data, dict):
            return None
        u = data.get("usage")
        if not isinstance(u, dict):
            return None
        details = u.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            int(u.get("prompt_tokens") or 0),
            int(u.get("completion_tokens") or 0),
            int(cached or 0),
        )


@dataclass(slots=True)
class Upstream:
    """An accepted upstream response whose first body chunk has arrived (or that is complete)."""

    replica_id: str
    response: UpstreamResponse
    status: int
    first: bytes
    first_at: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def content_type(self) -> str:
        return self.response.header(b"content-type", b"application/json").decode("latin-1")

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.response.aclose()


class RetryReason(StrEnum):
    """Why a request was sent to another replica (label of cp_retries_total)."""

    CONNECT = "connect"  # the connection was refused or timed out
    UNAVAILABLE = "503"  # the replica answered 503 (busy, loading)
    EJECTED = "ejected"  # the replica was ejected (or went DOWN) before its first byte


class NotAccepted(Exception):
    """The replica never accepted the request, or was ejected before it answered anything
    (safe to send it elsewhere: the client has seen nothing)."""

    def __init__(self, kind: RetryReason) -> None:
        super().__init__(kind)
        self.kind = kind


class Proxy:
    def __init__(self, fleet: LiveFleet, *, ttft_s: float, idle_s: float, retry_budget: float):
        self.fleet = fleet
        self.ttft_s = ttft_s
        self.idle_s = idle_s
        self.budget = RetryBudget(retry_budget)
        self.ejections = EjectionGuard()
        fleet.on_eject(self.ejections.on_eject)

    async def open(
        self, replica_id: str, path: str, payload: bytes, headers: Sequence[Header]
    ) -> Upstream:
        """Send and wait for the first chunk. Raises NotAccepted, UpstreamError, or returns an
        error response as an `Upstream` whose status is >= 400 (body read whole). The replica's
        ejection during the wait cancels it: NotAccepted(EJECTED) (router/http/ejection.py)."""
        try:
            async with self.ejections.watch(replica_id):
                return await self._open(replica_id, path, payload, headers)
        except Ejected:
            raise NotAccepted(RetryReason.EJECTED) from None

    async def _open(
        self, replica_id: str, path: str, payload: bytes, headers: Sequence[Header]
    ) -> Upstream:
        return await self.send(
            self.fleet.get(replica_id).upstream, replica_id, path, payload, headers
        )

    async def send(
        self,
        pool: UpstreamPool,
        replica_id: str,
        path: str,
        payload: bytes,
        headers: Sequence[Header],
    ) -> Upstream:
        """`open` over a given client (the Serve ingress's handle: router/serve/upstream.py),
        without the ejection watch; failures are recorded on the fleet's `replica_id` (ignored
        when the fleet does not know it)."""
        deadline = time.monotonic() + self.ttft_s
        try:
            async with asyncio.timeout(self.ttft_s):
                resp = await pool.request(b"POST", path, headers, payload)
        except ConnectFailed as exc:
            self.fleet.record_failure(replica_id, FailureReason.CONNECT)
            raise NotAccepted(RetryReason.CONNECT) from exc
        except TimeoutError:
            self.fleet.record_slow(replica_id, SlowReason.TTFT)
            raise UpstreamTimeoutError(f"replica {replica_id} sent no response in time") from None
        except UpstreamBroken as exc:
            self.fleet.record_failure(replica_id, FailureReason.RESET)
            raise UpstreamError(f"replica {replica_id} failed: {exc}") from None
        status = resp.status
        if status == 503:
            await resp.aclose()
            self.fleet.record_failure(replica_id, FailureReason.STATUS_5XX)
            raise NotAccepted(RetryReason.UNAVAILABLE)
        if status >= 400:
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    body = await resp.read()
            except (TimeoutError, UpstreamBroken):
                body = b""
            finally:
                await resp.aclose()
            if status >= 500:
                self.fleet.record_failure(replica_id, FailureReason.STATUS_5XX)
            return Upstream(replica_id, resp, status, body, time.monotonic())
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                first = await resp.next_chunk()
        except TimeoutError:
            await resp.aclose()
            self.fleet.record_slow(replica_id, SlowReason.TTFT)
            raise UpstreamTimeoutError(f"replica {replica_id}: no first token in time") from None
        except UpstreamBroken as exc:
            await resp.aclose()
            self.fleet.record_failure(replica_id, FailureReason.RESET)
            raise UpstreamError(f"replica {replica_id} failed: {exc}") from None
        except BaseException:
            await resp.aclose()
            raise
        return Upstream(replica_id, resp, status, first or b"", time.monotonic())

    async def next(self, up: Upstream) -> bytes | None:
        """The body bytes that arrived since the last call, within `idle_s` (None: the end);
        raises UpstreamError when the replica breaks the stream or goes silent."""
        try:
            return await up.response.next_chunk(self.idle_s)
        except TimeoutError:
            self.fleet.record_slow(up.replica_id, SlowReason.IDLE)
            raise UpstreamError(f"replica {up.replica_id} went silent mid-stream") from None
        except UpstreamBroken as exc:
            self.fleet.record_failure(up.replica_id, FailureReason.STREAM_DIED)
            raise UpstreamError(f"replica {up.replica_id} broke the stream: {exc}") from None


class SSEFilter:
    """Reads what settlement needs from the relayed SSE stream (usage, `[DONE]`, how many
    content events) and drops the usage-only chunk the client did not ask for; every other
    byte goes through unchanged, split into events only where a chunk holds usage or
    `[DONE]` or ends mid-event."""

    def __init__(self, keep_usage: bool) -> None:
        self.keep_usage = keep_usage
        self.buf = b""
        self.usage: Usage | None = None
        self.done = False
        self.content_events = 0

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to relay for `chunk`. Whole events that carry neither usage nor `[DONE]`
        (nearly every chunk of a stream) pass through as they came, only counted."""
        plain = b'"usage"' not in chunk and b"[DONE]" not in chunk
        if plain and not self.buf and chunk.endswith(b"\n\n"):
            self.content_events += chunk.count(b"\n\n")
            return chunk
        self.buf += chunk
        out: list[bytes] = []
        while True:
            cut = self.buf.find(b"\n\n")
            if cut < 0:
                break
            event, self.buf = self.buf[: cut + 2], self.buf[cut + 2 :]
            if self._keep(event):
                out.append(event)
        return b"".join(out)

    def _keep(self, event: bytes) -> bool:
        data = event.strip()
        if data == b"data: [DONE]":
            self.done = True
            return True
        if b'"usage":{' in data.replace(b" ", b""):
            try:
                obj = json.loads(data.removeprefix(b"data:"))
            except ValueError:
                return True
            usage = Usage.of(obj)
            if usage is not None:
                self.usage = usage
                if not obj.get("choices"):
                    return self.keep_usage
        self.content_events += 1
        return True
