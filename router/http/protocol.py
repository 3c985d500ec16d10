"""The router's HTTP/1.1 connection: uvicorn's httptools protocol with limits on request heads.

uvicorn bounds neither the time a request head may take nor its size: a connection that sends
nothing, or a header a byte at a time, is held forever, and a header of any size is buffered.
`guarded_protocol(limits)` returns a subclass of uvicorn's `HttpToolsProtocol` (passed as
`http=` in `uvicorn.Config`) that adds, per connection:

    head deadline   the whole head of a request must arrive within `header_timeout_s` of the
                    connection opening, or of the previous response finishing
    idle keep-alive a connection with no byte of a next request is closed after
                    `keepalive_timeout_s` (a fresh connection waits `header_timeout_s`)
    head size       `max_header_bytes` (request line + header lines) and `max_headers` header
                    lines; beyond either: 431
    connections     a request head completed while more than `max_connections` connections are
                    open is answered 503 (the client may retry; open connections finish)
    draining        while the server drains (`router/http/shutdown.py`) each response closes
                    its connection (`connection: close`)

One timer per connection (`loop.call_later`), armed when the connection opens and when a response
completes (where uvicorn arms its keep-alive timer, which this replaces) and cancelled when a head
completes; when it fires with no request in progress it closes an idle connection, answers 408 to
a partial head, or re-arms for the time left. Sizes are counted as the parser reports them (the
URL and each header, exact), and raw bytes while a head is incomplete (a header being
accumulated inside the parser), so at most one read chunk past the limit is ever buffered. A body
chunk costs one attribute test (`_awaiting_head`), nothing more.

Every refusal that can still be answered is an OpenAI error body (`router/http/openai_api.py`;
the status from `controlplane/errors.py`) with `connection: close`; the connection then stops
parsing and discards what the client still sends for up to `LINGER_S` (or until it closes), so
the client reads the answer instead of a reset. While another response is in progress on the
connection (a pipelined request), nothing is answered: the connection closes when it ends.
Malformed HTTP gets the same JSON shape (400) instead of uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from controlplane.errors import (
    ControlPlaneError,
    InvalidHttpError,
    RequestHeadTimeoutError,
    RequestHeadTooLargeError,
    TooManyConnectionsError,
)
from router.config import LimitsConfig
from router.http.openai_api import error_of

log = logging.getLogger("controlplane.router")

LINGER_S = 2.0  # how long a refused connection discards input before it is closed
_EPS = 1e-3


class _Refused(Exception):
    """Raised from a parser callback to stop parsing after a refusal was written."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with the head limits above (class attributes: `guarded_protocol`)."""

    header_timeout_s = 10.0
    keepalive_timeout_s = 5.0
    max_header_bytes = 64 * 1024
    max_headers = 100
    max_connections = 4096

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0  # when waiting for the current head began (loop time)
        self._fresh = True  # no request has completed on this connection yet
        self._awaiting_head = True
        self._raw = 0  # bytes received since the previous message ended (or the connection began)
        self._head_size = 0  # URL + header lines of the current head, as parsed
        self._header_count = 0
        self._refused = False

    # -- the timer ---------------------------------------------------------------------------------
    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(max(0.0, delay), self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self.pipeline:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request in progress: its own deadlines apply; re-armed when it completes
        if not self._awaiting_head:  # answered early, the body still coming: no second answer
            self.transport.close()
            return
        elapsed = self.loop.time() - self._since
        if self._raw == 0:  # nothing of a next request yet
            limit = self.header_timeout_s if self._fresh else self.keepalive_timeout_s
            if elapsed >= limit - _EPS:
                self.transport.close()
            else:
                self._arm(limit - elapsed)
        elif elapsed >= self.header_timeout_s - _EPS:
            message = f"the request head did not arrive within {self.header_timeout_s:g} s"
            self._refuse(RequestHeadTimeoutError(message))
        else:
            self._arm(self.header_timeout_s - elapsed)

    # -- connection --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._since = self.loop.time()
        self._arm(self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:
            self._raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refused:
                return  # a callback refused the request: answered already
            self._refuse(InvalidHttpError("Invalid HTTP request received."))
            return
        if self._awaiting_head and self._raw > self.max_header_bytes:
            self._refuse(RequestHeadTooLargeError(self._too_large()))

    def _discard(self, data: bytes) -> None:
        """Input after a refusal: dropped until the client or the linger timer closes."""

    def send_400_response(self, msg: str) -> None:
        self._refuse(InvalidHttpError(msg))

    # -- parser callbacks --------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        self._header_count = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._head_size += len(url)
        if self._head_size > self.max_header_bytes:
            self._refuse(RequestHeadTooLargeError(self._too_large()))
            raise _Refused

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._head_size += len(name) + len(value) + 4
        if self._header_count > self.max_headers or self._head_size > self.max_header_bytes:
            self._refuse(RequestHeadTooLargeError(self._too_large()))
            raise _Refused
        # uvicorn's own: lower-case names, no trailing whitespace in values, Expect: 100-continue
        name = name.lower()
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._disarm()
        if len(self.connections) > self.max_connections:
            message = "the router has too many open connections; retry later"
            self._refuse(TooManyConnectionsError(message))
            raise _Refused
        super().on_headers_complete()
        if getattr(self.server_state, "draining", False) and self.cycle is not None:
            self.cycle.keep_alive = False  # router/http/shutdown.py: `connection: close`

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_head = True
        self._raw = 0

    def on_response_complete(self) -> None:
        # uvicorn's, with this module's timer in place of its keep-alive timer
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._fresh = False
        self._since = self.loop.time()
        self._arm(min(self.keepalive_timeout_s, self.header_timeout_s))

    # -- refusals ----------------------------------------------------------------------------------
    def _too_large(self) -> str:
        return (
            f"the request head exceeds this router's limits ({self.max_header_bytes} bytes, "
            f"{self.max_headers} header lines)"
        )

    def _refuse(self, exc: ControlPlaneError) -> None:
        """Answer `exc` as an OpenAI error and close; while a response is in progress (a
        pipelined request), no answer: the connection closes once that response ends. Input is
        discarded meanwhile."""
        self._disarm()
        self._refused = True
        self.data_received = self._discard  # type: ignore[method-assign]
        transport = self.transport
        if transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # no answer in the middle of another response: that one ends, then the connection
            self.cycle.keep_alive = False
            return
        status, body = error_of(exc)
        payload = json.dumps(body).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(payload)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
        ]
        transport.write(b"".join(head) + payload)
        log.debug("connection refused with %d: %s", status, exc)
        self.flow.resume_reading()  # keep reading (and discarding) until the client closes
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)


def guarded_protocol(limits: LimitsConfig) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these limits."""
    return type(
        "RouterHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "header_timeout_s": limits.header_timeout_s,
            "keepalive_timeout_s": limits.keepalive_timeout_s,
            "max_header_bytes": limits.max_header_bytes,
            "max_headers": limits.max_headers,
            "max_connections": limits.max_connections,
        },
    )


__all__ = ["LINGER_S", "GuardedHttpToolsProtocol", "guarded_protocol"]
