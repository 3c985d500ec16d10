"""The lean upstream client (router/http/h1.py) against a raw asyncio server on loopback, under
the default event loop and uvloop (the router's): keep-alive reuse, chunked and length-framed
and close-delimited bodies, refused connections, a replica breaking the stream, and a response
closed before its end closing its connection (how vLLM learns the client left)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest
import uvloop

from router.http.h1 import ConnectFailed, H1Pool, UpstreamBroken

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Iterator[Callable[[Awaitable[None]], None]]:
    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def go(coro: Awaitable[None]) -> None:
        async def main() -> None:
            await coro

        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())

    yield go


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


class Server:
    """A loopback server running `handler` per connection; `close` ends every handler."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.tasks: set[asyncio.Task[None]] = set()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def serve(handler: Handler) -> tuple[Server, str]:
    server = Server(handler)
    return server, await server.start()


def test_keep_alive_reuse_and_framings(run: Callable[[Awaitable[None]], None]) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            seen.append(head + body)
            if b"/chunked" in head:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
                    b"content-type: text/event-stream\r\n\r\n"
                    b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
                )
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n" + body[:4])
            await writer.drain()

    async def main() -> None:
        server, url = await serve(handler)
        pool = H1Pool(url, connect_s=1.0)
        sent: list[str] = []
        pool.on_send.append(lambda method, path: sent.append(path))
        resp = await pool.request(b"POST", "/echo", [(b"x-a", b"1")], b"abcdef")
        assert resp.status == 200
        assert await resp.read() == b"abcd"
        resp = await pool.request(b"POST", "/chunked", [], b"{}")
        assert resp.header(b"content-type") == b"text/event-stream"
        assert await resp.read() == b"hello world"
        assert pool.opened == 1  # one connection, kept alive
        assert sent == ["/echo", "/chunked"]
        assert b"x-a: 1\r\n" in seen[0] and seen[0].endswith(b"abcdef")
        pool.close()
        await server.close()

    run(main())


def test_close_delimited_body_and_refused_connection(
    run: Callable[[Awaitable[None]], None],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async def main() -> None:
        server, url = await serve(handler)
        pool = H1Pool(url, connect_s=1.0)
        resp = await pool.request(b"GET", "/", [], b"")
        assert await resp.read() == b"until the end"
        await server.close()
        with pytest.raises(ConnectFailed):
            await H1Pool(url, connect_s=1.0).request(b"POST", "/", [], b"")

    run(main())


def test_broken_stream_and_early_close(run: Callable[[Awaitable[None]], None]) -> None:
    closed = asyncio.Event

    async def main() -> None:
        gone = closed()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head, _ = await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await writer.drain()
            if b"/die" in head:
                writer.transport.abort()  # the replica dies mid-stream
                return
            await reader.read()  # until the router closes the connection
            gone.set()

        server, url = await serve(handler)
        pool = H1Pool(url, connect_s=1.0)
        resp = await pool.request(b"POST", "/die", [], b"")
        assert await resp.next_chunk() == b"abc"
        with pytest.raises(UpstreamBroken):
            await resp.next_chunk()
        resp = await pool.request(b"POST", "/left", [], b"")
        assert await resp.next_chunk() == b"abc"
        await resp.aclose()  # the client left: the connection closes, the replica sees it
        await asyncio.wait_for(gone.wait(), 2.0)
        assert not pool._idle
        await server.close()

    run(main())


def test_idle_deadline_is_per_gap_not_per_stream(run: Callable[[Awaitable[None]], None]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive: requests one after the other on the connection
            try:
                head, _ = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(6):  # a steady stream: a chunk every 20 ms, longer than idle_s
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(0.02)
            if b"/stall" in head:
                await asyncio.sleep(5)  # then silent
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        server, url = await serve(handler)
        pool = H1Pool(url, connect_s=1.0)
        resp = await pool.request(b"POST", "/steady", [], b"")
        got = b""
        while (chunk := await resp.next_chunk(idle_s=0.08)) is not None:
            got += chunk
        assert got == b"x" * 6
        resp = await pool.request(b"POST", "/stall", [], b"")
        with pytest.raises(TimeoutError):
            while await resp.next_chunk(idle_s=0.08) is not None:
                pass
        await resp.aclose()
        pool.close()
        await server.close()

    run(main())
