"""`deploy.engines.asgi`: an engine's ASGI app called in process, no server and no Ray.

The simulated engine's own app (`controlplane.sim_replica.build_app`) under `Lifespan`: a
stream arrives as its head and then one SSE event per chunk; a caller that stops reading
mid-stream is a client disconnect (the engine aborts the request and frees its slot); apps
that break the protocol raise `EngineCallError`, and so does a failing lifespan.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from starlette.types import Receive, Scope, Send

from controlplane.sim_replica import Replica, ReplicaConfig, build_app
from deploy.engines.asgi import EngineCallError, Lifespan, asgi_request

HEADERS = [["content-type", "application/json"]]


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Replica, Lifespan]]:
    replica = Replica(ReplicaConfig(speed=50.0))
    lifespan = Lifespan(build_app(replica))
    await lifespan.start()
    try:
        yield replica, lifespan
    finally:
        await lifespan.stop()
    assert replica.server_load == 0


def completion(max_tokens: int, stream: bool) -> bytes:
    body = {"model": "tiny-llama", "prompt": "hello there", "max_tokens": max_tokens}
    return json.dumps({**body, "stream": stream}).encode()


async def test_a_stream_is_its_head_then_one_event_per_chunk(
    engine: tuple[Replica, Lifespan],
) -> None:
    _, life = engine
    parts = [
        p
        async for p in asgi_request(
            life.app, "POST", "/v1/completions", HEADERS, completion(5, True), state=life.state
        )
    ]
    head, chunks = parts[0], parts[1:]
    assert isinstance(head, dict) and head["status"] == 200
    assert dict(head["headers"])["content-type"].startswith("text/event-stream")
    assert all(isinstance(c, bytes) and c.startswith(b"data: ") for c in chunks)
    assert chunks[-1] == b"data: [DONE]\n\n"


async def test_an_error_is_the_engines_own(engine: tuple[Replica, Lifespan]) -> None:
    _, life = engine
    body = json.dumps({"model": "nope", "prompt": "x"}).encode()
    parts = [p async for p in asgi_request(life.app, "POST", "/v1/completions", HEADERS, body)]
    head = parts[0]
    assert isinstance(head, dict) and head["status"] == 404
    error = json.loads(b"".join(p for p in parts[1:] if isinstance(p, bytes)))["error"]
    assert error["code"] == 404 and "nope" in error["message"]


async def test_a_caller_that_leaves_aborts_the_request(engine: tuple[Replica, Lifespan]) -> None:
    replica, life = engine
    gen = asgi_request(
        life.app, "POST", "/v1/completions", HEADERS, completion(500, True), state=life.state
    )
    head = await anext(gen)
    assert isinstance(head, dict) and head["status"] == 200
    assert isinstance(await anext(gen), bytes)
    assert replica.server_load == 1
    await gen.aclose()  # the client went away (Serve cancels the call)
    for _ in range(200):
        if replica.server_load == 0 and replica.loop.gauges().running == 0:
            break
        await asyncio.sleep(0.01)
    assert replica.server_load == 0
    assert replica.loop.gauges().running == 0


async def _raises(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("boom")


async def _silent(scope: Scope, receive: Receive, send: Send) -> None:
    return None


@pytest.mark.parametrize(
    ("app", "message"),
    [(_raises, "boom"), (_silent, "without a response")],
    ids=["raises", "silent"],
)
async def test_a_broken_app_is_an_error(app: object, message: str) -> None:
    with pytest.raises(EngineCallError, match=message):
        async for _ in asgi_request(app, "GET", "/x", [], b""):  # type: ignore[arg-type]
            pass


async def test_a_failing_lifespan_is_an_error() -> None:
    with pytest.raises(EngineCallError, match="startup failed"):
        await Lifespan(_raises).start()
