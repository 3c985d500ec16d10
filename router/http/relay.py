"""One OpenAI request through the router, from its parsed body to the last byte relayed.

    build + quota + route               4xx / 503 before anything is reserved or sent; the quota
                                        holds prompt + max_tokens (429/503 when it cannot)
    open (cancellable)                  the first chunk, with at most one transparent retry
                                        (refused, 503, or the replica ejected before its first
                                        byte: router/http/ejection.py)
    relay                               streamed: the replica's bytes as they come (SSEFilter
                                        reads usage, [DONE] and counts events); else whole; a
                                        stream cut by the shutdown's grace deadline ends with an
                                        SSE error event (503 `shutting_down`)
    close                               the request's scope ends exactly once, in every path
                                        (router/scope.py: quota settled, fair-queue slot freed,
                                        routing books released, demand and telemetry told),
                                        then the upstream response is closed

`serve_request` speaks ASGI itself (it sends its response, refusals included, as OpenAI error
bodies), so the hot endpoints run it without a framework in between (`router/http/hot.py`), and
the FastAPI endpoints run the same function for bodies only the full validation accepts.

The body goes upstream as it came, with the router's rewrites spliced in (`upstream_payload`):
the tenant's `cache_salt`, `stream_options.include_usage` when streaming, and the quota's
`max_tokens` when the request has none.

A client that disconnects while the router waits for the replica (the fair queue, the first
chunk, the stream) cuts the wait short (`router/http/watch.py`): the upstream connection is
closed, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from controlplane.errors import (
    ControlPlaneError,
    NoReadyReplicaError,
    QuotaExceededError,
    QuotaUnavailableError,
    UpstreamError,
)
from controlplane.routing.books import Routed
from controlplane.tenancy.identity import KeyRejected
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import Reservation
from router.http.h1 import Header
from router.http.lean import OpenAIRequest
from router.http.openai_api import error_of, sse_error_event
from router.http.prompts import check_prompt_count, quota_prompt_tokens, sequences
from router.http.proxy import NotAccepted, RetryReason, SSEFilter, Upstream, Usage
from router.http.splice import set_members, set_nested
from router.http.watch import ClientGone, ClientWatch
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

log = logging.getLogger("controlplane.router")
_RID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
_CUT_MESSAGE = "the router shut down before the stream ended; retry the request"


def request_id_of(headers: Mapping[str, str]) -> str:
    given = headers.get("x-request-id", "")
    return given if _RID.match(given) else f"cp-{uuid.uuid4().hex}"


def authenticate(rt: RouterRuntime, headers: Mapping[str, str]) -> Tenant:
    """The request's tenant, from its API key alone (401 otherwise, counted by reason)."""
    try:
        return rt.tenancy.authenticate(headers)
    except KeyRejected as exc:
        rt.metrics.auth_failures.labels(exc.reason).inc()
        raise


def upstream_payload(
    req: OpenAIRequest,
    rt: RouterRuntime,
    cache_salt: str | None = None,
    max_tokens: int | None = None,
) -> bytes:
    """The body sent to the replica: the client's bytes with `cache_salt` (the router's choice)
    overwriting the client's, `stream_options.include_usage` set when streaming, and
    `max_tokens` (the quota's cap) injected when the request has none (router/http/splice.py)."""
    top: dict[str, bytes] = {}
    if cache_salt is not None and req.client_salt != cache_salt:
        top["cache_salt"] = json.dumps(cache_salt).encode()
    cap = max_tokens if max_tokens is not None else rt.settings.limits.default_max_tokens
    if cap is not None and req.output_cap is None:
        top["max_tokens"] = str(int(cap)).encode()
    opts = req.data.get("stream_options")
    if req.stream and not (isinstance(opts, dict) and opts.get("include_usage") is True):
        return set_nested(req.body, req.data, "stream_options", {"include_usage": b"true"}, top)
    return set_members(req.body, req.data, top)


async def send_json(
    send: Send, status: int, body: bytes, headers: list[Header], content_type: bytes = _JSON
) -> None:
    head = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, exc: ControlPlaneError, rid: str | None) -> None:
    """An OpenAI error body with the exception's status (and e.g. Retry-After)."""
    status, body = error_of(exc)
    if status >= 500:
        log.warning("request failed: %s", exc)
    headers = _headers({"x-request-id": rid} if rid else {}, exc.response_headers())
    await send_json(send, status, json.dumps(body).encode(), headers)


