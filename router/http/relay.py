"""One OpenAI request through the router, from validated body to the last byte relayed.

    build + quota + route               4xx / 503 before anything is reserved or sent; the quota
                                        holds prompt + max_tokens (429/503 when it cannot)
    open (race with client disconnect)  the first chunk, with at most one transparent retry
    relay                               streamed: chunk by chunk (RelayResponse); else whole
    close                               exactly once, in every path: upstream response closed,
                                        reservation released, policy told, metrics recorded

A client that disconnects while the router waits for the replica cancels the upstream call at
once (the connection to the replica is closed, which makes vLLM abort the request); during a
stream, the ASGI server's disconnect cancels the relay, with the same effect.

Quota settlement (`Exchange._charge`, first thing in `close`, so a cancelled close cannot skip it):
the usage the replica reported (prompt + completion tokens); 0 when no replica accepted the
request (refused before sending, every replica refused, or a replica's 4xx); otherwise the usage
is unknown (the client left, the replica died or failed) and `quota.unknown_usage` decides: the
whole reservation (default; an upper bound, since max_tokens is always set) or the prompt plus the
content events relayed so far.
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
from opentelemetry.trace import Span, SpanKind
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from controlplane.errors import (
    NoReadyReplicaError,
    QuotaExceededError,
    QuotaUnavailableError,
    UpstreamError,
)
from controlplane.tenancy.identity import KeyRejected
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import Reservation, settle_tokens
from router.core import Routed
from router.fairness.queue import Ticket
from router.http.openai_api import ChatCompletionRequest, CompletionRequest, sse_error_event
from router.http.prompts import quota_prompt_tokens, sequences
from router.http.proxy import NotAccepted, SSEFilter, Upstream, Usage
from router.runtime import RouterRuntime
from router.telemetry.logs import request_context
from router.telemetry.tracing import (
    extract_context,
    inject_headers,
    operation_for_path,
    set_decision_attributes,
    set_request_attributes,
    set_usage_attributes,
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
    """One request's relay state; `close` is idempotent and does all the accounting."""

    def __init__(self, rt: RouterRuntime, routed: Routed, stream: bool, keep_usage: bool) -> None:
        self.rt = rt
        self.routed = routed
        self.stream = stream
        self.sse = SSEFilter(keep_usage)
        self.up: Upstream | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.usage: Usage | None = None
        self.closed = False
        self.spans: tuple[Span, ...] = ()
        self.ticket: Ticket | None = None
        self.reservation: Reservation | None = None
        self.reached = False  # a replica may have started the request (False: never accepted)

    async def open(self, path: str, payload: bytes, headers: dict[str, str]) -> Upstream:
        core, proxy = self.rt.core, self.rt.proxy
        proxy.budget.deposit()
        while True:
            try:
                self.reached = True
                up = await proxy.open(self.routed.replica_id, path, payload, headers)
            except NotAccepted as exc:
                self.reached = False
                refused = f"replica {self.routed.replica_id} refused the request ({exc.kind})"
                if len(self.routed.tried) > 1 or not proxy.budget.available():
                    raise _refusal(exc.kind, refused) from None
                if await core.reroute(self.routed) is None:
                    raise _refusal(exc.kind, f"{refused}; no other replica to retry on") from None
                proxy.budget.spend()
                self.rt.metrics.retries.labels(exc.kind).inc()
                continue
            self.up = up
            if up.response.status_code < 400:
                self.first_at = self.last_at = up.first_at
                core.first_token(self.routed)
                self.rt.demand.first_token(self.routed.request_id)
            return up

    async def chunks(self) -> AsyncIterator[bytes]:
        """The relayed stream: the first chunk, then the rest; an SSE error event on failure."""
        assert self.up is not None
        out = self.sse.feed(self.up.first)
        if out:
            yield out
        try:
            async for chunk in self.rt.proxy.rest(self.up):
                self.last_at = time.monotonic()
                seen = self.sse.content_events
                out = self.sse.feed(chunk)
                if self.ticket is not None:  # decode work is charged as it streams
                    self.rt.fairq.on_tokens(self.ticket, self.sse.content_events - seen)
                if out:
                    yield out
        except UpstreamError as exc:
            self.status = "upstream_died"
            yield sse_error_event(502, str(exc), "upstream_died")
            return
        if not self.sse.done:
            self.status = "upstream_died"
            yield sse_error_event(502, "the replica ended the stream early", "upstream_died")

    status: str = "200"

    async def close(self, status: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        if status is not None:
            self.status = status
        usage = self.sse.usage if self.stream else self.usage
        if self.reservation is not None:  # first, before any await: nothing can skip it
            self.rt.quotas.settle_soon(self.reservation, self._charge(usage))
        if self.up is not None:
            await self.up.aclose()
        r = self.routed
        self.rt.core.finish(r, usage.completion_tokens if usage else None)
        self.rt.demand.finished(r.request_id)
        if self.ticket is not None:
            self.rt.fairq.release(
                self.ticket,
                cached_tokens=usage.cached_tokens if usage else 0,
                output_tokens=usage.completion_tokens if usage else None,
            )
        self.rt.record(r, self.status, usage, self.first_at, self.last_at)
        for span in self.spans:
            _decision_attributes(span, r)  # the replica may have changed on a retry
            span.set_attribute("http.response.status_code", self.status)
            if usage is not None:
                set_usage_attributes(
                    span,
                    input_tokens=usage.prompt_tokens,
                    output_tokens=usage.completion_tokens,
                    cached_tokens=usage.cached_tokens,
                )
            span.end()

    def _charge(self, usage: Usage | None) -> int:
        """Tokens the quota is charged (`settle_tokens`): the usage the replica reported; 0 when
        no replica accepted the request or one refused it with a 4xx; else unknown."""
        assert self.reservation is not None
        refused = self.up is not None and 400 <= self.up.response.status_code < 500
        return settle_tokens(
            self.reservation,
            reported=None if usage is None else usage.prompt_tokens + usage.completion_tokens,
            reached_replica=self.reached and not refused,
            streamed=self.sse.content_events if self.stream else None,
            rule=self.rt.settings.quota.unknown_usage,
        )


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
        try:
            await super().__call__(scope, receive, send)
        except BaseException:
            # a client that closes as soon as it has `[DONE]` (the OpenAI SDK) was served; Ray
            # Serve then cancels the response task while it sends the body's end
            if self.exchange.status == "200" and not self.exchange.sse.done:
                self.exchange.status = "client_closed"
            raise
        finally:
            if not self.exchange.sse.done and self.exchange.status == "200":
                self.exchange.status = "client_closed"
            if self.exchange.status == "client_closed" and not self.exchange.closed:
                self.exchange.rt.metrics.client_disconnects.inc()  # left mid-stream
            await self.exchange.close()


async def serve_request(
    rt: RouterRuntime,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    path: str,
) -> Response:
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
    reservation: Reservation | None = None
    try:
        tenant = authenticate(rt, request)  # first: an unknown key is refused before any work
        root.set_attribute("cp.tenant", tenant.tenant_id)
        with trace.use_span(root, end_on_exit=False), tracer.start_as_current_span("route") as sp:
            given = body.user or request.headers.get("x-session-id")
            # a session key is the tenant's own: another tenant naming it changes nothing
            session = f"{tenant.tenant_id}:{given}" if given else None
            req = await rt.core.build(body, request_id=rid, tenant=tenant, session=session)
            reservation = await reserve_quota(rt, tenant, body, req.prompt_tokens)  # 429/503
            # demand for the autoscaler: admitted work, until its first token / its end
            rt.demand.arrived(rid, body.model, req.prompt_tokens, req.predicted_output_tokens)
            # the tenant's turn in the fair queue (waits while the fleet is full)
            ticket = await race_disconnect(request, rt.fairq.acquire(tenant, req))
            try:
                routed = await rt.core.route(req)
            except BaseException:
                rt.fairq.release(ticket)
                raise
            for span in (sp, root):
                _decision_attributes(span, routed)
    except ClientGone:
        rt.quotas.settle_soon(reservation, 0)  # nothing was sent
        rt.demand.finished(rid)
        root.set_attribute("error.type", "client_closed")
        root.end()
        rt.metrics.client_disconnects.inc()
        return Response(status_code=499)
    except BaseException as exc:
        rt.quotas.settle_soon(reservation, 0)  # nothing was sent
        rt.demand.finished(rid)
        root.set_attribute("error.type", type(exc).__name__)
        root.end()
        raise
    keep_usage = bool(body.stream_options and body.stream_options.include_usage)
    ex = Exchange(rt, routed, bool(body.stream), keep_usage)
    ex.ticket = ticket
    ex.reservation = reservation
    ex.spans = (
        tracer.start_span(
            "upstream", context=trace.set_span_in_context(root), kind=SpanKind.CLIENT
        ),
        root,
    )
    _decision_attributes(ex.spans[0], routed)
    headers = {"content-type": "application/json", "x-request-id": rid}
    inject_headers(headers, trace.set_span_in_context(ex.spans[0]))
    try:
        cap = reservation.max_tokens if reservation is not None else None
        payload = upstream_payload(body, rt, routed.request.cache_salt, cap)
        up = await race_disconnect(request, ex.open(path, payload, headers))
        out_headers = {"x-request-id": rid, **rt.decision_header(routed)}
        if reservation is not None:
            out_headers |= reservation.headers()  # x-ratelimit-*-tokens, as OpenAI sends
        if up.response.status_code >= 400:
            await ex.close(str(up.response.status_code))
            return Response(
                up.first,
                status_code=up.response.status_code,
                media_type=up.response.headers.get("content-type", "application/json"),
                headers=out_headers,
            )
        if body.stream:
            return RelayResponse(ex, out_headers)
        data = await race_disconnect(request, _read_rest(rt, ex, up))
        ex.usage = _usage_of(data)
        ex.last_at = time.monotonic()
        await ex.close("200")
        return Response(data, media_type="application/json", headers=out_headers)
    except ClientGone:
        await ex.close("client_closed")
        rt.metrics.client_disconnects.inc()
        return Response(status_code=499)
    except BaseException as exc:
        status = str(getattr(exc, "status_code", 500))
        await ex.close(status)
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


def _decision_attributes(span: Span, routed: Routed) -> None:
    set_decision_attributes(
        span,
        arm=routed.arm.name,
        policy=routed.arm.policy,
        reason=routed.decision.reason,
        replica=routed.replica_id,
        predicted_hit_blocks=routed.decision.expected_hit_blocks,
    )


async def _read_rest(rt: RouterRuntime, ex: Exchange, up: Upstream) -> bytes:
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
