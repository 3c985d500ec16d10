"""Every request's resources are released exactly once, however it ends (Hypothesis).

The router runs under uvicorn on loopback (a thread of this process) in front of two in-process
replicas that speak vLLM's protocol (one `httpx.MockTransport`) and end each request the way
its prompt says: answer, die after k chunks, hang before or after the first chunk, or refuse
with a 400. A real httpx client sends batches of concurrent requests with random endings:

    ok                 streamed or not, relayed whole
    client_gone        the client closes its connection before the first chunk (waiting in the
                       router's queue, or at the replica), or after k
    replica_dies       the replica breaks the stream after k chunks
    timeout            no first chunk within ttft_s, or a gap over idle_s after k chunks
    replica_4xx        the replica refuses the request
    router_4xx         the router refuses it (max_tokens over its limit) before any work
    quota_429          a hard-quota tenant over its quota
    redis_down         (second stack) the quota store's Redis is unreachable: 503 for hard quotas

After each batch, once the router is idle, the books are checked on its own loop: no ledger
reservation, no fair-queue slot or waiter, no demand in flight, no open quota reservation, every
upstream response closed, no live speculative prefix-index entry, and no task left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import load_settings
from router.http.service import create_app
from router.runtime import RouterRuntime

MODEL = "tiny-llama"
KEYS = {"free": "cpk-endings-free", "tight": "cpk-endings-tight"}
TTFT_S, IDLE_S = 0.4, 0.4
CONTEXT = "some shared context " * 30
pytestmark = pytest.mark.timeout(600)


def metrics_text(block_size: int = 32, blocks: int = 1000) -> str:
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    lines = [f'# TYPE vllm:{g} gauge\nvllm:{g}{{engine="0"}} 0.0' for g in gauges]
    lines.append(
        f'vllm:cache_config_info{{block_size="{block_size}",enable_prefix_caching="True",'
        f'engine="0",num_gpu_blocks="{blocks}"}} 1.0'
    )
    return "\n".join(lines) + "\n"


class Replicas:
    """Two fake replicas; a request's prompt names its ending: `end=<kind>:<k>`."""

    def __init__(self) -> None:
        self.open_streams = 0

    def url(self, rid: str) -> str:
        return f"http://{rid}.fake:8000"

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=metrics_text())
        body = json.loads(request.content)
        text = body["messages"][-1]["content"]
        kind, _, k = text.partition("end=")[2].partition(":")
        if kind == "replica_4xx":
            return httpx.Response(400, json={"error": {"message": "bad", "code": 400}})
        if kind == "hang_first":
            await asyncio.sleep(30)
        return httpx.Response(
            200,
            headers={
                "content-type": "text/event-stream" if body.get("stream") else "application/json"
            },
            content=self._stream(body, kind, int(k or 0)),
        )

    async def _stream(self, body: dict[str, Any], kind: str, k: int) -> AsyncIterator[bytes]:
        self.open_streams += 1
        try:
            n = int(body.get("max_tokens") or 4)
            usage = {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n}
            if not body.get("stream"):
                msg = {"role": "assistant", "content": "x" * n}
                yield json.dumps(
                    {"choices": [{"index": 0, "message": msg}], "usage": usage}
                ).encode()
                return
            for i in range(n):
                if i == k and kind == "die":
                    raise httpx.ReadError("the replica died")
                if i == k and kind == "hang_mid":
                    await asyncio.sleep(30)
                chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                await asyncio.sleep(0.005)
            yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.open_streams -= 1


@dataclass
class Stack:
    url: str
    runtime: RouterRuntime
    replicas: Replicas
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


