"""The simulated replica in process: the Starlette app over httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.metrics_scrape import parse_metrics
from controlplane.sim_replica import Faults, Replica, ReplicaConfig, build_app
from controlplane.sim_replica.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

TOKEN = "secret"
B = 32


async def _open(config: ReplicaConfig) -> tuple[Replica, httpx.AsyncClient]:
    replica = Replica(config)
    await replica.startup()
    transport = httpx.ASGITransport(app=build_app(replica))
    return replica, httpx.AsyncClient(transport=transport, base_url="http://replica")


@pytest.fixture
async def served() -> AsyncIterator[tuple[Replica, httpx.AsyncClient]]:
    replica, client = await _open(ReplicaConfig(speed=50, admin_token=TOKEN, model_name="m"))
    yield replica, client
    await client.aclose()
    await replica.shutdown()


def sse_data(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_completion_usage_and_request_id(served: tuple[Replica, httpx.AsyncClient]) -> None:
    _, client = served
    body = {"prompt": list(range(10, 10 + 2 * B + 3)), "max_tokens": 6, "return_token_ids": True}
    first = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc"})
    assert first.status_code == 200 and first.headers["x-request-id"] == "abc"
    out = first.json()
    assert out["id"] == "cmpl-abc" and out["model"] == "m"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    assert out["usage"] == {
        "prompt_tokens": 2 * B + 3,
        "total_tokens": 2 * B + 9,
        "completion_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    again = (await client.post("/v1/completions", json={**body, "request_id": "r2"})).json()
    assert again["id"] == "cmpl-r2"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * B
    assert again["choices"][0]["text"] == choice["text"]


async def test_streams(served: tuple[Replica, httpx.AsyncClient]) -> None:
    _, client = served
    body = {
        "prompt": "stream me",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    resp = await client.post("/v1/completions", json=body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_data(resp.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    content = events[:-2]
    assert all(e["object"] == "text_completion" and "usage" in e for e in content)
    assert [e["choices"][0]["finish_reason"] for e in content][-1] == "length"
    text = "".join(e["choices"][0]["text"] for e in content)
    plain = await client.post("/v1/completions", json={"prompt": "stream me", "max_tokens": 4})
    assert plain.json()["choices"][0]["text"] == text
    chat = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    chunks = sse_data(chat.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-2]


async def test_chat_and_batch_completion(served: tuple[Replica, httpx.AsyncClient]) -> None:
    _, client = served
    chat = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3},
    )
    out = chat.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == 3
    batch = await client.post("/v1/completions", json={"prompt": ["a", "bb"], "max_tokens": 2})
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert batch.json()["usage"]["prompt_tokens"] == 2 + 3


async def test_simulated_stop_counts_as_stop(served: tuple[Replica, httpx.AsyncClient]) -> None:
    _, client = served
    body = {"prompt": "x", "max_tokens": 8, "vllm_xargs": {"sim_output_tokens": 2}}
    out = (await client.post("/v1/completions", json=body)).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 2
    scraped = parse_metrics((await client.get("/metrics")).text)
    assert scraped.request_success["stop"] == 1.0


async def test_metrics_exposition(served: tuple[Replica, httpx.AsyncClient]) -> None:
    replica, client = served
    prompt = list(range(3, 3 + 3 * B))
    for _ in range(2):
        await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    text = (await client.get("/metrics")).text
    scraped = parse_metrics(text, model_name="m")
    assert scraped.engine.running == 0 and scraped.engine.waiting == 0
    assert scraped.prefix_cache_queries == 2 * 3 * B
    assert scraped.prefix_cache_hits == (3 * B - 1) // B * B
    assert scraped.prompt_tokens == 2 * 3 * B and scraped.generation_tokens == 6
    assert scraped.request_success["length"] == 2 and scraped.num_preemptions == 0
    cache = scraped.cache
    assert cache is not None
    assert (cache.block_size, cache.prefix_caching_hash_algo) == (B, "sha256")
    assert cache.num_gpu_blocks == replica.profile.num_gpu_blocks
    assert cache.enable_prefix_caching is True and cache.labels["engine"] == "0"
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, buckets in [
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
        ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
    ]:
        family = families[name]
        assert family.type == "histogram"
        les = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        assert les == [*(str(float(b)) for b in buckets), "+Inf"]
        count = next(s for s in family.samples if s.name.endswith("_count"))
        assert count.value == 2 and count.labels == {"model_name": "m", "engine": "0"}
    assert families["vllm:prefix_cache_hits"].type == "counter"
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"


async def test_tokenize_detokenize_models(served: tuple[Replica, httpx.AsyncClient]) -> None:
    _, client = served
    tok = (await client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True})).json()
    assert tok == {
        "count": 3,
        "max_model_len": 1024,
        "tokens": [1, 100, 101],
        "token_strs": ["<s>", "a", "b"],
    }
    plain = (
        await client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False})
    ).json()
    assert plain["tokens"] == [100, 101]
    chat = await client.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": "ab"}], "add_generation_prompt": False},
    )
    assert chat.json()["tokens"][0] == 1
    detok = (await client.post("/detokenize", json={"tokens": [1, 100, 101]})).json()
    assert detok == {"prompt": "<s>ab"}
    assert (await client.post("/tokenize", json={})).status_code == 400
    assert (await client.post("/tokenize", json={"prompt": "x", "model": "zz"})).status_code == 404
    card = (await client.get("/v1/models")).json()["data"][0]
    assert (card["id"], card["root"], card["parent"], card["max_model_len"]) == (
        "m",
        "m",
        None,
        1024,
    )


async def test_health_and_fault_admin(served: tuple[Replica, httpx.AsyncClient]) -> None:
    replica, client = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert (await client.get("/health")).status_code == 200
    assert (await client.post("/_faults", json={"stall": True})).status_code == 401
    faults = (await client.post("/_faults", json={"stall": True}, headers=auth)).json()["faults"]
    assert faults["stall"] is True and replica.faults.stall
    assert (await client.get("/health")).status_code == 503
    await client.post("/_faults", json={"lie_health": True}, headers=auth)
    assert (await client.get("/health")).status_code == 200
    await client.post("/_faults", json={"reset": True, "unavailable": True}, headers=auth)
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
    assert (await client.get("/_faults", headers=auth)).json()["faults"]["unavailable"] is True
    refuse = await client.post("/_faults", json={"refuse_s": 1}, headers=auth)
    assert refuse.status_code == 501, "refusing connections needs the uvicorn server"


async def test_fault_endpoint_is_off_without_a_token() -> None:
    replica, client = await _open(ReplicaConfig(speed=50, faults=Faults(unavailable=True)))
    try:
        assert (await client.post("/_faults", json={})).status_code == 404
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 503
    finally:
        await client.aclose()
        await replica.shutdown()


async def test_abort_frees_blocks_and_counts(served: tuple[Replica, httpx.AsyncClient]) -> None:
    replica, _ = served
    loop = replica.loop
    replica.faults.slow_factor = 50  # slow enough to abort mid-decode
    woke = asyncio.Event()
    prompt = list(range(3, 3 + 2 * B + 1))
    live = loop.submit(prompt, [100] * 300, request_id="a", notify=woke.set, max_tokens=300)
    while live.produced < 3:
        await woke.wait()
        woke.clear()
    assert replica.engine.kv_usage(loop.now()) > 0
    loop.abort(live)
    assert live.done and loop.num_live == 0
    assert replica.engine.kv_usage(loop.now()) == 0.0
    await asyncio.sleep(0.05)  # the step in flight ends; its events are read, refs released
    assert len(replica.table) <= 2, "only the cached prompt blocks stay interned"
    assert parse_metrics(replica.metrics.render().decode()).request_success["abort"] == 1.0


async def test_priority_scheduling_flag() -> None:
    replica, client = await _open(ReplicaConfig(speed=50, scheduling_policy="priority"))
    try:
        resp = await client.post("/v1/completions", json={"prompt": "x", "priority": 5})
        assert resp.status_code == 200
    finally:
        await client.aclose()
        await replica.shutdown()
