"""The simulated replica as a process: the OpenAI SDK and httpx against its HTTP surface."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
from sim_fleet import SimReplica, sim_replica

from controlplane.metrics_scrape import parse_metrics, scrape

BLOCK = 32
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def replica() -> Iterator[SimReplica]:
    with sim_replica("--speed", "20", "--model-name", MODEL) as r:
        yield r


@pytest.fixture
def client(replica: SimReplica) -> Iterator[openai.OpenAI]:
    # closed at teardown: a pooled connection left to the garbage collector is a ResourceWarning
    # whenever it happens to be collected, possibly in pytest's own teardown
    with openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_completion_non_streaming(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7)
    assert out.object == "text_completion"
    assert out.id.startswith("cmpl-")
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 7
    # byte fallback tokenizer: BOS + one id per byte
    assert out.usage.prompt_tokens == 1 + len("The quick brown fox")
    again = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7)
    assert again.choices[0].text == out.choices[0].text, "same prompt and seed, same output"


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    non_stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5
    )
    assert non_stream.choices[0].message.content == content
    assert non_stream.object == "chat.completion"


def test_completion_streaming_token_ids_prompt(client: openai.OpenAI) -> None:
    prompt = list(range(10, 10 + 3 * BLOCK + 5))
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == len(prompt)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 4


def test_cached_tokens_and_prefix_metrics_follow_the_last_token_rule(
    replica: SimReplica, client: openai.OpenAI
) -> None:
    """Repeating a shared prefix: each repeat hits (N-1)//B blocks (vllm-interfaces §1.4)."""
    n = 3 * BLOCK + 4  # 100 tokens
    prompt = list(range(300, 300 + n))
    before = parse_metrics(httpx.get(f"{replica.url}/metrics").text)
    cached = []
    for _ in range(4):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0] + [(n - 1) // BLOCK * BLOCK] * 3
    after = parse_metrics(httpx.get(f"{replica.url}/metrics").text)
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4 * n
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * ((n - 1) // BLOCK) * BLOCK
    assert after.request_success["length"] - before.request_success.get("length", 0) == 4
    assert after.cache is not None and after.cache.block_size == BLOCK
    # a prompt that is a whole number of blocks recomputes its last block
    whole = list(range(100, 100 + 2 * BLOCK))
    client.completions.create(model=MODEL, prompt=whole, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=whole, max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == BLOCK


def test_http_surface(replica: SimReplica) -> None:
    base = replica.url
    models = httpx.get(f"{base}/v1/models").json()
    card = models["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == 1024 and card["owned_by"] == "vllm"
    assert card["root"] == MODEL
    tok = httpx.post(f"{base}/tokenize", json={"prompt": "hi"}).json()
    assert tok["tokens"] == [1, ord("h") + 3, ord("i") + 3] and tok["count"] == 3
    assert tok["max_model_len"] == 1024
    chat_tok = httpx.post(
        f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat_tok["tokens"][0] == 1  # the template writes BOS; add_special_tokens=False
    assert chat_tok["tokens"].count(1) == 1
    detok = httpx.post(f"{base}/detokenize", json={"tokens": tok["tokens"][1:]}).json()
    assert detok == {"prompt": "hi"}
    resp = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "my-id-1"},
    )
    assert resp.headers["x-request-id"] == "my-id-1"
    assert resp.json()["id"] == "cmpl-my-id-1"
    minted = httpx.get(f"{base}/v1/models").headers["x-request-id"]
    assert len(minted) == 32
    assert httpx.get(f"{base}/version").json() == {"version": "0.33.0"}
    assert httpx.get(f"{base}/load").json() == {"server_load": 0}


def test_errors_are_vllm_error_info(replica: SimReplica) -> None:
    base = replica.url
    long = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": [5] * 1000, "max_tokens": 100},
    )
    assert long.status_code == 400
    err = long.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert "maximum context length is 1024" in err["message"]
    missing = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError"
    bad = httpx.post(f"{base}/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400


async def test_client_disconnect_aborts_the_engine_request(replica: SimReplica) -> None:
    base = replica.url
    before = parse_metrics(httpx.get(f"{base}/metrics").text)
    replica.set_faults(slow_factor=20.0)  # ~4 ms steps: the stream outlives the client
    async with httpx.AsyncClient(timeout=10.0) as http:
        body = {"model": MODEL, "prompt": list(range(5, 100)), "max_tokens": 900, "stream": True}
        async with http.stream("POST", f"{base}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    seen += 1
                if seen == 3:
                    break
        # the response is closed: the replica must notice and free the request's blocks
        for _ in range(100):
            now = await scrape(base, http)
            if now.engine.running == 0:
                break
            await asyncio.sleep(0.02)
    replica.set_faults(reset=True)
    assert now.engine.running == 0 and now.engine.kv_usage == 0.0
    assert now.request_success["abort"] == before.request_success.get("abort", 0) + 1
    assert now.generation_tokens - before.generation_tokens < 900