@contextlib.contextmanager
def serve(redis_down: bool) -> Iterator[Stack]:
    reps = Replicas()
    tenants = [
        {"id": "free", "api_key_sha256": [hashlib.sha256(KEYS["free"].encode()).hexdigest()]},
        {
            "id": "tight",
            "api_key_sha256": [hashlib.sha256(KEYS["tight"].encode()).hexdigest()],
            "quota_tokens": 120,
            "quota_window_s": 3600,
        },
    ]
    overrides: dict[str, Any] = {
        "replicas": [
            {"id": r, "url": reps.url(r), "gpu": "cpu", "model": MODEL} for r in ("a", "b")
        ],
        "tokenizer": "approx",
        "served_model": MODEL,
        "tenants": tenants,
        "timeouts": {"ttft_s": TTFT_S, "idle_s": IDLE_S},
        "limits": {"max_tokens": 64},
        # two slots per replica: a batch queues in the router, and clients leave while queued
        "fairness": {"slots_per_replica": 2},
        "telemetry": {"json_logs": False, "log_level": "WARNING"},
    }
    if redis_down:  # a port nobody listens on: index, quota and fair queue all lose Redis
        overrides["redis"] = {"url": "redis://127.0.0.1:9", "lookup_budget_ms": 50}
    cfg = load_settings(**overrides)
    # the made-up replica names resolve to a private address for the replica guard
    transport = httpx.MockTransport(reps.handle)
    runtime = RouterRuntime(cfg, transport=transport, resolve=lambda _host: ["10.0.0.1"])
    app = create_app(cfg, runtime=runtime)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on")
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),))
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the router did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    stack = Stack(f"http://127.0.0.1:{port}", runtime, reps, loop)
    try:
        yield stack
    finally:
        server.should_exit = True
        thread.join(20)
        loop.close()
        assert not thread.is_alive()


ENDINGS = [
    "ok",
    "ok_whole",
    "client_gone_first",
    "client_gone_mid",
    "replica_dies",
    "timeout_first",
    "timeout_mid",
    "replica_4xx",
    "router_4xx",
    "quota_429",
]


async def one(client: httpx.AsyncClient, ending: str, k: int) -> str:
    """Send one request that ends as `ending`; what the client saw."""
    tenant = "tight" if ending == "quota_429" else "free"
    marker = {
        "client_gone_first": "hang_first",
        "timeout_first": "hang_first",
        "timeout_mid": "hang_mid",
        "replica_dies": "die",
    }.get(ending, ending)
    body = {
        "model": MODEL,
        # a few blocks of shared context first: the request has block hashes to index
        "messages": [{"role": "user", "content": f"{CONTEXT} hello end={marker}:{k}"}],
        "max_tokens": 500 if ending == "router_4xx" else 6,
        "stream": ending != "ok_whole",
    }
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    if ending == "client_gone_first":  # the client gives up while the replica says nothing
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(TTFT_S / 4):
                await client.post("/v1/chat/completions", json=body, headers=headers)
        return "left"
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            seen = 0
            async for _ in r.aiter_raw():
                seen += 1
                if ending == "client_gone_mid" and seen > k:
                    return "left"
            return str(r.status_code)
    except httpx.HTTPError as exc:
        return type(exc).__name__


def books(stack: Stack) -> dict[str, int]:
    """The router's books, read on its loop."""
    rt = stack.runtime

    def read() -> dict[str, int]:
        quota = getattr(rt.quotas, "local", rt.quotas)
        return {
            "ledger": len(rt.ledger),
            "queue_admitted": rt.fairq.admitted,
            "queue_waiting": rt.fairq.queued,
            "demand": sum(m.in_flight + m.backlog_requests for m in rt.demand.meters.values()),
            "quota_open": len(getattr(quota, "_open", {})),
            "upstream_open": stack.replicas.open_streams,
            # a request that never had a first token takes its entry with it (the others'
            # end one retract grace after their first token)
            "speculative": getattr(rt.index.events_sink, "live_speculative_entries", 0),
            "request_tasks": sum(
                1
                for t in asyncio.all_tasks()
                if not t.done() and "RequestResponseCycle" in repr(t.get_coro())
            ),
        }

    out: dict[str, int] = stack.call(read)
    return out


def settle(stack: Stack, timeout_s: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = books(stack)
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


@pytest.fixture(scope="module", params=[False, True], ids=["redis_up", "redis_down"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    with serve(redis_down=request.param) as s:
        yield s


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.tuples(st.sampled_from(ENDINGS), st.integers(0, 3)), min_size=1, max_size=8))
def test_every_ending_releases_everything_once(stack: Stack, batch: list[tuple[str, int]]) -> None:
    async def send() -> list[str]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            return await asyncio.gather(*(one(client, e, k) for e, k in batch))

    seen = asyncio.run(send())
    # a fleet whose replicas were all ejected (streams that died) answers 503 at once
    expect = {"router_4xx": {"400"}, "replica_4xx": {"400", "503"}}
    expect |= {key: {"200", "503"} for key in ("ok", "ok_whole")}
    for (ending, _), got in zip(batch, seen, strict=True):
        assert got in expect.get(ending, {got}), (ending, got)
    assert settle(stack) == dict.fromkeys(books(stack), 0)