async def _send_499(send: Send) -> None:
    """The client left: nobody reads this, the status is for the server's own books."""
    head = [(b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 499, "headers": head})
    await send({"type": "http.response.body", "body": b""})


def _headers(*maps: Mapping[str, str]) -> list[Header]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for m in maps for k, v in m.items()]


class Exchange:
    """The upstream side of one request's scope: the replica's answer, relayed; `close` ends the
    scope (every book released, once) and then closes the upstream response."""

    def __init__(self, rt: RouterRuntime, scope: RequestScope, keep_usage: bool) -> None:
        self.rt = rt
        self.scope = scope
        self.sse = SSEFilter(keep_usage)
        self.up: Upstream | None = None
        self.failed = False
        self.cut = False  # ended by the shutdown's grace deadline

    @property
    def routed(self) -> Routed:
        assert self.scope.routed is not None
        return self.scope.routed

    async def open(self, path: str, payload: bytes, headers: list[Header]) -> Upstream:
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
                # an ejection's retry does not wait for the budget: it is the fleet's own call
                # and the client has seen nothing; still once per request
                ejected = exc.kind is RetryReason.EJECTED
                refused = (
                    f"replica {routed.replica_id} was ejected before it answered"
                    if ejected
                    else f"replica {routed.replica_id} refused the request ({exc.kind})"
                )
                if len(routed.tried) > 1 or not (ejected or proxy.budget.available()):
                    raise _refusal(exc.kind, refused) from None
                if await core.reroute(routed) is None:
                    raise _refusal(exc.kind, f"{refused}; no other replica to retry on") from None
                scope.routed_to(routed)  # its backlog now waits on the new replica
                if scope.ticket is not None:
                    rt.fairq.place(scope.ticket, routed.replica_id, rt.profile_of(routed))
                proxy.budget.spend()  # an ejection's retry spends a token when there is one
                rt.metrics.retries.labels(exc.kind).inc()
                continue
            return self.accepted(up)

    def accepted(self, up: Upstream) -> Upstream:
        """The replica answered: the scope hears of its first token (or its refusal)."""
        self.up = up
        if up.status < 400:
            self.scope.first_token(up.first_at)
        elif up.status < 500:
            self.scope.refused_by_replica = True
        return up

    async def relay(self, send: Send, headers: list[Header], watch: ClientWatch) -> None:
        """Stream the replica's bytes to the client (an SSE error event ends a broken stream),
        then close, whatever happened."""
        assert self.up is not None
        scope, sse, proxy, up = self.scope, self.sse, self.rt.proxy, self.up
        try:
            head = [(b"content-type", _SSE), *headers]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            async with watch.cancellable():
                out = sse.feed(up.first)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                try:
                    while (chunk := await proxy.next(up)) is not None:
                        seen = sse.content_events
                        out = sse.feed(chunk)
                        scope.tokens(sse.content_events - seen, time.monotonic())
                        if out:
                            msg = {"type": "http.response.body", "body": out, "more_body": True}
                            await send(msg)
                    if not sse.done:
                        self.failed = True
                        out = sse_error_event(
                            502, "the replica ended the stream early", "upstream_died"
                        )
                except UpstreamError as exc:
                    self.failed = True
                    out = sse_error_event(502, str(exc), "upstream_died")
                except asyncio.CancelledError:
                    if watch.gone or sse.done:
                        # the client left (the section turns this into ClientGone), or it has
                        # its [DONE] already and its host cancelled the call as it closed (Ray
                        # Serve does, when the OpenAI SDK hangs up): served, not cut
                        raise
                    # the shutdown's grace deadline (router/http/shutdown.py): end the stream
                    # with an error event the client can read, then let the cancellation go on
                    self.cut = True
                    last = sse_error_event(503, _CUT_MESSAGE, "shutting_down")
                    with contextlib.suppress(Exception):
                        await send({"type": "http.response.body", "body": last, "more_body": False})
                    raise
                else:
                    out = out if self.failed else b""
                await send({"type": "http.response.body", "body": out, "more_body": False})
        except ClientGone:
            pass
        finally:
            # a client that closes as soon as it has `[DONE]` (the OpenAI SDK) was served
            if self.cut:
                outcome, status = Outcome.SHUTDOWN_CUT, "shutdown_cut"
            elif self.failed:
                outcome, status = Outcome.UPSTREAM_DIED, "upstream_died"
            elif sse.done:
                outcome, status = Outcome.COMPLETED, "200"
            else:
                outcome, status = Outcome.CLIENT_CLOSED, "client_closed"
                if not scope.ended:
                    self.rt.metrics.client_disconnects.inc()  # left mid-stream
            await self.close(outcome, status)

    async def close(self, outcome: Outcome, status: str) -> None:
        """End the scope (first, before any await: nothing can skip it), then the upstream."""
        scope = self.scope
        if scope.stream and scope.usage is None:
            scope.usage = self.sse.usage
        scope.end(outcome, status)
        if self.up is not None:
            await self.up.aclose()


