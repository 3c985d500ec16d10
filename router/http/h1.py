"""A lean HTTP/1.1 client for the router's upstream calls: a keep-alive connection pool per replica.

    pool = H1Pool("http://10.0.0.5:8000", connect_s=2.0)
    resp = await pool.request(b"POST", "/v1/chat/completions", headers, body)  # head received
    resp.status, resp.header(b"content-type")
    while (chunk := await resp.next_chunk()) is not None: ...   # body bytes, de-chunked
    resp.close()        # whenever the caller is done; idempotent (`await resp.aclose()` too)

Algorithm. A connection is an `asyncio.Protocol` whose bytes go straight into httptools'
response parser (llhttp, C): the head is collected by callbacks, body bytes are queued as they
are parsed (chunked framing removed) and handed over in one piece per wake-up, so a relay does
one await per burst of network reads rather than one per SSE event. A request is written with
one `transport.write` (head and body together). Reading pauses while more than `HIGH_WATER`
bytes wait unread (a slow client slows its replica's stream, not the router's memory).

Pool: idle connections are reused last-in first-out; one idle longer than `idle_expiry_s` (below
the replica server's own keep-alive timeout), closed by the server, or with bytes (a FIN) waiting
to be read is dropped, so a request is not written to a connection the server is closing (as
httpx does; a FIN still in flight at that instant fails the request as a reset). A connection
goes back to the pool only when its response was read to the end and both sides keep it alive;
`close()` before the end closes the connection, which is how the replica learns that the client
left (vLLM aborts the request when its connection closes). At most `max_idle` connections are
kept.

Errors: connecting refused or timed out -> `ConnectFailed` (the replica never saw the request);
the connection lost or a malformed response afterwards -> `UpstreamBroken`. The deadline for the
head is the caller's (`asyncio.timeout` around the await); between chunks, `next_chunk(idle_s)`
keeps one timer per response, moved on as bytes arrive (TimeoutError after idle_s of silence
while waiting), not one per chunk; cancelling an
await closes the connection.
"""

from __future__ import annotations

import asyncio
import collections
import select
import time
from collections.abc import Callable, Sequence
from typing import cast
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 256 * 1024
Header = tuple[bytes, bytes]


class ConnectFailed(OSError):
    """The connection could not be made (refused, unreachable, timed out)."""


class UpstreamBroken(Exception):
    """The connection broke, or the replica sent something that is not HTTP/1.1."""


