"""One OpenAI request through the router, from validated body to the last byte relayed.

    build + quota + route               4xx / 503 before anything is reserved or sent; the quota
                                        holds prompt + max_tokens (429/503 when it cannot)
    open (race with client disconnect)  the first chunk, with at most one transparent retry
    relay                               streamed: chunk by chunk (RelayResponse); else whole
    close                               the request's scope ends exactly once, in every path
                                        (router/scope.py: quota settled, fair-queue slot freed,
                                        routing books released, demand and telemetry told),
                                        then the upstream response is closed

A client that disconnects while the router waits for the replica cancels the upstream call at
once (the connection to the replica is closed, which makes vLLM abort the request); during a
stream, the ASGI server's disconnect cancels the relay, with the same effect.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from controlplane.errors import (
    NoReadyReplicaError,
    QuotaExceededError,
    QuotaUnavailableError,
    UpstreamError,
)
from controlplane.routing.books import Routed
from controlplane.tenancy.identity import KeyRejected
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import Reservation
from router.http.openai_api import ChatCompletionRequest, CompletionRequest, sse_error_event
from router.http.prompts import quota_prompt_tokens, sequences
from router.http.proxy import NotAccepted, SSEFilter, Upstream, Usage
from router.runtime import RouterRuntime
from router.scope import Outcome, RequestScope
from router.telemetry.logs import request_context
from router.telemetry.requests import decision_attributes
from router.telemetry.tracing import (
    extract_context,
    inject_headers,
    operation_for_path,
    set_request_attributes,
    span_name,
)

T = TypeVar("T")
_RID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def request_id_of(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _RID.match(given) else f"cp-{uuid.uuid4().hex}"


async def _disconnected(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled the moment the client disconnects (raises ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
        raise
    if task.done():
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


def authenticate(rt: RouterRuntime, request: Request) -> Tenant:
    """The request's tenant, from its API key alone (401 otherwise, counted by reason)."""
    try:
        return rt.tenancy.authenticate(request.headers)
    except KeyRejected as exc:
        rt.metrics.auth_failures.labels(exc.reason).inc()
        raise


def upstream_payload(
    body: ChatCompletionRequest | CompletionRequest,
    rt: RouterRuntime,
    cache_salt: str | None = None,
    max_tokens: int | None = None,
) -> bytes:
    """The body sent to the replica; `cache_salt` (the router's choice) overwrites the client's;
    `max_tokens` (the quota's cap) is injected when the request has none."""
    data: dict[str, Any] = body.model_dump(mode="json", exclude_unset=True)
    if cache_salt is not None:
        data["cache_salt"] = cache_salt
    if body.stream:
        opts = dict(data.get("stream_options") or {})
        opts["include_usage"] = True
        data["stream_options"] = opts
    cap = max_tokens if max_tokens is not None else rt.settings.limits.default_max_tokens
    if cap is not None and body.output_cap is None:
        data["max_tokens"] = cap
    return json.dumps(data, separators=(",", ":")).encode()