def _refusal(kind: RetryReason, message: str) -> Exception:
    """Every replica tried refused: 503 when they were busy (their own 503), else 502."""
    busy = kind is RetryReason.UNAVAILABLE
    return NoReadyReplicaError(message) if busy else UpstreamError(message)


async def serve_request(
    rt: RouterRuntime, scope: Scope, receive: Receive, send: Send, req: OpenAIRequest
) -> None:
    """Serve one parsed request on an ASGI connection whose body was read (see the module
    docstring); every refusal is sent as an OpenAI error body, a bug as a 500 one."""
    watch = ClientWatch(receive)
    state = _State()
    try:
        await _serve(rt, scope, send, req, watch, state)
    except Exception:
        log.exception("request %s: unexpected error", state.rid)
        if not state.started:
            body = json.dumps(
                {
                    "error": {
                        "message": "internal error in the router",
                        "type": "server_error",
                        "param": None,
                        "code": "internal_error",
                    }
                }
            ).encode()
            await send_json(send, 500, body, _headers({"x-request-id": state.rid}))
    finally:
        watch.close()


class _State:
    __slots__ = ("rid", "started")

    def __init__(self) -> None:
        self.rid = ""
        self.started = False


async def _serve(
    rt: RouterRuntime,
    asgi: Scope,
    send: Send,
    req: OpenAIRequest,
    watch: ClientWatch,
    state: _State,
) -> None:
    started = time.monotonic()
    headers = Headers(scope=asgi)
    state.rid = rid = request_id_of(headers)
    asgi.setdefault("state", {})["request_id"] = rid  # FastAPI's error handlers read it
    # every log line of this request's task carries its id (each request runs in its own task)
    request_context.set({**request_context.get(), "request_id": rid})
    path: str = asgi["path"]
    op = operation_for_path(path)
    tracer = rt.tracer
    root = tracer.start_span(
        span_name(op, req.model), context=extract_context(headers), kind=SpanKind.SERVER
    )
    set_request_attributes(root, operation=op, model=req.model, max_tokens=req.output_cap)
    root.set_attribute("cp.request_id", rid)
    try:
        tenant = authenticate(rt, headers)  # first: an unknown key is refused before any work
    except BaseException as exc:
        root.set_attribute("error.type", type(exc).__name__)
        root.end()
        if isinstance(exc, ControlPlaneError):
            state.started = True
            await send_error(send, exc, rid)
            return
        raise
    root.set_attribute("cp.tenant", tenant.tenant_id)
    scope = rt.scope(rid, tenant, req.model, stream=req.stream, started_s=started)
    scope.spans = (root,)
    try:
        with trace.use_span(root, end_on_exit=False), tracer.start_as_current_span("route") as sp:
            given = req.user or headers.get("x-session-id")
            # a session key is the tenant's own: another tenant naming it changes nothing
            session = f"{tenant.tenant_id}:{given}" if given else None
            check_prompt_count(rt.settings.limits, req)  # 400 before any tokenizing
            built = await rt.core.build(req, request_id=rid, tenant=tenant, session=session)
            scope.request = built
            # the index lookup's round trip overlaps the quota's: one on the critical path
            lookup = rt.core.prefetch(built)
            try:
                scope.reservation = await reserve_quota(rt, tenant, req, built.prompt_tokens)
                scope.admitted()  # demand for the autoscaler: admitted work, queued or not
                # the tenant's turn in the fair queue (waits while no replica has room)
                async with watch.cancellable():
                    scope.ticket = ticket = await rt.fairq.acquire(tenant, built)
            except BaseException:
                rt.core.discard(lookup)
                raise
            await rt.route(scope, ticket, lookup)
            for span in (sp, root):
                decision_attributes(span, scope)
    except ClientGone:
        root.set_attribute("error.type", "client_closed")
        scope.end(Outcome.CLIENT_CLOSED, "499")
        rt.metrics.client_disconnects.inc()
        state.started = True
        await _send_499(send)
        return
    except BaseException as exc:
        root.set_attribute("error.type", type(exc).__name__)
        scope.end(Outcome.REJECTED, str(getattr(exc, "status_code", 500)))
        if isinstance(exc, ControlPlaneError):
            state.started = True
            await send_error(send, exc, rid)
            return
        raise
    ex = (rt.exchange_type or Exchange)(rt, scope, req.include_usage)
    upstream = tracer.start_span(
        "upstream", context=trace.set_span_in_context(root), kind=SpanKind.CLIENT
    )
    scope.spans = (upstream, root)
    decision_attributes(upstream, scope)
    up_headers = {"content-type": "application/json", "x-request-id": rid}
    inject_headers(up_headers, trace.set_span_in_context(upstream))
    reservation = scope.reservation
    try:
        cap = reservation.max_tokens if reservation is not None else None
        payload = upstream_payload(req, rt, built.cache_salt, cap)
        async with watch.cancellable():
            up = await ex.open(path, payload, _headers(up_headers))
        out = {"x-request-id": rid}
        if scope.routed is not None:
            out |= rt.decision_header(scope.routed)
        if reservation is not None:
            out |= reservation.headers()  # x-ratelimit-*-tokens, as OpenAI sends
        out_headers = _headers(out)
        state.started = True
        if up.status >= 400:
            await ex.close(Outcome.REPLICA_ERROR, str(up.status))
            ctype = up.content_type.encode("latin-1")
            await send_json(send, up.status, up.first, out_headers, ctype)
            return
        if req.stream:
            await ex.relay(send, out_headers, watch)
            return
        async with watch.cancellable():
            data = await _read_rest(rt, up)
        scope.usage = _usage_of(data)
        scope.last_at = time.monotonic()
        await ex.close(Outcome.COMPLETED, "200")
        await send_json(send, 200, data, out_headers)
    except ClientGone:
        await ex.close(Outcome.CLIENT_CLOSED, "client_closed")
        rt.metrics.client_disconnects.inc()
        if not state.started:
            state.started = True
            await _send_499(send)
    except BaseException as exc:
        await ex.close(Outcome.UPSTREAM_FAILED, str(getattr(exc, "status_code", 500)))
        if isinstance(exc, ControlPlaneError) and not state.started:
            state.started = True
            await send_error(send, exc, rid)
            return
        raise


