"""Connections that hold the router without sending a request: a live router (uvicorn with the
guarded protocol, real sockets, asyncio clients) with small configured limits.

- a connection that sends nothing is closed once the head deadline passes, and the server holds
  no connection afterwards; one that sends its head a byte at a time is answered 408 and closed;
- an idle keep-alive connection is closed after its timeout, a busy one is not;
- a 1 MB header, or 5,000 headers, are answered 431 with an OpenAI error body (not read whole);
- a request on a connection past the connection cap is answered 503, and once connections close
  requests are served again.

No assertion measures time: each test waits (bounded by a generous ceiling) for the close or the
answer that the configured limit must bring.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from router_fixtures import MODEL, wait_until
from router_harness import RouterServer

from router.config import load_settings

pytestmark = [pytest.mark.timeout(120)]

HEADER_TIMEOUT_S = 1.0
KEEPALIVE_S = 0.5
MAX_CONNECTIONS = 6
CEILING_S = 30.0  # hang detection only: the limits above must act long before
GET = b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n"
ERROR_KEYS = {"message", "type", "param", "code"}
Response = tuple[int, dict[str, str], bytes]


def serve(**limits: Any) -> RouterServer:
    settings = load_settings(
        served_model=MODEL,
        tokenizer="approx",
        limits=limits,
        telemetry={"json_logs": False, "log_level": "WARNING"},
    )
    return RouterServer(settings)


@pytest.fixture(scope="module")
def router() -> Iterator[RouterServer]:
    with serve(header_timeout_s=HEADER_TIMEOUT_S, keepalive_timeout_s=KEEPALIVE_S) as server:
        yield server


@pytest.fixture
def capped() -> Iterator[RouterServer]:
    """A router whose silent connections are held long enough to fill its connection cap."""
    with serve(
        header_timeout_s=CEILING_S, keepalive_timeout_s=CEILING_S, max_connections=MAX_CONNECTIONS
    ) as server:
        yield server


def open_connections(router: RouterServer) -> int:
    count: int = router.call(lambda: len(router.server.server_state.connections))
    return count


def no_connection_left(router: RouterServer) -> None:
    wait_until(lambda: open_connections(router) == 0, CEILING_S, "every connection to close")


async def connect(router: RouterServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = int(router.url.rsplit(":", 1)[1])
    return await asyncio.open_connection("127.0.0.1", port)


async def read_response(reader: asyncio.StreamReader) -> Response:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CEILING_S)
    status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), CEILING_S)
    return int(status_line.split()[1]), headers, body


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server still sends, up to its close (EOF or a reset)."""
    rest = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await asyncio.wait_for(reader.read(65536), CEILING_S):
            rest += chunk
    return rest


def openai_error(response: Response, status: int) -> dict[str, Any]:
    got, headers, body = response
    assert got == status, body
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    err: dict[str, Any] = json.loads(body)["error"]
    assert set(err) == ERROR_KEYS
    return err


# -- deadlines -------------------------------------------------------------------------------------
def test_a_silent_connection_is_closed(router: RouterServer) -> None:
    async def main() -> bytes:
        reader, writer = await connect(router)
        try:
            return await until_closed(reader)
        finally:
            writer.close()

    assert asyncio.run(main()) == b""  # closed without a word: there was no request to answer
    no_connection_left(router)


def test_a_head_sent_byte_by_byte_is_cut_off_with_408(router: RouterServer) -> None:
    async def main() -> Response:
        reader, writer = await connect(router)

        async def drip() -> None:
            head = b"GET /health HTTP/1.1\r\nhost: router\r\nx-slow: " + b"a" * 100_000
            for i in range(len(head)):
                writer.write(head[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.02)

        dripping = asyncio.create_task(drip())
        try:
            response = await read_response(reader)
            await until_closed(reader)
            return response
        finally:
            dripping.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await dripping
            writer.close()

    err = openai_error(asyncio.run(main()), 408)
    assert err["code"] == "header_timeout"
    no_connection_left(router)


def test_an_idle_keep_alive_connection_is_closed_a_busy_one_served(router: RouterServer) -> None:
    async def main() -> list[int]:
        reader, writer = await connect(router)
        statuses = []
        try:
            for _ in range(3):  # back-to-back requests keep the connection
                writer.write(GET)
                statuses.append((await read_response(reader))[0])
            assert await until_closed(reader) == b""  # then idle: closed
        finally:
            writer.close()
        return statuses

    assert asyncio.run(main()) == [200, 200, 200]
    no_connection_left(router)


# -- sizes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("what", "headers"),
    [
        ("one 1 MB header", [("x-big", "b" * 1_000_000)]),
        ("5,000 headers", [(f"x-h{i}", "v") for i in range(5000)]),
        ("a 70 KB URL", None),
    ],
)
def test_an_oversized_head_is_refused_with_431(
    router: RouterServer, what: str, headers: list[tuple[str, str]] | None
) -> None:
    if headers is None:
        head = b"GET /health?q=" + b"u" * 70_000 + b" HTTP/1.1\r\nhost: router\r\n\r\n"
    else:
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers)
        head = f"GET /health HTTP/1.1\r\nhost: router\r\n{lines}\r\n".encode()

    async def main() -> Response:
        reader, writer = await connect(router)
        try:
            writer.write(head)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            response = await read_response(reader)
            await until_closed(reader)
            return response
        finally:
            writer.close()

    err = openai_error(asyncio.run(main()), 431)
    assert err["code"] == "request_header_fields_too_large", what
    no_connection_left(router)


def test_a_large_head_within_the_limits_is_served(router: RouterServer) -> None:
    lines = "".join(f"x-h{i}: {'v' * 500}\r\n" for i in range(90))  # 90 headers, ~46 KB

    async def main() -> int:
        reader, writer = await connect(router)
        try:
            writer.write(f"GET /health HTTP/1.1\r\nhost: router\r\n{lines}\r\n".encode())
            return (await read_response(reader))[0]
        finally:
            writer.close()

    assert asyncio.run(main()) == 200


def test_malformed_http_gets_a_json_400(router: RouterServer) -> None:
    async def main() -> Response:
        reader, writer = await connect(router)
        try:
            writer.write(b"HELLO \x01 WORLD\r\n\r\n")
            return await read_response(reader)
        finally:
            writer.close()

    err = openai_error(asyncio.run(main()), 400)
    assert err["code"] == "invalid_http"


# -- the connection cap ----------------------------------------------------------------------------
def test_connections_past_the_cap_get_503_until_some_close(capped: RouterServer) -> None:
    no_connection_left(capped)

    async def main() -> tuple[Response, int]:
        held = [await connect(capped) for _ in range(MAX_CONNECTIONS)]
        wait_for = asyncio.get_running_loop().run_in_executor
        await wait_for(
            None,
            lambda: wait_until(
                lambda: open_connections(capped) == MAX_CONNECTIONS, CEILING_S, "held connections"
            ),
        )
        try:
            reader, writer = await connect(capped)  # one too many
            writer.write(GET)
            refused = await read_response(reader)
            await until_closed(reader)
            writer.close()
        finally:
            for _, w in held:
                w.close()
        await wait_for(None, lambda: no_connection_left(capped))
        reader, writer = await connect(capped)  # room again
        writer.write(GET)
        status = (await read_response(reader))[0]
        writer.close()
        return refused, status

    refused, status = asyncio.run(main())
    err = openai_error(refused, 503)
    assert err["code"] == "too_many_connections" and err["type"] == "service_unavailable_error"
    assert status == 200