class _Conn(asyncio.Protocol):
    """One connection; it carries one response at a time."""

    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.resp: H1Response | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no asyncio.Transport subclass, but have its methods
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.resp is None or self.resp.complete:  # bytes after the response: not HTTP/1.1
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.resp._fail(UpstreamBroken(f"malformed response: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.resp
        if resp is not None and not resp.complete:
            if resp.head_done and resp.until_eof:
                resp._finish()  # a body delimited by the connection's end
            else:
                resp._fail(UpstreamBroken("the replica closed the connection"))

    def pause_writing(self) -> None:
        return None

    def resume_writing(self) -> None:
        return None

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        resp.status = self.parser.get_status_code()
        framed = any(n in (b"content-length", b"transfer-encoding") for n, _ in resp.headers)
        resp.until_eof = not framed and resp.status not in (204, 304)
        resp._head()

    def on_body(self, body: bytes) -> None:
        assert self.resp is not None
        self.resp._body(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        resp.keep_alive = self.parser.should_keep_alive()
        resp._finish()

    # -- the pool's side ---------------------------------------------------------------------------
    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed and self.transport.is_reading() is False:
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class H1Response:
    """The replica's answer: its head, then its body as it arrives."""

    __slots__ = (
        "_buf",
        "_buffered",
        "_conn",
        "_error",
        "_head_waiter",
        "_loop",
        "_since",
        "_waiter",
        "_watchdog",
        "complete",
        "head_done",
        "headers",
        "keep_alive",
        "released",
        "status",
        "until_eof",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = 0
        self.headers: list[Header] = []
        self.head_done = False
        self.until_eof = False
        self.complete = False
        self.keep_alive = False
        self.released = False
        self._buf: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: Exception | None = None
        self._loop = loop = asyncio.get_running_loop()
        self._since = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        self._head_waiter: asyncio.Future[None] | None = loop.create_future()
        self._waiter: asyncio.Future[None] | None = None

    def header(self, name: bytes, default: bytes = b"") -> bytes:
        for n, v in self.headers:
            if n == name:
                return v
        return default

    # -- fed by the connection ---------------------------------------------------------------------
    def _wake(self, fut: asyncio.Future[None] | None) -> None:
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _head(self) -> None:
        self.head_done = True
        self._wake(self._head_waiter)

    def _body(self, data: bytes) -> None:
        self._since = self._loop.time()
        self._buf.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake(self._waiter)

    def _finish(self) -> None:
        self.complete = True
        self._wake(self._head_waiter)
        self._wake(self._waiter)

    def _fail(self, exc: Exception) -> None:
        if self._error is None and not self.complete:
            self._error = exc
        self._wake(self._head_waiter)
        self._wake(self._waiter)

    # -- the caller's side -------------------------------------------------------------------------
    async def _wait_head(self) -> None:
        while not self.head_done:
            if self._error is not None:
                raise self._error
            if self.complete:  # closed before a head
                raise UpstreamBroken("the replica closed the connection without a response")
            assert self._head_waiter is not None
            await self._head_waiter
            self._head_waiter = asyncio.get_running_loop().create_future()
        self._head_waiter = None

    async def next_chunk(self, idle_s: float | None = None) -> bytes | None:
        """The body bytes that arrived since the last call (waits for some); None at the end.
        With `idle_s`: TimeoutError when no byte arrives for that long while it waits (one
        timer per response, moved on as bytes arrive, rather than one per chunk)."""
        while not self._buf:
            if self.complete:
                self._release()
                return None
            if self._error is not None:
                raise self._error
            loop = self._loop
            self._waiter = fut = loop.create_future()
            if idle_s is not None:
                self._since = loop.time()
                if self._watchdog is None:
                    self._watchdog = loop.call_at(self._since + idle_s, self._idle, idle_s)
            try:
                await fut
            finally:
                self._waiter = None
        if len(self._buf) == 1:
            data = self._buf.popleft()
        else:
            data = b"".join(self._buf)
            self._buf.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def _idle(self, idle_s: float) -> None:
        """The watchdog: fail a wait that saw no byte for `idle_s`; else look again later."""
        self._watchdog = None
        if self.released or self.complete:
            return
        due = self._since + idle_s
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._loop.time() >= due:
            waiter.set_exception(TimeoutError())
        elif waiter is not None:
            self._watchdog = self._loop.call_at(due, self._idle, idle_s)

    def _release(self) -> None:
        """Back to the pool when read whole and kept alive; else the connection is closed."""
        if self.released:
            return
        self.released = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        conn = self._conn
        conn.resp = None
        whole = self.complete and not self._buf and self._error is None
        if whole and self.keep_alive and not conn.closed:
            conn.pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Done with the response (idempotent): the connection goes back to the pool if the
        response was read whole, else it is closed (the replica sees the client leave)."""
        self._release()

    async def aclose(self) -> None:
        self._release()


def _quiet(conn: _Conn) -> bool:
    """Nothing waits to be read on an idle connection (bytes there, or the server's FIN that
    the loop has not delivered yet, mean the server is closing it)."""
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class H1Pool:
    """Keep-alive connections to one replica (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_s: float,
        max_idle: int = 64,
        idle_expiry_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the lean upstream client speaks http:// only, not {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        netloc = parts.netloc.rsplit("@", 1)[-1]
        self.host_header = netloc.encode("ascii")
        self.prefix = parts.path.rstrip("/")
        self.connect_s = connect_s
        self.max_idle = max_idle
        self.idle_expiry_s = idle_expiry_s
        self.clock = clock
        self._idle: list[_Conn] = []
        self.opened = 0  # connections made (reuse = requests - opened)
        self.closed = False
        # called with (method, path) for every request sent (tests count what reached a replica)
        self.on_send: list[Callable[[bytes, str], None]] = []

    def _put(self, conn: _Conn) -> None:
        if self.closed or len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = self.clock()
        self._idle.append(conn)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc!r}") from exc
        self.opened += 1
        return conn

    def _idle_conn(self) -> _Conn | None:
        now = self.clock()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_expiry_s and _quiet(conn):
                return conn
            conn.close()
        return None

    async def request(
        self, method: bytes, path: str, headers: Sequence[Header], body: bytes
    ) -> H1Response:
        """Send one request; returns once the response head is here."""
        if self.closed:
            raise ConnectFailed("the pool is closed")
        conn = self._idle_conn() or await self._connect()
        head = [
            method, b" ", (self.prefix + path).encode("ascii"), b" HTTP/1.1\r\nhost: ",
            self.host_header, b"\r\ncontent-length: ", str(len(body)).encode("ascii"), b"\r\n",
        ]  # fmt: skip
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        head.append(body)
        resp = conn.resp = H1Response(conn)
        for hook in self.on_send:
            hook(method, path)
        assert conn.transport is not None
        conn.transport.write(b"".join(head))
        try:
            await resp._wait_head()
        except BaseException:
            resp.close()
            raise
        return resp

    def close(self) -> None:
        self.closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()


__all__ = ["ConnectFailed", "H1Pool", "H1Response", "UpstreamBroken"]