class Exchange:
    """The upstream side of one request's scope: the replica's answer, relayed; `close` ends the
    scope (every book released, once) and then closes the upstream response."""

    def __init__(self, rt: RouterRuntime, scope: RequestScope, keep_usage: bool) -> None:
        self.rt = rt
        self.scope = scope
        self.sse = SSEFilter(keep_usage)
        self.up: Upstream | None = None

    @property
    def routed(self) -> Routed:
        assert self.scope.routed is not None
        return self.scope.routed

    async def open(self, path: str, payload: bytes, headers: dict[str, str]) -> Upstream:
        rt, scope = self.rt, self.scope
        core, proxy = rt.core, rt.proxy
        proxy.budget.deposit()
        while True:
            routed = self.routed
            try:
                scope.reached = True
                up = await proxy.open(routed.replica_id, path, payload, headers)
            except NotAccepted as exc:
                scope.reached = False
                refused = f"replica {routed.replica_id} refused the request ({exc.kind})"
                if len(routed.tried) > 1 or not proxy.budget.available():
                    raise _refusal(exc.kind, refused) from None
                if await core.reroute(routed) is None:
                    raise _refusal(exc.kind, f"{refused}; no other replica to retry on") from None
                if scope.ticket is not None:
                    rt.fairq.place(scope.ticket, routed.replica_id, rt.profile_of(routed))
                proxy.budget.spend()
                rt.metrics.retries.labels(exc.kind).inc()
                continue
            self.up = up
            status = up.response.status_code
            if status < 400:
                scope.first_token(up.first_at)
            elif status < 500:
                scope.refused_by_replica = True
            return up

    async def chunks(self) -> AsyncIterator[bytes]:
        """The relayed stream: the first chunk, then the rest; an SSE error event on failure."""
        assert self.up is not None
        scope, sse = self.scope, self.sse
        out = sse.feed(self.up.first)
        if out:
            yield out
        try:
            async for chunk in self.rt.proxy.rest(self.up):
                seen = sse.content_events
                out = sse.feed(chunk)
                scope.tokens(sse.content_events - seen, time.monotonic())
                if out:
                    yield out
        except UpstreamError as exc:
            self.failed = True
            yield sse_error_event(502, str(exc), "upstream_died")
            return
        if not sse.done:
            self.failed = True
            yield sse_error_event(502, "the replica ended the stream early", "upstream_died")

    failed: bool = False

    async def close(self, outcome: Outcome, status: str) -> None:
        """End the scope (first, before any await: nothing can skip it), then the upstream."""
        scope = self.scope
        if scope.stream and scope.usage is None:
            scope.usage = self.sse.usage
        scope.end(outcome, status)
        if self.up is not None:
            await self.up.aclose()


def _refusal(kind: str, message: str) -> Exception:
    """Every replica tried refused: 503 when they were busy (their own 503), else 502."""
    return NoReadyReplicaError(message) if kind == "503" else UpstreamError(message)


class RelayResponse(StreamingResponse):
    """A streaming response that closes its exchange however the stream ends (even when the
    client left before it started)."""

    def __init__(self, exchange: Exchange, headers: dict[str, str]) -> None:
        super().__init__(exchange.chunks(), media_type="text/event-stream", headers=headers)
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex = self.exchange
        try:
            await super().__call__(scope, receive, send)
        finally:
            # a client that closes as soon as it has `[DONE]` (the OpenAI SDK) was served; Ray
            # Serve then cancels the response task while it sends the body's end
            if ex.failed:
                outcome, status = Outcome.UPSTREAM_DIED, "upstream_died"
            elif ex.sse.done:
                outcome, status = Outcome.COMPLETED, "200"
            else:
                outcome, status = Outcome.CLIENT_CLOSED, "client_closed"
                if not ex.scope.ended:
                    ex.rt.metrics.client_disconnects.inc()  # left mid-stream
            await ex.close(outcome, status)


