"""The Serve ingress's parts without a cluster: settings it refuses, the links, the handle client.

The handle client is driven by a stand-in for Serve's streaming response (an async iterator with
`cancel()`) that fails the way Serve does: backpressure, a dead replica, a broken stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from controlplane.errors import ConfigError
from router.config import load_settings
from router.http.h1 import ConnectFailed, UpstreamBroken
from router.serve.ingress import check_settings
from router.serve.links import MAX_DECISIONS, Links
from router.serve.upstream import HandlePool


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"tokenizer": "approx"}, None),
        ({"tokenizer": "remote"}, "tokenizes prompts itself"),
        (
            {"tokenizer": "approx", "replicas": [{"id": "a", "url": "http://127.0.0.1:1"}]},
            "remove `replicas`",
        ),
        (
            {"tokenizer": "approx", "fleet": {"shared": True}, "redis": {"url": "redis://h:1"}},
            "discovers no replicas",
        ),
        ({"tokenizer": "approx", "fleet": {"dns_name": "engines.local"}}, "no replicas"),
    ],
)
def test_settings_the_ingress_refuses(values: dict[str, Any], error: str | None) -> None:
    settings = load_settings(**values)
    if error is None:
        check_settings(settings)
        return
    with pytest.raises(ConfigError, match=error):
        check_settings(settings)


def test_links_keep_a_bounded_set_of_decisions() -> None:
    links = Links()
    routed: Any = object()
    for i in range(MAX_DECISIONS + 10):
        links.decided(f"r{i}", routed)
    assert links.take("r0") is None  # the oldest were dropped
    assert links.take(f"r{MAX_DECISIONS + 9}") is routed
    assert links.take(f"r{MAX_DECISIONS + 9}") is None  # taken once

    class View:
        def snapshot(self) -> Any:
            return None

    view, other = View(), View()
    links.publish("app", "engine", view)
    links.withdraw("app", "engine", other)  # not the published one: kept
    assert links.view("app", "engine") is view
    links.withdraw("app", "engine", view)
    assert links.view("app", "engine") is None


class Call:
    """Serve's streaming response, as the client sees it."""

    def __init__(self, items: list[Any], fail: BaseException | None = None) -> None:
        self.items, self.fail = list(items), fail
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if self.items:
            return self.items.pop(0)
        if self.fail is not None:
            raise self.fail
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self, call: Call) -> None:
        self.call = call
        self.sent: list[tuple[Any, ...]] = []

    def options(self, **_: Any) -> Handle:
        return self

    @property
    def handle(self) -> Any:
        outer = self

        class Method:
            def remote(self, *args: Any) -> Call:
                outer.sent.append(args)
                return outer.call

        return Method()


HEAD = {"status": 200, "headers": [["Content-Type", "text/event-stream"]]}


async def test_handle_client_streams_the_engines_answer() -> None:
    call = Call([HEAD, b"data: 1\n\n", b"data: [DONE]\n\n"])
    handle = Handle(call)
    resp = await HandlePool(handle).request(
        b"POST", "/v1/completions", [(b"x-request-id", b"r1")], b"{}"
    )
    assert (resp.status, resp.header(b"content-type")) == (200, b"text/event-stream")
    assert await resp.read() == b"data: 1\n\ndata: [DONE]\n\n"
    assert handle.sent == [("POST", "/v1/completions", [["x-request-id", "r1"]], b"{}")]
    assert not call.cancelled  # it ended on its own


async def test_handle_client_maps_serves_failures() -> None:
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    busy = await HandlePool(Handle(Call([], BackPressureError(10, 10)))).request(
        b"POST", "/", [], b""
    )
    assert busy.status == 503  # the proxy's "never accepted" path
    with pytest.raises(ConnectFailed):
        await HandlePool(Handle(Call([], ActorDiedError()))).request(b"POST", "/", [], b"")
    not_a_head = Call([b"bytes first"])
    with pytest.raises(UpstreamBroken):
        await HandlePool(Handle(not_a_head)).request(b"POST", "/", [], b"")
    assert not_a_head.cancelled
    broken = Call([HEAD, b"data: 1\n\n"], RuntimeError("replica crashed"))
    resp = await HandlePool(Handle(broken)).request(b"POST", "/", [], b"")
    assert await resp.next_chunk() == b"data: 1\n\n"
    with pytest.raises(UpstreamBroken):
        await resp.next_chunk()


async def test_handle_client_cancels_a_call_it_leaves() -> None:
    call = Call([HEAD, b"a", b"b"])
    resp = await HandlePool(Handle(call)).request(b"POST", "/", [], b"")
    assert await resp.next_chunk() == b"a"
    await resp.aclose()
    assert call.cancelled and await resp.next_chunk() is None