async def reserve_quota(
    rt: RouterRuntime, tenant: Tenant, req: OpenAIRequest, prompt_tokens: int
) -> Reservation | None:
    """Hold `prompt + sequences x max_tokens` of the tenant's quota before the request is queued
    (None: no quota); a request without max_tokens gets the quota's cap injected."""
    limits, q = rt.settings.limits, rt.settings.quota
    default_cap = min(limits.default_max_tokens or q.default_max_tokens, limits.max_tokens)
    # approx tokenizer: an upper bound of what the replica will count, not the estimate
    prompt_tokens = quota_prompt_tokens(
        rt.tokenizer.mode, q.approx_template_tokens, req, prompt_tokens
    )
    try:
        return await rt.quotas.reserve(
            tenant,
            prompt_tokens,
            req.output_cap,
            default_cap=default_cap,
            sequences=sequences(req),
        )
    except (QuotaExceededError, QuotaUnavailableError) as exc:
        rt.metrics.quota_rejections.labels(tenant.tenant_id, exc.reason).inc()
        raise


async def _read_rest(rt: RouterRuntime, up: Upstream) -> bytes:
    parts = [up.first]
    while (chunk := await rt.proxy.next(up)) is not None:
        parts.append(chunk)
    return b"".join(parts)


def _usage_of(data: bytes) -> Usage | None:
    try:
        return Usage.of(json.loads(data))
    except ValueError:
        return None


__all__ = ["ClientGone", "Exchange", "serve_request", "upstream_payload"]