async def serve_request(
    rt: RouterRuntime,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    path: str,
) -> Response:
    started = time.monotonic()
    rid = request_id_of(request)
    request.state.request_id = rid
    # every log line of this request's task carries its id (each request runs in its own task)
    request_context.set({**request_context.get(), "request_id": rid})
    op = operation_for_path(path)
    tracer = rt.tracer
    root = tracer.start_span(
        span_name(op, body.model), context=extract_context(request.headers), kind=SpanKind.SERVER
    )
    set_request_attributes(root, operation=op, model=body.model, max_tokens=body.output_cap)
    root.set_attribute("cp.request_id", rid)
    try:
        tenant = authenticate(rt, request)  # first: an unknown key is refused before any work
    except BaseException as exc:
        root.set_attribute("error.type", type(exc).__name__)
        root.end()
        raise
    root.set_attribute("cp.tenant", tenant.tenant_id)
    scope = rt.scope(rid, tenant, body.model, stream=bool(body.stream), started_s=started)
    scope.spans = (root,)
    try:
        with trace.use_span(root, end_on_exit=False), tracer.start_as_current_span("route") as sp:
            given = body.user or request.headers.get("x-session-id")
            # a session key is the tenant's own: another tenant naming it changes nothing
            session = f"{tenant.tenant_id}:{given}" if given else None
            req = await rt.core.build(body, request_id=rid, tenant=tenant, session=session)
            scope.request = req
            scope.reservation = await reserve_quota(rt, tenant, body, req.prompt_tokens)
            scope.admitted()  # demand for the autoscaler: admitted work, queued or not
            # the tenant's turn in the fair queue (waits while no replica has room)
            scope.ticket = ticket = await race_disconnect(request, rt.fairq.acquire(tenant, req))
            routed = await rt.core.route(req, allowed=ticket.room)
            scope.routed = routed
            rt.fairq.place(ticket, routed.replica_id, rt.profile_of(routed))
            for span in (sp, root):
                decision_attributes(span, scope)
    except ClientGone:
        root.set_attribute("error.type", "client_closed")
        scope.end(Outcome.CLIENT_CLOSED, "499")
        rt.metrics.client_disconnects.inc()
        return Response(status_code=499)
    except BaseException as exc:
        root.set_attribute("error.type", type(exc).__name__)
        scope.end(Outcome.REJECTED, str(getattr(exc, "status_code", 500)))
        raise
    keep_usage = bool(body.stream_options and body.stream_options.include_usage)
    ex = Exchange(rt, scope, keep_usage)
    upstream = tracer.start_span(
        "upstream", context=trace.set_span_in_context(root), kind=SpanKind.CLIENT
    )
    scope.spans = (upstream, root)
    decision_attributes(upstream, scope)
    headers = {"content-type": "application/json", "x-request-id": rid}
    inject_headers(headers, trace.set_span_in_context(upstream))
    reservation = scope.reservation
    try:
        cap = reservation.max_tokens if reservation is not None else None
        payload = upstream_payload(body, rt, routed.request.cache_salt, cap)
        up = await race_disconnect(request, ex.open(path, payload, headers))
        out_headers = {"x-request-id": rid, **rt.decision_header(routed)}
        if reservation is not None:
            out_headers |= reservation.headers()  # x-ratelimit-*-tokens, as OpenAI sends
        if up.response.status_code >= 400:
            await ex.close(Outcome.REPLICA_ERROR, str(up.response.status_code))
            return Response(
                up.first,
                status_code=up.response.status_code,
                media_type=up.response.headers.get("content-type", "application/json"),
                headers=out_headers,
            )
        if body.stream:
            return RelayResponse(ex, out_headers)
        data = await race_disconnect(request, _read_rest(rt, up))
        scope.usage = _usage_of(data)
        scope.last_at = time.monotonic()
        await ex.close(Outcome.COMPLETED, "200")
        return Response(data, media_type="application/json", headers=out_headers)
    except ClientGone:
        await ex.close(Outcome.CLIENT_CLOSED, "client_closed")
        rt.metrics.client_disconnects.inc()
        return Response(status_code=499)
    except BaseException as exc:
        await ex.close(Outcome.UPSTREAM_FAILED, str(getattr(exc, "status_code", 500)))
        raise


async def reserve_quota(
    rt: RouterRuntime,
    tenant: Tenant,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_tokens: int,
) -> Reservation | None:
    """Hold `prompt + sequences x max_tokens` of the tenant's quota before the request is queued
    (None: no quota); a request without max_tokens gets the quota's cap injected."""
    limits, q = rt.settings.limits, rt.settings.quota
    default_cap = min(limits.default_max_tokens or q.default_max_tokens, limits.max_tokens)
    # approx tokenizer: an upper bound of what the replica will count, not the estimate
    prompt_tokens = quota_prompt_tokens(
        rt.tokenizer.mode, q.approx_template_tokens, body, prompt_tokens
    )
    try:
        return await rt.quotas.reserve(
            tenant,
            prompt_tokens,
            body.output_cap,
            default_cap=default_cap,
            sequences=sequences(body),
        )
    except (QuotaExceededError, QuotaUnavailableError) as exc:
        rt.metrics.quota_rejections.labels(tenant.tenant_id, exc.reason).inc()
        raise


async def _read_rest(rt: RouterRuntime, up: Upstream) -> bytes:
    parts = [up.first]
    async for chunk in rt.proxy.rest(up):
        parts.append(chunk)
    return b"".join(parts)


def _usage_of(data: bytes) -> Usage | None:
    try:
        return Usage.of(json.loads(data))
    except ValueError:
        return None


__all__ = ["Callable", "ClientGone", "RelayResponse", "race_disconnect", "serve_request"]
